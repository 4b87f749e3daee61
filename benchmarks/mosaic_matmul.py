"""GPU probe: the Mosaic GPU and Triton lowerings of the `matmul` template against XLA (and, for a plain GEMM,
JAX's hand-written `hopper_matmul_mgpu`), same process, same inputs.

Every kernel is checked against jax.jit on the inputs before it is timed; times are medians of many back-to-back
calls per sync over 3 rotating input sets (`runner.measure.time_fn`), with the spread (min..max of the repeats).

    python -m benchmarks.mosaic_matmul [--out results/mosaic_matmul_h100.json] [--quick]
"""
from __future__ import annotations

import argparse
import json
import sys
import traceback

import jax
import jax.numpy as jnp

import autofuse
from autofuse.kernels import TEMPLATES
from autofuse.runner.measure import check, cone_tolerances, random_inputs, time_fn
from autofuse.graph import Group
from autofuse.tuning.partition import Candidate

BF16 = jnp.bfloat16


def plain(x, w):
    return x @ w


def bias_gelu(x, w, b):
    return jax.nn.gelu(x @ w + b)


def bias_residual(x, w, b, r):
    return (x @ w + b) + r


WORKLOADS = {
    "gemm-8192^3": (plain, [(8192, 8192), (8192, 8192)]),
    "gemm-1024x8192x8192": (plain, [(1024, 8192), (8192, 8192)]),
    "bias-gelu-8192x4096x8192": (bias_gelu, [(8192, 4096), (4096, 8192), (8192,)]),
    "bias-residual-8192x4096x8192": (bias_residual, [(8192, 4096), (4096, 8192), (8192,), (8192, 8192)]),
}
MOSAIC = [
    {},  # the lowering's default
    {"max_concurrent_steps": 3},
    {"grid_tile_width": 4},
    {"grid_tile_width": 16},
    {"block_k": 128, "max_concurrent_steps": 2},
    {"wg_dimension": 1},
    {"epi_tile_n": 128},
]
TRITON = [{"block_m": 128, "block_n": 256, "block_k": 64, "num_warps": 8, "num_stages": 3, "group_m": 8}]


def _group(fn, shapes):
    """The whole program as one matmul group (a lone dot is no candidate of the tuner, but the template runs it)."""
    graph = autofuse.capture(fn, *[jax.ShapeDtypeStruct(s, BF16) for s in shapes])
    group = Group.of(graph, [n.id for n in graph.nodes])
    return graph, Candidate(group, "matmul", TEMPLATES["matmul"].match(group))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="the default configs only")
    a = ap.parse_args(argv)
    from autofuse.kernels.mosaic_gpu import matmul as mgpu

    rows = []
    dev = jax.devices()[0].device_kind
    print(f"device {dev}, jax {jax.__version__}", flush=True)
    for name, (fn, shapes) in WORKLOADS.items():
        graph, cand = _group(fn, shapes)
        g = cand.group
        avals = g.input_avals()
        sets = [random_inputs(avals, 100 + k) for k in range(3)]
        ref = jax.jit(lambda *xs: g.evaluate(xs))
        tol = cone_tolerances(graph, g.node_ids, g.outputs)
        M, N, K = cand.spec.M, cand.spec.N, cand.spec.K
        flops = 2.0 * M * N * K

        def measure(label, f, config=None):
            try:
                res = check(f, ref, avals, (1,), tol)
                if not res.ok:
                    rows.append({"workload": name, "kernel": label, "config": config, "status": "wrong", "error": res.reason})
                    print(f"{name:30} {label:28} WRONG {res.reason}", flush=True)
                    return
                t = time_fn(f, sets, repeats=15)
            except Exception as e:  # noqa: BLE001 - a config that fails is a row, not the end of the probe
                rows.append({"workload": name, "kernel": label, "config": config, "status": "error", "error": f"{type(e).__name__}: {str(e)[:300]}"})
                print(f"{name:30} {label:28} ERROR {type(e).__name__}: {str(e)[:200]}", flush=True)
                return
            tf = flops / (t.median_ms * 1e-3) / 1e12
            rows.append({"workload": name, "kernel": label, "config": config, "status": "ok", "median_ms": t.median_ms, "min_ms": t.min_ms,
                         "max_ms": t.max_ms, "tflops": tf, "max_error": res.max_error})
            print(f"{name:30} {label:28} {t.median_ms:9.4f} ms ({t.min_ms:.4f}..{t.max_ms:.4f})  {tf:6.1f} TFLOP/s  err {res.max_error:.1e}",
                  flush=True)

        measure("xla", ref)
        for cfg in ([{}] if a.quick else MOSAIC):
            full = {**mgpu.default_config(cand.spec), **cfg}
            try:
                k = mgpu.lower(g, cand.spec, full)
            except Exception as e:  # noqa: BLE001
                print(f"{name:30} mosaic {cfg} declined: {e}", flush=True)
                continue
            measure(f"mosaic {json.dumps(cfg)}", jax.jit(lambda *xs, k=k: k(*xs)), full)
        for cfg in TRITON:
            k = TEMPLATES["matmul"].build(g, cfg, spec=cand.spec)
            measure("triton", jax.jit(lambda *xs, k=k: k(*xs)), cfg)
        measure("xla (again)", jax.jit(lambda *xs: g.evaluate(xs)))
        if fn is plain:
            try:
                from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

                c = hm.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4, epi_tile_m=64, epi_tile_n=64,
                                    grid_minor_dim=hm.MatmulDimension.N, grid_tile_width=8, wg_dimension=hm.MatmulDimension.M)
                measure("jax hopper_matmul_mgpu", jax.jit(lambda x, w: [hm.matmul(x, w, None, c)]))
            except Exception:  # noqa: BLE001
                traceback.print_exc()
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": dev, "jax": jax.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
