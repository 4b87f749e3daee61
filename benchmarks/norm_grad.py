"""Tune the backward of a layer norm and of an RMS norm (`jax.vjp` with a given cotangent: dx, dγ, dβ) at GPT-2
medium's and Llama's widths and print each job's table and a summary row: what the fused `row_reduce` kernel with
its sums over the rows (dγ, dβ as partials per block of rows) gains over jax.jit. Beside them, the two halves of a
training step's layer norm as its groups are once the backward computes the norm's float32 values again
(`graph.recompute_for_late_readers`): the forward with the residual add writing the row sums besides x and the
norm (against the same forward writing x - mean and x-hat instead, as before, and writing neither), and the
backward from x and the row sums.

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


def _residual_norm(a, b, g, beta):
    """A step's forward norm after the residual add: x, x - mean, x-hat (float32) and the row sums."""
    x = a + b
    xf = x.astype(jnp.float32)
    s1 = xf.sum(-1)
    xc = xf - s1[:, None] / x.shape[-1]
    s2 = (xc * xc).sum(-1)
    xhat = xc * jax.lax.rsqrt(s2[:, None] / x.shape[-1] + 1e-5)
    return x, (xhat * g + beta).astype(x.dtype), xc, xhat, s1, s2


def residual_norm(a, b, g, beta):
    x, y, *_ = _residual_norm(a, b, g, beta)
    return x, y


def residual_norm_stats(a, b, g, beta):
    """The forward as a training step's group writes it once its backward computes the rest again."""
    x, y, _, _, s1, s2 = _residual_norm(a, b, g, beta)
    return x, y, s1, s2


def residual_norm_residuals(a, b, g, beta):
    """The forward as it wrote its float32 residuals for the backward before."""
    x, y, xc, xhat, _, _ = _residual_norm(a, b, g, beta)
    return x, y, xc, xhat


def layer_norm_grad_from_input(x, s1, s2, g, dy, dres):
    """The backward from x and the row sums (the step's recomputed group), the residual's gradient added."""
    C = x.shape[-1]
    rstd = jax.lax.rsqrt(s2[:, None] / C + 1e-5)
    xhat = (x.astype(jnp.float32) - s1[:, None] / C) * rstd
    dxhat = dy.astype(jnp.float32) * g
    dx = rstd * (dxhat - dxhat.mean(-1, keepdims=True) - xhat * (dxhat * xhat).mean(-1, keepdims=True))
    return (dx + dres.astype(jnp.float32)).astype(x.dtype), (dy.astype(jnp.float32) * xhat).sum(0), dy.astype(jnp.float32).sum(0)


def _grad_args(R, C, params, keys):
    args = [jax.random.normal(keys[0], (R, C), jnp.float32).astype(jnp.bfloat16)]
    args += [(1 + 0.1 * jax.random.normal(k, (C,), jnp.float32)).astype(jnp.bfloat16) for k in keys[1:1 + params]]
    return args + [jax.random.normal(keys[-1], (R, C), jnp.float32).astype(jnp.bfloat16)]


def _forward_args(R, C, keys):
    return [jax.random.normal(keys[0], (R, C), jnp.float32).astype(jnp.bfloat16),
            jax.random.normal(keys[1], (R, C), jnp.float32).astype(jnp.bfloat16),
            1 + 0.1 * jax.random.normal(keys[2], (C,), jnp.float32), 0.1 * jax.random.normal(keys[3], (C,), jnp.float32)]


def _from_input_args(R, C, keys):
    x = jax.random.normal(keys[0], (R, C), jnp.float32).astype(jnp.bfloat16)
    xf = x.astype(jnp.float32)
    s1 = xf.sum(-1)
    s2 = ((xf - s1[:, None] / C) ** 2).sum(-1)  # the real statistics: a positive variance
    return [x, s1, s2, 1 + 0.1 * jax.random.normal(keys[1], (C,), jnp.float32),
            jax.random.normal(keys[2], (R, C), jnp.float32).astype(jnp.bfloat16),
            jax.random.normal(keys[3], (R, C), jnp.float32).astype(jnp.bfloat16)]


CASES = {  # name: (fn, rows, width, its arguments from (rows, width, keys)), bf16 (GPT-2 medium: B8 S2048 d1024; Llama: B4 S2048 d4096)
    "layer_norm_grad": (layer_norm_grad, 16384, 1024, lambda R, C, k: _grad_args(R, C, 2, k)),
    "rms_norm_grad": (rms_norm_grad, 8192, 4096, lambda R, C, k: _grad_args(R, C, 1, k)),
    "residual_norm": (residual_norm, 16384, 1024, _forward_args),
    "residual_norm_stats": (residual_norm_stats, 16384, 1024, _forward_args),
    "residual_norm_residuals": (residual_norm_residuals, 16384, 1024, _forward_args),
    "layer_norm_grad_from_input": (layer_norm_grad_from_input, 16384, 1024, _from_input_args),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument("--out", default="")
    ap.add_argument("--only", default="", help="comma-separated case names (default: all)")
    a = ap.parse_args()
    rows = []
    for name, (fn, R, C, make_args) in CASES.items():
        if a.only and name not in a.only.split(","):
            continue
        args = make_args(R, C, jax.random.split(jax.random.PRNGKey(0), 4))
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
