"""Attention written in plain jnp in the ways models write it: the programs both attention lowerings are tested on."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.workloads import attention_blhd


def causal_iota_minus_1e9(q, k, v):
    # [B, H, L, D] with `@`, mask from explicit iota comparisons and a finite fill
    L = q.shape[2]
    s = (q @ jnp.swapaxes(k, -1, -2)) / np.sqrt(q.shape[-1])
    causal = jax.lax.broadcasted_iota(jnp.int32, (L, L), 0) >= jax.lax.broadcasted_iota(jnp.int32, (L, L), 1)
    s = jnp.where(causal, s, -1e9)
    e = jnp.exp(s - s.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)).astype(v.dtype) @ v


def bias_blhd(q, k, v, bias):
    # additive bias [H, Lq, Lk] (relative-position style), [B, L, H, D] layout
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * 0.125 + bias
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1).astype(v.dtype), v)


def padding_mask(q, k, v, keep):
    # key padding mask [B, Lk] (bool), [B, H, L, D]
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * 0.125
    s = jnp.where(keep[:, None, None, :], s, -1e9)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s.astype(jnp.float32), axis=-1).astype(v.dtype), v)


def gqa_repeat(q, k, v):
    # grouped-query attention: 4 query heads share each of 2 key/value heads
    g = q.shape[2] // k.shape[2]
    return attention_blhd(q, jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2))


def gqa_broadcast(q, k, v):
    # grouped-query attention with the key/value heads broadcast and merged by hand
    b, l, h, d = q.shape
    hk = k.shape[2]
    k = jnp.broadcast_to(k[:, :, :, None, :], (b, l, hk, h // hk, d)).reshape(b, l, h, d)
    v = jnp.broadcast_to(v[:, :, :, None, :], (b, l, hk, h // hk, d)).reshape(b, l, h, d)
    return attention_blhd(q, k, v)


def heads_split_causal(xq, xk, xv):
    # GPT-2 style: heads split out of [B, L, H*D] by reshape, causal mask with a finfo.min fill
    b, l, hd = xq.shape
    q, k, v = (t.reshape(b, l, 2, hd // 2) for t in (xq, xk, xv))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / np.sqrt(hd // 2)
    s = jnp.where(jnp.tril(jnp.ones((l, l), bool)), s, jnp.finfo(jnp.float32).min)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1).astype(v.dtype), v)


def softcap_then_causal(q, k, v):
    # tanh soft-capping before the mask: the mask is still known at build time
    L = q.shape[2]
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k).astype(jnp.float32) * 0.125
    s = 5.0 * jnp.tanh(s / 5.0)
    s = jnp.where(jnp.tril(jnp.ones((L, L), bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1).astype(v.dtype), v)


def causal_then_softcap(q, k, v):
    # the mask before tanh: capping revives masked scores (-inf -> -5), so nothing may be skipped
    L = q.shape[2]
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k).astype(jnp.float32) * 0.125
    s = jnp.where(jnp.tril(jnp.ones((L, L), bool)), s, -jnp.inf)
    s = 5.0 * jnp.tanh(s / 5.0)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1).astype(v.dtype), v)


def sliding_window(q, k, v):
    # a band of 24 keys: later query blocks start after key block 0
    L = q.shape[2]
    i, j = jnp.arange(L)[:, None], jnp.arange(L)[None, :]
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k).astype(jnp.float32) * 0.125
    s = jnp.where((i >= j) & (i - j < 24), s, -jnp.inf)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1).astype(v.dtype), v)


def alibi_causal(q, k, v, slopes):
    # ALiBi: a slope per head [H] (a scalar per score batch position) times the keys' distance, causal
    L = q.shape[2]
    i, j = jnp.arange(L)[:, None], jnp.arange(L)[None, :]
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k).astype(jnp.float32) * 0.125 - slopes[None, :, None, None] * (i - j)
    s = jnp.where(i >= j, s, -jnp.inf)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1).astype(v.dtype), v)


def query_temperature(q, k, v, temp):
    # a float32 factor per query [B, Lq] on the scores (a vector along the queries)
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k).astype(jnp.float32) * temp[:, None, :, None]
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1).astype(v.dtype), v)


def library_xla_lengths(q, k, v, q_lengths, kv_lengths):
    # padding given as lengths [B] (int32), queries and keys: per-batch scalars compared with positions in the kernel
    return jax.nn.dot_product_attention(q, k, v, query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths,
                                        implementation="xla")


def library_xla(q, k, v):
    # attention as a careful user writes it, on JAX's own XLA path ([B, L, H, D]; what the call runs where cuDNN is
    # not chosen: float32, another GPU, a CPU): scores in float32 by an algorithm preset, a unit grouped-query axis
    # moved by transposes
    return jax.nn.dot_product_attention(q, k, v, implementation="xla")


def library_xla_causal(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")


def library_xla_gqa(q, k, v):
    # grouped-query heads: the XLA path writes q as [B, T, N_kv, G, H] and transposes the scores between the dots
    # (G moves): read as the library's attention by what it computes (`attention_library.xla_path_spec`)
    return library_xla(q, k, v)


def key_lengths_blhd(q, k, v, kv_lengths):
    # padding given as key lengths [B] (int32), as the library takes it: keys from a row's length on are masked
    return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=kv_lengths, implementation="xla")


def key_lengths_causal_blhd(q, k, v, kv_lengths):
    # causal and key lengths, joined in one predicate by JAX's XLA path (the causal part known at build time)
    return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=kv_lengths, is_causal=True, implementation="xla")


def nan_past_lengths(x, lengths, block: int):
    """x [B, L, ...] with NaN at the key positions from each row's length rounded up to `block` on: what a kernel that
    visits only the key blocks holding a live key never reads (a visit would make the output NaN: 0 * NaN)."""
    ends = -(-lengths // block) * block
    dead = jnp.arange(x.shape[1])[None, :] >= ends[:, None]
    return jnp.where(dead.reshape(dead.shape + (1,) * (x.ndim - 2)), jnp.nan, x).astype(x.dtype)
