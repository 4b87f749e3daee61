"""Issue 17 benchmark: attention forward + backward (one `jax.vjp` and its pullback) of plain-jnp attention under
jax.jit, cuDNN's fused fwd+bwd, and autofuse's flash pair (the fused forward emitting the logsumexp, the
generated backward kernels), same process, same inputs (three rotated sets).

The program timed for each implementation is `(q, k, v, dO) -> (dq, dk, dv)`: the forward, then the pullback of
`dO`, as a training step runs them. cuDNN (`jax.nn.dot_product_attention(implementation="cudnn")`) takes
[B, L, H, D], so it gets the same data transposed beforehand (untimed). autofuse runs
`autofuse.jit(fn, plan=...)` with the attention group fused at each `--configs` forward config (Triton ``128x128w8s3``
or Mosaic GPU ``mgpu64x128s2``, whose forward then writes the logsumexp); `--bwd-configs` sweeps the Triton
backward kernels' tiles, Triton's or (after a Mosaic GPU forward) Mosaic GPU's ``mgpu64x64s2`` (default: the
flash pair's own choice, `AttentionTemplate.vjp_rule`). For reference, JAX's hand-written Mosaic GPU
attention (`jax.experimental.pallas.ops.gpu.attention_mgpu`, forward and its two backward kernels) runs where it
can: float16 only and not causal in jax 0.11.2.

    python -m benchmarks kernels attention-grad --out results/attention_grad_h100.md
    python -m benchmarks kernels attention-grad --configs 128x128w8s3 --bwd-configs 64x64w4s2,64x128w8s2,128x64w8s2

`--pairs N` also times each autofuse pair against cuDNN's in N alternating pairs of ~25 ms batches (`time_pair`): the
ratio's median and quartiles, each pair at one clock (the medians above come from separate stretches of calls, between
which cuDNN's own time moved by up to 3%).
"""
from __future__ import annotations

import argparse
import math
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import autofuse  # noqa: E402
from autofuse.kernels import TEMPLATES  # noqa: E402
from autofuse.plan import plan_from_choices  # noqa: E402
from autofuse.runner.measure import compare, random_inputs, time_fn, time_pair  # noqa: E402
from autofuse.tuning.partition import enumerate_candidates  # noqa: E402
from benchmarks.provenance import header  # noqa: E402
from benchmarks.workloads import attention_bhld, attention_bhld_causal, attention_config, attention_table, emit  # noqa: E402


def backward_tiles(s: str) -> dict:
    """The backward kernels' config from its short form: Triton ``128x32w8s3`` (held x step, warps, stages), Mosaic GPU
    ``mgpu64x128s2`` (held x step, steps in flight; a Mosaic GPU forward's backward only), its steps followed by
    flags: ``f`` dQ in the dK/dV kernel, ``o`` products issued in pairs (``mgpu64x64s2fo``)."""
    if s.startswith("mgpu"):
        flags = s[len(s.rstrip("fo")):]
        c = attention_config(s.rstrip("fo"))
        return {"bwd_mosaic": 1, "bwd_held": c["block_q"], "bwd_step": c["block_kv"], "bwd_stages": c["max_concurrent_steps"],
                "bwd_fused": int("f" in flags), "bwd_overlap": int("o" in flags)}
    c = attention_config(s)
    return {"bwd_mosaic": 0, "bwd_held": c["block_q"], "bwd_step": c["block_k"], "bwd_warps": c["num_warps"], "bwd_stages": c["num_stages"]}


def jax_attention_mgpu(causal: bool, compute_wgs_bwd: int):
    """JAX's own Mosaic GPU attention ([B, L, H, D], scale 1/sqrt(D) applied to q) with its backward blocks."""
    from jax.experimental.pallas.ops.gpu import attention_mgpu as am

    cfg = am.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=causal, compute_wgs_bwd=compute_wgs_bwd,
                          block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)

    def f(q, k, v):
        return am.attention(q * jnp.asarray(1.0 / math.sqrt(q.shape[-1]), q.dtype), k, v, cfg)

    return f


def key_lengths(q, k, v, lengths, *, is_causal=False):
    """[B, H, L, D] attention over padded keys as a careful user writes it: the library call with each batch row's key
    lengths ([B] int32), at its default implementation (JAX's XLA path in jax 0.11.2)."""
    def t(x):
        return jnp.swapaxes(x, 1, 2)

    return t(jax.nn.dot_product_attention(t(q), t(k), t(v), key_value_seq_lengths=lengths, is_causal=is_causal))


def key_lengths_causal(q, k, v, lengths):
    return key_lengths(q, k, v, lengths, is_causal=True)


def fixed_bias(q, k, v, bias):
    """[B, H, L, D] attention with a fixed additive bias [1, H, L, L] (ALiBi's or relative positions' as a tensor, not
    learned: the step differentiates q, k, v only), the library call at its default."""
    def t(x):
        return jnp.swapaxes(x, 1, 2)

    return t(jax.nn.dot_product_attention(t(q), t(k), t(v), bias=bias))


def fwd_bwd(f, *, jit: bool = True):
    """(q, k, v, dO, *fixed) -> (dq, dk, dv): the forward and its pullback, jitted (`fixed`: inputs not differentiated,
    the key lengths, a bias)."""
    def step(q, k, v, do, *fixed):
        _, pull = jax.vjp(lambda q, k, v: f(q, k, v, *fixed), q, k, v)
        return pull(do)

    return jax.jit(step) if jit else step


def pair_step(fn, specs: list, g, cand, cfg: dict):
    """The step with the flash pair at `cfg`: the attention group's own reverse-mode rule (`fn` captured as `g`, `cand`
    its attention candidate); with a bias, whose group keeps XLA's rule there, the step itself captured and its
    attention_vjp candidate planned (the pair a tuning job of the step runs: a fixed bias reads no gradient)."""
    if not any(s.dtype == jnp.bfloat16 and len(s.shape) == 4 and s.shape[2] == s.shape[3] for s in specs[3:]):
        fused = autofuse.jit(fn, plan=plan_from_choices(g, [(cand.group, "attention", cfg)]), on_miss="error")
        return fused, fwd_bwd(fused)
    step = fwd_bwd(fn, jit=False)
    out = jax.eval_shape(fn, *specs)
    step_specs = [*specs[:3], jax.ShapeDtypeStruct(out.shape, out.dtype), *specs[3:]]
    gs = autofuse.capture(step, *step_specs)
    vc = max((c for c in enumerate_candidates(gs) if c.template == "attention_vjp"), key=lambda c: len(c.nodes))
    cfg = {**TEMPLATES["attention_vjp"].default_config_of(vc.spec, cfg.get("backend", "triton")), **cfg}
    fused = autofuse.jit(step, plan=plan_from_choices(gs, [(vc.group, "attention_vjp", cfg, vc.stages)]), on_miss="error")
    return fused, jax.jit(fused)


def paired(cudnn_call: tuple | None, step, sets: list, pairs: int) -> str:
    """`step`'s time over cuDNN's (`cudnn_call`: its step and input sets) in `pairs` alternating pairs, or ""."""
    if not pairs or cudnn_call is None:
        return ""
    ref, ref_sets = cudnn_call
    _, _, ratio = time_pair(lambda i: ref(*ref_sets[i]), lambda i: step(*sets[i]), [(i,) for i in range(len(sets))],
                            repeats=pairs, warmup=2)
    return f"{ratio.median_ms:.3f}x cuDNN in {ratio.repeats} alternating pairs ({ratio.q1_ms:.3f}..{ratio.q3_ms:.3f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="8,32,2048,128", help="B,H,L,D")
    ap.add_argument("--configs", default="128x128w8s3,mgpu64x128s2", help="forward tiles, comma-separated: Triton "
                    "BQxBKwWARPSsSTAGES, Mosaic GPU mgpuBQxBKVsSTEPS")
    ap.add_argument("--bwd-configs", default="", help="backward tiles HELDxSTEPwWARPSsSTAGES, e.g. 128x32w8s3: each "
                    "program holds HELD keys (dK/dV) or queries (dQ) and steps through the other side STEP rows at a "
                    "time; Mosaic GPU's mgpuHELDxSTEPsSTAGES after a Mosaic GPU forward (default: the flash pair's own)")
    ap.add_argument("--variants", default="bhld,bhld_causal", help="bhld, bhld_causal, key_lengths, key_lengths_causal "
                    "(padded keys: lengths drawn in [L/2, L] per batch row), fixed_bias (a bf16 bias [1, H, L, L])")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--pairs", type=int, default=0, metavar="N", help="also each autofuse pair's time over cuDNN's in N "
                    "alternating pairs of ~25 ms batches (median and quartiles)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    B, H, L, D = (int(x) for x in a.shape.split(","))
    scale = 1.0 / math.sqrt(D)
    fns = {"bhld": attention_bhld, "bhld_causal": attention_bhld_causal, "key_lengths": key_lengths,
           "key_lengths_causal": key_lengths_causal, "fixed_bias": fixed_bias}
    rows = []
    for name in a.variants.split(","):
        fn, causal = fns[name], name.endswith("causal")
        shape = (B, H, L, D)
        fixed = {"key_lengths": [((B,), jnp.int32)], "fixed_bias": [((1, H, L, L), jnp.bfloat16)]}.get(name.removesuffix("_causal"), [])
        specs = [jax.ShapeDtypeStruct(shape, jnp.bfloat16)] * 3 + [jax.ShapeDtypeStruct(s, d) for s, d in fixed]

        def fixed_inputs(i: int) -> list:
            """The inputs not differentiated: key lengths drawn in [L/2, L], a bias normal."""
            if name.startswith("key_lengths"):
                return [jax.random.randint(jax.random.key(200 + i), (B,), L // 2, L + 1, jnp.int32)]
            return [jax.random.normal(jax.random.key(200 + i), s, jnp.float32).astype(d) for s, d in fixed]

        sets = [random_inputs([autofuse.graph.Aval(shape, jnp.dtype(jnp.bfloat16))] * 4, 100 + i) + fixed_inputs(i) for i in range(3)]
        # fwd 2 matmuls, bwd 5 (FlashAttention-2's count), over the positions computed (padded keys: the dense count)
        flops = 3.5 * 4.0 * B * H * L * L * D * (0.5 if causal else 1.0)
        ref = fwd_bwd(fn)
        t_ref = time_fn(ref, sets, repeats=a.repeats)
        want = ref(*sets[0])

        def row(label, t, got=None, extra=""):
            err = "" if got is None else "max rel err " + f"{max(compare(g, w)[1] for g, w in zip(got, want)):.1e}"
            rows.append((name, label, t.median_ms, (t.q3_ms - t.q1_ms) / t.median_ms, flops / t.median_ms / 1e9,
                         t_ref.median_ms / t.median_ms, "; ".join(filter(None, (err, extra)))))
            print(rows[-1], flush=True)

        row("jax.jit (XLA)", t_ref)
        t_cudnn = cudnn_call = None
        try:
            def cud(q, k, v, *extra):
                kw = {"bias": extra[0]} if name == "fixed_bias" else {"key_value_seq_lengths": extra[0]} if extra else {}
                return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal, implementation="cudnn", **kw)

            blhd = [[jnp.swapaxes(x, 1, 2) for x in s[:4]] + s[4:] for s in sets]
            step = fwd_bwd(cud)
            t = time_fn(step, blhd, repeats=a.repeats)
            row("cuDNN dot_product_attention fwd+bwd", t, [jnp.swapaxes(x, 1, 2) for x in step(*blhd[0])])
            t_cudnn = t.median_ms
            cudnn_call = (step, blhd)
        except Exception as e:  # noqa: BLE001 - report and go on
            print("cuDNN failed:", type(e).__name__, str(e)[:300])
        if not causal and not fixed:
            for wgs in (1, 2):
                try:
                    step = fwd_bwd(jax_attention_mgpu(causal, wgs))
                    blhd16 = [[jnp.swapaxes(x, 1, 2).astype(jnp.float16) for x in s] for s in sets]
                    t = time_fn(step, blhd16, repeats=a.repeats)
                    row(f"JAX attention_mgpu fwd+bwd (hand-written Mosaic GPU, float16, {wgs} compute warpgroup(s) in the backward)",
                        t, [jnp.swapaxes(x, 1, 2) for x in step(*blhd16[0])],
                        "" if t_cudnn is None else f"{t.median_ms / t_cudnn:.2f}x cuDNN's time")
                except Exception as e:  # noqa: BLE001
                    print("attention_mgpu failed:", type(e).__name__, str(e)[:300], flush=True)

        g = autofuse.capture(fn, *specs)
        cand = max((c for c in enumerate_candidates(g) if c.template == "attention"), key=lambda c: len(c.nodes))
        for cs in filter(None, a.configs.split(",")):
            for bs in (a.bwd_configs.split(",") if a.bwd_configs else [""]):
                label = f"autofuse flash pair fwd {cs} bwd {bs or 'default'}"
                try:  # the flash pair reads the backward's tiles from the group's config (`bwd_` keys)
                    cfg = {**attention_config(cs), **(backward_tiles(bs) if bs else {})}
                    fused, step = pair_step(fn, specs, g, cand, cfg)
                    got = step(*sets[0])
                    assert fused.last_status.startswith("plan:"), fused.last_status
                    t = time_fn(step, sets, repeats=a.repeats)
                    row(label, t, got, "; ".join(filter(None, (
                        "" if t_cudnn is None else f"{t.median_ms / t_cudnn:.2f}x cuDNN's time",
                        paired(cudnn_call, step, sets, a.pairs)))))
                except Exception as e:  # noqa: BLE001
                    print(label, "failed:", type(e).__name__, str(e)[:300], flush=True)
    lines = [
        f"{header()}; B,H,L,D = {a.shape}, bfloat16; fwd+bwd (vjp and pullback)",
    ]
    emit(lines + attention_table(rows), a.out)


if __name__ == "__main__":
    main()
