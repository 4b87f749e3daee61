"""Small programs for the tests of tuning with several workers (importable by name, as workers need)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm_inputs() -> tuple:
    """rms_norm (benchmarks.workloads) at a CPU-friendly size: 8 distinct candidates, of which the model has the whole
    norm's row_reduce beat XLA (at 256 x 512 every one was a modelled loss: no plan to select or validate)."""
    return jax.ShapeDtypeStruct((512, 1024), jnp.float32), jax.ShapeDtypeStruct((1024,), jnp.float32)


def log_relu_bias_inputs() -> tuple:
    """log_relu_bias (benchmarks.workloads) at a CPU-friendly size: one candidate, 1280 configs."""
    return jax.ShapeDtypeStruct((128, 512), jnp.float32), jax.ShapeDtypeStruct((512,), jnp.float32)


def matmul_bias_gelu_inputs() -> tuple:
    """matmul_bias_gelu (benchmarks.workloads) in bf16: a matmul candidate (Triton and Mosaic GPU lowerings) beside
    elementwise ones (Triton only)."""
    return (jax.ShapeDtypeStruct((256, 128), jnp.bfloat16), jax.ShapeDtypeStruct((128, 256), jnp.bfloat16),
            jax.ShapeDtypeStruct((256,), jnp.bfloat16))


def attention_inputs() -> tuple:
    """attention_bhld (benchmarks.workloads) in bf16 at [1, 2, 256, 64]: one attention candidate with a Mosaic GPU
    lowering (its two compute warpgroups block on simulated barriers in interpret mode)."""
    return tuple(jax.ShapeDtypeStruct((1, 2, 256, 64), jnp.bfloat16) for _ in range(3))
