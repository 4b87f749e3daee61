"""The public benchmark suite: patterns where fusion matters, at realistic sizes.

Each workload is (name, function, argument shapes and dtype). Sizes follow
GPU_NOTES.md; `small=True` gives CPU-sized versions of the same programs.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp


def log_relu_bias(x, b):
    return jnp.log(jax.nn.relu(x + b))


def softmax(x):
    return jax.nn.softmax(x, axis=-1)


def layer_norm(x, scale, shift):
    xf = x.astype(jnp.float32)
    mean = xf.mean(-1, keepdims=True)
    var = ((xf - mean) ** 2).mean(-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + 1e-5)
    return (y * scale + shift).astype(x.dtype)


def rms_norm(x, scale):
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt((xf * xf).mean(-1, keepdims=True) + 1e-6)
    return (y * scale).astype(x.dtype)


def logsumexp(x):
    return jax.nn.logsumexp(x, axis=-1)


def matmul_bias_gelu(x, w, b):
    return jax.nn.gelu(x @ w + b, approximate=True)


def matmul_bias_swish_groupnorm(x, w, b, gamma, beta, groups=32):
    """matmul + bias + swish, then GroupNorm over `groups` segments of each row (statistics in float32)."""
    y = jax.nn.silu(x @ w + b)
    yg = y.reshape(y.shape[0], groups, -1).astype(jnp.float32)
    mu = yg.mean(-1, keepdims=True)
    var = ((yg - mu) ** 2).mean(-1, keepdims=True)
    out = ((yg - mu) * jax.lax.rsqrt(var + 1e-5)).reshape(y.shape) * gamma + beta
    return out.astype(x.dtype)


def mlp_grad(x, w1, b1, w2, b2):
    """A transformer MLP's backward (GPT-2's: up-projection, GELU, down-projection): the gradients of a float32 loss
    with respect to x and every weight and bias. The dgrad GEMM of the down-projection meets GELU' and the
    up-projection bias's gradient there (`matmul` with a sum over the rows in its epilogue)."""
    def loss(x, w1, b1, w2, b2):
        return jnp.sum(jnp.square((jax.nn.gelu(x @ w1 + b1) @ w2 + b2).astype(jnp.float32)))
    return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(x, w1, b1, w2, b2)


def splade_head(h, w, bias, mask):
    """SPLADE: max over the sequence of log(1 + relu(h @ W + b)), padding masked ([B, S, D] -> [B, V])."""
    return jnp.max(jnp.log1p(jax.nn.relu(h @ w + bias)) * mask[..., None], axis=1)


def splade_head_grad(h, w, bias, mask):
    """The gradient of a loss of SPLADE's representation with respect to h, W and b, the head as
    `examples/splade.py` has it (log1p(relu(.)) of the logits in float32: in bf16, ties at the max depend on where
    XLA rounds); the loss, the log of its squared norm, makes the cotangent depend on the whole forward (as in
    training: the head runs in two stages)."""
    def loss(h, w, bias):
        act = jnp.log1p(jax.nn.relu((h @ w + bias).astype(jnp.float32))) * (mask[..., None] > 0)
        return jnp.log(jnp.sum(jnp.max(act, axis=1) ** 2))

    return jax.grad(loss, argnums=(0, 1, 2))(h, w, bias)


def cross_entropy(h, w, target):
    """Per-token cross-entropy over a vocabulary, the target logit picked by a one-hot `where` (no gather)."""
    logits = h @ w
    hit = jnp.arange(logits.shape[-1])[None, :] == target[:, None]
    return jax.nn.logsumexp(logits, axis=-1) - jnp.sum(jnp.where(hit, logits, 0), axis=-1)


def cross_entropy_grad(h, w, target):
    """The gradient of the mean cross-entropy with respect to h and W (a language model head's backward)."""
    return jax.grad(lambda h, w: jnp.mean(cross_entropy(h, w, target).astype(jnp.float32)), argnums=(0, 1))(h, w)


def attention_bhld(q, k, v):
    """Plain-jnp attention, [B, H, L, D]."""
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * (q.shape[-1] ** -0.5)
    p = jax.nn.softmax(s.astype(jnp.float32), axis=-1)
    return jnp.einsum("bhqk,bhkd->bhqd", p.astype(v.dtype), v)


def attention_bhld_causal(q, k, v):
    """The same with a causal mask built from iota (jnp.tril)."""
    L = q.shape[2]
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * (q.shape[-1] ** -0.5)
    s = jnp.where(jnp.tril(jnp.ones((L, L), bool)), s, -jnp.inf)
    p = jax.nn.softmax(s.astype(jnp.float32), axis=-1)
    return jnp.einsum("bhqk,bhkd->bhqd", p.astype(v.dtype), v)


def attention_blhd(q, k, v):
    """Plain-jnp attention, [B, L, H, D] (XLA transposes the output back)."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (q.shape[-1] ** -0.5)
    p = jax.nn.softmax(s.astype(jnp.float32), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p.astype(v.dtype), v)


def attention_library_causal(q, k, v):
    """Attention as a careful user writes it, [B, L, H, D]: `jax.nn.dot_product_attention` at its default
    implementation, which in jax 0.11.2 is JAX's own XLA path on every device and dtype (cuDNN only when asked for)."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def attention_library_gqa_causal(q, k, v):
    """The same with grouped-query heads (fewer key/value heads than query heads, as Llama's): JAX's XLA path
    transposes the scores between its two products."""
    return attention_library_causal(q, k, v)


def attention_library_gqa_causal_grad(q, k, v, dout):
    """Its forward and backward."""
    return attention_library_causal_grad(q, k, v, dout)


def attention_library_gqa_window(q, k, v):
    """Grouped-query heads with a causal sliding window of a quarter of the sequence (Mistral's; Gemma's local layers:
    Mistral 7B's 4096 keys at 16k tokens): `local_window_size`, whose positions JAX's XLA path makes as constants of
    the trace."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=(q.shape[1] // 4, 0))


def attention_library_gqa_window_grad(q, k, v, dout):
    """Its forward and backward."""
    _, pull = jax.vjp(attention_library_gqa_window, q, k, v)
    return pull(dout)


def attention_library_causal_grad(q, k, v, dout):
    """Its forward and backward (the cotangents of q, k, v for the output's cotangent `dout`), as a training step
    differentiates it."""
    _, pull = jax.vjp(attention_library_causal, q, k, v)
    return pull(dout)


@dataclass(frozen=True)
class Workload:
    name: str
    fn: Callable
    shapes: tuple  # argument shapes; every argument has the workload dtype unless `arg_dtypes` says otherwise
    arg_dtypes: tuple = ()  # per argument: a dtype name, or None for the workload dtype (e.g. integer targets)


WORKLOADS = [
    Workload("log_relu_bias", log_relu_bias, ((8192, 8192), (8192,))),
    Workload("softmax", softmax, ((16384, 4096),)),
    Workload("layer_norm", layer_norm, ((65536, 1024), (1024,), (1024,))),
    Workload("rms_norm", rms_norm, ((16384, 4096), (4096,))),
    Workload("logsumexp", logsumexp, ((16384, 4096),)),
    Workload("matmul_bias_gelu", matmul_bias_gelu, ((8192, 4096), (4096, 8192), (8192,))),
    Workload("matmul_bias_swish_groupnorm", matmul_bias_swish_groupnorm, ((16384, 2048), (2048, 4096), (4096,), (4096,), (4096,))),
    Workload("mlp_grad", mlp_grad, ((16384, 1024), (1024, 4096), (4096,), (4096, 1024), (1024,))),  # GPT-2 medium's MLP
    Workload("splade_head", splade_head, ((32, 256, 768), (768, 30522), (30522,), (32, 256))),
    Workload("splade_head_grad", splade_head_grad, ((32, 256, 768), (768, 30522), (30522,), (32, 256))),
    Workload("cross_entropy", cross_entropy, ((8192, 4096), (4096, 32000), (8192,)), (None, None, "int32")),
    Workload("cross_entropy_grad", cross_entropy_grad, ((16384, 1024), (1024, 50257), (16384,)), (None, None, "int32")),  # GPT-2's head
    Workload("attention", attention_bhld, ((8, 32, 2048, 128),) * 3),
    Workload("attention_causal", attention_bhld_causal, ((8, 32, 2048, 128),) * 3),
    Workload("attention_library_causal", attention_library_causal, ((8, 2048, 32, 128),) * 3),
    Workload("attention_library_causal_grad", attention_library_causal_grad, ((8, 2048, 32, 128),) * 4),
    Workload("attention_library_gqa_causal", attention_library_gqa_causal, ((4, 2048, 32, 64), (4, 2048, 8, 64), (4, 2048, 8, 64))),  # Llama-3.2-1B's heads
    Workload("attention_library_gqa_causal_grad", attention_library_gqa_causal_grad,
             ((4, 2048, 32, 64), (4, 2048, 8, 64), (4, 2048, 8, 64), (4, 2048, 32, 64))),
    Workload("attention_library_gqa_window", attention_library_gqa_window,  # Mistral 7B's heads: 32 q / 8 kv, D128
             ((2, 4096, 32, 128), (2, 4096, 8, 128), (2, 4096, 8, 128))),
    Workload("attention_library_gqa_window_grad", attention_library_gqa_window_grad,
             ((2, 4096, 32, 128), (2, 4096, 8, 128), (2, 4096, 8, 128), (2, 4096, 32, 128))),
]


def attention_key_lengths_grad(q, k, v, lengths, dout):
    """Padding as key lengths, as a careful user writes it (`key_value_seq_lengths`: each row's keys past its length
    masked, BERT-style), forward and backward: `autofuse tune benchmarks.workloads:attention_key_lengths_grad --inputs
    benchmarks.workloads:key_lengths_inputs` (the lengths are the caller's, so the plan is timed on them)."""
    _, pull = jax.vjp(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths), q, k, v)
    return pull(dout)


def key_lengths_inputs(batch: int = 8, length: int = 2048, heads: int = 16, head_dim: int = 128) -> tuple:
    """Arrays for `attention_key_lengths_grad`: q, k, v and the output's cotangent normal in bf16 ([B, L, H, D]), the
    lengths drawn uniformly in [L/2, L] (a quarter of the keys padding on average)."""
    keys = jax.random.split(jax.random.key(0), 5)
    qkv = [jax.random.normal(k, (batch, length, heads, head_dim), jnp.float32).astype(jnp.bfloat16) for k in keys[:3]]
    lengths = jax.random.randint(keys[3], (batch,), length // 2, length + 1, jnp.int32)
    dout = jax.random.normal(keys[4], (batch, length, heads, head_dim), jnp.float32).astype(jnp.bfloat16)
    return (*qkv, lengths, dout)


def long_attention_shapes() -> tuple:
    """FlashAttention-3's paper's longest attention (B x L = 16k tokens, H x D = 2048), bf16, as shapes:
    `autofuse tune benchmarks.workloads:attention_bhld_causal --inputs benchmarks.workloads:long_attention_shapes`."""
    return (jax.ShapeDtypeStruct((1, 16, 16384, 128), jnp.bfloat16),) * 3


SMALL = {
    "log_relu_bias": ((100, 77), (77,)),
    "softmax": ((64, 300),),
    "layer_norm": ((96, 200), (200,), (200,)),
    "rms_norm": ((64, 130), (130,)),
    "logsumexp": ((50, 333),),
    "matmul_bias_gelu": ((100, 70), (70, 90), (90,)),
    "matmul_bias_swish_groupnorm": ((100, 70), (70, 1024), (1024,), (1024,), (1024,)),  # 32 segments of 32
    "mlp_grad": ((100, 40), (40, 136), (136,), (136, 40), (40,)),
    "splade_head": ((2, 37, 40), (40, 70), (70,), (2, 37)),
    "splade_head_grad": ((2, 37, 40), (40, 70), (70,), (2, 37)),
    "cross_entropy": ((50, 40), (40, 300), (50,)),
    "cross_entropy_grad": ((64, 64), (64, 300), (64,)),
    "attention": ((2, 2, 100, 64),) * 3,
    "attention_causal": ((2, 2, 100, 64),) * 3,
    "attention_library_causal": ((2, 100, 2, 64),) * 3,
    "attention_library_causal_grad": ((2, 100, 2, 64),) * 4,
    "attention_library_gqa_causal": ((2, 100, 8, 64), (2, 100, 2, 64), (2, 100, 2, 64)),
    "attention_library_gqa_causal_grad": ((2, 100, 8, 64), (2, 100, 2, 64), (2, 100, 2, 64), (2, 100, 8, 64)),
    "attention_library_gqa_window": ((2, 100, 8, 64), (2, 100, 2, 64), (2, 100, 2, 64)),
    "attention_library_gqa_window_grad": ((2, 100, 8, 64), (2, 100, 2, 64), (2, 100, 2, 64), (2, 100, 8, 64)),
}


def workloads(small: bool = False) -> list[Workload]:
    return [dataclasses.replace(w, shapes=SMALL[w.name]) if small else w for w in WORKLOADS]


def specs(w: Workload, dtype) -> list[jax.ShapeDtypeStruct]:
    dts = w.arg_dtypes or (None,) * len(w.shapes)
    return [jax.ShapeDtypeStruct(s, dtype if d is None else jnp.dtype(d)) for s, d in zip(w.shapes, dts)]


def attention_config(s: str) -> dict:
    """A Triton attention tile config from its short form ``128x64w8s3`` (block_q x block_k, warps, stages), or a
    Mosaic GPU one from ``mgpu64x128s2`` (block_q rows per compute warpgroup x block_kv, max_concurrent_steps;
    the config names its backend; schedule barrier on, Lane semantics, no overlap, a CTA per tile), its steps followed
    by flags: ``o`` FA3's intra-warpgroup overlap, ``n`` no schedule barrier, ``t`` three compute warpgroups, ``p``
    persistent (``mgpu64x128s2onp``)."""
    if s.startswith("mgpu"):
        bq, rest = s[4:].split("x")
        bk, st = rest.split("s")
        flags = st.lstrip("0123456789")
        return {"backend": "mosaic_gpu", "block_q": int(bq), "block_kv": int(bk), "max_concurrent_steps": int(st[:len(st) - len(flags)]),
                "schedule_barrier": int("n" not in flags), "semantics": 0, "overlap": int("o" in flags),
                "compute_wgs": 3 if "t" in flags else 2, "persistent": int("p" in flags)}
    bq, rest = s.split("x")
    bk, rest = rest.split("w")
    w, st = rest.split("s")
    return {"block_q": int(bq), "block_k": int(bk), "num_warps": int(w), "num_stages": int(st)}


def attention_table(rows: list[tuple]) -> list[str]:
    """The attention benchmarks' Markdown table (after a blank line) of (program, implementation, ms, IQR/median,
    TFLOP/s, speedup vs jax.jit, note) rows."""
    lines = ["", "| program | implementation | ms | IQR/median | TFLOP/s | speedup vs jax.jit | note |", "|---|---|---|---|---|---|---|"]
    return lines + [f"| {name} | {label} | {ms:.3f} | {iqr:.1%} | {tf:.0f} | {sp:.2f}x | {extra} |"
                    for name, label, ms, iqr, tf, sp, extra in rows]


def emit(lines: list[str], out: str = "") -> None:
    """Print a result table, and write it to `out` if given."""
    text = "\n".join(lines)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
