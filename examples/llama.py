"""Llama-style decoder blocks in plain JAX.

    autofuse tune examples.llama:forward --inputs examples.llama:example_inputs
    autofuse tune examples.llama:forward_cudnn --inputs examples.llama:example_inputs

Pre-norm blocks: RMS norm, rotary position embeddings (rotate-half form),
grouped-query causal attention (key/value heads repeated with `jnp.repeat`),
SwiGLU MLP, residuals. The blocks map hidden states to hidden states (a
block stack as it sits inside the model; embedding and LM head are the
GPT-2 example's business); the loss is a regression of the output on a
target, enough to differentiate the whole stack.
`example_inputs()` is a 1B-class configuration (Llama 3.2 1B: d=2048,
32 query heads, 8 key/value heads of 64, ffn 8192, rope theta 500000) with 2
of its 16 blocks, batch 4, sequence 2048, bf16.

`forward_cudnn`, `loss_cudnn` and `grad_step_cudnn` write the attention as a
careful JAX user does: `jax.nn.dot_product_attention(is_causal=True)` on the
grouped key/value heads as they are (no repeat), cuDNN's fused kernels on a GPU
(XLA's attention elsewhere). The `_library` twins (`forward_library`,
`loss_library`, `grad_step_library`) call it at its default implementation,
which in jax 0.11 is JAX's XLA path on every device. `grad_step_cudnn_remat`
is `grad_step_cudnn` with each block under `jax.checkpoint` (its GEMMs' results
kept), as a user fits a training step in memory.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from examples import library_attention

HEAD_DIM = 64  # Llama 3.2 1B: 2048 = 32 heads x 64
ROPE_THETA = 500000.0


@dataclass(frozen=True)
class Config:
    d_model: int
    n_kv_heads: int
    d_ff: int
    n_layers: int


LLAMA_1B = Config(d_model=2048, n_kv_heads=8, d_ff=8192, n_layers=2)
SMALL = Config(d_model=256, n_kv_heads=2, d_ff=512, n_layers=2)  # CPU tests: 4 query heads, 2 kv heads


def init_params(cfg: Config, key: jax.Array, dtype=jnp.bfloat16) -> dict:
    """Random weights (normal, std 0.02), no biases, as in Llama."""
    d, kv = cfg.d_model, cfg.n_kv_heads * HEAD_DIM

    def w(k, shape):
        return (0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dtype)

    blocks = []
    for i in range(cfg.n_layers):
        k = jax.random.split(jax.random.fold_in(key, i), 7)
        blocks.append({
            "attn_norm": jnp.ones((d,), dtype),
            "wq": w(k[0], (d, d)), "wk": w(k[1], (d, kv)), "wv": w(k[2], (d, kv)), "wo": w(k[3], (d, d)),
            "mlp_norm": jnp.ones((d,), dtype),
            "w_gate": w(k[4], (d, cfg.d_ff)), "w_up": w(k[5], (d, cfg.d_ff)), "w_down": w(k[6], (cfg.d_ff, d)),
        })
    return {"blocks": blocks}


def rms_norm(x: jax.Array, scale: jax.Array, eps: float = 1e-5) -> jax.Array:
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * scale).astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding of x [B, S, H, D] (the rotate-half layout)."""
    half = x.shape[-1] // 2
    freqs = 1.0 / theta ** (jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions[:, None].astype(jnp.float32) * freqs[None, :]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _qkv(x: jax.Array, p: dict) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Queries [B, S, H, D] and grouped keys and values [B, S, KV, D], rotary embeddings on queries and keys."""
    B, S, D = x.shape
    H, KV = D // HEAD_DIM, p["wk"].shape[1] // HEAD_DIM
    pos = jnp.arange(S)
    q = rope((x @ p["wq"]).reshape(B, S, H, HEAD_DIM), pos, ROPE_THETA)
    k = rope((x @ p["wk"]).reshape(B, S, KV, HEAD_DIM), pos, ROPE_THETA)
    return q, k, (x @ p["wv"]).reshape(B, S, KV, HEAD_DIM)


def attention(x: jax.Array, p: dict) -> jax.Array:
    """Attention written in plain jnp: key/value heads repeated, the score matrix, a causal mask, softmax."""
    B, S, D = x.shape
    q, k, v = _qkv(x, p)
    H, KV = q.shape[2], k.shape[2]
    k, v = jnp.repeat(k, H // KV, axis=2), jnp.repeat(v, H // KV, axis=2)  # grouped-query attention
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(HEAD_DIM)
    causal = jnp.tril(jnp.ones((S, S), dtype=bool))
    probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1).astype(x.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(B, S, D) @ p["wo"]


def library_attention_gqa(x: jax.Array, p: dict, implementation: str | None = None) -> jax.Array:
    """Grouped-query attention as a careful user writes it: `jax.nn.dot_product_attention` at `implementation`
    (None: JAX's default, its XLA path on every device in jax 0.11)."""
    B, S, D = x.shape
    q, k, v = _qkv(x, p)
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
    return out.reshape(B, S, D) @ p["wo"]


def block(x: jax.Array, p: dict, attention=attention) -> jax.Array:
    x = x + attention(rms_norm(x, p["attn_norm"]), p)
    h = rms_norm(x, p["mlp_norm"])
    return x + (jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]


def forward(params: dict, batch: dict) -> jax.Array:
    """The blocks applied to hidden states `batch["x"]` [batch, seq, d_model]."""
    return _forward(params, batch, attention)


def forward_cudnn(params: dict, batch: dict) -> jax.Array:
    """`forward` with library attention asking for cuDNN (`library_attention_gqa`; XLA's path off a GPU)."""
    return _forward(params, batch, functools.partial(library_attention_gqa, implementation=library_attention()))


def forward_library(params: dict, batch: dict) -> jax.Array:
    """`forward` with library attention at JAX's default implementation."""
    return _forward(params, batch, library_attention_gqa)


def _forward(params: dict, batch: dict, attend, checkpoint: bool = False) -> jax.Array:
    x = batch["x"]
    step = functools.partial(block, attention=attend)
    if checkpoint:  # keep the blocks' GEMM results for the backward, compute the rest again there
        step = jax.checkpoint(step, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    for p in params["blocks"]:
        x = step(x, p)
    return x


def loss(params: dict, batch: dict) -> jax.Array:
    return _regression(forward(params, batch), batch)


def loss_cudnn(params: dict, batch: dict) -> jax.Array:
    return _regression(forward_cudnn(params, batch), batch)


def loss_library(params: dict, batch: dict) -> jax.Array:
    return _regression(forward_library(params, batch), batch)


def _regression(out: jax.Array, batch: dict) -> jax.Array:
    return jnp.mean((out.astype(jnp.float32) - batch["y"].astype(jnp.float32)) ** 2)


def grad_step(params: dict, batch: dict) -> dict:
    """The differentiated program: gradients of the loss for every parameter."""
    return jax.grad(loss)(params, batch)


def grad_step_cudnn(params: dict, batch: dict) -> dict:
    return jax.grad(loss_cudnn)(params, batch)


def grad_step_cudnn_remat(params: dict, batch: dict) -> dict:
    """`grad_step_cudnn` with each block under `jax.checkpoint`, saving its GEMMs' results only (the way a careful
    user fits a training step in memory): the norms, rotary embeddings, SiLU and attention are computed again in
    the backward."""
    def loss_remat(params: dict, batch: dict) -> jax.Array:
        attend = functools.partial(library_attention_gqa, implementation=library_attention())
        return _regression(_forward(params, batch, attend, checkpoint=True), batch)
    return jax.grad(loss_remat)(params, batch)


def grad_step_library(params: dict, batch: dict) -> dict:
    return jax.grad(loss_library)(params, batch)


def make_inputs(cfg: Config, batch: int, seq: int, dtype=jnp.bfloat16, seed: int = 0) -> tuple[dict, dict]:
    key = jax.random.PRNGKey(seed)
    x = jax.random.normal(jax.random.fold_in(key, 1), (batch, seq, cfg.d_model), jnp.float32).astype(dtype)
    y = jax.random.normal(jax.random.fold_in(key, 2), (batch, seq, cfg.d_model), jnp.float32).astype(dtype)
    return init_params(cfg, jax.random.fold_in(key, 0), dtype), {"x": x, "y": y}


def example_inputs(layers: int = 2) -> tuple[dict, dict]:
    """The 1B-class configuration with `layers` blocks (default 2 of 16), batch 4, sequence 2048, bf16."""
    return make_inputs(Config(**{**LLAMA_1B.__dict__, "n_layers": layers}), batch=4, seq=2048)


def small_inputs() -> tuple[dict, dict]:
    """Two d=256 blocks (4 query heads, 2 kv heads) at batch 2, sequence 32: CPU-sized (interpret mode)."""
    return make_inputs(SMALL, batch=2, seq=32, dtype=jnp.float32)
