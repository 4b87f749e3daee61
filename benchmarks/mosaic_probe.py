"""GPU probe: the Mosaic GPU and Triton lowerings of a template against XLA, same process, same inputs: the
`matmul` template (and, for a plain GEMM, JAX's hand-written `hopper_matmul_mgpu`; `groupnorm`: matmul + bias +
swish + GroupNorm(32), the epilogue reducing over 128-column segments of each product row), the `attention`
template (and cuDNN's fused attention, `jax.nn.dot_product_attention(implementation="cudnn")`), and the
`matmul_reduce` template on GPT-2's cross-entropy rows (the logits of a 50257 vocabulary never written), and the
`row_reduce` template (Triton) on the layer norm's and RMS norm's backward (dx with dγ, dβ summed over the rows; GPT-2's
with the residual's gradient added), reported in GB/s of the group's inputs and outputs.

Every kernel is checked against jax.jit on the inputs before it is timed; times are medians of many back-to-back
calls per sync over 3 rotating input sets (`runner.measure.time_fn`), with the spread (min..max of the repeats).

    python -m benchmarks kernels mosaic [--only attention] [--out results/mosaic_probe_h100.md] [--quick]
    python -m benchmarks kernels mosaic --only groupnorm --out results/groupnorm_probe_h100.md
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import traceback

import jax
import jax.numpy as jnp

import autofuse
from autofuse.kernels import TEMPLATES
from autofuse.kernels.mosaic_gpu import matmul as mosaic_matmul
from autofuse.runner.measure import check, cone_tolerances, random_inputs, time_fn
from autofuse.graph import Group
from autofuse.tuning.partition import Candidate
from benchmarks.provenance import header
from benchmarks.workloads import emit, matmul_bias_swish_groupnorm

BF16 = jnp.bfloat16


def plain(x, w):
    return x @ w


def bias_gelu(x, w, b):
    return jax.nn.gelu(x @ w + b)


def qkv_split(x, w, b):  # a fused QKV projection split into queries, keys and values (XLA: the product, then 3 copies)
    return jnp.split(x @ w + b, 3, axis=-1)


def bias_residual(x, w, b, r):
    return (x @ w + b) + r


def highest_bias_gelu(x, w, b):  # a float32 program that asks for an exact product (XLA: float32 FMA, not TF32)
    return jax.nn.gelu(jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST) + b)


def cross_entropy_rows(x, w, t):  # GPT-2's loss per token (examples.gpt2.cross_entropy without the mean), wte as stored
    logits = jnp.einsum("mk,nk->mn", x, w).astype(jnp.float32)
    return jax.nn.logsumexp(logits, axis=-1) - jnp.sum(jax.nn.one_hot(t, logits.shape[-1]) * logits, axis=-1)


def dgrad_gelu(dz, w, h):  # an MLP's down-projection backward: dz @ W^T (W [N, K] as stored), times GELU'(h) (tanh form)
    c = math.sqrt(2 / math.pi)
    t = jnp.tanh(c * (h + 0.044715 * h ** 3))
    gelu_grad = 0.5 * (1 + t) + 0.5 * h * (1 - t * t) * c * (1 + 3 * 0.044715 * h * h)
    return jax.lax.dot_general(dz, w, (((1,), (1,)), ((), ()))) * gelu_grad


def dgrad_gelu_dbias(dz, w, h):  # the same with the up-projection bias's gradient, a sum over the rows, in the epilogue
    dy = dgrad_gelu(dz, w, h)
    return dy, jnp.sum(dy.astype(jnp.float32), axis=0)


def dgrad_dgamma(dz, w, dres, xn):  # Llama's: a dgrad GEMM, the other branch's gradient added, the RMS norm's dγ summed over the rows
    dx = jnp.einsum("mk,nk->mn", dz, w) + dres
    return dx, jnp.sum((dx * xn).astype(jnp.float32), axis=0)


def swiglu(h, w_gate, w_up):  # Llama's MLP before its down-projection: two GEMMs of one A meeting in the epilogue
    return jax.nn.silu(h @ w_gate) * (h @ w_up)


def lm_head(x, w):  # GPT-2's logits, `x @ wte.T`, with wte read as stored ([N, K])
    return jnp.einsum("mk,nk->mn", x, w)


def _layer_norm(x, g, b):
    xf = x.astype(jnp.float32)
    mu = xf.mean(-1, keepdims=True)
    var = ((xf - mu) ** 2).mean(-1, keepdims=True)
    return ((xf - mu) * jax.lax.rsqrt(var + 1e-5) * g + b).astype(x.dtype)


def ln_grad(x, g, b, dy):  # a layer norm's backward: dx, dγ, dβ for the cotangent dy
    return jax.vjp(_layer_norm, x, g, b)[1](dy)


def ln_grad_residual(x, g, b, dy, dres):  # GPT-2's: the norm's dx added to the residual stream's gradient
    dx, dg, db = ln_grad(x, g, b, dy)
    return dx + dres, dg, db


def rms_grad(x, g, dy):  # Llama's RMS norm backward: dx, dγ
    def rms(x, g):
        xf = x.astype(jnp.float32)
        return (xf * jax.lax.rsqrt((xf * xf).mean(-1, keepdims=True) + 1e-6) * g).astype(x.dtype)
    return jax.vjp(rms, x, g)[1](dy)


def attention(q, k, v):
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * (q.shape[-1] ** -0.5)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s.astype(jnp.float32), axis=-1).astype(v.dtype), v)


def attention_causal(q, k, v):
    L = q.shape[2]
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * (q.shape[-1] ** -0.5)
    s = jnp.where(jnp.tril(jnp.ones((L, L), bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s.astype(jnp.float32), axis=-1).astype(v.dtype), v)


WORKLOADS = {
    "attention-B8H32L2048D128": (attention, [(8, 32, 2048, 128)] * 3),
    "attention-f32-B8H32L2048D128": (attention, [(8, 32, 2048, 128)] * 3),
    "attention-causal-B8H32L2048D128": (attention_causal, [(8, 32, 2048, 128)] * 3),
    "attention-causal-f32-B8H32L2048D128": (attention_causal, [(8, 32, 2048, 128)] * 3),
    # GPT-2's and Llama 3.2 1B's head dim (issue 31 asks the same of D64)
    "attention-B8H32L2048D64": (attention, [(8, 32, 2048, 64)] * 3),
    "attention-causal-B8H32L2048D64": (attention_causal, [(8, 32, 2048, 64)] * 3),
    # FlashAttention-3's paper's shapes (B x L = 16k tokens, H x D = 2048): its 8% over cuDNN at D128 is at L = 16k
    "attention-B2H16L8192D128": (attention, [(2, 16, 8192, 128)] * 3),
    "attention-B1H16L16384D128": (attention, [(1, 16, 16384, 128)] * 3),
    "attention-causal-B1H16L16384D128": (attention_causal, [(1, 16, 16384, 128)] * 3),
    "attention-causal-B4H16L4096D128": (attention_causal, [(4, 16, 4096, 128)] * 3),
    "attention-causal-B2H16L8192D128": (attention_causal, [(2, 16, 8192, 128)] * 3),
    "attention-B1H32L16384D64": (attention, [(1, 32, 16384, 64)] * 3),
    "attention-causal-B1H32L16384D64": (attention_causal, [(1, 32, 16384, 64)] * 3),
    "gemm-8192^3": (plain, [(8192, 8192), (8192, 8192)]),
    "gemm-1024x8192x8192": (plain, [(1024, 8192), (8192, 8192)]),
    "bias-gelu-8192x4096x8192": (bias_gelu, [(8192, 4096), (4096, 8192), (8192,)]),
    "bias-residual-8192x4096x8192": (bias_residual, [(8192, 4096), (4096, 8192), (8192,), (8192, 8192)]),
    # GPT-2 medium's MLP at B8 S2048: the up-projection (+ bias + GELU) and the down-projection (+ bias + residual)
    "qkv-split-16384x1024x3072": (qkv_split, [(16384, 1024), (1024, 3072), (3072,)]),
    "gemm-16384x1024x4096": (plain, [(16384, 1024), (1024, 4096)]),
    "bias-gelu-16384x1024x4096": (bias_gelu, [(16384, 1024), (1024, 4096), (4096,)]),
    "gemm-16384x4096x1024": (plain, [(16384, 4096), (4096, 1024)]),
    "bias-residual-16384x4096x1024": (bias_residual, [(16384, 4096), (4096, 1024), (1024,), (16384, 1024)]),
    "highest-f32-bias-gelu-4096^3": (highest_bias_gelu, [(4096, 4096), (4096, 4096), (4096,)]),
    "groupnorm-16384x2048x4096-G32": (matmul_bias_swish_groupnorm, [(16384, 2048), (2048, 4096), (4096,), (4096,), (4096,)]),
    "ce-16384x1024x50257": (cross_entropy_rows, [(16384, 1024), (50257, 1024), (16384,)]),
    # GPT-2's LM head at its vocabulary (rows of 100514 bytes: no TMA descriptor of [M, N]) and padded to 50304
    "lm-head-16384x1024x50257": (lm_head, [(16384, 1024), (50257, 1024)]),
    "lm-head-16384x1024x50304": (lm_head, [(16384, 1024), (50304, 1024)]),
    "dgrad-gelu-16384x1024x4096": (dgrad_gelu, [(16384, 1024), (4096, 1024), (16384, 4096)]),
    "dgrad-gelu-dbias-16384x1024x4096": (dgrad_gelu_dbias, [(16384, 1024), (4096, 1024), (16384, 4096)]),
    "dgrad-dgamma-8192x8192x2048": (dgrad_dgamma, [(8192, 8192), (2048, 8192), (8192, 2048), (8192, 2048)]),
    "swiglu-8192x2048x8192": (swiglu, [(8192, 2048), (2048, 8192), (2048, 8192)]),  # Llama 3.2 1B, B4 S2048
    # norms' backward (row_reduce, Triton): GPT-2 medium's at B8 S2048, Llama's RMS norm at B4 S2048 d4096
    "ln-grad-16384x1024": (ln_grad, [(16384, 1024), (1024,), (1024,), (16384, 1024)]),
    "ln-grad-residual-16384x1024": (ln_grad_residual, [(16384, 1024), (1024,), (1024,), (16384, 1024), (16384, 1024)]),
    "rms-grad-8192x4096": (rms_grad, [(8192, 4096), (4096,), (8192, 4096)]),
}
INT_ARGS = {"ce-16384x1024x50257": (2,)}  # argument positions that are int32 (targets)
# Mosaic GPU configs per kind, each over the lowering's default ({}: the default itself); a matmul config that does not
# name `pingpong` is over the cooperative schedule's default (`default_config(spec, pingpong=False)`).
MOSAIC = {"matmul": [
    {},  # the lowering's default
    {"max_concurrent_steps": 3},
    {"grid_tile_width": 4},
    {"grid_tile_width": 16},
    {"block_k": 128, "max_concurrent_steps": 2},
    {"wg_dimension": 1},
    {"epi_tile_n": 128},
    # the epilogue in its own warpgroup, beside the next tile's mainloop (the product staged in SMEM: a shallower ring)
    {"epilogue_wg": 1, "block_k": 64, "max_concurrent_steps": 3},
    {"epilogue_wg": 1, "block_k": 64, "max_concurrent_steps": 2},
    {"epilogue_wg": 1, "block_k": 64, "max_concurrent_steps": 2, "grid_tile_width": 16},
    {"epilogue_wg": 1, "block_k": 64, "max_concurrent_steps": 3, "epi_tile_n": 32},
    # the mainloop: 2-CTA clusters multicasting the shared operand
    {"cluster": 1},
    {"cluster": 2},
    {"cluster": 1, "wg_dimension": 1},
], "dual": [  # two [block_m, block_n] float32 accumulators per warpgroup: at most 128 x 64 each
    {},  # the lowering's default: 64 x 128 per warpgroup, the two along M (CTA 128 x 128)
    {"block_m": 128, "block_n": 64, "wg_dimension": 1},  # CTA 128 x 128, the warpgroups side by side along N
    {"block_m": 128, "block_n": 64},  # CTA 256 x 64
    {"wg_dimension": 1, "block_k": 64, "max_concurrent_steps": 2},  # CTA 64 x 256
    {"block_k": 64, "max_concurrent_steps": 4},
    {"block_k": 64, "max_concurrent_steps": 3},
    {"grid_tile_width": 16},
    {"grid_minor_dim": 0},
], "groupnorm": [  # epi_tile_n is the segment (128) in every one: one epilogue piece per segment
    {},  # the lowering's default: 2 x [128, 128] warpgroup tiles along M, 3-deep ring of 64-column K steps
    {"block_m": 64, "wg_dimension": 1},  # CTA 64 x 256: half the accumulator registers per thread (64), 4 stages fit
    {"block_m": 64, "wg_dimension": 1, "max_concurrent_steps": 4},
    {"block_m": 64, "block_n": 256, "wg_dimension": 0},  # CTA 128 x 256, two pieces (segments) per warpgroup
    {"block_m": 64, "block_n": 128, "wg_dimension": 0, "max_concurrent_steps": 4},  # CTA 128 x 128
    {"block_m": 64, "wg_dimension": 1, "max_concurrent_steps": 2, "block_k": 128},  # 256-byte K steps, 2-deep ring
    {"grid_tile_width": 4},
    {"grid_tile_width": 16},
], "matmul_reduce": [
    {},  # the lowering's default: 2 x 128 rows, 128-column steps, 32-column epilogue pieces, 4-deep ring, split 2
    {"epi_tile": 64},
    {"epi_tile": 128},
    {"block_m": 64, "block_n": 256, "epi_tile": 64},
    {"split": 1},
    {"split": 4},
    {"max_concurrent_steps": 3, "block_k": 64},
], "attention": [
    {},
    {"semantics": 0},
    {"semantics": 1},
    {"block_kv": 192},
    {"max_concurrent_steps": 3},
    {"schedule_barrier": 0},
    {"overlap": 1},  # FA3's intra-warpgroup overlap: S of the next key block and P V of this one issued together
    {"overlap": 1, "max_concurrent_steps": 3},
    {"overlap": 1, "schedule_barrier": 0},
]}
DTYPES = {"highest-f32-bias-gelu-4096^3": jnp.float32, "attention-f32-B8H32L2048D128": jnp.float32,
          "attention-causal-f32-B8H32L2048D128": jnp.float32}  # else bf16
TRITON_F32 = {"matmul": [{"block_m": 128, "block_n": 128, "block_k": 32, "num_warps": 8, "num_stages": 3, "group_m": 8}],
              "attention": [{"block_q": q, "block_k": k, "num_warps": w, "num_stages": st}
                            for q, k, w, st in [(128, 64, 8, 2), (64, 64, 4, 2), (64, 32, 4, 2), (128, 32, 8, 2), (32, 32, 4, 2),
                                                (64, 64, 4, 1), (128, 64, 8, 1)]]}
# row_reduce's Triton configs: rows per block, warps, and the row blocks a program walks (fewer partials of the
# column sums); those that do not apply (rows of several column blocks walked) are declined
TRITON_ROWS = [{"block_rows": r, "block_cols": c, "num_warps": w, "num_stages": st, "row_steps": k}
               for r, c, w, k, st in [(4, 1024, 8, 1, 1), (4, 1024, 8, 4, 1), (4, 1024, 8, 8, 1), (4, 1024, 8, 8, 2),
                                      (4, 1024, 8, 8, 3), (2, 1024, 4, 16, 1), (2, 1024, 4, 16, 2), (2, 1024, 4, 16, 3),
                                      (2, 1024, 8, 16, 2), (1, 1024, 4, 32, 2), (8, 1024, 8, 4, 2), (1, 4096, 8, 1, 1),
                                      (1, 4096, 8, 16, 1), (1, 4096, 8, 16, 2), (1, 4096, 8, 16, 3), (1, 4096, 16, 16, 2),
                                      (1, 4096, 8, 32, 2), (2, 4096, 16, 8, 2)]]
TRITON = {"matmul": {"block_m": 128, "block_n": 256, "block_k": 64, "num_warps": 8, "num_stages": 3, "group_m": 8},
          "groupnorm": {"block_m": 128, "block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 3, "group_m": 8},
          "attention": {"block_q": 128, "block_k": 64, "num_warps": 8, "num_stages": 3},
          "matmul_reduce": {"block_m": 128, "block_n": 256, "block_k": 64, "num_warps": 8, "num_stages": 3, "split": 1}}


def arg_specs(name: str, shapes, dtype=BF16) -> list[jax.ShapeDtypeStruct]:
    """The workload's arguments: `dtype`, but int32 at its `INT_ARGS` positions."""
    return [jax.ShapeDtypeStruct(s, jnp.int32 if i in INT_ARGS.get(name, ()) else dtype) for i, s in enumerate(shapes)]


def _group(fn, specs):
    """The whole program as one group (a lone dot is no candidate of the tuner, but the matmul template runs it)."""
    graph = autofuse.capture(fn, *specs)
    group = Group.of(graph, [n.id for n in graph.nodes])
    name = next(n for n in ("attention", "matmul", "matmul_reduce", "row_reduce") if TEMPLATES[n].match(group) is not None)
    return graph, Candidate(group, name, TEMPLATES[name].match(group))


def cudnn_attention(causal: bool):
    """cuDNN's fused attention, `jax.nn.dot_product_attention(implementation="cudnn")`, jitted, on [B, L, H, D] operands
    (a list of one output, as the kernels give)."""
    return jax.jit(lambda q, k, v: [jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")])


def flops_of(fn, cand: Candidate, shapes) -> float:
    """The workload's FLOPs: 2MNK a GEMM (twice for a dual one), 4BHL^2D attention (half of it causal); for a
    `row_reduce` group, the bytes of its inputs and outputs instead (so its rate reads as TB/s)."""
    if cand.template == "row_reduce":
        g = cand.group
        return float(sum(g.graph.aval(v).size * g.graph.aval(v).dtype.itemsize for v in (*g.inputs, *g.outputs)))
    if cand.template in ("matmul", "matmul_reduce"):
        return 2.0 * cand.spec.M * cand.spec.N * cand.spec.K * (2 if getattr(cand.spec, "dot2", None) is not None else 1)
    B, H, L, D = shapes[0]
    return 4.0 * B * H * L * L * D * (0.5 if fn is attention_causal else 1.0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="", help="the Markdown table (a name ending in .json: the rows as JSON instead)")
    ap.add_argument("--quick", action="store_true", help="the default configs only")
    ap.add_argument("--only", default="", help="comma-separated workload name prefixes")
    ap.add_argument("--configs", default="", help="a JSON list of Mosaic GPU configs (each over the default) instead of the "
                    "probe's own list")
    a = ap.parse_args(argv)

    rows = []
    dev = jax.devices()[0].device_kind
    print(f"device {dev}, jax {jax.__version__}", flush=True)
    for name, (fn, shapes) in WORKLOADS.items():
        if a.only and not any(name.startswith(p) for p in a.only.split(",")):
            continue
        graph, cand = _group(fn, arg_specs(name, shapes, DTYPES.get(name, BF16)))
        tmpl = TEMPLATES[cand.template]
        kind = cand.template  # the configs to try
        if cand.template == "matmul":
            kind = "groupnorm" if cand.spec.seg else "dual" if cand.spec.dot2 is not None else kind
        g = cand.group
        avals = g.input_avals()
        sets = [random_inputs(avals, 100 + k) for k in range(3)]
        ref = jax.jit(lambda *xs: g.evaluate(xs))
        tol = cone_tolerances(graph, g.node_ids, g.outputs)
        flops = flops_of(fn, cand, shapes)

        def measure(label, f, config=None):
            try:
                res = check(f, ref, avals, (1,), tol)
                if not res.ok:
                    rows.append({"workload": name, "kernel": label, "config": config, "status": "wrong", "error": res.reason})
                    print(f"{name:30} {label:28} WRONG {res.reason}", flush=True)
                    return
                t = time_fn(f, sets, repeats=15)
            except Exception as e:  # noqa: BLE001 - a config that fails is a row, not the end of the probe
                rows.append({"workload": name, "kernel": label, "config": config, "status": "error", "error": f"{type(e).__name__}: {str(e)[:300]}"})
                print(f"{name:30} {label:28} ERROR {type(e).__name__}: {str(e)[:200]}", flush=True)
                return
            tf = flops / (t.median_ms * 1e-3) / 1e12
            rows.append({"workload": name, "kernel": label, "config": config, "status": "ok", "median_ms": t.median_ms, "min_ms": t.min_ms,
                         "max_ms": t.max_ms, "tflops": tf, "max_error": res.max_error})
            print(f"{name:30} {label:28} {t.median_ms:9.4f} ms ({t.min_ms:.4f}..{t.max_ms:.4f})  {tf:6.1f} {'TB/s' if cand.template == 'row_reduce' else 'TFLOP/s'}  err {res.max_error:.1e}",
                  flush=True)

        measure("xla", ref)
        for cfg in ([] if kind not in MOSAIC else [{}] if a.quick else json.loads(a.configs) if a.configs else MOSAIC[kind]):
            base = tmpl.default_config_of(cand.spec, "mosaic_gpu")
            if cand.template == "matmul" and cfg and "pingpong" not in cfg:  # a variant of the cooperative schedule
                base = mosaic_matmul.default_config(cand.spec, pingpong=False)
            full = {**base, **cfg}
            why = tmpl.unsupported(cand.spec, "mosaic_gpu", full)
            if why:
                print(f"{name:30} mosaic {cfg} declined: {why}", flush=True)
                continue
            k = tmpl.build(g, full, backend="mosaic_gpu", spec=cand.spec)
            measure(f"mosaic {json.dumps(cfg)}", jax.jit(lambda *xs, k=k: k(*xs)), full)
            if not cfg and kind in ("matmul", "dual") and len(g.nodes) > 1:  # the same kernel with the exact transcendentals
                k = mosaic_matmul.lower(g, cand.spec, full, approx_math=False)
                measure("mosaic {} exact math", jax.jit(lambda *xs, k=k: k(*xs)), full)
        triton_cfgs = ([] if tmpl.unsupported(cand.spec, "triton") else TRITON_ROWS[:1 if a.quick else None] if kind == "row_reduce"
                       else TRITON_F32[kind] if name in DTYPES
                       else [TRITON[kind]] + ([] if a.quick or kind != "groupnorm" else [{**TRITON[kind], "block_n": 256}]))
        for tcfg in triton_cfgs:
            if why := tmpl.unsupported(cand.spec, "triton", tcfg):
                print(f"{name:30} triton {tcfg} declined: {why}", flush=True)
                continue
            k = tmpl.build(g, tcfg, spec=cand.spec)
            measure(f"triton {json.dumps(tcfg)}", jax.jit(lambda *xs, k=k: k(*xs)), tcfg)
        measure("xla (again)", jax.jit(lambda *xs: g.evaluate(xs)))
        if cand.template == "attention":  # cuDNN's fused attention takes [B, L, H, D]: transposed outside its timing
            cud = cudnn_attention(fn is attention_causal)
            t_sets = [[jnp.swapaxes(x, 1, 2) for x in xs] for xs in sets]
            try:
                t = time_fn(cud, t_sets, repeats=15)
                rows.append({"workload": name, "kernel": "cudnn", "status": "ok", "median_ms": t.median_ms, "min_ms": t.min_ms,
                             "max_ms": t.max_ms, "tflops": flops / (t.median_ms * 1e-3) / 1e12})
                print(f"{name:30} {'cudnn':28} {t.median_ms:9.4f} ms ({t.min_ms:.4f}..{t.max_ms:.4f})  "
                      f"{flops / (t.median_ms * 1e-3) / 1e12:6.1f} TFLOP/s", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"{name:30} cudnn ERROR {type(e).__name__}: {str(e)[:200]}", flush=True)
        if fn is plain:
            try:
                from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

                c = hm.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4, epi_tile_m=64, epi_tile_n=64,
                                    grid_minor_dim=hm.MatmulDimension.N, grid_tile_width=8, wg_dimension=hm.MatmulDimension.M)
                measure("jax hopper_matmul_mgpu", jax.jit(lambda x, w: [hm.matmul(x, w, None, c)]))
            except Exception:  # noqa: BLE001
                traceback.print_exc()
    if a.out.endswith(".json"):  # the rows alone, as the earlier probes' files (results/mosaic_h100.md cites them)
        with open(a.out, "w") as f:
            json.dump({"device": dev, "jax": jax.__version__, "rows": rows}, f, indent=1)
    else:
        emit(table(rows, argv), a.out)
    return 0


def table(rows: list[dict], argv: list[str] | None) -> list[str]:
    """The probe's rows as a results/ table: per workload and kernel, its time, spread, throughput and error."""
    lines = [header(argv), "", "Medians of back-to-back calls over 3 rotating input sets (min..max of the repeats); every kernel "
             "checked against jax.jit on the inputs first.", "",
             "| workload | kernel | ms | min..max ms | TFLOP/s (row_reduce: TB/s) | max error | config |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['workload']} | {r['kernel']} | {r['status']}: {r['error'][:200].replace('|', '/')} | | | | |")
            continue
        err = f"{r['max_error']:.1e}" if "max_error" in r else ""
        lines.append(f"| {r['workload']} | {r['kernel']} | {r['median_ms']:.4f} | {r['min_ms']:.4f}..{r['max_ms']:.4f} | {r['tflops']:.1f} | "
                     f"{err} | {json.dumps(r.get('config') or {})} |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
