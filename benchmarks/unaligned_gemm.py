"""XLA's GEMMs at a vocabulary whose rows are not 16 bytes apart, against the same GEMMs padded to aligned rows (why
the `aligned_dot` template exists): GPT-2 medium's LM head in its training step, [16384, 1024] activations against a
[50257, 1024] embedding, bf16, each GEMM under `jax.jit` at both vocabularies in alternation (`time_pair`).

And the unaligned GEMM with XLA's own layouts for what would be intermediates in the step (the logits' gradient, the
activations, the logits: `Layout.AUTO`; the embedding, a parameter, stays row-major): inside a program XLA lays
those out as it likes, timed alone (as autofuse times a group's XLA reference) it must read and write them
row-major. The training step's profile found these three GEMMs at 2.97-7.33 ms inside the program against 5.4-10.1
ms alone (results/models_cudnn_h200.md §2); whether layouts are why is what this column asks, and whether XLA
fusing the gradient's producer into the GEMM is, what the second table asks (`with_producer`).

    python -m benchmarks kernels unaligned-gemm [--vocab 50257 --padded 50304]
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from jax.experimental.layout import Format, Layout

from autofuse.runner.measure import time_pair
from benchmarks.provenance import header


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--padded", type=int, default=50304)
    p.add_argument("--rows", type=int, default=16384)
    p.add_argument("--width", type=int, default=1024)
    args = p.parse_args(argv)
    M, D, V, Vp = args.rows, args.width, args.vocab, args.padded
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    g = jax.random.normal(k[0], (M, V), jnp.bfloat16)
    x = jax.random.normal(k[1], (M, D), jnp.bfloat16)
    w = jax.random.normal(k[2], (V, D), jnp.bfloat16)
    gp, wp = jnp.pad(g, ((0, 0), (0, Vp - V))), jnp.pad(w, ((0, Vp - V), (0, 0)))
    gemms = (("dx = dlogits @ W", lambda g, w: g @ w, (g, w), (gp, wp), (True, False)),
             ("dW = dlogits^T @ X", lambda g, x: g.T @ x, (g, x), (gp, x), (True, True)),
             ("logits = X @ W^T", lambda x, w: x @ w.T, (x, w), (x, wp), (True, False)))
    print(header(argv))
    print(f"\n| GEMM | V = {V} | V = {V}, XLA's own layouts (chosen: inputs; output) | V = {Vp} | ratio own layouts / "
          f"unaligned | ratio padded / unaligned (median and quartiles) |\n|---|---|---|---|---|---|")
    flop = 2 * M * V * D / 1e12
    for name, fn, a, b, free in gemms:
        f = jax.jit(fn)
        own, laid = own_layouts(fn, a, free)
        t1, t3, r3 = time_pair(lambda: f(*a), lambda: own(*laid), [[]], repeats=10)
        _, t2, r = time_pair(lambda: f(*a), lambda: f(*b), [[]], repeats=10)
        chosen = "; ".join(str(fm.layout.major_to_minor) for fm in (*own.input_formats[0], own.output_formats))
        print(f"| {name} | {t1.median_ms:.3f} ms ({flop / t1.median_ms * 1e3:.0f} TFLOP/s) | {t3.median_ms:.3f} ms "
              f"({flop / t3.median_ms * 1e3:.0f}; {chosen}) | {t2.median_ms:.3f} ms ({flop / t2.median_ms * 1e3:.0f}) | "
              f"{r3.median_ms:.3f} ({r3.q1_ms:.3f}-{r3.q3_ms:.3f}) | {r.median_ms:.3f} ({r.q1_ms:.3f}-{r.q3_ms:.3f}) |")
    with_producer(M, V, w)


def with_producer(M: int, V: int, w) -> None:
    """The other way the program differs from the dot alone: the logits' gradient made by the softmax's backward
    right before the dot. Timed as the producer alone, the dot alone (on the producer's output) and both in one
    program: where XLA fuses the producer into its GEMM's operand loads, both together cost less than the parts."""
    k = jax.random.split(jax.random.PRNGKey(1), 2)
    logits = jax.random.normal(k[0], (M, V), jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)

    def producer(logits, lse):  # softmax - (the one-hot term left out: an elementwise producer is the point)
        return jnp.exp(logits - lse[:, None]).astype(jnp.bfloat16)

    prod, dot, both = jax.jit(producer), jax.jit(lambda g, w: g @ w), jax.jit(lambda l, m, w: producer(l, m) @ w)
    g = prod(logits, lse)
    tp, tb, rb = time_pair(lambda: prod(logits, lse), lambda: both(logits, lse, w), [[]], repeats=10)
    td, _, _ = time_pair(lambda: dot(g, w), lambda: both(logits, lse, w), [[]], repeats=10)
    parts = tp.median_ms + td.median_ms
    print(f"\n| dx with its producer | producer alone | dot alone | parts summed | in one program | one program / parts |"
          f"\n|---|---|---|---|---|---|\n| exp(logits - lse) -> bf16, @ W | {tp.median_ms:.3f} ms | {td.median_ms:.3f} ms | "
          f"{parts:.3f} ms | {tb.median_ms:.3f} ms | {tb.median_ms / parts:.3f} |")


def own_layouts(fn, args: tuple, free: tuple[bool, ...]):
    """`fn` compiled with the layouts XLA chooses for the arguments marked `free` and for its result (the others
    row-major), and `args` placed in those layouts."""
    compiled = jax.jit(fn, in_shardings=tuple(Format(Layout.AUTO) if f else None for f in free),
                       out_shardings=Format(Layout.AUTO)).lower(*args).compile()
    return compiled, [jax.device_put(v, fm) for v, fm in zip(args, compiled.input_formats[0])]


if __name__ == "__main__":
    main()
