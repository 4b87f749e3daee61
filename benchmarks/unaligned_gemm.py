"""XLA's GEMMs at a vocabulary whose rows are not 16 bytes apart, against the same GEMMs padded to aligned rows (why
the `aligned_dot` template exists): GPT-2 medium's LM head in its training step, [16384, 1024] activations against a
[50257, 1024] embedding, bf16, each GEMM under `jax.jit` at both vocabularies in alternation (`time_pair`).

    python -m benchmarks kernels unaligned-gemm [--vocab 50257 --padded 50304]
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

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
    gemms = (("dx = dlogits @ W", lambda g, w: g @ w, (g, w), (gp, wp)),
             ("dW = dlogits^T @ X", lambda g, x: g.T @ x, (g, x), (gp, x)),
             ("logits = X @ W^T", lambda x, w: x @ w.T, (x, w), (x, wp)))
    print(header(argv))
    print(f"\n| GEMM | V = {V} | V = {Vp} | ratio (padded / unaligned, median and quartiles) |\n|---|---|---|---|")
    flop = 2 * M * V * D / 1e12
    for name, fn, a, b in gemms:
        f = jax.jit(fn)
        t1, t2, r = time_pair(lambda: f(*a), lambda: f(*b), [[]], repeats=10)
        print(f"| {name} | {t1.median_ms:.3f} ms ({flop / t1.median_ms * 1e3:.0f} TFLOP/s) | {t2.median_ms:.3f} ms "
              f"({flop / t2.median_ms * 1e3:.0f}) | {r.median_ms:.3f} ({r.q1_ms:.3f}-{r.q3_ms:.3f}) |")


if __name__ == "__main__":
    main()
