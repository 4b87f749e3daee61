"""Issue 3 benchmark: the whole tuning job on each suite workload, on the GPU.

For each workload and dtype: `autofuse.tune` (device measurement, trials in an
isolated worker) with a trial and time budget, plans stored in a SQLite file;
prints jax.jit ms, autofuse ms (the end-to-end validation, same process, same
inputs), speedup, memory floor and tuning wall time, as a Markdown table.

    python -m benchmarks suite --trials 30 --time-budget 120 --db /tmp/suite.db --out results/tune_suite.md
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax.numpy as jnp  # noqa: E402

import autofuse  # noqa: E402
from autofuse import costmodel  # noqa: E402
from benchmarks.provenance import header  # noqa: E402
from benchmarks.workloads import emit, specs, workloads  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--only", default="")
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--time-budget", type=float, default=120.0)
    ap.add_argument("--db", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--backends", default=None, help="lowerings to search, e.g. mosaic_gpu,triton (default: the machine's)")
    a = ap.parse_args()
    backends = a.backends.split(",") if a.backends else None
    store = autofuse.PlanStore(f"sqlite:///{os.path.abspath(a.db)}") if a.db else None
    rows = []
    for w in workloads(a.small):
        if a.only and w.name not in a.only.split(","):
            continue
        for dt in a.dtypes.split(","):
            sp = specs(w, jnp.dtype(dt))
            t0 = time.time()
            rep = autofuse.tune(w.fn, *sp, trials=a.trials, time_budget_s=a.time_budget, store=store, name=f"{w.name}-{dt}", quiet=True,
                                backends=backends)
            wall = time.time() - t0
            floor = costmodel.floor_ms(autofuse.capture(w.fn, *sp))
            kern = "XLA" if rep.plan.is_xla else "; ".join(
                f"{g.template}/{g.backend} " + " ".join(f"{k}={v}" for k, v in sorted(g.config.items())) for g in rep.plan.groups)
            rows.append((w.name, dt, "x".join(map(str, w.shapes[0])), rep, floor, wall, kern))
            print(rep.table(), flush=True)
    lines = [
        header(),
        "",
        "| workload | dtype | shape | jax.jit ms | autofuse ms | speedup | noise | floor ms | XLA/floor | autofuse/floor | trials | tuning s | plan |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, dt, shape, rep, floor, wall, kern in rows:
        lines.append(
            f"| {name} | {dt} | {shape} | {rep.baseline_ms:.4f} | {rep.tuned_ms:.4f} | {rep.speedup:.2f}x | "
            f"{'' if rep.noise is None else f'±{rep.noise:.1%}'} | {floor:.4f} | {rep.baseline_ms / floor:.2f} | {rep.tuned_ms / floor:.2f} | "
            f"{rep.trials_run} | {wall:.0f} | {kern} |"
        )
    emit(lines, a.out)


if __name__ == "__main__":
    main()
