"""Issue 4 check: in a fresh process, `autofuse.jit` finds the stored plans and reproduces the tuned speedup.

For every suite workload with a plan in the database: wrap it with
`autofuse.jit(fn, store=DB)`, confirm the lookup hit, check it against
`jax.jit` and time both in this process (rotating 3 input sets). Also times
the per-call overhead of a warm hit against plain `jax.jit` on a tiny input
(where dispatch is all there is), and prints a Markdown table.

    python -m benchmarks deploy check --db /tmp/suite.db [--out results/deploy_check.md]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import autofuse  # noqa: E402
from autofuse.runner.measure import check, random_inputs, time_fn  # noqa: E402
from autofuse.plan import executor  # noqa: E402
from autofuse.tuning.select import default_plan  # noqa: E402
from benchmarks.provenance import header  # noqa: E402
from benchmarks.workloads import emit, specs, workloads  # noqa: E402


def dispatch_overhead_us(fn, x, n=2000, reps=7) -> float:
    """Median per-call wall time (µs) of n back-to-back calls."""
    jax.block_until_ready(fn(x))
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            y = fn(x)
        jax.block_until_ready(y)
        out.append((time.perf_counter() - t0) / n * 1e6)
    return float(np.median(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", required=True)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    url = f"sqlite:///{os.path.abspath(a.db)}"
    store = autofuse.PlanStore(url)
    tuned = {p["program"]: p for p in store.plans(current_only=True)}
    rows = []
    for w in workloads(a.small):
        for dt in ("bfloat16", "float32"):
            name = f"{w.name}-{dt}"
            if name not in tuned:
                continue
            sp = specs(w, jnp.dtype(dt))
            fused = autofuse.jit(w.fn, store=url)
            xla = jax.jit(w.fn)
            avals = [autofuse.graph.Aval(s.shape, np.dtype(s.dtype)) for s in sp]
            sets = [random_inputs(avals, 500 + k) for k in range(3)]
            jax.block_until_ready(fused(*sets[0]))
            status = fused.last_status
            res = check(lambda *x: jax.tree_util.tree_leaves(fused(*x)), lambda *x: jax.tree_util.tree_leaves(xla(*x)), avals, seeds=(21,))
            tx, tf = time_fn(xla, sets), time_fn(fused, sets)
            rows.append((name, status, res.ok, tuned[name].get("speedup"), tx, tf))
            print(rows[-1][:4], tx.median_ms, tf.median_ms, flush=True)
    # Per-call overhead: autofuse.jit against jax.jit of the very same program, on a tiny input.
    soft = workloads()[1].fn
    x = jax.random.normal(jax.random.PRNGKey(0), (8, 128), jnp.float32)
    miss_xla = dispatch_overhead_us(jax.jit(soft), x)
    miss_af = dispatch_overhead_us(autofuse.jit(soft, store=url), x)  # no plan for this shape: jax.jit behind autofuse.jit
    graph = autofuse.capture(soft, x)
    plan = default_plan(graph)
    run = executor(graph, plan)
    hit_xla = dispatch_overhead_us(jax.jit(lambda a: run([a])[0]), x)
    hit_af = dispatch_overhead_us(autofuse.jit(soft, plan=plan), x)
    lines = [
        header(),
        "",
        "| program | lookup | correct | tuned speedup (stored) | jax.jit ms | autofuse.jit ms | speedup now |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, status, ok, stored, tx, tf in rows:
        lines.append(f"| {name} | {status} | {ok} | {stored:.2f}x | {tx.median_ms:.4f} | {tf.median_ms:.4f} | {tx.median_ms / tf.median_ms:.2f}x |")
    lines += ["", "Per-call wall time (µs), 8x128 float32 softmax, median of 7 x 2000 back-to-back calls, each against jax.jit of the same program:", "",
              "| case | jax.jit | autofuse.jit |", "|---|---|---|",
              f"| miss (plain program) | {miss_xla:.1f} | {miss_af:.1f} |", f"| hit (fused plan, generated kernel) | {hit_xla:.1f} | {hit_af:.1f} |"]
    emit(lines, a.out)


if __name__ == "__main__":
    main()
