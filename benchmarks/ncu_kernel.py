"""Run one kernel of `benchmarks.mosaic_probe`'s workloads a few times, for `ncu` to profile one launch:
autofuse's lowering of the workload's group on `--backend` (Mosaic GPU: its default config, or `--config JSON` over
it; Triton: `--config` whole), or, for a plain GEMM, JAX's hand-written `hopper_matmul_mgpu` (`--kernel hopper`, its
best H100 config in GPU_NOTES.md), or, for an attention, cuDNN's fused attention on the same operands in [B, L, H, D]
(`--kernel cudnn`, `jax.nn.dot_product_attention(implementation="cudnn")`).

    ncu --kernel-name regex:autofuse_matmul_mgpu --launch-skip 2 --launch-count 1 --section SpeedOfLight \\
        --section WarpStateStats --section ComputeWorkloadAnalysis python -m benchmarks profile ncu bias-gelu-16384x1024x4096
"""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from autofuse.kernels import TEMPLATES
from autofuse.runner.measure import random_inputs
from benchmarks.mosaic_probe import DTYPES, WORKLOADS, _group, arg_specs, attention_causal, cudnn_attention


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload", choices=sorted(WORKLOADS))
    ap.add_argument("--kernel", choices=("autofuse", "hopper", "cudnn"), default="autofuse")
    ap.add_argument("--config", default="{}", help="JSON: parameters over the Mosaic GPU lowering's default config, or a Triton config")
    ap.add_argument("--backend", choices=("mosaic_gpu", "triton"), default="mosaic_gpu")
    a = ap.parse_args(argv)
    fn, shapes = WORKLOADS[a.workload]
    if a.kernel == "hopper":
        from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

        c = hm.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4, epi_tile_m=64, epi_tile_n=64,
                            grid_minor_dim=hm.MatmulDimension.N, grid_tile_width=8, wg_dimension=hm.MatmulDimension.M)
        k = jax.jit(lambda x, w: hm.matmul(x, w, None, c))
        cfg = c
        avals = arg_specs(a.workload, shapes)
    elif a.kernel == "cudnn":
        k, cfg = cudnn_attention(fn is attention_causal), "cudnn"
        dtype = DTYPES.get(a.workload, jnp.bfloat16)
        avals = [jax.ShapeDtypeStruct((b, l, h, d), dtype) for b, h, l, d in shapes]
    else:
        _, cand = _group(fn, arg_specs(a.workload, shapes, DTYPES.get(a.workload, jnp.bfloat16)))
        tmpl = TEMPLATES[cand.template]
        base = tmpl.default_config_of(cand.spec, "mosaic_gpu") if a.backend == "mosaic_gpu" else {}
        cfg = {**base, **json.loads(a.config)}
        k = jax.jit(tmpl.build(cand.group, cfg, backend=a.backend, spec=cand.spec))
        avals = cand.group.input_avals()  # the kernel's inputs in the group's order, not the workload function's
    xs = random_inputs(avals, 0)
    for _ in range(4):
        jax.block_until_ready(k(*xs))
    print("config", cfg)


if __name__ == "__main__":
    main()
