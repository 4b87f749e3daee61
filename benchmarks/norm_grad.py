"""Tune the backward of a layer norm and of an RMS norm (`jax.vjp` with a given cotangent: dx, dγ, dβ) at GPT-2
medium's and Llama's widths and print each job's table and a summary row: what the fused `row_reduce` kernel with
its sums over the rows (dγ, dβ as partials per block of rows) gains over jax.jit.

    python -m benchmarks kernels norm-grad --trials 12 --out results/norm_grad.md
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

import autofuse
from benchmarks.provenance import header
from benchmarks.workloads import emit


def layer_norm(x, g, b):
    xf = x.astype(jnp.float32)
    mu = xf.mean(-1, keepdims=True)
    var = ((xf - mu) ** 2).mean(-1, keepdims=True)
    return ((xf - mu) * jax.lax.rsqrt(var + 1e-5) * g + b).astype(x.dtype)


def rms_norm(x, g):
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt((xf * xf).mean(-1, keepdims=True) + 1e-6) * g).astype(x.dtype)


def layer_norm_grad(x, g, b, dy):
    """dx, dγ, dβ of a layer norm for the cotangent dy."""
    return jax.vjp(layer_norm, x, g, b)[1](dy)


def rms_norm_grad(x, g, dy):
    """dx, dγ of an RMS norm for the cotangent dy."""
    return jax.vjp(rms_norm, x, g)[1](dy)


CASES = {  # rows x width, bf16 (GPT-2 medium: B8 S2048 d1024; Llama: B4 S2048 d4096)
    "layer_norm_grad": (layer_norm_grad, 16384, 1024, 2),
    "rms_norm_grad": (rms_norm_grad, 8192, 4096, 1),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    rows = []
    for name, (fn, R, C, params) in CASES.items():
        keys = jax.random.split(jax.random.PRNGKey(0), 2 + params)
        args = [jax.random.normal(keys[0], (R, C), jnp.float32).astype(jnp.bfloat16)]
        args += [(1 + 0.1 * jax.random.normal(k, (C,), jnp.float32)).astype(jnp.bfloat16) for k in keys[1:1 + params]]
        args.append(jax.random.normal(keys[-1], (R, C), jnp.float32).astype(jnp.bfloat16))
        t0 = time.time()
        rep = autofuse.tune(fn, *args, trials=a.trials, name=name, quiet=True, store=False)
        print(rep.table(), flush=True)
        plan = "XLA" if rep.plan.is_xla else "; ".join(
            f"{g.template}/{g.backend} ({len(g.nodes)} ops) " + " ".join(f"{k}={v}" for k, v in sorted(g.config.items())) for g in rep.plan.groups)
        rows.append(f"| {name} | {R}x{C} | {rep.baseline_ms:.4f} | {rep.tuned_ms:.4f} | {rep.speedup:.2f}x | "
                    f"{'' if rep.noise is None else f'±{rep.noise:.1%}'} | {time.time() - t0:.0f} | {plan} |")
    emit([header(),
          "", "| program | shape | jax.jit ms | autofuse ms | speedup | noise | tuning s | plan |", "|---|---|---|---|---|---|---|---|", *rows],
         a.out)


if __name__ == "__main__":
    main()
