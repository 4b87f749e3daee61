"""Example inputs for the tests that tune through the command line (importable by name: --inputs MODULE:FACTORY)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def layer_norm_inputs() -> tuple:
    """layer_norm (benchmarks.workloads) in bfloat16: its model-mode plan fuses the layer norm in a few trials."""
    return (jax.ShapeDtypeStruct((2048, 1024), jnp.bfloat16), jax.ShapeDtypeStruct((1024,), jnp.bfloat16),
            jax.ShapeDtypeStruct((1024,), jnp.bfloat16))
