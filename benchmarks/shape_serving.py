"""Issue 19 benchmark: a plan tuned at one shape serves shapes it was not tuned at (deploy-time shapes).

Per model (the GPT-2 and Llama examples' `forward`, bf16):

1. tune `forward` at a base shape (`autofuse.tune`, measured on the device, into a fresh SQLite store: the base
   store), and serve the base shape from it (`autofuse.jit(forward, store=<base store>)`: the exact plan);
2. at five shapes whose batch and sequence both differ from the base: `autofuse.jit(forward, store=<base store>)`
   finds no plan for its exact shapes, takes the base plan adapted to them (`autofuse.shapes`), checks it once
   against `jax.jit` there and serves it. Recorded: its `last_status` (it must read ``plan (tuned at ..., serving
   ...)``: fused, from the base plan), its relative error against `jax.jit` on the model's own weights, and its time
   against `jax.jit` in alternation (`time_pair`, 3 input sets rotating);
3. at each of those shapes, a job tuned exactly there (same trial budget, into another store, so that the served
   rows only ever see the base plan), its plan run by `autofuse.jit(forward, plan=...)`, timed against `jax.jit`
   and, in alternation, against the served plan: the served speedup must be at least 0.90 of the exact one.

A job costs about the same at any size: its start times every distinct candidate in XLA (GPT-2's 158, Llama's 83;
about 0.2 s each on an H100) and its end compiles and validates the whole plan and its fallbacks (GPT-2 medium's 24
layers on an H100: 31 s and 88 s, `benchmarks.multi_gpu`), so a job of 8 trials should take about 1.5 minutes for
GPT-2 (4 layers) and 1 for Llama (2 blocks), and base + 5 exact jobs + 6 served shapes about 11 and 8 minutes: more
than GPT-2's fit in one GPU's 10-minute command. `--gpus 0,1,2,3` shares each model's work among
`len(gpus) // len(models)` processes, one per GPU (`CUDA_VISIBLE_DEVICES`): the first tunes the base shape and
serves its shapes, the others tune their shapes exactly first and then serve them from the same base store (waiting
for its plan if need be); this process merges their rows into one table. Without `--gpus`, one process does
everything in turn, as far as `--deadline` allows.

The table (`--out`, and its rows as JSON beside it, `<out>.json`) is rewritten after every step, so a run cut short
keeps what it did; `--deadline` (seconds from the start) skips what would not finish in time, with a row saying so.

    python -m benchmarks deploy shapes --models gpt2,llama --gpus 0,1,2,3 --out results/shape_serving_h100.md \
        --workdir /tmp/shape_serving --commit HASH                              # 4 GPUs: 2 processes per model
    python -m benchmarks deploy shapes --models gpt2 --out results/shape_serving_gpt2.md     # one GPU, one process
    python -m benchmarks deploy shapes --models gpt2,llama --small --out /tmp/shape_serving.md   # CPU smoke run

`--small`: the examples' CPU-sized configs, modelled tuning (`measure="model"`), Pallas in interpret mode; the
timings are meaningless there, it only runs the whole path and writes the table.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import jaxlib

import autofuse  # before JAX starts its GPU client: no preallocation (tune()'s trial process needs the memory)
from autofuse.runner.measure import compare, time_pair
from benchmarks.provenance import command, commit
from examples import gpt2, llama

Shape = tuple[int, int]  # (batch, sequence)

# Base shapes and served shapes: batch and sequence both differ from the base at every served shape (up and down,
# log2 distance 1.6 to 4; 1536 and 24 are not powers of two). GPT-2's sequence stays below its position table's
# size (2048; SMALL: 32): at the table's size `wpe[:S]` slices nothing, JAX traces no slice, and the program is of
# another structure (one node fewer), which no plan tuned below it serves.
SHAPES = {
    "gpt2": ((8, 1024), ((4, 512), (16, 512), (2, 1536), (4, 1536), (32, 256))),
    "llama": ((4, 2048), ((2, 1024), (8, 1024), (1, 4096), (2, 4096), (16, 512))),
}
SMALL_SHAPES = {
    "gpt2": ((2, 16), ((1, 8), (4, 8), (1, 24), (4, 24), (8, 8))),
    "llama": ((2, 16), ((1, 8), (4, 8), (1, 24), (4, 24), (8, 8))),
}
DEFAULT_LAYERS = {"gpt2": 4, "llama": 2}
# Seconds one job takes before this process has timed one (to plan against --deadline): its start (about 15 s), the
# XLA timing of every distinct candidate (GPT-2 158, Llama 83, about 0.2 s each on an H100), 8 trials, the final
# selection and validation (compiling whole plans: GPT-2 medium's 24 layers took 88 s; 4 layers, about a sixth).
JOB_S_GUESS = {"gpt2": 110.0, "llama": 80.0}
SERVE_S_GUESS = 30.0  # a shape served: the fused program and jax.jit compiled, checked, timed
PASS_RATIO = 0.90


@dataclass(frozen=True)
class Setup:
    """One model of the benchmark: its config, the base shape tuned, the shapes served (by this process)."""

    name: str
    what: str
    forward: Callable
    cfg: Any
    base: Shape
    serve: tuple[Shape, ...]
    dtype: Any

    def public(self) -> dict:
        return {"name": self.name, "what": self.what, "base": list(self.base), "serve": [list(s) for s in self.serve]}


def setup(name: str, small: bool, layers: int | None, shapes: str) -> Setup:
    base, serve = (SMALL_SHAPES if small else SHAPES)[name]
    if shapes:  # "none": the base shape only (a part of a --gpus run with no other shape)
        serve = () if shapes == "none" else tuple(parse_shape(s) for s in shapes.split(","))
    layers = layers or DEFAULT_LAYERS[name]
    if name == "gpt2":
        cfg = gpt2.SMALL if small else gpt2.Config(**{**gpt2.MEDIUM.__dict__, "n_layers": layers})
        what = (f"GPT-2 {'SMALL' if small else 'medium'} forward (d={cfg.d_model}, {cfg.d_model // gpt2.HEAD_DIM} heads, "
                f"vocab {cfg.vocab}, {cfg.n_layers} layers, {cfg.max_seq} positions, tied LM head)")
        fwd = gpt2.forward
    elif name == "llama":
        cfg = llama.SMALL if small else llama.Config(**{**llama.LLAMA_1B.__dict__, "n_layers": layers})
        what = (f"Llama {'SMALL' if small else '3.2-1B-class'} blocks forward (d={cfg.d_model}, {cfg.d_model // llama.HEAD_DIM} q / "
                f"{cfg.n_kv_heads} kv heads, ffn {cfg.d_ff}, {cfg.n_layers} blocks)")
        fwd = llama.forward
    else:
        raise ValueError(f"unknown model {name!r} (gpt2, llama)")
    return Setup(name, what, fwd, cfg, base, serve, jnp.float32 if small else jnp.bfloat16)


def parse_shape(text: str) -> Shape:
    """``4x512`` (batch x sequence)."""
    b, s = text.lower().replace("×", "x").split("x")
    return int(b), int(s)


def fmt_shape(s: Any) -> str:
    return f"B{s[0]} S{s[1]}"


class Inputs:
    """A model's arguments at any shape: one set of weights (as the examples' `make_inputs` makes them), scaled by
    1 + 0.01 k for input set k, and a batch drawn with seed k (as `make_inputs` draws it)."""

    def __init__(self, st: Setup):
        self.st = st
        mod = gpt2 if st.name == "gpt2" else llama
        self.params = mod.init_params(st.cfg, jax.random.fold_in(jax.random.PRNGKey(0), 0), st.dtype)
        self._scaled: dict[int, Any] = {0: self.params}

    def params_set(self, k: int) -> Any:
        if k not in self._scaled:
            f = 1.0 + 0.01 * k
            self._scaled[k] = jax.tree_util.tree_map(lambda x: (x * f).astype(x.dtype), self.params)
        return self._scaled[k]

    def batch(self, shape: Shape, k: int) -> dict:
        b, s = shape
        key = jax.random.PRNGKey(k)
        if self.st.name == "gpt2":
            tokens = jax.random.randint(jax.random.fold_in(key, 1), (b, s + 1), 0, self.st.cfg.vocab, jnp.int32)
            return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
        d = self.st.cfg.d_model
        return {"x": jax.random.normal(jax.random.fold_in(key, 1), (b, s, d), jnp.float32).astype(self.st.dtype),
                "y": jax.random.normal(jax.random.fold_in(key, 2), (b, s, d), jnp.float32).astype(self.st.dtype)}

    def sets(self, shape: Shape, n: int = 3) -> list[tuple]:
        return [(self.params_set(k), self.batch(shape, k)) for k in range(n)]

    def specs(self, shape: Shape) -> tuple:
        """The arguments as shapes, for `tune` (its trial process makes its own random inputs: no weights copied)."""
        return jax.eval_shape(lambda: (self.params, self.batch(shape, 0)))


@dataclass
class Row:
    model: str
    shape: tuple
    kind: str  # "base" (tuned here, served exactly) or "served"
    status: str = ""
    groups: int | None = None
    err: float | None = None
    correct: bool | None = None
    xla_ms: float | None = None
    af_ms: float | None = None
    speedup: float | None = None
    noise: float | None = None
    exact: dict = field(default_factory=dict)  # the job tuned at this shape: groups, kinds, trials, tune_s, status, err, ms, speedup
    ratio: float | None = None  # served speedup / exact speedup, timed in alternation (served vs the exact plan)
    ratio_noise: float | None = None
    note: str = ""
    gpu: str = ""  # CUDA_VISIBLE_DEVICES of the process that ran the row

    @property
    def fused(self) -> bool:
        return self.status.startswith("plan (tuned at" if self.kind == "served" else "plan:")

    def verdict(self) -> str:
        if self.kind == "base":
            return "base" if self.fused and self.correct else "FAIL"
        if self.speedup is None and not self.status:
            return "—"
        if not (self.fused and self.correct):
            return "FAIL"
        if self.ratio is None:
            return "served ok; no exact job"
        return "pass" if self.ratio >= PASS_RATIO else "FAIL"


def groups_of(status: str) -> int | None:
    m = re.search(r"(\d+) fused groups?", status)
    return int(m.group(1)) if m else (0 if status.startswith(("xla", "xla-plan")) else None)


def rel_error(got: Any, want: Any) -> tuple[bool, float, str]:
    """Every output leaf against jax.jit's (relative error norm, the dtype's tolerance): ok, worst error, why not."""
    ok, worst, why = True, 0.0, ""
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        k_ok, err, k_why = compare(g, w)
        worst = max(worst, err)
        if not k_ok and ok:
            ok, why = False, k_why
    return ok, worst, why


_BASE_STORES: dict[str, Any] = {}


def base_plan_ready(url: str) -> str | None:
    """Whether the base store has its plan: "ready", "failed: ..." (its job ended without one), or None (not yet).
    Read-only: the process that tunes the base shape is writing it."""
    if not os.path.exists(url[len("sqlite:///"):]):
        return None
    try:
        store = _BASE_STORES.get(url) or _BASE_STORES.setdefault(url, autofuse.PlanStore(url, readonly=True))
        if store.plans(current_only=True):
            return "ready"
        ended = [r for r in store.runs() if r.get("status") in ("failed", "interrupted")]
        return f"failed: the base job's run {ended[0]['id']} {ended[0]['status']}" if ended else None
    except Exception:  # noqa: BLE001 -- a store still being made by the other process: open it again next time
        _BASE_STORES.pop(url, None)
        return None


class Bench:
    """One process's part of the benchmark: its models, its shapes, its rows."""

    def __init__(self, a: argparse.Namespace, argv: list[str]):
        self.a = a
        self.t0 = time.time()
        self.rows: list[Row] = []
        self.setups: list[Setup] = []
        self.gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        self.measure = "model" if a.small else "device"
        self.timing = {"repeats": 2, "warmup": 0, "target_ms": 1.0} if a.small else {"repeats": 10, "warmup": 2}
        self.header = header(a, argv, self.timing)
        self.header["card"] = (jax.devices()[0].device_kind if jax.default_backend() == "gpu"
                               else f"{jax.default_backend()} (no GPU: --small smoke run)")

    def say(self, msg: str) -> None:
        gpu = f" gpu {self.gpu}" if self.a.base_db else ""
        print(f"[{self.elapsed():5.0f} s{gpu}] {msg}", flush=True)

    def elapsed(self) -> float:
        return time.time() - self.t0

    def left(self) -> float:
        return self.a.deadline - self.elapsed()

    def write(self) -> None:
        write_outputs(self.a.out, self.header, [st.public() for st in self.setups], self.rows)

    def tune(self, st: Setup, inputs: Inputs, shape: Shape, url: str) -> tuple[Any, float]:
        t = time.time()
        rep = autofuse.tune(st.forward, *inputs.specs(shape), trials=self.a.trials, time_budget_s=self.a.job_budget or None, seed=0,
                            store=url, name=f"examples.{st.name}:forward", measure=self.measure, quiet=True,
                            trial_timeout_s=self.a.trial_timeout)
        return rep, time.time() - t

    def run_model(self, st: Setup) -> None:
        a = self.a
        self.setups.append(st)
        base_url, exact_url = store_urls(a, st.name)
        role = a.base
        self.say(f"{st.name}: {st.what}; base {fmt_shape(st.base)} ({'tuned here' if role == 'tune' else 'tuned by another process'}), "
                 f"serving {', '.join(map(fmt_shape, st.serve))}; stores {base_url}, {exact_url}")
        inputs = Inputs(st)
        ref = jax.jit(st.forward)
        rows = {shape: Row(st.name, shape, "served", gpu=self.gpu) for shape in st.serve}
        plans: dict[Shape, Any] = {}
        self.tune_times: list[float] = []  # this model's jobs so far, seconds
        self.guess_tune = JOB_S_GUESS.get(st.name, 130.0) if not a.small else 20.0
        self.est_serve = SERVE_S_GUESS if not a.small else 5.0

        if role == "tune":  # 1. the base job, and the base shape served from its store (the exact plan)
            self.say(f"{st.name}: tuning at the base shape {fmt_shape(st.base)} ({a.trials} trials)")
            base_row = Row(st.name, st.base, "base", gpu=self.gpu)
            self.rows.append(base_row)
            try:
                rep, tune_s = self.tune(st, inputs, st.base, base_url)
            except Exception as e:  # noqa: BLE001 -- the model's row says why; the next model goes on
                base_row.note = f"base tuning failed: {type(e).__name__}: {str(e)[:300]}"
                self.say(f"{st.name}: {base_row.note}")
                self.write()
                return
            self.tune_times.append(tune_s)
            base_row.exact = exact_facts(rep, tune_s)
            self.say(f"{st.name}: base job {tune_s:.0f} s: {rep.summary()}")
            if rep.plan.is_xla:
                base_row.note = "the base job kept XLA's plan (nothing beat jax.jit): no fused plan to serve other shapes"
            self.serve_row(base_row, autofuse.jit(st.forward, store=base_url), ref, inputs)
            self.write()
            if rep.plan.is_xla:
                return
        self.rows.extend(rows.values())
        self.write()

        if role == "wait":  # 2'. the exact jobs first, while the other process tunes the base shape
            for shape, row in rows.items():
                plans[shape] = self.exact_job(st, inputs, row, exact_url, reserve=len(st.serve) * self.est_serve)
            ready = self.wait_for_base(base_url, st)
            if ready != "ready":
                for row in rows.values():
                    row.note = (row.note + "; " if row.note else "") + f"not served: {ready}"
                self.write()
                return

        served = {}
        for shape, row in rows.items():  # 2. each other shape served from the base plan
            if self.left() < self.est_serve + 10:
                row.note = f"not served: {self.left():.0f} s left of --deadline {a.deadline:.0f}"
                self.say(f"{st.name} {fmt_shape(shape)}: {row.note}")
                self.write()
                continue
            t = time.time()
            fn = autofuse.jit(st.forward, store=base_url)
            self.serve_row(row, fn, ref, inputs)
            self.est_serve = max(self.est_serve, time.time() - t)
            served[shape] = fn
            if plans.get(shape) is not None:
                self.compare_row(row, autofuse.jit(st.forward, plan=plans[shape]), fn, ref, inputs)
            self.write()

        if role == "tune":  # 3. a job tuned exactly at each shape; its plan timed against jax.jit and the served plan
            for shape, fn in served.items():
                plan = self.exact_job(st, inputs, rows[shape], exact_url, reserve=self.est_serve)
                if plan is not None:
                    self.compare_row(rows[shape], autofuse.jit(st.forward, plan=plan), fn, ref, inputs)
                self.write()

    def exact_job(self, st: Setup, inputs: Inputs, row: Row, url: str, reserve: float) -> Any:
        """Tune exactly at `row.shape` (if it fits before the deadline, keeping `reserve` seconds): its plan, or None."""
        tag = f"{st.name} {fmt_shape(row.shape)}"
        est = max(self.tune_times, default=self.guess_tune)  # the longest job so far (or a guess): jobs differ little in cost
        if self.left() < est * 1.15 + reserve:
            row.note = f"exact job skipped: {self.left():.0f} s left of --deadline {self.a.deadline:.0f} (a job takes about {est:.0f} s)"
            self.say(f"{tag}: {row.note}")
            self.write()
            return None
        self.say(f"{tag}: tuning exactly at this shape ({self.a.trials} trials)")
        try:
            rep, tune_s = self.tune(st, inputs, row.shape, url)
        except Exception as e:  # noqa: BLE001 -- the row says why
            row.note = f"exact job failed: {type(e).__name__}: {str(e)[:300]}"
            self.say(f"{tag}: {row.note}")
            self.write()
            return None
        self.tune_times.append(tune_s)
        row.exact = exact_facts(rep, tune_s)
        self.say(f"{tag}: exact job {tune_s:.0f} s: {rep.summary()}")
        self.write()
        return rep.plan

    def wait_for_base(self, url: str, st: Setup) -> str:
        """Wait until the base store holds the base job's plan (another process tunes it)."""
        said = False
        while True:
            state = base_plan_ready(url)
            if state is not None:
                return state
            if self.left() < self.est_serve + 10:
                return f"no base plan in {url} before the deadline"
            if not said:
                self.say(f"{st.name}: waiting for the base plan in {url}")
                said = True
            time.sleep(5)

    def serve_row(self, row: Row, fn: Any, ref: Any, inputs: Inputs) -> None:
        """`fn` (an autofuse.jit) at `row.shape`: what it runs, its error on the model's weights, its time against jax.jit."""
        sets = inputs.sets(row.shape)
        tag = f"{row.model} {fmt_shape(row.shape)}"
        try:
            got = jax.block_until_ready(fn(*sets[0]))
            row.status = fn.last_status
            row.groups = groups_of(row.status)
            want = jax.block_until_ready(ref(*sets[0]))
            row.correct, row.err, why = rel_error(got, want)
            del got, want
            self.say(f"{tag}: {row.status}; max rel error {row.err:.1e}{'' if row.correct else ' WRONG: ' + why}")
            base, mine, ratio = time_pair(ref, fn, sets, **self.timing)
            row.xla_ms, row.af_ms = base.median_ms, mine.median_ms
            row.speedup, row.noise = 1.0 / ratio.median_ms, (ratio.q3_ms - ratio.q1_ms) / ratio.median_ms
            self.say(f"{tag}: jax.jit {row.xla_ms:.4g} ms, autofuse {row.af_ms:.4g} ms: {row.speedup:.2f}x (±{row.noise / 2:.1%})")
        except Exception as e:  # noqa: BLE001 -- the row says why
            row.note = f"{type(e).__name__}: {str(e)[:300]}"
            self.say(f"{tag}: failed: {row.note}")

    def compare_row(self, row: Row, exact: Any, served: Any, ref: Any, inputs: Inputs) -> None:
        """The exact plan at `row.shape`: its error, its time against jax.jit, and the served plan's against it."""
        sets = inputs.sets(row.shape)
        tag = f"{row.model} {fmt_shape(row.shape)}"
        try:
            got = jax.block_until_ready(exact(*sets[0]))
            row.exact["status"] = exact.last_status
            ok, err, _ = rel_error(got, jax.block_until_ready(ref(*sets[0])))
            row.exact["err"], row.exact["correct"] = err, ok
            del got
            base, mine, ratio = time_pair(ref, exact, sets, **self.timing)
            row.exact["xla_ms"], row.exact["ms"] = base.median_ms, mine.median_ms
            row.exact["speedup"] = 1.0 / ratio.median_ms
            # the served plan against the exact one, in alternation: the ratio of their speedups is t_exact / t_served
            _, _, r = time_pair(exact, served, sets, **self.timing)
            row.ratio, row.ratio_noise = 1.0 / r.median_ms, (r.q3_ms - r.q1_ms) / r.median_ms
            quot = row.speedup / row.exact["speedup"] if row.speedup else float("nan")
            self.say(f"{tag}: exact plan {row.exact['status']}; {row.exact['ms']:.4g} ms, {row.exact['speedup']:.2f}x jax.jit; "
                     f"served/exact {row.ratio:.3f} (±{row.ratio_noise / 2:.1%}; from the two speedups {quot:.3f}): {row.verdict()}")
        except Exception as e:  # noqa: BLE001 -- the row says why
            row.note = f"exact plan failed: {type(e).__name__}: {str(e)[:300]}"
            self.say(f"{tag}: {row.note}")


def exact_facts(rep: Any, tune_s: float) -> dict:
    """What a tuning job's report says of its plan."""
    kinds = sorted({f"{g.template}/{g.backend}" for g in rep.plan.groups})
    return {"tune_s": tune_s, "groups": len(rep.plan.groups), "kinds": ", ".join(kinds) or "XLA", "trials": rep.trials_run,
            "tuned_speedup": rep.speedup, "run": rep.run_id, "plan": rep.plan_id}


def store_urls(a: argparse.Namespace, model: str) -> tuple[str, str]:
    """The base store and this process's exact jobs' store, both fresh SQLite files. With --base-db (a part of a
    --gpus run) the base store is that file (the part that tunes the base made it); else --db, else beside --out;
    the exact store beside this process's --out. Files made beside --out are replaced; a --db that exists is refused."""
    stem = work_stem(a) + (f"_{model}" if "," in a.models or not a.base_db else "")
    exact = stem + "_exact.db"
    fresh = [exact]
    if a.base_db:
        base = os.path.abspath(a.base_db)
        if a.base == "tune":
            fresh.append(base)
    elif a.db:
        base = os.path.splitext(os.path.abspath(a.db))[0] + (f"_{model}" if "," in a.models else "") + ".db"
        for suffix in ("", "-wal", "-shm"):
            if os.path.exists(base + suffix):
                raise SystemExit(f"{base + suffix} exists: give --db a new path (the benchmark starts from an empty store)")
    else:
        base = stem + ".db"
        fresh.append(base)
    for p in fresh:
        for suffix in ("", "-wal", "-shm"):
            if os.path.exists(p + suffix):
                os.unlink(p + suffix)
    return f"sqlite:///{base}", f"sqlite:///{exact}"


def work_stem(a: argparse.Namespace) -> str:
    """Where this process's stores (and a --gpus run's parts) go: --workdir, else beside --out; named after --out."""
    out = os.path.abspath(a.out or "shape_serving.md")
    return os.path.join(os.path.abspath(a.workdir) if a.workdir else os.path.dirname(out), os.path.splitext(os.path.basename(out))[0])


def header(a: argparse.Namespace, argv: list[str], timing: dict) -> dict:
    return {
        "card": "",
        "versions": f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, autofuse {autofuse.__version__}",
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit(a.commit),
        "command": command(argv),
        "tuning": (f"autofuse.tune(forward, ..., trials={a.trials}, time_budget_s={a.job_budget or None}, "
                   f"measure={'model' if a.small else 'device'!r}, seed=0), one job per shape, the base job's into the base store, "
                   "the others' into another store"),
        "timing": "autofuse.runner.measure.time_pair(" + ", ".join(f"{k}={v}" for k, v in timing.items()) + ")",
    }


def write_outputs(out: str, head: dict, setups: list[dict], rows: list[Row]) -> None:
    """The table at `out` and the rows as JSON beside it (`<out>.json`), each replaced whole."""
    if not out:
        return
    data = {"header": head, "setups": setups, "rows": [dataclasses.asdict(r) for r in rows]}
    for path, text in ((out, table(rows, head, setups)), (out + ".json", json.dumps(data, indent=1, default=str))):
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)


def read_part(path: str) -> dict | None:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    data["rows"] = [Row(**{**r, "shape": tuple(r["shape"])}) for r in data["rows"]]
    return data


def _f(x: Any, fmt: str = "{:.4g}") -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def table(rows: list[Row], head: dict, setups: list[dict]) -> str:
    lines = ["# Deploy-time shapes: plans served at shapes they were not tuned at (issue 19)", ""]
    lines += [f"- {k}: {v}" for k, v in head.items()]
    lines += [f"- {st['name']}: {st['what']}; base shape {fmt_shape(st['base'])}; served at {', '.join(map(fmt_shape, st['serve']))}"
              for st in setups]
    lines += ["", ("Served: `autofuse.jit(forward, store=<base store>)` at that shape (the base plan adapted, checked once against "
                   "jax.jit). Exact: a job tuned at that very shape, its plan run by `autofuse.jit(forward, plan=...)`. Times: medians "
                   "of alternating repeats (timing, above; 3 input sets rotating), speedups the median per-repeat ratio, ± half its "
                   "interquartile range; served / exact: the served plan timed in alternation with the exact plan (t_exact / t_served); "
                   f"pass: served fused and correct, served / exact >= {PASS_RATIO:.2f}. Max error: relative error norm against jax.jit "
                   "on the model's weights (bf16 tolerance 2e-2)."), "",
              ("| model | shape | served: status | groups | max err | jax.jit ms | served ms | served speedup | exact: plan (trials, tune s) "
               "| exact ms | exact speedup | served / exact | result | gpu |"),
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        e = r.exact
        plan = (f"{e['groups']} groups: {e['kinds']} ({e['trials']} trials, {e['tune_s']:.0f} s; tuned {_f(e.get('tuned_speedup'), '{:.2f}x')})"
                if e else "—")
        if r.kind == "base":
            plan = "(the base job) " + plan
        status = r.status.replace("|", "/") or "—"
        if r.note:
            status = f"{status}; **{r.note}**" if r.status else f"**{r.note}**"
        noise = f" ±{r.noise / 2:.1%}" if r.noise is not None else ""
        rnoise = f" ±{r.ratio_noise / 2:.1%}" if r.ratio_noise is not None else ""
        lines.append(f"| {r.model} | {fmt_shape(r.shape)} | {status} | {_f(r.groups, '{}')} | {_f(r.err, '{:.1e}')} | {_f(r.xla_ms)} | "
                     f"{_f(r.af_ms)} | {_f(r.speedup, '{:.2f}x')}{noise if r.speedup else ''} | {plan} | {_f(e.get('ms'))} | "
                     f"{_f(e.get('speedup'), '{:.2f}x')} | {_f(r.ratio, '{:.3f}')}{rnoise if r.ratio else ''} | {r.verdict()} | {r.gpu or '—'} |")
    served = [r for r in rows if r.kind == "served"]
    if served:
        passed = sum(r.verdict() == "pass" for r in served)
        lines += ["", f"{passed} of {len(served)} served shapes pass (fused, correct, within {1 - PASS_RATIO:.0%} of the exact job's speedup)."]
    return "\n".join(lines) + "\n"


def split_shapes(serve: tuple[Shape, ...], parts: int) -> list[list[Shape]]:
    """The served shapes among `parts` processes, one job each, the first also tuning the base (one job more)."""
    load, out = [1] + [0] * (parts - 1), [[] for _ in range(parts)]
    for s in serve:
        k = min(range(parts), key=lambda i: (load[i], i))
        out[k].append(s)
        load[k] += 1
    return out


def launch(a: argparse.Namespace, argv: list[str]) -> int:
    """--gpus: each model's shapes shared among its GPUs, one process each; their rows merged into one table."""
    t0 = time.time()
    gpus = [g.strip() for g in a.gpus.split(",") if g.strip()]
    models = [m.strip() for m in a.models.split(",") if m.strip()]
    if len(gpus) < len(models):
        raise SystemExit(f"--gpus {a.gpus}: fewer GPUs than models ({len(models)})")
    per = len(gpus) // len(models)
    stem = work_stem(a)
    os.makedirs(os.path.dirname(stem), exist_ok=True)
    keep = ["--trials", str(a.trials), "--job-budget", str(a.job_budget), "--trial-timeout", str(a.trial_timeout)]
    keep += (["--layers", str(a.layers)] if a.layers else []) + (["--small"] if a.small else []) + (["--commit", a.commit] if a.commit else [])
    parts, procs, order = [], [], {}
    for m_i, m in enumerate(models):
        st = setup(m, a.small, a.layers, a.shapes)
        order.update({(m, tuple(s)): (m_i, k) for k, s in enumerate((st.base, *st.serve))})
        base_db = f"{stem}_{m}.db"
        for p_i, shapes in enumerate(split_shapes(st.serve, per)):
            if not shapes and p_i:
                continue
            gpu = gpus[m_i * per + p_i]
            out = f"{stem}.part_{m}_{p_i}.md"
            for path in (out, out + ".json"):
                if os.path.exists(path):
                    os.unlink(path)
            listed = ",".join(f"{b}x{s}" for b, s in shapes) or "none"
            cmd = [sys.executable, "-m", "benchmarks.shape_serving", "--models", m, "--shapes", listed,
                   "--base-db", base_db, "--base", "tune" if p_i == 0 else "wait", "--out", out,
                   "--deadline", f"{max(a.deadline - (time.time() - t0), 30.0):.0f}", *keep]
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpu)
            print(f"[{time.time() - t0:5.0f} s] gpu {gpu}: {' '.join(cmd[1:])}", flush=True)
            procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
            parts.append(out + ".json")
    head = header(a, argv, {"repeats": 2, "warmup": 0, "target_ms": 1.0} if a.small else {"repeats": 10, "warmup": 2})
    head["processes"] = f"{len(procs)} on GPUs {', '.join(gpus)} (CUDA_VISIBLE_DEVICES each), {per} per model, one base job per model"

    def merge() -> None:
        rows, setups, cards = [], {}, []
        for path in parts:
            data = read_part(path)
            if data is None:
                continue
            rows += data["rows"]
            cards.append(data["header"].get("card", ""))
            for st in data["setups"]:
                have = setups.setdefault(st["name"], {**st, "serve": []})
                have["serve"] = sorted(have["serve"] + st["serve"], key=lambda s: order.get((st["name"], tuple(s)), (99, 99)))
        head["card"] = ", ".join(sorted({c for c in cards if c})) or "(no part reported yet)"
        rows.sort(key=lambda r: (order.get((r.model, tuple(r.shape)), (99, 99)), r.kind != "base"))
        write_outputs(a.out, head, [setups[m] for m in models if m in setups], rows)

    hard = a.deadline + 20  # the parts keep their own deadline; this only ends parts that hang
    while any(p.poll() is None for p in procs):
        if time.time() - t0 > hard:
            for p in procs:
                if p.poll() is None:
                    print(f"[{time.time() - t0:5.0f} s] killing part {p.pid}: past --deadline", flush=True)
                    os.killpg(p.pid, signal.SIGKILL)
            break
        merge()
        time.sleep(5)
    for p in procs:
        p.wait()
    merge()
    with open(a.out) as f:
        text = f.read()
    print(text, flush=True)
    print(f"[{time.time() - t0:5.0f} s] written: {a.out}", flush=True)
    rows = [r for path in parts if (d := read_part(path)) for r in d["rows"] if r.kind == "served"]
    return 0 if rows and all(r.verdict() == "pass" for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gpt2,llama", help="of gpt2, llama")
    ap.add_argument("--gpus", default="", help="e.g. 0,1,2,3: share each model's jobs among len(gpus) // len(models) processes, one per GPU")
    ap.add_argument("--trials", type=int, default=8, help="trial budget of every job (base and exact)")
    ap.add_argument("--job-budget", type=float, default=150.0, help="time budget of every job, seconds (0: trials only); it bounds "
                    "the trials, not the job's start (XLA timing of every distinct candidate) or its final validation")
    ap.add_argument("--trial-timeout", type=float, default=90.0, help="seconds before a trial is given up as hung")
    ap.add_argument("--layers", type=int, default=None,
                    help=f"blocks of the model (default: gpt2 {DEFAULT_LAYERS['gpt2']}, llama {DEFAULT_LAYERS['llama']})")
    ap.add_argument("--shapes", default="", help="served shapes instead of the defaults, e.g. 4x512,16x512 (batch x sequence)")
    ap.add_argument("--deadline", type=float, default=540.0, help="seconds for everything; what would not finish is skipped with a row saying so")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "shape_serving.md"))
    ap.add_argument("--db", default="", help="SQLite file for the base store (default: in --workdir); the exact jobs' store is in --workdir")
    ap.add_argument("--workdir", default="", help="folder for the stores and, with --gpus, the parts' tables (default: beside --out)")
    ap.add_argument("--base-db", default="", help=argparse.SUPPRESS)  # a part of a --gpus run: the model's shared base store
    ap.add_argument("--base", choices=("tune", "wait"), default="tune", help=argparse.SUPPRESS)  # this part tunes it, or waits for it
    ap.add_argument("--commit", default=None)
    ap.add_argument("--small", action="store_true", help="the examples' CPU-sized configs, modelled tuning, interpret mode (smoke run)")
    a = ap.parse_args(argv)
    for folder in (os.path.dirname(os.path.abspath(a.out)) if a.out else "", a.workdir):
        if folder:
            os.makedirs(folder, exist_ok=True)
    if a.gpus:
        return launch(a, argv)
    logging.basicConfig(level=logging.WARNING, format="  %(message)s")  # autofuse.jit says when it checks a shape
    bench = Bench(a, argv)
    bench.say(f"{bench.header['card']}; {bench.header['versions']}; {bench.header['command']}")
    for name in [m.strip() for m in a.models.split(",") if m.strip()]:
        st = setup(name, a.small, a.layers, a.shapes)
        try:
            bench.run_model(st)
        except Exception as e:  # noqa: BLE001 -- one model's failure is a row, not the end of the run
            bench.rows.append(Row(name, st.base, "base", note=f"{type(e).__name__}: {str(e)[:300]}", gpu=bench.gpu))
            bench.say(f"{name}: failed: {bench.rows[-1].note}")
        bench.write()
    if not a.base_db:  # a part of a --gpus run leaves the table to the process that merges the parts
        print(table(bench.rows, bench.header, [st.public() for st in bench.setups]), flush=True)
    if a.out:
        bench.say(f"written: {a.out}")
    served = [r for r in bench.rows if r.kind == "served"]
    return 0 if served and all(r.verdict() == "pass" for r in served) else 1


if __name__ == "__main__":
    sys.exit(main())
