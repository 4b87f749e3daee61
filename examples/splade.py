"""A SPLADE encoder in plain JAX: BERT-style transformer layers and the SPLADE head.

    autofuse tune examples.splade:forward --inputs examples.splade:example_inputs
    autofuse tune examples.splade:forward_cudnn --inputs examples.splade:example_inputs

BERT (post-norm): word + position + token-type embeddings and a layer norm,
then layers of self-attention with a padding mask, exact (erf) GELU MLP,
residual + layer norm after each; then the masked-language-model transform
(dense, GELU, layer norm) and the vocabulary projection tied to the word
embedding, turned into a sparse representation by the SPLADE head
`max over the sequence of log1p(relu(h @ W + b)) * mask`.
`example_inputs()` is BERT-base (d=768, 12 heads, ffn 3072, vocab 30522) with
2 of its 12 layers, batch 32, sequence 256, bf16: the head's
[32, 256, 30522] logits are what XLA materialises and what a fused kernel
avoids; `example_inputs(layers=12)` is the full encoder.

`forward_cudnn`, `loss_cudnn` and `grad_step_cudnn` write the attention as a
careful JAX user does: `jax.nn.dot_product_attention` with the padding given as
key lengths (cuDNN's fused kernels on a GPU, XLA's attention elsewhere). The
`_library` twins call it at its default implementation, which in jax 0.11 is
JAX's XLA path on every device.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from examples import library_attention

HEAD_DIM = 64  # BERT-base: 768 = 12 heads x 64


@dataclass(frozen=True)
class Config:
    vocab: int
    d_model: int
    d_ff: int
    n_layers: int
    max_seq: int = 512


BERT_BASE = Config(vocab=30522, d_model=768, d_ff=3072, n_layers=12)
SMALL = Config(vocab=200, d_model=128, d_ff=256, n_layers=2, max_seq=64)  # CPU tests


def init_params(cfg: Config, key: jax.Array, dtype=jnp.bfloat16) -> dict:
    """Random weights (normal, std 0.02), BERT's layout."""
    d, f = cfg.d_model, cfg.d_ff

    def w(k, shape):
        return (0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dtype)

    def dense(k, n_in, n_out):
        return {"w": w(k, (n_in, n_out)), "b": jnp.zeros((n_out,), dtype)}

    def norm():
        return {"scale": jnp.ones((d,), dtype), "bias": jnp.zeros((d,), dtype)}

    layers = []
    for i in range(cfg.n_layers):
        k = jax.random.split(jax.random.fold_in(key, i), 6)
        layers.append({
            "q": dense(k[0], d, d), "k": dense(k[1], d, d), "v": dense(k[2], d, d), "o": dense(k[3], d, d),
            "ln_attn": norm(), "ffn_in": dense(k[4], d, f), "ffn_out": dense(k[5], f, d), "ln_ffn": norm(),
        })
    k = jax.random.split(jax.random.fold_in(key, cfg.n_layers), 4)
    return {
        "word_emb": w(k[0], (cfg.vocab, d)), "pos_emb": w(k[1], (cfg.max_seq, d)), "type_emb": w(k[2], (2, d)),
        "ln_emb": norm(), "layers": layers,
        "mlm": {"transform": dense(k[3], d, d), "ln": norm(), "bias": jnp.zeros((cfg.vocab,), dtype)},
    }


def layer_norm(x: jax.Array, p: dict, eps: float = 1e-12) -> jax.Array:
    xf = x.astype(jnp.float32)
    mean = xf.mean(-1, keepdims=True)
    var = ((xf - mean) ** 2).mean(-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps)
    return (y * p["scale"] + p["bias"]).astype(x.dtype)


def dense(x: jax.Array, p: dict) -> jax.Array:
    return x @ p["w"] + p["b"]


def self_attention(x: jax.Array, p: dict, mask: jax.Array) -> jax.Array:
    B, S, D = x.shape
    H = D // HEAD_DIM
    q, k, v = (dense(x, p[n]).reshape(B, S, H, HEAD_DIM) for n in ("q", "k", "v"))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(HEAD_DIM)
    scores = scores + jnp.where(mask[:, None, None, :], 0.0, -10000.0)  # BERT's additive padding mask
    probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    return dense(jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(B, S, D), p["o"])


def library_self_attention(x: jax.Array, p: dict, mask: jax.Array, implementation: str | None = None) -> jax.Array:
    """`self_attention` through `jax.nn.dot_product_attention` at `implementation` (None: JAX's default, its XLA
    path in jax 0.11), the padding (a prefix of each row) as key lengths."""
    B, S, D = x.shape
    q, k, v = (dense(x, p[n]).reshape(B, S, D // HEAD_DIM, HEAD_DIM) for n in ("q", "k", "v"))
    lengths = jnp.sum(mask, axis=-1, dtype=jnp.int32)
    out = jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths, implementation=implementation)
    return dense(out.reshape(B, S, D), p["o"])


def encoder_layer(x: jax.Array, p: dict, mask: jax.Array, attention=self_attention) -> jax.Array:
    x = layer_norm(x + attention(x, p, mask), p["ln_attn"])
    h = jax.nn.gelu(dense(x, p["ffn_in"]), approximate=False)
    return layer_norm(x + dense(h, p["ffn_out"]), p["ln_ffn"])


def splade_head(h: jax.Array, w: jax.Array, b: jax.Array, mask: jax.Array) -> jax.Array:
    """Sparse vocabulary weights: max over the sequence of log1p(relu(logits)), padding masked out."""
    logits = h @ w + b
    act = jnp.log1p(jax.nn.relu(logits.astype(jnp.float32))) * mask[..., None]
    return jnp.max(act, axis=1)


def forward(params: dict, batch: dict) -> jax.Array:
    """SPLADE representations [batch, vocab] (float32) of `batch["tokens"]` under `batch["mask"]`."""
    return _forward(params, batch, self_attention)


def forward_cudnn(params: dict, batch: dict) -> jax.Array:
    """`forward` with library attention asking for cuDNN (`library_self_attention`; XLA's path off a GPU)."""
    return _forward(params, batch, functools.partial(library_self_attention, implementation=library_attention()))


def forward_library(params: dict, batch: dict) -> jax.Array:
    """`forward` with library attention at JAX's default implementation."""
    return _forward(params, batch, library_self_attention)


def _forward(params: dict, batch: dict, attention) -> jax.Array:
    tokens, mask = batch["tokens"], batch["mask"]
    S = tokens.shape[1]
    x = params["word_emb"][tokens] + params["pos_emb"][:S] + params["type_emb"][0]
    x = layer_norm(x, params["ln_emb"])
    for lp in params["layers"]:
        x = encoder_layer(x, lp, mask, attention)
    m = params["mlm"]
    h = layer_norm(jax.nn.gelu(dense(x, m["transform"]), approximate=False), m["ln"])
    return splade_head(h, params["word_emb"].T, m["bias"], mask)


def loss(params: dict, batch: dict) -> jax.Array:
    """A contrastive ranking loss: each query's positive document is the same row of `batch["docs"]`, with
    the other rows as in-batch negatives (queries and documents share the encoder), plus FLOPS regularisation."""
    return _loss(params, batch, forward)


def loss_cudnn(params: dict, batch: dict) -> jax.Array:
    return _loss(params, batch, forward_cudnn)


def loss_library(params: dict, batch: dict) -> jax.Array:
    return _loss(params, batch, forward_library)


def _loss(params: dict, batch: dict, forward) -> jax.Array:
    q = forward(params, batch)
    d = forward(params, batch["docs"])
    scores = q @ d.T
    ranking = -jnp.mean(jnp.diagonal(jax.nn.log_softmax(scores, axis=-1)))
    flops = jnp.sum(jnp.mean(d, axis=0) ** 2)
    return ranking + 1e-4 * flops


def grad_step(params: dict, batch: dict) -> dict:
    """The differentiated program: gradients of the loss for every parameter."""
    return jax.grad(loss)(params, batch)


def grad_step_cudnn(params: dict, batch: dict) -> dict:
    return jax.grad(loss_cudnn)(params, batch)


def grad_step_library(params: dict, batch: dict) -> dict:
    return jax.grad(loss_library)(params, batch)


def _text(key: jax.Array, cfg: Config, batch: int, seq: int) -> dict:
    tokens = jax.random.randint(jax.random.fold_in(key, 0), (batch, seq), 0, cfg.vocab, jnp.int32)
    lengths = jax.random.randint(jax.random.fold_in(key, 1), (batch, 1), seq // 4, seq + 1)
    return {"tokens": tokens, "mask": jnp.arange(seq)[None, :] < lengths}


def make_inputs(cfg: Config, batch: int, seq: int, dtype=jnp.bfloat16, seed: int = 0) -> tuple[dict, dict]:
    key = jax.random.PRNGKey(seed)
    queries = _text(jax.random.fold_in(key, 1), cfg, batch, seq)
    queries["docs"] = _text(jax.random.fold_in(key, 2), cfg, batch, seq)
    return init_params(cfg, jax.random.fold_in(key, 0), dtype), queries


def example_inputs(layers: int = 2) -> tuple[dict, dict]:
    """BERT-base dimensions with `layers` encoder layers (default 2 of 12), batch 32, sequence 256, bf16."""
    return make_inputs(Config(**{**BERT_BASE.__dict__, "n_layers": layers}), batch=32, seq=256)


def small_inputs() -> tuple[dict, dict]:
    """A 2-layer, d=128, vocab-200 model at batch 2, sequence 16: CPU-sized (interpret mode)."""
    return make_inputs(SMALL, batch=2, seq=16, dtype=jnp.float32)
