"""A GPT-2-style decoder in plain JAX: the whole model as one program to tune.

    autofuse tune examples.gpt2:forward --inputs examples.gpt2:example_inputs
    autofuse tune examples.gpt2:grad_step --inputs examples.gpt2:small_inputs
    autofuse tune examples.gpt2:forward_cudnn --inputs examples.gpt2:example_inputs

Token and position embeddings, pre-norm blocks (layer norm, causal attention
written in plain jnp, GELU-tanh MLP, residuals), a final layer norm and the
LM head tied to the token embedding, with a cross-entropy loss over integer
targets. Parameters are a pytree of arrays; the blocks are a Python list
walked by a Python loop, so every layer appears in the jaxpr (the same
computation `n_layers` times: autofuse tunes each distinct group once).
`example_inputs()` is GPT-2 medium (24 layers, d=1024, 16 heads, vocab
50257) at batch 8, sequence 2048 (GPT-2 was trained with 1024 positions; the
position table here has 2048), random weights, bf16.

Each entry point has a `_cudnn` twin (`forward_cudnn`, `loss_cudnn`,
`grad_step_cudnn`) written as a careful JAX user writes attention: the same
fused QKV projection, then `jax.nn.dot_product_attention(is_causal=True)`,
cuDNN's fused kernels on a GPU (XLA's attention elsewhere). What autofuse gains
there is what it gains beyond attention. The `_library` twins (`forward_library`,
`loss_library`, `grad_step_library`) call the same function at its default
implementation, which in jax 0.11 is JAX's XLA path on every device.
`grad_step_cudnn_remat` is `grad_step_cudnn` with its blocks under `jax.checkpoint`.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from examples import library_attention

HEAD_DIM = 64  # every GPT-2 size uses 64-wide heads, so heads = d_model // 64


@dataclass(frozen=True)
class Config:
    vocab: int
    d_model: int
    n_layers: int
    max_seq: int


MEDIUM = Config(vocab=50257, d_model=1024, n_layers=24, max_seq=2048)
SMALL = Config(vocab=96, d_model=128, n_layers=2, max_seq=32)  # CPU tests


def init_params(cfg: Config, key: jax.Array, dtype=jnp.bfloat16) -> dict:
    """Random weights (normal, std 0.02; output projections scaled by depth as in GPT-2)."""
    d = cfg.d_model

    def w(k, shape, std=0.02):
        return (std * jax.random.normal(k, shape, jnp.float32)).astype(dtype)

    def norm():
        return {"scale": jnp.ones((d,), dtype), "bias": jnp.zeros((d,), dtype)}

    proj_std = 0.02 / math.sqrt(2 * cfg.n_layers)
    blocks = []
    for i in range(cfg.n_layers):
        k = jax.random.split(jax.random.fold_in(key, i), 4)
        blocks.append({
            "ln1": norm(),
            "attn": {"w_qkv": w(k[0], (d, 3 * d)), "b_qkv": jnp.zeros((3 * d,), dtype),
                     "w_out": w(k[1], (d, d), proj_std), "b_out": jnp.zeros((d,), dtype)},
            "ln2": norm(),
            "mlp": {"w_fc": w(k[2], (d, 4 * d)), "b_fc": jnp.zeros((4 * d,), dtype),
                    "w_proj": w(k[3], (4 * d, d), proj_std), "b_proj": jnp.zeros((d,), dtype)},
        })
    k = jax.random.split(jax.random.fold_in(key, cfg.n_layers), 2)
    return {"wte": w(k[0], (cfg.vocab, d)), "wpe": w(k[1], (cfg.max_seq, d), 0.01), "blocks": blocks, "ln_f": norm()}


def layer_norm(x: jax.Array, p: dict, eps: float = 1e-5) -> jax.Array:
    xf = x.astype(jnp.float32)
    mean = xf.mean(-1, keepdims=True)
    var = ((xf - mean) ** 2).mean(-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps)
    return (y * p["scale"] + p["bias"]).astype(x.dtype)


def _qkv(x: jax.Array, p: dict) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The fused QKV projection, split into [B, S, H, HEAD_DIM] queries, keys and values."""
    B, S, D = x.shape
    qkv = x @ p["w_qkv"] + p["b_qkv"]
    return tuple(t.reshape(B, S, D // HEAD_DIM, HEAD_DIM) for t in jnp.split(qkv, 3, axis=-1))


def causal_attention(x: jax.Array, p: dict) -> jax.Array:
    """Attention written in plain jnp: the score matrix, a causal mask, softmax."""
    B, S, D = x.shape
    q, k, v = _qkv(x, p)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(HEAD_DIM)
    causal = jnp.tril(jnp.ones((S, S), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(B, S, D)
    return out @ p["w_out"] + p["b_out"]


def library_causal_attention(x: jax.Array, p: dict, implementation: str | None = None) -> jax.Array:
    """Attention as a careful user writes it: `jax.nn.dot_product_attention` at `implementation` (None: JAX's
    default, its XLA path on every device in jax 0.11)."""
    B, S, D = x.shape
    q, k, v = _qkv(x, p)
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
    return out.reshape(B, S, D) @ p["w_out"] + p["b_out"]


def mlp(x: jax.Array, p: dict) -> jax.Array:
    h = jax.nn.gelu(x @ p["w_fc"] + p["b_fc"], approximate=True)
    return h @ p["w_proj"] + p["b_proj"]


def forward(params: dict, batch: dict) -> jax.Array:
    """Logits [batch, seq, vocab] for `batch["tokens"]`."""
    return _forward(params, batch, causal_attention)


def forward_cudnn(params: dict, batch: dict) -> jax.Array:
    """`forward` with library attention asking for cuDNN (`library_causal_attention`; XLA's path off a GPU)."""
    return _forward(params, batch, functools.partial(library_causal_attention, implementation=library_attention()))


def forward_library(params: dict, batch: dict) -> jax.Array:
    """`forward` with library attention at JAX's default implementation."""
    return _forward(params, batch, library_causal_attention)


def _forward(params: dict, batch: dict, attention, checkpoint: bool = False) -> jax.Array:
    tokens = batch["tokens"]
    x = params["wte"][tokens] + params["wpe"][: tokens.shape[1]]

    def block(x: jax.Array, blk: dict) -> jax.Array:
        x = x + attention(layer_norm(x, blk["ln1"]), blk["attn"])
        return x + mlp(layer_norm(x, blk["ln2"]), blk["mlp"])
    if checkpoint:  # keep the blocks' GEMM results for the backward, compute the rest again there
        block = jax.checkpoint(block, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    for blk in params["blocks"]:
        x = block(x, blk)
    x = layer_norm(x, params["ln_f"])
    return x @ params["wte"].T


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy over integer targets: logsumexp minus the target's logit (float32)."""
    logits = logits.astype(jnp.float32)
    target_logits = jnp.sum(jax.nn.one_hot(targets, logits.shape[-1]) * logits, axis=-1)
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - target_logits)


def loss(params: dict, batch: dict) -> jax.Array:
    return cross_entropy(forward(params, batch), batch["targets"])


def loss_cudnn(params: dict, batch: dict) -> jax.Array:
    return cross_entropy(forward_cudnn(params, batch), batch["targets"])


def loss_library(params: dict, batch: dict) -> jax.Array:
    return cross_entropy(forward_library(params, batch), batch["targets"])


def grad_step(params: dict, batch: dict) -> dict:
    """The differentiated program: gradients of the loss for every parameter."""
    return jax.grad(loss)(params, batch)


def grad_step_cudnn(params: dict, batch: dict) -> dict:
    return jax.grad(loss_cudnn)(params, batch)


def grad_step_cudnn_remat(params: dict, batch: dict) -> dict:
    """`grad_step_cudnn` with each block under `jax.checkpoint`, saving its GEMMs' results only (the way a careful
    user fits a training step in memory): the norms, GELU and attention are computed again in the backward."""
    def loss_remat(params: dict, batch: dict) -> jax.Array:
        attention = functools.partial(library_causal_attention, implementation=library_attention())
        return cross_entropy(_forward(params, batch, attention, checkpoint=True), batch["targets"])
    return jax.grad(loss_remat)(params, batch)


def grad_step_library(params: dict, batch: dict) -> dict:
    return jax.grad(loss_library)(params, batch)


def make_inputs(cfg: Config, batch: int, seq: int, dtype=jnp.bfloat16, seed: int = 0) -> tuple[dict, dict]:
    key = jax.random.PRNGKey(seed)
    tokens = jax.random.randint(jax.random.fold_in(key, 1), (batch, seq + 1), 0, cfg.vocab, jnp.int32)
    return init_params(cfg, jax.random.fold_in(key, 0), dtype), {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}


def example_inputs(layers: int = 24) -> tuple[dict, dict]:
    """GPT-2 medium (`layers` of its 24 blocks), batch 8, sequence 2048, bf16 (about 0.7 GB of weights, made when called)."""
    return make_inputs(Config(**{**MEDIUM.__dict__, "n_layers": layers}), batch=8, seq=2048)


def small_inputs() -> tuple[dict, dict]:
    """A 2-layer, d=128 model at batch 2, sequence 32: CPU-sized (interpret mode)."""
    return make_inputs(SMALL, batch=2, seq=32, dtype=jnp.float32)
