"""Issue 2 benchmark: each suite workload through autofuse with default configs vs jax.jit.

Checks the fused program against jax.jit on fresh random inputs, then times
both in the same process (rotating 3 input sets) and prints a Markdown table
with the memory floor (bytes read + written / 4.26 TB/s).

    python benchmarks/core_default.py [--small] [--dtypes bfloat16,float32] [--out results/core_default.md]
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import autofuse  # noqa: E402
from autofuse import costmodel  # noqa: E402
from autofuse.runner.measure import check, random_inputs, time_fn  # noqa: E402
from autofuse.tuning.select import default_plan  # noqa: E402
from benchmarks.workloads import emit, specs, workloads  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="CPU-sized shapes")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--only", default="", help="comma-separated workload names")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    rows = []
    for w in workloads(a.small):
        if a.only and w.name not in a.only.split(","):
            continue
        for dt in a.dtypes.split(","):
            dtype = jnp.dtype(dt)
            sp = specs(w, dtype)
            graph = autofuse.capture(w.fn, *sp)
            plan = default_plan(graph)
            fused = autofuse.jit(w.fn, plan=plan)
            xla = jax.jit(w.fn)
            avals = [graph.avals[v] for v in graph.inputs]
            res = check(lambda *x: jax.tree_util.tree_leaves(fused(*x)), lambda *x: jax.tree_util.tree_leaves(xla(*x)), avals, seeds=(11, 12))
            sets = [[jnp.asarray(x) for x in random_inputs(avals, 100 + k)] for k in range(3)]
            tx = time_fn(xla, sets)
            tf = time_fn(fused, sets) if res.ok else None
            floor = costmodel.floor_ms(graph)
            kernels = ", ".join(f"{g.template}{g.config['block_rows']}x{g.config['block_cols']}w{g.config['num_warps']}" for g in plan.groups)
            rows.append((w.name, dt, "x".join(map(str, w.shapes[0])), res.ok, f"{res.max_error:.2e}", tx, tf, floor, kernels))
            print(rows[-1][:4], tx.median_ms, tf and tf.median_ms, flush=True)
    lines = [
        f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}; date {datetime.date.today()}; command: python {' '.join(sys.argv)}",
        "",
        "| workload | dtype | shape | correct | rel err | jax.jit ms (IQR) | autofuse ms (IQR) | speedup | floor ms | XLA/floor | autofuse/floor | kernels (default configs) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, dt, shape, ok, err, tx, tf, floor, kernels in rows:
        fs = f"{tf.median_ms:.4f} ({tf.q1_ms:.4f}-{tf.q3_ms:.4f})" if tf else "-"
        sp = f"{tx.median_ms / tf.median_ms:.2f}x" if tf else "-"
        af = f"{tf.median_ms / floor:.2f}" if tf else "-"
        lines.append(f"| {name} | {dt} | {shape} | {ok} | {err} | {tx.median_ms:.4f} ({tx.q1_ms:.4f}-{tx.q3_ms:.4f}) | {fs} | {sp} | {floor:.4f} | {tx.median_ms / floor:.2f} | {af} | {kernels} |")
    emit(lines, a.out)


if __name__ == "__main__":
    main()
