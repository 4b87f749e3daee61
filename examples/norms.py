"""The bundled example: a pre-norm residual block's memory-bound part.

    autofuse tune examples.norms:forward --inputs examples.norms:example_inputs

Layer norm, a bias + GELU (tanh) elementwise chain, a residual add and a
softmax over the last axis: the patterns where fusing well matters. Shapes
are small enough for a CPU (interpret mode); `example_inputs(large=True)`
gives GPU-sized ones.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def forward(params: dict, x: jax.Array) -> dict:
    xf = x.astype(jnp.float32)
    mean = xf.mean(-1, keepdims=True)
    var = ((xf - mean) ** 2).mean(-1, keepdims=True)
    h = ((xf - mean) * jax.lax.rsqrt(var + 1e-5) * params["scale"] + params["shift"]).astype(x.dtype)
    h = jax.nn.gelu(h + params["bias"], approximate=True)
    y = x + h
    return {"y": y, "probs": jax.nn.softmax(y.astype(jnp.float32), axis=-1)}


def example_inputs(large: bool = False) -> tuple:
    rows, cols = (16384, 4096) if large else (2048, 1024)
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    params = {
        "scale": 1.0 + 0.1 * jax.random.normal(k[0], (cols,), jnp.float32),
        "shift": 0.1 * jax.random.normal(k[1], (cols,), jnp.float32),
        "bias": (0.1 * jax.random.normal(k[2], (cols,))).astype(jnp.bfloat16),
    }
    x = jax.random.normal(k[3], (rows, cols)).astype(jnp.bfloat16)
    return params, x


def example_inputs_large() -> tuple:
    return example_inputs(large=True)
