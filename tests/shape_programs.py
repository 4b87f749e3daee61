"""Small programs for the shape-generic deploy tests (importable by name from a fresh process)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def norm(x: jax.Array, g: jax.Array) -> jax.Array:
    """RMS-free layer norm of [B, 128] rows (one row_reduce group); its structure does not depend on B."""
    m = jnp.mean(x, -1, keepdims=True)
    v = jnp.mean((x - m) ** 2, -1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(v + 1e-5) * g


def norm_specs(rows: int) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    return jax.ShapeDtypeStruct((rows, 128), jnp.float32), jax.ShapeDtypeStruct((128,), jnp.float32)


def norm_buckets() -> dict[str, tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]]:
    """Three buckets of `norm` by name, given out of size order (`autofuse tune --shapes MODULE:BUCKETS`)."""
    return {"large": norm_specs(128), "small": norm_specs(8), "mid": norm_specs(32)}


def norm_mixed_buckets() -> list[tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]]:
    """Two buckets that are not one program at other sizes (float32, then bfloat16): refused by --shapes."""
    return [norm_specs(8), (jax.ShapeDtypeStruct((16, 128), jnp.bfloat16), jax.ShapeDtypeStruct((128,), jnp.bfloat16))]
