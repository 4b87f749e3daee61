"""Issue 17 benchmark: a training step's gradients through a plan tuned on the forward loss.

A plan's fused groups are differentiable (`autofuse.differentiate`: each group a `jax.custom_vjp`; attention's
backward the generated flash pair, from the forward's output and row logsumexp), so the gradients of a model can
run through the plan of its *loss*: `jax.jit(jax.grad(autofuse.jit(loss, plan=...)))`. This tunes `loss` of
an example model (`autofuse.tune`, measured on the device), then times, in one process and in alternation,

    jax.jit(jax.grad(loss))                        # XLA
    jax.jit(jax.grad(autofuse.jit(loss, plan)))   # the tuned forward plan, differentiated

after checking that every gradient leaf matches XLA's within the dtype's tolerance, and reports each program's
device memory (XLA's memory analysis of the compiled step: temporaries, arguments, outputs).

    python -m benchmarks models step --models gpt2,llama --modes loss,grad_step --trials 8 --out results/train_step_h100.md
    python -m benchmarks models step --models gpt2 --small   # CPU smoke run (interpret mode, model measure)

`--profile N` adds, per model, the N longest GPU kernels of each step (`benchmarks/kernel_profile.py`): where the
time the plan leaves to XLA goes.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from typing import Any

# GPT-2 medium's training step under jax.jit (B8 S2048) needs 64.7 GiB of temporaries: more than JAX's default 75% of
# an H100. The steps are compared in a child process started after the tuning job's trial process has exited
# (`measure_in_child`), with one preallocated pool of 92% of the card: jax.jit's step and the plan's then take turns
# in one region (a pool grown region by region let a few small buffers split the big step's region and the next
# call failed out of memory; CUDA's stream-ordered pool made XLA rematerialise jax.jit's step, 243 -> 349 ms).
# This process itself must not preallocate: the tuning job's trial process gets 90% of what it leaves free.
MEASURE_ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "true", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.92"}
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp
import numpy as np

import autofuse
from autofuse.runner.measure import time_pair
from autofuse.runner.program_check import NOISE_SPREAD, example_tolerances, rounding_spread
from benchmarks import kernel_profile
from benchmarks.provenance import header

TOL = {np.dtype(jnp.bfloat16): 5e-2, np.dtype(jnp.float16): 1e-2, np.dtype(jnp.float32): 1e-3}


def _rel_errors(got: Any, want: Any) -> list[float]:
    """Relative error (norm of the difference over the norm of XLA's) of every gradient leaf."""
    errs = []
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        errs.append(float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30)))
    return errs


def _own_spread(step: Any, args: tuple) -> list[float]:
    """Per gradient leaf, how far jax.jit's own result moves when the inputs move by one rounding step, the largest
    over the job's three nudges (`rounding_spread` at the model's inputs, as the job's check widens it). The job holds
    each leaf to that move where it exceeds the dtype's tolerance (`example_tolerances`; a deep bf16 step amplifies
    rounding), and a leaf that moves by its whole norm, rounding noise there (SPLADE's key-bias gradients, zero in
    exact arithmetic), to NOISE_FACTOR times it; so does this check."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    return rounding_spread(lambda *xs: jax.tree_util.tree_leaves(step(*jax.tree_util.tree_unflatten(tree, xs))), leaves, (1, 2, 3), args=leaves)


def _memory_mib(step: Any, args: tuple) -> dict[str, float]:
    m = step.lower(*args).compile().memory_analysis()
    mib = 1 << 20
    return {"temp": m.temp_size_in_bytes / mib, "args": m.argument_size_in_bytes / mib, "out": m.output_size_in_bytes / mib}


def run_model(name: str, trials: int, budget_s: float, small: bool, mode: str = "loss", profile: int = 0) -> dict:
    """One model's gradient step, jax.jit against autofuse: with `mode` "loss", the plan tuned on the forward loss
    and differentiated (each fused group's custom VJP); with "grad_step", the plan tuned on the gradient program
    itself (attention's forward and backward chains as the flash pair). Tuned here, compared in a child process."""
    mod = importlib.import_module(f"examples.{name}")
    args = mod.small_inputs() if small else mod.example_inputs()
    fn = mod.loss if mode == "loss" else mod.grad_step
    t0 = time.time()
    rep = autofuse.tune(fn, *args, trials=trials, time_budget_s=budget_s or None, seed=0, quiet=True, store=False, name=f"examples.{name}:{mode}")
    tune_s = time.time() - t0
    print(f"{name} {mode}: {rep.summary()}\nvalidation: {rep.validation.status} {rep.validation.error or ''}\n{rep.table()}", file=sys.stderr, flush=True)  # why a plan kept XLA's: the candidates' bests
    del args
    row = {"model": name, "mode": mode, "plan": ", ".join(sorted({f"{g.template}/{g.backend}" for g in rep.plan.groups})) or "XLA",
           "groups": len(rep.plan.groups), "fwd_speedup": rep.speedup, "tune_s": tune_s}
    return {**row, **measure_in_child(name, mode, rep.plan.to_json(), small, profile)}


def measure_in_child(name: str, mode: str, plan_json: str, small: bool, profile: int = 0) -> dict:
    """`compare_steps` in a fresh process with `MEASURE_ENV`'s pool; its row fields (an "error" if it failed)."""
    import json
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        plan_path, out_path = os.path.join(d, "plan.json"), os.path.join(d, "row.json")
        with open(plan_path, "w") as f:
            f.write(plan_json)
        cmd = [sys.executable, "-m", "benchmarks.train_step", "--compare", name, mode, plan_path, out_path,
               "--profile", str(profile)] + (["--small"] if small else [])
        proc = subprocess.run(cmd, env={**os.environ, **MEASURE_ENV}, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        if proc.returncode or not os.path.exists(out_path):
            return {"error": f"the comparing process exited with {proc.returncode}"}
        with open(out_path) as f:
            return json.load(f)


def compare_steps(name: str, mode: str, plan: Any, small: bool, profile: int = 0) -> dict:
    """jax.jit's step and the plan's: every gradient leaf checked against XLA's, XLA's memory analysis of each,
    then both timed in alternation on rotated inputs (and, with `profile`, each one's kernels traced)."""
    mod = importlib.import_module(f"examples.{name}")
    args = mod.small_inputs() if small else mod.example_inputs()
    if mode == "loss":
        ref = jax.jit(jax.grad(mod.loss))
        fused = jax.jit(jax.grad(autofuse.jit(mod.loss, plan=plan)))
    else:
        ref = jax.jit(mod.grad_step)
        fused = jax.jit(autofuse.jit(mod.grad_step, plan=plan))
    want, got = ref(*args), fused(*args)
    errs = _rel_errors(got, want)
    del want, got
    dtype = np.dtype(jax.tree_util.tree_leaves(args[0])[0].dtype)
    spread = _own_spread(ref, args)
    noise = [k for k, e in enumerate(spread) if e >= NOISE_SPREAD]  # rounding noise at these inputs: held to jax.jit's own move
    bound = example_tolerances([TOL[dtype]] * len(spread), spread)
    spread_held = [k for k, e in enumerate(errs) if k not in noise and e > TOL[dtype]]  # beyond the dtype's tolerance, within jax.jit's move
    row = {"max_rel_err": max((e for k, e in enumerate(errs) if k not in noise), default=0.0), "ok": all(e <= b for e, b in zip(errs, bound)),
           "noise_leaves": [(errs[k], spread[k]) for k in noise], "spread_leaves": [(errs[k], spread[k]) for k in spread_held],
           "mem_xla": _memory_mib(ref, args), "mem_af": _memory_mib(fused, args)}
    if row["ok"]:
        sets = [args] + [_scaled(args, 1 + 0.01 * k) for k in (1, 2)]  # other values, so that caches do not flatter
        base, plan_t, ratio = time_pair(ref, fused, sets, repeats=10)
        row.update(xla_ms=base.median_ms, af_ms=plan_t.median_ms, speedup=1.0 / ratio.median_ms, noise=(ratio.q3_ms - ratio.q1_ms))
    if profile:
        row["profile"] = {k: kernel_profile.as_json(kernel_profile.kernel_times(f, args)) for k, f in (("jax.jit", ref), ("autofuse", fused))}
    return row


def _scaled(args: tuple, f: float) -> tuple:
    return jax.tree_util.tree_map(lambda x: (x * f).astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, args)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gpt2")
    ap.add_argument("--modes", default="loss", help="loss (the forward loss's plan, differentiated), grad_step (the gradient "
                    "program tuned itself), or both: loss,grad_step")
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--budget", type=float, default=0.0, help="tuning seconds per model (0: the trials alone bound it)")
    ap.add_argument("--small", action="store_true", help="the examples' small inputs (a CPU smoke run)")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="list the N longest GPU kernels of each step")
    ap.add_argument("--out", default="")
    ap.add_argument("--compare", nargs=4, metavar=("MODEL", "MODE", "PLAN_JSON", "ROW_JSON"), help=argparse.SUPPRESS)  # the child
    a = ap.parse_args(argv)
    if a.compare:
        import json

        from autofuse.plan import Plan

        name, mode, plan_path, out_path = a.compare
        with open(plan_path) as f:
            plan = Plan.from_json(f.read())
        row = compare_steps(name, mode, plan, a.small, a.profile)
        with open(out_path, "w") as f:
            json.dump(row, f)
        return 0
    rows = []
    for name in a.models.split(","):
        for mode in a.modes.split(","):
            try:
                rows.append(run_model(name, a.trials, a.budget, a.small, mode, a.profile))
            except Exception as e:  # noqa: BLE001 - one model's failure is a row, not the end of the run
                rows.append({"model": name, "mode": mode, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            print({k: v for k, v in rows[-1].items() if k != "profile"}, flush=True)
            if a.out:
                write_table(rows, a.out, argv, a.profile)  # after every row: a run cut short keeps what it did
    text = write_table(rows, a.out, argv, a.profile)
    print(text)
    return 0 if all("error" not in r and r.get("ok") for r in rows) else 1


def write_table(rows: list[dict], out: str, argv: list[str] | None, profile: int = 0) -> str:
    """The Markdown table of `rows` (written to `out` when given): per model and mode, the plan, both steps' times
    and their device memory (XLA's memory analysis of the compiled step: temporaries; arguments and outputs)."""
    lines = [header(argv), "",
             "mode loss: the plan tuned on the forward loss, differentiated (`jax.jit(jax.grad(autofuse.jit(loss, plan)))`); "
             "mode grad_step: the plan tuned on `grad_step` itself (`jax.jit(autofuse.jit(grad_step, plan))`). Memory: XLA's "
             "memory analysis of each compiled step, MiB: temporaries (peak working set beyond arguments and outputs), "
             "and arguments + outputs. Max rel err: over every gradient leaf on the model's inputs, each held, as the job's "
             "check holds it, to the dtype's tolerance or jax.jit's own move when the inputs move by one rounding step (the "
             "largest of three nudges) where larger, up to 25% (a leaf beyond the dtype's tolerance is listed with that move); "
             "a leaf that is rounding noise there (jax.jit's own result moves by its whole norm) is listed apart, held to twice "
             "that move.", "",
             "| model | mode | plan | speedup at tuning | step: jax.jit ms | step: autofuse ms | speedup | noise | max rel err "
             "| temp MiB jax.jit / autofuse | args+out MiB | tuning s |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r.get('mode', '')} | error: {r['error']} ||||||||||")
            continue
        t = (f"{r['xla_ms']:.3f} | {r['af_ms']:.3f} | {r['speedup']:.2f}x | ±{r['noise']:.1%}" if "xla_ms" in r
             else "- | - | WRONG | -")
        fwd = f"{r['fwd_speedup']:.2f}x" if r["fwd_speedup"] else "-"
        io = r["mem_xla"]["args"] + r["mem_xla"]["out"]
        err = (f"{r['max_rel_err']:.1e}" + "".join(f"; a leaf {e:.2g} (jax.jit's own move {m:.2g})" for e, m in r.get("spread_leaves", []))
               + "".join(f"; a noise leaf {e:.2g} (jax.jit's own move {m:.2g})" for e, m in r.get("noise_leaves", [])))
        lines.append(f"| {r['model']} | {r['mode']} | {r['groups']} groups: {r['plan']} | {fwd} | {t} | {err} | "
                     f"{r['mem_xla']['temp']:.0f} / {r['mem_af']['temp']:.0f} | {io:.0f} | {r['tune_s']:.0f} |")
    for r in rows:
        for prog, items in r.get("profile", {}).items():
            lines += [""] + kernel_profile.kernel_table(kernel_profile.from_json(items), top=profile,
                                                         title=f"{r['model']} {r['mode']}, {prog}: its longest GPU kernels")
    text = "\n".join(lines) + "\n"
    if out:
        with open(out, "w") as f:
            f.write(text)
    return text


if __name__ == "__main__":
    sys.exit(main())
