"""Tuning on a machine with several GPUs (issue 18): `autofuse tune ... --workers N` for each N on the same trial
budget, for the suite's attention and SPLADE head workloads and GPT-2 medium's forward; one Markdown table.

    python -m benchmarks workers --workers 1,2 --out $OUT/multi_gpu.md [--workloads gpt2,attention,splade]
        [--trials gpt2=24,attention=12,splade=12] [--deadline 560] [--commit HASH]

Each configuration runs `python -m autofuse.cli tune` in its own process group, with its own SQLite file
(beside the table), under a time limit (what is left of `--deadline`, at most `--timeout`): a failure or a
timeout is a row that says so, and the rest go on. The table is rewritten after every configuration, so a
run cut short keeps what it did; each command's output is kept in `<out>.logs/`.

Per row, from the run's store: the command's wall time; "start": the run's start to its first trial (capture,
the XLA timing of the candidates the budget reaches first, compiling ahead); "first plan": the command's start to the first
plan stored for the run (the run's timestamps: the chosen plan is stored as soon as it passes validation, before
the smaller plans are validated); the run's recorded phases (migration 0006) as seconds from the command's start at
which its setup (candidates registered, studies created), its XLA timings, its trials, its first validated plan
and its selection ended, and the selection's parts (seconds:
checking the bests, timing lone dots, the cover, compiling the plans ahead, validating; per plan validated its
compile, jax.jit reference, check and timing);
trials counted against the budget and per minute of wall time; jax.jit and plan ms and the speedup as the
final validation measured them; the candidates timed in XLA and the sum of their XLA times (compare it between
rows, and with `--extra "--compile-workers 1"`, to see that concurrent compilation, whose XLA autotuning shares the
GPU, left the XLA timings as they were); and per worker (host:pid) the device its trial process ran on
(`CUDA_VISIBLE_DEVICES` and the jax device), its XLA timings and its trials.
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks.provenance import command, commit
from benchmarks.workloads import specs, workloads

PROGRAMS = {  # name: (function, inputs factory, what it is)
    "gpt2": ("examples.gpt2:forward", "benchmarks.multi_gpu:gpt2_shapes", "GPT-2 medium forward (24 layers, B8 S2048, bf16)"),
    "attention": ("benchmarks.workloads:attention_bhld", "benchmarks.multi_gpu:attention_shapes", "attention [8,32,2048,128] bf16"),
    "splade": ("benchmarks.workloads:splade_head", "benchmarks.multi_gpu:splade_shapes", "SPLADE head [32,256,768]x[768,30522] bf16"),
}
DEFAULT_TRIALS = {"gpt2": 24, "attention": 12, "splade": 12}
PHASES = ("start", "setup", "xla", "trials", "first_plan", "selected", "saved")  # a run's recorded phase marks (autofuse show run)
SMALL_INPUTS = {  # --small: CPU-sized shapes, for trying the script without a GPU (model mode)
    "gpt2": "examples.gpt2:small_inputs", "attention": "benchmarks.multi_gpu:attention_small", "splade": "benchmarks.multi_gpu:splade_small",
}


def _suite(name: str, small: bool = False) -> tuple:
    (w,) = [w for w in workloads(small) if w.name == name]
    return tuple(specs(w, jnp.float32 if small else jnp.bfloat16))


def attention_small() -> tuple:
    return _suite("attention", small=True)


def splade_small() -> tuple:
    return _suite("splade_head", small=True)


def attention_shapes() -> tuple:
    """The suite's attention workload, as shapes (workers rebuild arguments from shapes anyway)."""
    return _suite("attention")


def splade_shapes() -> tuple:
    return _suite("splade_head")


def gpt2_shapes() -> tuple:
    """GPT-2 medium's forward arguments as shapes: no 0.7 GB of weights made in the launcher."""
    from examples import gpt2

    return jax.eval_shape(gpt2.example_inputs)


def run_one(program: str, workers: int, trials: int, workdir: str, limit_s: float, extra: list[str], small: bool = False,
            tag: str = "") -> dict[str, Any]:
    """One `autofuse tune --workers N` in its own process group, killed whole at `limit_s`; its facts from the store
    (its own file: `tag` tells apart two runs of the same worker count, e.g. one with the caches the first filled)."""
    fn, inputs, _ = PROGRAMS[program]
    inputs = SMALL_INPUTS[program] if small else inputs
    db = os.path.join(workdir, f"{program}_w{workers}{tag}.db")
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(db + suffix):
            os.unlink(db + suffix)
    cmd = ["autofuse", "tune", fn, "--inputs", inputs, "--trials", str(trials), "--workers", str(workers), "--db", f"sqlite:///{db}", "-v", *extra]
    log = os.path.join(workdir, f"{program}_w{workers}{tag}.log")
    row: dict[str, Any] = {"program": program, "small": small, "workers": workers, "trials_budget": trials, "command": " ".join(cmd), "log": log}
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "autofuse.cli", *cmd[1:]], stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its workers and their trial processes
            proc.wait()
            code = "timeout"
    row["wall_s"], row["t0"] = time.time() - t0, t0
    row["exit"] = code
    try:
        row.update(read_store(db, t0))
    except Exception as e:  # noqa: BLE001 - a run that never got far has no store to read: the row says why
        row["store_error"] = f"{type(e).__name__}: {e}"
    return row


def read_store(db: str, t0: float) -> dict[str, Any]:
    """What the run's store says: status, timings, speedup, and who measured what on which device."""
    from autofuse.store import PlanStore

    store = PlanStore(f"sqlite:///{db}")
    (run,) = store.runs()
    run = store.get_run(run["id"])
    trials = store.trials(run["id"])
    cands = store.candidates(run["id"])
    counted = [t for t in trials if t["status"] not in ("infeasible", "pruned", "lost", "running")]
    plans = [p for p in store.plans() if p["run_id"] == run["id"]]
    started = run["started_at"].timestamp()
    first_trial = min((t["created_at"].timestamp() for t in counted), default=None)
    per_worker: dict[str, dict] = defaultdict(lambda: {"devices": Counter(), "xla": 0, "trials": 0})
    for c in cands:
        if c.get("xla_worker"):
            w = per_worker[c["xla_worker"]]
            w["xla"] += 1
            w["devices"][c.get("xla_device") or "?"] += 1
    for t in counted:
        w = per_worker[t.get("worker") or "?"]
        w["trials"] += 1
        w["devices"][t.get("device") or "?"] += 1
    for key, parts in (run.get("phases") or {}).items():  # where each worker's trial loop went (`TrialLoop.spent`)
        if key.startswith("trial_parts ") and isinstance(parts, dict):
            per_worker[key.split(" ", 1)[1]]["loop"] = parts
    return {
        "status": run["status"], "error": run.get("error"), "device": run["device"],
        "versions": f"jax {run.get('jax')}, jaxlib {run.get('jaxlib')}, autofuse {run.get('autofuse')}",
        "candidates": len(cands), "trials": len(counted),
        "xla_sum_ms": sum(c["xla_ms"] or 0.0 for c in cands), "xla_timed": sum(c["xla_ms"] is not None for c in cands),
        "start_s": first_trial - started if first_trial else None,
        "first_plan_s": min(p["created_at"].timestamp() for p in plans) - t0 if plans else None,
        "baseline_ms": run.get("baseline_ms"), "best_ms": run.get("best_ms"), "speedup": run.get("speedup"),
        "per_worker": {k: dict(v) for k, v in per_worker.items()},
        "phases": phases_from(run.get("phases"), started - t0),
    }


def phases_from(phases: dict | None, offset: float) -> dict[str, Any]:
    """A run's recorded phases (migration 0006) as seconds from the command's start (`offset`: the run row's), and
    the selection's parts."""
    if not phases:
        return {}
    out: dict[str, Any] = {k: offset + phases[k] for k in PHASES if isinstance(phases.get(k), (int, float))}
    sel = phases.get("selection") or {}
    out["selection_parts"] = ", ".join(f"{k} {sel[k]:.1f}" for k in ("check", "singles", "cover", "compile_ahead", "validate")
                                       if isinstance(sel.get(k), (int, float)))
    compiled = [", ".join(f"{k} {v:.1f}" for k, v in batch.items()) for batch in sel.get("compiled") or [] if batch]
    if compiled:
        out["selection_parts"] += " (longest compile of one: " + "; then ".join(compiled) + ")"
    plans = sel.get("plans") or []
    if plans:
        out["selection_parts"] += "; plans: " + ", ".join(
            f"{p.get('groups')}g {p.get('seconds', 0):.1f} (compile {p.get('compile', 0):.1f}, ref {p.get('reference', 0):.1f}, "
            f"check {p.get('check', 0):.1f}, time {p.get('time', 0):.1f})" + (f" on GPU {p['gpu']}" if p.get("gpu") else "") for p in plans)
    return out


def _f(x: Any, fmt: str = "{:.1f}") -> str:
    return "—" if x is None else fmt.format(x)


def workers_cell(per_worker: dict) -> str:
    """Per worker: the devices it ran on (counts), its XLA timings and its trials, and where its trial loop's seconds
    went (`loop_text`)."""
    parts = []
    for w, v in sorted(per_worker.items()):
        devs = "; ".join(f"{d} x{n}" for d, n in v["devices"].most_common())
        loop = loop_text(v.get("loop"))
        parts.append(f"`{w}`: {v['xla']} XLA + {v['trials']} trials on {devs}" + (f"; loop s: {loop}" if loop else ""))
    return "<br>".join(parts) or "—"


def loop_text(parts: dict | None) -> str:
    """A worker's trial loop in seconds: measuring (compile and time; its parts in the trial process beside it: the
    kernel built, checked, its timed form compiled, timed), the sampler and its storage (a trial's time that is
    neither measuring nor the ledger's claims), compiling ahead (and asking phase 2's configs ahead), the scheduler's picks, reading the ledger."""
    if not parts:
        return ""
    sampler = parts.get("trials", 0.0) - parts.get("measure", 0.0) - parts.get("claim", 0.0)
    shown = {"measure": parts.get("measure"), "sampler": sampler if "trials" in parts else None, "claims": parts.get("claim"),
             "ahead": parts.get("compile_ahead"), "asked ahead": parts.get("ask_ahead"), "pick": parts.get("pick"), "ledger": parts.get("ledger"), "study": parts.get("study")}
    inner = {k[len("measure_"):]: v for k, v in parts.items() if k.startswith("measure_") and isinstance(v, (int, float))}
    text = ", ".join(f"{k} {v:.1f}" for k, v in shown.items() if isinstance(v, (int, float)))
    if parts.get("batches"):
        text += (f" (compiled ahead: {parts.get('compiled_ahead', 0)} in {parts['batches']} batches, {parts.get('ahead_failed', 0)} failed, "
                 f"{parts.get('ahead_lost', 0)} batches lost)")
    return text + (f" (measuring: {', '.join(f'{k} {v:.1f}' for k, v in inner.items())})" if inner else "")


def phases_cell(ph: dict) -> str:
    """When the setup, the XLA timings, the trials and the selection ended, in seconds from the command's start."""
    return " / ".join(_f(ph.get(k)) for k in ("setup", "xla", "trials", "first_plan", "selected")) if ph else "—"


def table(rows: list[dict], header: dict[str, str]) -> str:
    lines = ["# Tuning with several GPUs: `autofuse tune --workers N` (issue 18)", ""]
    lines += [f"- {k}: {v}" for k, v in header.items()]
    lines += ["", ("| workload | workers | exit | status | wall s | start s | first plan s | phases ended at s: setup / XLA / trials / first plan / selected "
                   "| selection s: parts | trials | trials/min | jax.jit ms | plan ms "
                   "| speedup | candidates: timed in XLA, their XLA ms summed | per worker: XLA timings, trials, devices, trial loop | command |"),
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tpm = 60 * r["trials"] / r["wall_s"] if r.get("trials") and r.get("wall_s") else None
        status = r.get("status") or r.get("store_error", "no store")
        if r.get("error"):
            status += f" ({r['error'][:120]})"
        what = f"{r['program']} (small shapes)" if r.get("small") else PROGRAMS[r["program"]][2]
        lines.append(f"| {what} | {r['workers']} | {r['exit']} | {status} | {_f(r.get('wall_s'))} | "
                     f"{_f(r.get('start_s'))} | {_f(r.get('first_plan_s'))} | {phases_cell(r.get('phases') or {})} | "
                     f"{(r.get('phases') or {}).get('selection_parts') or '—'} | {r.get('trials', '—')}/{r['trials_budget']} | {_f(tpm)} | "
                     f"{_f(r.get('baseline_ms'), '{:.4g}')} | {_f(r.get('best_ms'), '{:.4g}')} | {_f(r.get('speedup'), '{:.2f}x')} | "
                     f"{r.get('xla_timed', '—')}/{r.get('candidates', '—')}, {_f(r.get('xla_sum_ms'), '{:.4g}')} | "
                     f"{workers_cell(r.get('per_worker', {}))} | `{r['command']}` |")
    return "\n".join(lines) + "\n"


def gpus() -> str:
    """The host's GPUs as nvidia-smi lists them (no CUDA context made here)."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=False).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        return "(no nvidia-smi)"
    return f"{len(out)}: " + "; ".join(line.split(" (UUID")[0] for line in out) if out else "(none)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="gpt2,attention,splade", help=f"of {','.join(PROGRAMS)}, run in this order")
    ap.add_argument("--workers", default="1,2", help="worker counts, each on the same trial budget")
    ap.add_argument("--trials", default="", help="per workload, e.g. gpt2=24,attention=12 (defaults: "
                    + ",".join(f"{k}={v}" for k, v in DEFAULT_TRIALS.items()) + ")")
    ap.add_argument("--deadline", type=float, default=560.0, help="seconds for everything; a configuration gets what is left")
    ap.add_argument("--timeout", type=float, default=300.0, help="at most this many seconds per configuration")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "multi_gpu.md"))
    ap.add_argument("--commit", default=None)
    ap.add_argument("--small", action="store_true", help="CPU-sized shapes (to try the script without a GPU)")
    ap.add_argument("--extra", default="", help="more arguments for every autofuse tune (e.g. --compile-workers 8)")
    a = ap.parse_args(argv)
    t_start = time.time()
    trials = dict(DEFAULT_TRIALS, **{k: int(v) for k, v in (kv.split("=") for kv in a.trials.split(",") if kv)})
    progs = [p.strip() for p in a.workloads.split(",") if p.strip()]
    unknown = [p for p in progs if p not in PROGRAMS]
    if unknown:
        ap.error(f"unknown workload(s) {unknown}; known: {', '.join(PROGRAMS)}")
    counts = [int(x) for x in a.workers.split(",")]
    workdir = os.path.splitext(os.path.abspath(a.out))[0] + ".logs"
    os.makedirs(workdir, exist_ok=True)
    header = {"date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"), "commit": commit(a.commit),
              "gpus": gpus(), "host": f"{os.uname().nodename}, {os.cpu_count()} cores, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}",
              "command": command(argv)}
    rows: list[dict] = []
    plan = [(p, n) for p in progs for n in counts]
    for k, (p, n) in enumerate(plan):
        left = a.deadline - (time.time() - t_start)
        if left < 30:
            print(f"[{time.time() - t_start:5.0f} s] skip {p} --workers {n}: {left:.0f} s left of --deadline", flush=True)
            rows.append({"program": p, "workers": n, "trials_budget": trials[p], "command": "(skipped: out of time)", "exit": "skipped"})
            continue
        limit = min(a.timeout, left)
        print(f"[{time.time() - t_start:5.0f} s] ({k + 1}/{len(plan)}) {p} --workers {n} --trials {trials[p]} (limit {limit:.0f} s)", flush=True)
        repeat = sum(1 for q, m in plan[:k] if (q, m) == (p, n))  # `--workers 4,1,4`: the second 4 has its own store
        row = run_one(p, n, trials[p], workdir, limit, a.extra.split(), a.small, tag=f"_{repeat + 1}" if repeat else "")
        rows.append(row)
        for key in ("device", "versions"):
            if row.get(key):
                header.setdefault({"device": "card", "versions": "versions"}[key], row[key])
        print(f"[{time.time() - t_start:5.0f} s]   exit {row['exit']}, {row.get('status') or row.get('store_error')}: wall {row['wall_s']:.1f} s, "
              f"start {_f(row.get('start_s'))} s, first plan {_f(row.get('first_plan_s'))} s, {row.get('trials', 0)} trials, "
              f"speedup {_f(row.get('speedup'), '{:.2f}x')}; workers: {len(row.get('per_worker', {}))} (log {row['log']})", flush=True)
        with open(a.out, "w") as f:
            f.write(table(rows, header))
    with open(a.out, "w") as f:
        f.write(table(rows, header))
    print(table(rows, header))
    print(f"written: {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
