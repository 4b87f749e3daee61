"""Run the Mosaic GPU matmul+bias+GELU kernel (8192x4096x8192 bf16, the lowering's default config) a few times, for
`ncu` to profile one launch:

    ncu --kernel-name regex:autofuse_matmul_mgpu --launch-skip 2 --launch-count 1 --section SpeedOfLight \
        --section WarpStateStats python -m benchmarks.ncu_bias_gelu
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from autofuse.kernels import TEMPLATES
from benchmarks.mosaic_probe import WORKLOADS, _group


def main() -> None:
    fn, shapes = WORKLOADS["bias-gelu-8192x4096x8192"]
    _, cand = _group(fn, shapes)
    tmpl = TEMPLATES[cand.template]
    cfg = tmpl.default_config_of(cand.spec, "mosaic_gpu")
    k = jax.jit(tmpl.build(cand.group, cfg, backend="mosaic_gpu", spec=cand.spec))
    keys = jax.random.split(jax.random.key(0), len(shapes))
    xs = [jax.random.normal(kk, s, jnp.bfloat16) for kk, s in zip(keys, shapes)]
    for _ in range(4):
        jax.block_until_ready(k(*xs))
    print("config", cfg)


if __name__ == "__main__":
    main()
