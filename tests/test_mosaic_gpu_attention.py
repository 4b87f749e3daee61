"""The Mosaic GPU (Hopper: TMA, wgmma, warp specialisation) lowering of the `attention` template, on the CPU.

Numerics run under Mosaic GPU interpret mode (`plgpu.InterpretGPUParams`: it
simulates GMEM/SMEM, the three warpgroups, barriers and TMA, zero-filling
out-of-bounds TMA reads and dropping out-of-bounds TMA writes, and checks that
every warpgroup observes every barrier phase) against `jax.jit` of the same
group. Interpret mode runs P V with P through SMEM (it has no wgmma with an
operand in registers); `jax.export` for CUDA under an abstract H100 runs the
real Mosaic GPU lowering of the register path (layouts, wgmma and TMA rules,
the shared-memory limit) with no GPU, so every case is also exported.
"""
from __future__ import annotations

import re
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

import autofuse
from autofuse.kernels import attention, attention_masks
from autofuse.kernels.mosaic_gpu import attention as mgpu_attention
from autofuse.kernels.mosaic_gpu.tiles import Unsupported
from autofuse.runner.evaluator import export_for_cuda
from autofuse.tuning.partition import enumerate_candidates
from benchmarks.workloads import attention_bhld, attention_bhld_causal, attention_blhd
from tests.attention_programs import (
    bias_blhd,
    causal_iota_minus_1e9,
    causal_then_softcap,
    gqa_broadcast,
    gqa_repeat,
    heads_split_causal,
    library_xla,
    key_lengths_blhd,
    key_lengths_causal_blhd,
    library_xla_causal,
    nan_past_lengths,
    padding_mask,
    sliding_window,
    softcap_then_causal,
)
from tests.kernel_checks import rel_err
from tests.quick import slow_except

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
TOL = {np.dtype(BF16): 2e-2, np.dtype(F16): 4e-3, np.dtype(F32): 1e-4}  # relative error norms (float32: interpret
# mode multiplies exactly where the GPU runs TF32, ~3e-4 as XLA's own float32 dots there)
S = jax.ShapeDtypeStruct


def cross_causal_bottom_right(q, k, v):
    # Lq != Lk, the causal diagonal aligned to the last key (decoding with a cache)
    Lq, Lk = q.shape[2], k.shape[2]
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * 0.125
    s = jnp.where(jnp.arange(Lq)[:, None] + (Lk - Lq) >= jnp.arange(Lk)[None, :], s, -jnp.inf)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s.astype(jnp.float32), axis=-1).astype(v.dtype), v)


def scalar_temperature_f32_out(q, k, v, t):
    # a runtime scalar in the score work, a float32 output (its own SMEM buffer, not Q's)
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k).astype(jnp.float32) * t
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1).astype(v.dtype), v).astype(jnp.float32)


def alibi_causal(q, k, v, slopes):
    # ALiBi: a per-head slope [H] (a scalar per CTA, read at the CTA's head) times the distance from iota, causal
    L = q.shape[2]
    dist = (jnp.arange(L)[None, :] - jnp.arange(L)[:, None]).astype(jnp.float32)
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k).astype(jnp.float32) * 0.125 + slopes[:, None, None] * dist
    s = jnp.where(jnp.tril(jnp.ones((L, L), bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1).astype(v.dtype), v)


def additive_causal(q, k, v):
    # the causal mask as an additive 0 / -inf bias built from iota (skipped where all 0 or all -inf)
    L = q.shape[2]
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k).astype(jnp.float32) * 0.125
    s = s + jnp.where(jnp.tril(jnp.ones((L, L), bool)), 0.0, -jnp.inf)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1).astype(v.dtype), v)


K64 = {"block_kv": 64}  # several key blocks at these small lengths
W3 = {"compute_wgs": 3, "overlap": 1, "schedule_barrier": 0}
L = 100  # ragged against 64 and 128, and not a multiple of 8 (q/k/v/out padded to 104 rows by XLA)
BHLD, BLHD = (2, 2, L, 64), (2, L, 2, 64)
CASES = [
    pytest.param(attention_bhld, [BHLD] * 3, BF16, K64, id="bhld-bf16-ragged"),
    pytest.param(attention_bhld, [BHLD] * 3, F16, None, id="bhld-f16-ragged-default-config"),
    pytest.param(attention_blhd, [BLHD] * 3, BF16, K64, id="blhd-bf16-out-transposed"),
    pytest.param(attention_bhld_causal, [(1, 2, 256, 64)] * 3, BF16, K64, id="causal-tril-bf16"),
    pytest.param(attention_bhld_causal, [(1, 2, 256, 64)] * 3, F16,
                 {"block_q": 128, "block_kv": 64, "max_concurrent_steps": 3}, id="causal-tril-f16-bq128-3-stages"),
    pytest.param(attention_bhld_causal, [(1, 1, 300, 128)] * 3, BF16, None, id="causal-d128-bf16-default-config"),
    pytest.param(attention_bhld, [(1, 1, 300, 128)] * 3, BF16, {"block_kv": 192, "schedule_barrier": 0},
                 id="bhld-d128-bkv192-no-schedule-barrier"),
    # FA3's intra-warpgroup overlap (the default at D128 has it without the schedule barrier): with the barrier's
    # turns, leading and trailing flushes (a band), Lq != Lk, a CTA whose second warpgroup is past the last query
    pytest.param(sliding_window, [(1, 1, 300, 64)] * 3, BF16, {**K64, "overlap": 1}, id="sliding-window-overlap-bf16"),
    pytest.param(cross_causal_bottom_right, [(1, 1, 70, 64), (1, 1, 200, 64), (1, 1, 200, 64)], F16,
                 {**K64, "overlap": 1, "max_concurrent_steps": 3}, id="cross-causal-overlap-3-stages-f16"),
    pytest.param(attention_bhld_causal, [(1, 1, 150, 64)] * 3, BF16, {**K64, "overlap": 1},
                 id="causal-overlap-warpgroup-past-the-end-bf16"),
    pytest.param(attention_bhld_causal, [(1, 1, 256, 64)] * 3, BF16, {**K64, "overlap": 2, "schedule_barrier": 0},
                 id="causal-overlap-rescale-between-the-issues-bf16"),
    # three compute warpgroups (the D64 default): a CTA of 192 queries, the turns round three, a score input's tile per
    # warpgroup
    pytest.param(attention_bhld_causal, [(1, 1, 256, 64)] * 3, BF16, {**K64, **W3}, id="causal-3-warpgroups-overlap-bf16"),
    pytest.param(sliding_window, [(1, 1, 300, 64)] * 3, F16, {**K64, **W3, "schedule_barrier": 1, "max_concurrent_steps": 3},
                 id="sliding-window-3-warpgroups-turns-f16"),
    pytest.param(bias_blhd, [BLHD] * 3 + [(2, L, L)], BF16, {**K64, "compute_wgs": 3, "schedule_barrier": 0},
                 id="bias-3-warpgroups-bf16"),
    pytest.param(causal_iota_minus_1e9, [(1, 2, 200, 64)] * 3, F16, K64, id="causal-iota-finite-fill-f16"),
    pytest.param(bias_blhd, [BLHD] * 3 + [(2, L, L)], BF16, K64, id="bias-blhd-bf16"),
    pytest.param(padding_mask, [BHLD] * 3 + [(2, L)], BF16, K64, id="padding-mask-bf16"),
    pytest.param(gqa_repeat, [(1, L, 4, 64), (1, L, 2, 64), (1, L, 2, 64)], BF16, K64, id="gqa-repeat-bf16"),
    pytest.param(gqa_broadcast, [(1, L, 4, 64), (1, L, 1, 64), (1, L, 1, 64)], F16, K64, id="gqa-broadcast-f16"),
    pytest.param(heads_split_causal, [(1, L, 128)] * 3, BF16, K64, id="heads-split-from-BL(HD)-causal-bf16"),
    pytest.param(softcap_then_causal, [(1, 2, L, 64)] * 3, BF16, K64, id="softcap-then-causal-bf16"),
    pytest.param(causal_then_softcap, [(1, 2, L, 64)] * 3, F16, K64, id="causal-then-softcap-f16"),
    pytest.param(sliding_window, [(1, 2, 300, 64)] * 3, BF16, K64, id="sliding-window-bf16"),
    pytest.param(cross_causal_bottom_right, [(1, 2, 70, 64), (1, 2, 200, 64), (1, 2, 200, 64)], BF16, K64,
                 id="cross-causal-bottom-right-bf16"),
    pytest.param(attention_bhld_causal, [(1, 2, L, 48)] * 3, BF16, K64, id="causal-head-dim-48-bf16"),
    pytest.param(attention_bhld_causal, [(1, 1, 200, 256)] * 3, BF16, None, id="causal-head-dim-256-bf16-default-config"),
    pytest.param(attention_bhld_causal, [(1, 1, 5, 32)] * 3, F16, None, id="causal-L5-d32-f16"),
    pytest.param(alibi_causal, [(2, 4, 200, 64)] * 3 + [(4,)], BF16, K64, id="alibi-slopes-per-head-causal-bf16"),
    pytest.param(additive_causal, [(1, 2, 200, 64)] * 3, F16, K64, id="additive-causal-mask-f16"),
    pytest.param(scalar_temperature_f32_out, [BHLD] * 3 + [()], F16, K64, id="scalar-temperature-f32-out-f16"),
    # float32: TF32 wgmma, P through SMEM, V transposed outside ([.., Dv, Lk], its keys padded to 32)
    pytest.param(attention_bhld, [BHLD] * 3, F32, K64, id="bhld-f32-ragged"),
    pytest.param(attention_blhd, [BLHD] * 3, F32, K64, id="blhd-f32-out-transposed"),
    pytest.param(attention_bhld_causal, [(1, 2, 256, 64)] * 3, F32, None, id="causal-f32-default-config"),
    pytest.param(gqa_repeat, [(1, L, 4, 64), (1, L, 2, 64), (1, L, 2, 64)], F32, K64, id="gqa-repeat-f32"),
    # jax.nn.dot_product_attention's XLA path: a unit grouped-query axis, the output written [B, L, H, D] through transposes
    pytest.param(library_xla_causal, [BLHD] * 3, BF16, K64, id="jax-nn-dot-product-attention-xla-causal-bf16"),
    pytest.param(library_xla, [BLHD] * 3, F32, K64, id="jax-nn-dot-product-attention-xla-f32"),
    pytest.param(attention_bhld, [BHLD] * 3, F32, {**K64, "overlap": 1}, id="bhld-f32-overlap"),  # P through SMEM
    # persistent: 3 CTAs in interpret mode, each walking several (batch, query block) tiles; the K/V ring running on
    # across tiles, Q double-buffered (O through it, or its own buffer), score inputs per tile
    pytest.param(attention_bhld, [(2, 2, 200, 64)] * 3, BF16, {**K64, "persistent": 1}, id="persistent-bhld-ragged-bf16"),
    pytest.param(attention_blhd, [BLHD] * 3, F16, {**K64, **W3, "persistent": 1}, id="persistent-blhd-3-warpgroups-f16"),
    pytest.param(padding_mask, [BHLD] * 3 + [(2, L)], BF16, {**K64, "overlap": 1, "persistent": 1}, id="persistent-padding-mask-overlap-bf16"),
    pytest.param(bias_blhd, [BLHD] * 3 + [(2, L, L)], BF16, {**K64, "persistent": 1}, id="persistent-bias-bf16"),
    pytest.param(gqa_repeat, [(1, L, 4, 64), (1, L, 2, 64), (1, L, 2, 64)], BF16, {**K64, "persistent": 1}, id="persistent-gqa-repeat-bf16"),
    pytest.param(scalar_temperature_f32_out, [BHLD] * 3 + [()], F16, {**K64, "persistent": 1}, id="persistent-scalar-f32-out-f16"),
    pytest.param(attention_bhld, [BHLD] * 3, F32, {**K64, "persistent": 1}, id="persistent-bhld-f32"),
    # persistent with masks known at build time: each tile its own key blocks (the ranges table's), the ring's slots
    # counted on across tiles of unequal length, blocks loaded for the other warpgroup only (a band) flushed per tile
    pytest.param(attention_bhld_causal, [(2, 2, 256, 64)] * 3, BF16, {**K64, "persistent": 1}, id="persistent-causal-bf16"),
    pytest.param(sliding_window, [(1, 2, 300, 64)] * 3, F16, {**K64, "overlap": 1, "schedule_barrier": 1, "persistent": 1},
                 id="persistent-sliding-window-overlap-turns-f16"),
    pytest.param(cross_causal_bottom_right, [(1, 2, 70, 64), (1, 2, 200, 64), (1, 2, 200, 64)], BF16,
                 {**K64, **W3, "persistent": 1}, id="persistent-cross-causal-3-warpgroups-bf16"),
]


def _specs(fn, shapes, dtype):
    def dt(s):
        if fn is padding_mask and len(s) == 2:
            return jnp.bool_
        if (fn is scalar_temperature_f32_out and s == ()) or (fn is alibi_causal and len(s) == 1):
            return F32
        if fn in (key_lengths_blhd, key_lengths_causal_blhd) and len(s) == 1:
            return jnp.int32
        return dtype
    return [S(s, dt(s)) for s in shapes]


def _group(fn, shapes, dtype):
    g = autofuse.capture(fn, *_specs(fn, shapes, dtype))
    cands = [c for c in enumerate_candidates(g) if c.template == "attention"]
    assert cands, "an attention candidate is enumerated"
    c = max(cands, key=lambda c: len(c.nodes))
    return g, c.group, c.spec


def _inputs(group, seed=0):
    keys = jax.random.split(jax.random.key(seed), len(group.inputs))
    out = []
    for k, a in zip(keys, group.input_avals()):
        if a.dtype == jnp.bool_:
            x = jax.random.bernoulli(k, 0.8, a.shape).at[..., 0].set(True)  # every row keeps a key
        else:
            x = jax.random.normal(k, a.shape, jnp.float32).astype(a.dtype)
        out.append(x)
    return out


@pytest.mark.parametrize("fn,shapes,dtype,config", slow_except(CASES, "bhld-f16-ragged-default-config",
                                                                   "persistent-padding-mask-overlap-bf16"))  # float32: the quick
# subset has test_float32_runs_as_tf32_with_the_values_transposed_and_its_backward_on_triton
def test_interpret_matches_xla(fn, shapes, dtype, config):
    g, group, spec = _group(fn, shapes, dtype)
    cfg = config or mgpu_attention.default_config(spec)
    kernel = mgpu_attention.lower(group, spec, cfg, interpret=True)
    xs = _inputs(group)
    (out,) = jax.block_until_ready(kernel(*xs))
    (ref,) = jax.jit(lambda *a: group.evaluate(a))(*xs)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    err = rel_err(out, ref)
    assert err <= TOL[np.dtype(dtype)], (cfg, err)


@pytest.mark.parametrize("fn,shapes,dtype,config", slow_except(CASES, "bhld-f16-ragged-default-config",
                                                                   "persistent-blhd-3-warpgroups-f16"))
def test_lowers_for_cuda(fn, shapes, dtype, config):
    """The real Mosaic GPU lowering (no GPU): wgmma with P in registers, layouts, TMA tiling, shared memory;
    under both lowering semantics (Warpgroup: layouts inferred, as attention_mgpu; Lane: as the RegisterTiles give),
    and the spec's default config (under its own semantics where the case names another config)."""
    g, group, spec = _group(fn, shapes, dtype)
    default = mgpu_attention.default_config(spec)
    for cfg in [{**(config or default), "semantics": sem} for sem in (0, 1)] + ([default] if config else []):
        kernel = mgpu_attention.lower(group, spec, cfg)
        exp = export_for_cuda(kernel, [S(a.shape, a.dtype) for a in group.input_avals()])
        assert "mosaic_gpu" in exp.mlir_module()
        assert [(o.shape, o.dtype) for o in exp.out_avals] == [(a.shape, a.dtype) for a in group.output_avals()]


LSE_CASES = [
    pytest.param(attention_bhld, [BHLD] * 3, BF16, K64, id="bhld-bf16-ragged"),
    pytest.param(attention_bhld_causal, [(1, 2, 256, 64)] * 3, F16, {"block_q": 128, "block_kv": 64}, id="causal-f16-bq128"),
    pytest.param(padding_mask, [BHLD] * 3 + [(2, L)], BF16, K64, id="padding-mask-bf16"),
    pytest.param(gqa_repeat, [(1, L, 4, 64), (1, L, 2, 64), (1, L, 2, 64)], BF16, K64, id="gqa-repeat-bf16"),
    pytest.param(scalar_temperature_f32_out, [BHLD] * 3 + [()], F16, K64, id="scalar-temperature-f16"),
    pytest.param(padding_mask, [BHLD] * 3 + [(2, L)], BF16, {**K64, "overlap": 1}, id="padding-mask-overlap-bf16"),
    pytest.param(attention_bhld_causal, [(1, 2, 256, 64)] * 3, BF16, {**K64, **W3}, id="causal-3-warpgroups-overlap-bf16"),
    pytest.param(attention_bhld, [(2, 2, 200, 64)] * 3, BF16, {**K64, "overlap": 1, "persistent": 1}, id="persistent-overlap-bf16"),
    pytest.param(attention_bhld_causal, [(2, 2, 256, 64)] * 3, BF16, {**K64, "persistent": 1}, id="persistent-causal-bf16"),
]


@pytest.mark.parametrize("fn,shapes,dtype,config", LSE_CASES)
@pytest.mark.slow
def test_logsumexp_matches_the_triton_forwards(fn, shapes, dtype, config):
    """With `emit_lse` (the forward of a flash pair) the kernel also writes each query row's logsumexp, [batch, Lq]
    float32, the residual the Triton backward reads: the same as the Triton forward's, on ragged rows, causal and
    padding masks, GQA and a runtime temperature; the output is unchanged."""
    from autofuse.kernels.triton import attention as triton_attention

    g, group, spec = _group(fn, shapes, dtype)
    xs = _inputs(group)
    out, lse = jax.block_until_ready(mgpu_attention.lower(group, spec, config, interpret=True, emit_lse=True)(*xs))
    (plain,) = mgpu_attention.lower(group, spec, config, interpret=True)(*xs)
    small = {"block_q": 32, "block_k": 32, "num_warps": 4, "num_stages": 2}
    _, want = triton_attention.lower(group, spec, small, interpret=True, emit_lse=True)(*xs)
    assert lse.shape == want.shape == (spec.batch, spec.Lq) and lse.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(plain))


def test_logsumexp_buffer_counts_in_shared_memory_and_lowers_for_cuda():
    """The logsumexp's [2, block_q] float32 buffer is counted (a config at the limit without it is refused with
    it), and the forward with it goes through the real Mosaic GPU lowering at the issue's shape."""
    g, group, spec = _group(attention_bhld_causal, [(8, 32, 2048, 128)] * 3, BF16)
    cfg = mgpu_attention.Config.of(mgpu_attention.default_config(spec))
    assert mgpu_attention.smem_bytes(spec, cfg, emit_lse=True) == mgpu_attention.smem_bytes(spec, cfg) + 1024
    kernel = mgpu_attention.lower(group, spec, mgpu_attention.default_config(spec), emit_lse=True)
    exp = export_for_cuda(kernel, [S(a.shape, a.dtype) for a in group.input_avals()])
    assert "mosaic_gpu" in exp.mlir_module()
    assert [(o.shape, o.dtype) for o in exp.out_avals] == [((8, 32, 2048, 128), BF16), ((256, 2048), jnp.float32)]
    edge = mgpu_attention.Config.of({"block_q": 64, "block_kv": 128, "max_concurrent_steps": 3})  # 104 bytes to spare
    mgpu_attention.check_config(spec, edge)
    with pytest.raises(Unsupported):
        mgpu_attention.check_config(spec, edge, emit_lse=True)


@pytest.mark.parametrize("fn", [attention_bhld, attention_bhld_causal])
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_issue_target_shape_lowers(fn, dtype):
    """B8 H32 L2048 D128 (benchmarks/workloads.py): the default config is attention_mgpu's best and fits."""
    g, group, spec = _group(fn, [(8, 32, 2048, 128)] * 3, dtype)
    cfg = mgpu_attention.default_config(spec)
    assert cfg == {**mgpu_attention.DEFAULTS, "overlap": 1, "schedule_barrier": 0, "persistent": 1}
    assert mgpu_attention.smem_bytes(spec, mgpu_attention.Config.of(cfg)) <= mgpu_attention.SMEM_LIMIT
    exp = export_for_cuda(mgpu_attention.lower(group, spec, cfg), [S(a.shape, a.dtype) for a in group.input_avals()])
    assert [(o.shape, o.dtype) for o in exp.out_avals] == [((8, 32, 2048, 128), np.dtype(dtype))]


def test_causal_ctas_visit_live_key_blocks_only():
    g, group, spec = _group(attention_bhld_causal, [(1, 1, 2048, 128)] * 3, BF16)
    t = mgpu_attention._ranges_table(spec, 64, 128)
    assert t is not None and len(t) == 2048 // 128
    for c, row in enumerate(t):
        # CTA c: queries 128c .. 128c+127; key blocks 0..c, the last one (the diagonal) masked, the others mask-free
        assert list(row) == [0, 0, c, c + 1, 0, 0, c, c + 1, 0, c + 1]
    g, group, spec = _group(attention_bhld, [(1, 1, 2048, 128)] * 3, BF16)
    assert mgpu_attention._ranges_table(spec, 64, 128) is None  # no mask: every block, no mask arithmetic


def key_lengths_inputs(group, spec, lengths: list[int], block: int, seed=0) -> list:
    """Inputs of a key-lengths group (`key_lengths_blhd`): the lengths, q, k and v random, with NaN planted in k and v
    past each row's live key blocks (`nan_past_lengths`) where `block`; and the same with zeros there (the reference)."""
    n = jnp.asarray(lengths, jnp.int32)
    keys = iter(jax.random.split(jax.random.key(seed), 3))
    planted, zeros = [], []
    for v, a in zip(group.inputs, group.input_avals()):
        if a.dtype == jnp.int32:
            planted.append(n), zeros.append(n)
            continue
        x = jax.random.normal(next(keys), a.shape, jnp.float32).astype(a.dtype)
        if v != spec.q.value and block:
            x = nan_past_lengths(x, n, block)
        planted.append(x), zeros.append(jnp.nan_to_num(x, nan=0.0))
    return planted, zeros


@pytest.mark.parametrize("fn,config", slow_except([
    pytest.param(key_lengths_blhd, K64, id="key-lengths"),
    pytest.param(key_lengths_causal_blhd, {**K64, "overlap": 1}, id="key-lengths-causal-overlap"),
    pytest.param(key_lengths_blhd, {**K64, **W3, "persistent": 1}, id="key-lengths-persistent-3-warpgroups"),
], "key-lengths-causal-overlap"))
def test_key_lengths_visit_the_live_key_blocks_only(fn, config):
    """Keys from a row's length on (`jax.nn.dot_product_attention(key_value_seq_lengths=...)`) are masked for every
    query: each CTA reads its row's length and visits the key blocks up to the last live one (NaN planted past them
    stays out of the output), matching XLA; causal joined with the lengths keeps its blocks known at build time. A row
    of length 0 (every key masked) visits every block, where XLA weighs every key alike."""
    g, group, spec = _group(fn, [(4, 256, 2, 64)] * 3 + [(4,)], BF16)
    assert attention_masks.key_bound(spec) is not None
    assert (mgpu_attention._ranges_table(spec, 64, 64) is not None) == (fn is key_lengths_causal_blhd)
    kernel = mgpu_attention.lower(group, spec, config, interpret=True)
    ref = jax.jit(lambda *a: group.evaluate(a))
    planted, zeros = key_lengths_inputs(group, spec, [37, 128, 256, 200], 192 if config.get("compute_wgs") == 3 else 128)
    (out,) = kernel(*planted)
    assert not jnp.isnan(out).any() and rel_err(out, ref(*zeros)[0]) <= TOL[np.dtype(BF16)]
    planted, zeros = key_lengths_inputs(group, spec, [0, 1, 255, 64], 0)
    assert rel_err(kernel(*planted)[0], ref(*zeros)[0]) <= TOL[np.dtype(BF16)]
    exp = export_for_cuda(mgpu_attention.lower(group, spec, config), [S(a.shape, a.dtype) for a in group.input_avals()])
    assert "mosaic_gpu" in exp.mlir_module()


@pytest.mark.parametrize("overlap,persistent", [(0, 0), pytest.param(1, 0, marks=pytest.mark.slow), pytest.param(1, 1, marks=pytest.mark.slow)])
def test_no_races_or_barrier_misuse(overlap, persistent):
    """Interpret mode's happens-before race detector over TMA, SMEM, barriers (a band: leading and trailing flushes);
    with the overlap, P V reads the previous block's V slot while this block's K slot is released; persistent, a
    tile's Q lands in the buffer the tile before stored its O from, the band's tiles of unequal length."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

    g, group, spec = _group(sliding_window, [(1, 2 if persistent else 1, 300, 64)] * 3, BF16)
    kernel = mgpu_attention.lower(group, spec, {**K64, "overlap": overlap, "persistent": persistent},
                                  interpret=plgpu.InterpretGPUParams(detect_races=True))
    jax.block_until_ready(kernel(*_inputs(group)))
    assert not interpret_pallas_call.get_races().races_found


def test_smem_estimate_matches_mosaic(monkeypatch):
    """`smem_bytes` equals the count in Mosaic GPU's error message (buffers in whole KiB, barriers, reduction scratch)."""
    monkeypatch.setattr(mgpu_attention, "SMEM_LIMIT", 1 << 30)  # let the oversized configs through our own check
    for fn, shapes, cfg, dtype in [
        (padding_mask, [(2, 2, 1024, 128)] * 3 + [(2, 1024)], {"block_kv": 128, "max_concurrent_steps": 4}, BF16),
        (bias_blhd, [(1, 1024, 2, 128)] * 3 + [(2, 1024, 1024)], {"block_kv": 256, "max_concurrent_steps": 2}, BF16),
        (attention_bhld, [(1, 2, 1024, 128)] * 3, {"block_kv": 128, "max_concurrent_steps": 2}, F32),  # P's own buffer
        (attention_bhld, [(1, 2, 1024, 128)] * 3, {"block_kv": 256, "max_concurrent_steps": 2, "persistent": 1}, BF16),  # 2 Q buffers
    ]:
        g, group, spec = _group(fn, shapes, dtype)
        est = mgpu_attention.smem_bytes(spec, mgpu_attention.Config.of(cfg))
        assert est > 232448
        with pytest.raises(Exception, match="smem_bytes") as e:
            export_for_cuda(mgpu_attention.lower(group, spec, cfg), [S(a.shape, a.dtype) for a in group.input_avals()])
        assert int(re.search(r"smem_bytes=(\d+)", str(e.value)).group(1)) == est


def bf16_scores_f32_values(q, k, v):
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k).astype(jnp.float32)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v.astype(jnp.float32))


def log1p_bias(q, k, v, b):
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * 0.125 + jnp.log1p(b)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s.astype(jnp.float32), axis=-1).astype(v.dtype), v)


def test_defaults_follow_the_head_dim_and_dtype():
    """16-bit: the overlap without the schedule barrier, and at D64 with enough queries three compute warpgroups,
    persistent where it runs (not with a row-vector input) and a query block walks at most 64 key blocks; float32
    (TF32, P through SMEM): none of them (slower there, results/attention_overlap_h200.md, attention_persistent_h200.md,
    attention_long_h200.md)."""
    cases = [((1, 2, 1024, 128), BF16, {"overlap": 1, "schedule_barrier": 0, "block_q": 64, "compute_wgs": 2, "persistent": 1}),
             ((1, 2, 1024, 64), BF16, {"overlap": 1, "schedule_barrier": 0, "block_q": 64, "compute_wgs": 3, "persistent": 1}),
             ((1, 2, 1024, 64), BF16, {"overlap": 1, "schedule_barrier": 0, "compute_wgs": 3, "persistent": 1}, attention_bhld_causal),
             ((1, 2, 256, 64), F16, {"overlap": 1, "block_q": 64, "compute_wgs": 2, "persistent": 1}),
             ((1, 2, 1024, 128), F32, {"overlap": 0, "schedule_barrier": 1, "compute_wgs": 2, "persistent": 0}),
             ((1, 2, 256, 64), BF16, {"overlap": 1, "persistent": 0}, query_bias),  # a row-vector input: not persistent
             # persistent up to 64 key blocks a query block (8192 keys at 128 a step), not past it
             ((1, 1, 8192, 128), BF16, {"overlap": 1, "block_kv": 128, "persistent": 1}),
             ((1, 1, 8320, 128), BF16, {"overlap": 1, "block_kv": 128, "persistent": 0}),
             ((1, 1, 16384, 64), BF16, {"overlap": 1, "compute_wgs": 3, "persistent": 0})]
    for shape, dtype, want, *fn in cases:
        shapes = [shape] * 3 + ([shape[2:3]] if fn == [query_bias] else [])
        g, group, spec = _group((fn or [attention_bhld])[0], shapes, dtype)
        cfg = mgpu_attention.default_config(spec)
        assert {k: cfg[k] for k in want} == want, (shape, dtype, cfg)
        mgpu_attention.check_config(spec, mgpu_attention.Config.of(cfg))
    # the flash pair's forward is the forward's default (measured in the pair too), with the backward's keys
    from autofuse.kernels.mosaic_gpu import attention_vjp as mgpu_vjp

    g, group, spec = _group(attention_bhld_causal, [(1, 2, 1024, 64)] * 3, BF16)
    pair = mgpu_vjp.default_config(SimpleNamespace(attn=spec))
    assert {k: pair[k] for k in mgpu_attention.PARAMS} == mgpu_attention.default_config(spec)
    assert pair["bwd_mosaic"] == 1


def test_head_dim_64_default_lowers_for_cuda():
    """The D64 default as measured on the GPU (three compute warpgroups, the overlap, 2 steps in flight): the real
    Mosaic GPU lowering, causal and not, and its ranges table packs three blocks per CTA."""
    for fn in (attention_bhld, attention_bhld_causal):
        g, group, spec = _group(fn, [(8, 32, 2048, 64)] * 3, BF16)
        cfg = mgpu_attention.default_config(spec)
        assert cfg["compute_wgs"] == 3 and cfg["max_concurrent_steps"] == 2
        exp = export_for_cuda(mgpu_attention.lower(group, spec, cfg), [S(a.shape, a.dtype) for a in group.input_avals()])
        assert [(o.shape, o.dtype) for o in exp.out_avals] == [((8, 32, 2048, 64), np.dtype(BF16))]
    t = mgpu_attention._ranges_table(spec, 64, 128, one_block=True, n=3)
    assert t.shape == (-(-2048 // 192), 14)
    assert list(t[1]) == [0, 0, 1, 2, 0, 0, 2, 3, 0, 0, 2, 3, 0, 3]  # queries 192..383 in 3 blocks: key blocks up to 1, 2, 2


def test_default_falls_back_where_the_overlap_cannot_have_two_steps(monkeypatch):
    """Where shared memory leaves one step in flight (which the overlap cannot run), the default is the next one the
    lowering takes: attention_mgpu's schedule."""
    from autofuse.kernels.mosaic_gpu import gemm

    g, group, spec = _group(attention_bhld, [(1, 2, 1024, 128)] * 3, BF16)
    limit = 70 * 1024  # Q (32 KiB) and one step of K and V at 64 keys (32 KiB) fit, two steps do not
    monkeypatch.setattr(mgpu_attention, "SMEM_LIMIT", limit)
    monkeypatch.setattr(gemm, "SMEM_LIMIT", limit)
    cfg = mgpu_attention.default_config(spec)
    assert (cfg["overlap"], cfg["max_concurrent_steps"], cfg["block_kv"]) == (0, 1, 64)
    mgpu_attention.check_config(spec, mgpu_attention.Config.of(cfg))


def test_overlap_ranges_give_every_warpgroup_a_block():
    """The overlap peels its first and last steps off the loop, so every warpgroup visits at least one key block: a
    dead block (past the last query, or masked whole) visits its CTA's first one, all of it masked (P and l zero,
    as with none), and a CTA with no live block loads key block 0 for it; without the overlap they stay empty."""
    r = np.array([[0, 0, 1, 2], [0, 0, 0, 0], [3, 3, 3, 3]], np.int32)  # block 1 dead (empty), block 2 dead too
    plain, one = mgpu_attention.per_cta(r), mgpu_attention.per_cta(r, one_block=True)
    assert list(plain[0]) == [0, 0, 1, 2, 0, 0, 0, 0, 0, 2] and list(plain[1]) == [0] * 10
    assert list(one[0]) == [0, 0, 1, 2, 0, 0, 0, 1, 0, 2]
    assert list(one[1]) == [0, 0, 0, 1, 0, 0, 0, 1, 0, 1]  # block 2 and the missing block 3: key block 0, masked


def test_declines_what_it_does_not_support():
    assert issubclass(Unsupported, NotImplementedError)  # what the tuner counts as an infeasible config
    for fn, shapes, dtype, what in [
        (bf16_scores_f32_values, [(1, 2, 64, 64)] * 3, BF16, "dot dtypes"),
        (attention_bhld, [(1, 2, 64, 40)] * 3, BF16, "head dim"),
        (log1p_bias, [(1, 2, 64, 64)] * 3 + [(64, 64)], BF16, "log1p"),
    ]:
        g, group, spec = _group(fn, shapes, dtype)
        with pytest.raises(Unsupported, match=what):
            mgpu_attention.lower(group, spec, {})
        with pytest.raises(Unsupported, match=what):
            mgpu_attention.check_group(spec)

    g, group, spec = _group(attention_bhld, [(1, 2, 1024, 128)] * 3, BF16)
    for bad, why in [({"block_q": 96}, "block_q"), ({"block_kv": 96}, "block_kv"), ({"block_kv": 512}, "block_kv"),
                     ({"block_kv": 256, "max_concurrent_steps": 2}, "shared memory"),
                     ({"block_kv": 128, "max_concurrent_steps": 4}, "shared memory")]:
        with pytest.raises(Unsupported, match=why):
            mgpu_attention.lower(group, spec, bad)
        with pytest.raises(Unsupported, match=why):
            mgpu_attention.check_config(spec, mgpu_attention.Config.of(bad))
    for bad in ({"compute_wgs": 4}, {"compute_wgs": 3, "block_q": 128, "overlap": 1},
                {"compute_wgs": 3, "overlap": 0, "schedule_barrier": 1}):
        with pytest.raises(Unsupported, match="compute_wgs|3 compute warpgroups"):
            mgpu_attention.check_config(spec, mgpu_attention.Config.of(bad))
    with pytest.raises(Unsupported, match="overlap"):  # its step needs the next K beside the previous V in the ring
        mgpu_attention.check_config(spec, mgpu_attention.Config.of({"overlap": 1, "max_concurrent_steps": 1}))
    for overlap in (1, 2):  # 256 keys a step: the GPU compile failed at 160 registers a thread (H200), 192 compiled and ran
        with pytest.raises(Unsupported, match="do not fit 160 registers a thread"):
            mgpu_attention.check_config(spec, mgpu_attention.Config.of({"compute_wgs": 3, "overlap": overlap, "block_kv": 256}))
    g1, group1, spec1 = _group(attention_bhld, [(1, 2, 100, 64)] * 3, BF16)  # one key block: one step in flight is enough
    mgpu_attention.check_config(spec1, mgpu_attention.Config.of({"overlap": 1, "max_concurrent_steps": 1}))
    mgpu_attention.check_config(spec, mgpu_attention.Config.of({"block_kv": 192, "max_concurrent_steps": 2}))  # 226 KiB: fits
    mgpu_attention.check_config(spec, mgpu_attention.Config.of({"block_kv": 128, "max_concurrent_steps": 3}))
    with pytest.raises(Unsupported, match="shared memory"):  # persistent: a second Q buffer
        mgpu_attention.check_config(spec, mgpu_attention.Config.of({"block_kv": 192, "max_concurrent_steps": 2, "persistent": 1}))
    # persistent: no row-vector score input (loaded with Q, which is double-buffered; they are not)
    g, group, spec = _group(query_bias, [(1, 2, 256, 64)] * 3 + [(256,)], BF16)
    mgpu_attention.check_config(spec, mgpu_attention.Config.of({}))
    with pytest.raises(Unsupported, match="row-vector"):
        mgpu_attention.check_config(spec, mgpu_attention.Config.of({"persistent": 1}))


def query_bias(q, k, v, b):
    # a bias per query row (a row vector of the score tile, loaded with Q)
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * 0.125 + b[:, None].astype(q.dtype)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s.astype(jnp.float32), axis=-1).astype(v.dtype), v)


def test_template_builds_it_as_the_mosaic_gpu_backend():
    """The module is what `Template.build(backend="mosaic_gpu")` imports: lower(group, spec, config, *, interpret)."""
    assert "mosaic_gpu" in attention.TEMPLATE.backends
    g, group, spec = _group(attention_bhld_causal, [(1, 2, L, 64)] * 3, BF16)
    kernel = attention.TEMPLATE.build(group, K64, backend="mosaic_gpu", interpret=True, spec=spec)
    xs = _inputs(group)
    assert rel_err(kernel(*xs)[0], jax.jit(lambda *a: group.evaluate(a))(*xs)[0]) <= TOL[np.dtype(BF16)]
    space = attention.TEMPLATE.space_of(group, spec, "mosaic_gpu")  # its choices: search_spaces/attention.mosaic_gpu.toml
    assert set(mgpu_attention.PARAMS) == set(space["params"]) == set(mgpu_attention.DEFAULTS)
    assert all(mgpu_attention.DEFAULTS[k] in space["params"][k] for k in mgpu_attention.PARAMS)
    assert attention.TEMPLATE.unsupported(spec, "mosaic_gpu", space["default"]) is None


def _lowered_kernel_text(monkeypatch, tmp_path, fn, shapes, dtype, config) -> tuple[str, object]:
    """The kernel in the Mosaic GPU dialect after layout inference (Warpgroup semantics), as Mosaic GPU dumps it
    (MOSAIC_GPU_DUMP_MLIR_PASSES: read per module), with the group's spec."""
    g, group, spec = _group(fn, shapes, dtype)
    monkeypatch.setenv("MOSAIC_GPU_DUMP_MLIR_PASSES", "1")
    monkeypatch.setenv("MOSAIC_GPU_DUMP_TO", str(tmp_path))
    kernel = mgpu_attention.lower(group, spec, {**config, "semantics": 1})
    export_for_cuda(kernel, [S(a.shape, a.dtype) for a in group.input_avals()])
    (path,) = tmp_path.glob("autofuse_attention_mgpu_*.after_layout_inference.txt")
    return path.read_text(), spec


def _loops(text: str) -> list[list[str]]:
    """The bodies of the loops that carry values (the compute warpgroups' key-block loops), in order."""
    lines, out = text.split("\n"), []
    for i, line in enumerate(lines):
        if "scf.for" in line and "iter_args" in line:
            ind, body = len(line) - len(line.lstrip()), []
            for m in lines[i + 1:]:
                if m.strip().startswith("}") and len(m) - len(m.lstrip()) == ind:
                    break
                body.append(m)
            out.append(body)
    return out


def _tile_ops(body: list[str], op: str, tile: str) -> int:
    """How many `op`s of the loop body produce a [block_q, block_kv] / [block_q, Dv] tile (`tile`: e.g. '64x128xf32')."""
    return sum(1 for line in body if re.search(rf"\b{re.escape(op)}\b", line) and f"vector<{tile}>" in line.split(" : ")[-1])


def test_query_ctas_are_the_fastest_launch_axis(monkeypatch, tmp_path):
    """CTAs are issued blockIdx.x first: the query CTAs of one head must be x so that the CTAs resident at once share
    a few heads' K/V in L2 (batch along x read every head's K/V from DRAM once per query CTA: 4 GiB at B8 H32 L2048
    D128, 2.8 TB/s at the measured 1.545 ms)."""
    text, spec = _lowered_kernel_text(monkeypatch, tmp_path, attention_bhld, [(1, 3, 512, 64)] * 3, BF16, {})
    m = re.search(r"gpu\.launch .*?blocks\(.*?\) in \(%\w+ = (%\w+), %\w+ = (%\w+), %\w+ = (%\w+)\)", text)
    assert m, "a gpu.launch in the dump"

    def const(name):
        return int(re.search(rf"{re.escape(name)} = arith\.constant (\d+) : index", text).group(1))

    assert [const(n) for n in m.groups()] == [512 // (2 * 64), 3, 1]  # x: query CTAs, y: batch (B * H)


@pytest.mark.slow
def test_inner_loop_matches_attention_mgpu(monkeypatch, tmp_path):
    """The key-block loop, op for op on tiles, as attention_mgpu's: two wgmma (P from registers: no SMEM store),
    one exp2 per score with the scale and log2(e) folded into one multiply (+ the max's subtraction: one FMA),
    no select / compare per score where nothing is masked, no layout conversion; the causal diagonal's loop adds
    one compare and one select per score."""
    text, spec = _lowered_kernel_text(monkeypatch, tmp_path, attention_bhld, [(1, 1, 512, 128)] * 3, BF16, {})
    (body,) = _loops(text)
    s = acc = "64x128xf32"  # block_q 64 x block_kv 128; block_q 64 x Dv 128
    assert sum("mosaic_gpu.wgmma" in line for line in body) == 2
    assert _tile_ops(body, "math.exp2", s) == 1 and _tile_ops(body, "math.exp", s) == 0
    assert _tile_ops(body, "arith.mulf", s) == 2  # the scores times scale * log2(e), the accumulator times alpha
    assert _tile_ops(body, "arith.select", s) == 0 and _tile_ops(body, "arith.cmpf", "64x128xi1") == 0
    assert _tile_ops(body, "arith.divf", s) == 0 and _tile_ops(body, "arith.addf", acc) == 0
    assert not any(op in line for line in body for op in ("layout_cast", "vector_store", "vector_load", "extf"))
    assert sum("vector.multi_reduction" in line for line in body) == 2  # the row max, the row sum

    (tmp_path / "causal").mkdir()
    text, spec = _lowered_kernel_text(monkeypatch, tmp_path / "causal", attention_bhld_causal, [(1, 1, 512, 128)] * 3,
                                      BF16, {})
    masked0, full, masked1 = _loops(text)
    for body, n in ((masked0, 1), (full, 0), (masked1, 1)):
        assert sum("mosaic_gpu.wgmma" in line for line in body) == 2
        assert _tile_ops(body, "math.exp2", s) == 1
        assert _tile_ops(body, "arith.select", s) == n
        assert not any(op in line for line in body for op in ("vector_store", "vector_load"))


def test_float32_runs_as_tf32_with_the_values_transposed_and_its_backward_on_triton(monkeypatch):
    """A float32 attention (both dots at default precision: TF32, as XLA's own) on wgmma: the issue's shape fits at
    the default config (block_kv shrunk to 64: P has its own SMEM buffer, counted) and goes through the real
    lowering; V reaches the kernel [.., Dv, Lk] (TF32 wgmma reads its operands K-major); the flash pair's
    forward gives the Triton forward's logsumexp, and its backward stays on Triton (the Mosaic GPU one declines)."""
    from autofuse.kernels.mosaic_gpu import attention_vjp as mgpu_vjp
    from autofuse.kernels.triton import attention as triton_attention

    g, group, spec = _group(attention_bhld, [(8, 32, 2048, 128)] * 3, F32)
    assert mgpu_attention.tf32(spec)
    cfg = mgpu_attention.default_config(spec)
    assert cfg["block_kv"] == 64 and mgpu_attention.smem_bytes(spec, mgpu_attention.Config.of(cfg)) <= mgpu_attention.SMEM_LIMIT
    exp = export_for_cuda(mgpu_attention.lower(group, spec, cfg), [S(a.shape, a.dtype) for a in group.input_avals()])
    assert [(o.shape, o.dtype) for o in exp.out_avals] == [((8, 32, 2048, 128), np.dtype(F32))]
    v = mgpu_attention._operand_view(g, spec.v, seq_minor=True)
    assert v.shape == (8, 32, 128, 2048) and (v.operand.d_axis, v.operand.seq_axis) == (2, 3)

    g, group, spec = _group(attention_bhld_causal, [(1, 2, 200, 64)] * 3, F32)
    xs = _inputs(group)
    out, lse = jax.block_until_ready(mgpu_attention.lower(group, spec, K64, interpret=True, emit_lse=True)(*xs))
    _, want = triton_attention.lower(group, spec, {"block_q": 32, "block_k": 32, "num_warps": 4, "num_stages": 2}, interpret=True,
                                     emit_lse=True)(*xs)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert rel_err(out, jax.jit(lambda *a: group.evaluate(a))(*xs)[0]) <= TOL[np.dtype(F32)]
    assert not mgpu_vjp.backward_runs(spec, {"bwd_mosaic": 1, "bwd_held": 64, "bwd_step": 64, "bwd_warps": 4, "bwd_stages": 2})
    with_p = mgpu_attention.smem_bytes(spec, mgpu_attention.Config.of(K64))
    monkeypatch.setattr(mgpu_attention, "tf32", lambda spec: False)
    assert with_p - mgpu_attention.smem_bytes(spec, mgpu_attention.Config.of(K64)) == 2 * 64 * 64 * 4  # P: [2, block_q, block_kv] f32


def test_the_kernel_probes_float32_attention_workloads_run_on_mosaic_gpu():
    """`python -m benchmarks kernels mosaic --only attention-` times the float32 attention (causal too) on Mosaic GPU
    at its default config and the listed ones that fit, where before it printed "declined"."""
    from benchmarks import mosaic_probe as probe

    for name in ("attention-f32-B8H32L2048D128", "attention-causal-f32-B8H32L2048D128"):
        fn, shapes = probe.WORKLOADS[name]
        _, cand = probe._group(fn, probe.arg_specs(name, shapes, probe.DTYPES[name]))
        default = attention.TEMPLATE.default_config_of(cand.spec, "mosaic_gpu")
        runs = [cfg for cfg in probe.MOSAIC["attention"] if attention.TEMPLATE.unsupported(cand.spec, "mosaic_gpu", {**default, **cfg}) is None]
        assert {} in runs and {"schedule_barrier": 0} in runs, (name, runs)
