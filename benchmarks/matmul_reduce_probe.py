"""Probe: a template's kernels (matmul, matmul_reduce, reduce_vjp) at hand-picked configs, against jax.jit, on the GPU.

For each workload: jax.jit's time and compiled memory (temporaries + outputs,
`memory_analysis()`), then the whole program planned as one group of the
template (the largest candidate) at each config: checked against jax.jit,
timed (same inputs, `measure.time_fn`), its memory. A quick way to find good
configs before the tuning job, and the memory numbers the suite does not report. `--kernels`
adds each config's generated kernels' own device times (`kernel_profile`: which stage is slow).

    python benchmarks/matmul_reduce_probe.py --only splade_head,cross_entropy --out probe.md
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import autofuse  # noqa: E402
from autofuse import costmodel  # noqa: E402
from autofuse.runner.measure import check, cone_tolerances, random_inputs, time_fn  # noqa: E402
from autofuse.tuning.partition import enumerate_candidates  # noqa: E402
from autofuse.plan import executor, plan_from_choices  # noqa: E402
from benchmarks.kernel_profile import kernel_times  # noqa: E402
from benchmarks.workloads import emit, specs, workloads  # noqa: E402


def _mr(bm, bn, bk, w, s, split=1):
    return {"block_m": bm, "block_n": bn, "block_k": bk, "num_warps": w, "num_stages": s, "split": split}


def _mm(bm, bn, bk, w, s, g=8):
    return {"block_m": bm, "block_n": bn, "block_k": bk, "num_warps": w, "num_stages": s, "group_m": g}


def _rv(bc, w, bbc, bw):
    return {"block_cols": bc, "num_warps": w, "bwd_block_cols": bbc, "bwd_num_warps": bw}


CONFIGS = {
    "splade_head": ("matmul_reduce", [_mr(128, 128, 64, 8, 3), _mr(128, 128, 64, 4, 4), _mr(128, 64, 64, 4, 3), _mr(256, 128, 64, 8, 3),
                                      _mr(128, 256, 64, 8, 3), _mr(64, 128, 64, 4, 4)]),
    "cross_entropy": ("matmul_reduce", [_mr(128, 256, 64, 8, 3, 2), _mr(128, 256, 64, 8, 4, 2), _mr(128, 256, 32, 8, 5, 2),
                                        _mr(128, 256, 64, 8, 3, 1), _mr(128, 128, 64, 4, 4, 2), _mr(128, 256, 64, 8, 3, 4)]),
    "matmul_bias_gelu": ("matmul", [_mm(128, 256, 64, 8, 3), _mm(256, 128, 64, 8, 3)]),
    "splade_head_grad": ("reduce_vjp", [_rv(64, 16, 64, 32), _rv(64, 16, 64, 16), _rv(64, 16, 32, 16), _rv(64, 16, 32, 32)]),
}


def _mem(compiled) -> tuple[float, float]:
    m = compiled.memory_analysis()
    return m.temp_size_in_bytes / 2**20, m.output_size_in_bytes / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(CONFIGS))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default="")
    ap.add_argument("--small", action="store_true", help="CPU-sized shapes (interpret mode off the GPU): a dry run")
    ap.add_argument("--kernels", action="store_true", help="each config's generated kernels' device times (profiler)")
    a = ap.parse_args()
    lines = [f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}; date {datetime.date.today()}; command: python {' '.join(sys.argv)}", "",
             "| workload | kernel | config | ms | TFLOP/s | vs jax.jit | temp MiB | out MiB | check |", "|---|---|---|---|---|---|---|---|---|"]
    for w in workloads(a.small):
        if w.name not in a.only.split(","):
            continue
        sp = specs(w, jnp.dtype(a.dtype))
        g = autofuse.capture(w.fn, *sp)
        flops = sum(costmodel.node_flops(g, n.id) for n in g.nodes if n.name == "dot_general")
        avals = [g.avals[v] for v in g.inputs]
        sets = [random_inputs(avals, 100 + k) for k in range(3)]
        ref = jax.jit(w.fn)
        ref_c = ref.lower(*sp).compile()
        t_ref = time_fn(ref_c, sets).median_ms
        tmp, out = _mem(ref_c)
        lines.append(f"| {w.name} | jax.jit | | {t_ref:.4f} | {flops / t_ref / 1e9:.0f} | 1.00x | {tmp:.1f} | {out:.1f} | |")
        print(lines[-1], flush=True)
        template, cfgs = CONFIGS[w.name]
        cand = max((c for c in enumerate_candidates(g) if c.template == template), key=lambda c: len(c.nodes))
        for cfg in cfgs:
            cfg_s = " ".join(f"{k}={v}" for k, v in cfg.items())
            try:
                run = executor(g, plan_from_choices(g, [(cand.group, template, cfg, cand.stages)]), interpret=None)
                fused = jax.jit(lambda *x, run=run: run(x)).lower(*sp).compile()
                res = check(fused, lambda *x: jax.tree_util.tree_leaves(ref_c(*x)), avals, (1,), cone_tolerances(g, [n.id for n in g.nodes], g.outputs))
                t = time_fn(fused, sets).median_ms
                tmp, out = _mem(fused)
                lines.append(f"| {w.name} | {template} ({len(cand.nodes)}/{len(g.nodes)} nodes) | {cfg_s} | {t:.4f} | {flops / t / 1e9:.0f} | "
                             f"{t_ref / t:.2f}x | {tmp:.1f} | {out:.1f} | {'ok' if res.ok else res.reason} |")
                if a.kernels:
                    own = [k for k in kernel_times(fused, sets[0]) if k.name.startswith("autofuse")]
                    lines[-1] += " " + ", ".join(f"{k.name.split('_')[1]}×{k.launches_per_call:g} {k.ms_per_call:.4f} ms" for k in own)
            except Exception as e:  # a config that does not compile is one row, not the end of the probe
                lines.append(f"| {w.name} | {template} | {cfg_s} | failed: {type(e).__name__}: {str(e)[:120]} | | | | | |")
            print(lines[-1], flush=True)
    emit(lines, a.out)


if __name__ == "__main__":
    main()
