"""The Mosaic GPU lowering of attention's backward (`mosaic_gpu/attention_bwd.py`), on the CPU.

Numerics run under Mosaic GPU interpret mode (P and dS through SMEM, as interpret mode has no wgmma with an operand
in registers) against the Triton backward in interpret mode, from the same forward output and logsumexp: ragged
lengths, causal and sliding-window masks (blocks skipped, the transposed dK/dV tile's masks from iota), soft-capping
(its derivative by jax.vjp of the group's own equations), GQA and heads split out of [B, L, H*D], score work reading
other inputs (padding masks, lengths, slopes, a fixed bias) and key lengths bounding the blocks, each as two kernels
or with dQ fused into the dK/dV kernel (`F`: its rows or columns split between the warpgroups; interpret mode reads,
adds and writes where the GPU reduces by TMA). `jax.export` for CUDA under an abstract H100 runs the real Mosaic GPU
lowering of the register path (and the products issued in pairs, `O`) with no GPU.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import autofuse
from autofuse.kernels.mosaic_gpu import attention as mgpu_forward
from autofuse.kernels.mosaic_gpu import attention_bwd as mgpu_backward
from autofuse.kernels.mosaic_gpu.tiles import Unsupported
from autofuse.kernels.triton import attention_bwd as triton_backward
from autofuse.runner.evaluator import export_for_cuda
from autofuse.tuning.partition import enumerate_candidates
from benchmarks.workloads import attention_bhld, attention_bhld_causal
from tests.attention_programs import (alibi_causal, bias_blhd, gqa_repeat, heads_split_causal, key_lengths_blhd,
                                     key_lengths_causal_blhd, library_xla_lengths, padding_mask, query_temperature,
                                     sliding_window, softcap_then_causal)
from tests.test_mosaic_gpu_attention import key_lengths_inputs
from tests.kernel_checks import rel_err
from tests.quick import slow_except

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
S = jax.ShapeDtypeStruct
L = 100  # ragged against 64 and 128, not a multiple of 8
F = {"bwd_fused": 1}
O = {"bwd_overlap": 1}
P = {"bwd_persistent": 1}
CASES = [
    pytest.param(attention_bhld, [(2, 2, L, 64)] * 3, BF16, 64, {}, id="bhld-bf16-ragged"),
    pytest.param(attention_bhld, [(1, 2, L, 64)] * 3, BF16, 128, {}, id="bhld-bf16-ragged-step128"),
    pytest.param(attention_bhld_causal, [(1, 2, 256, 64)] * 3, F16, 64, {}, id="causal-f16"),
    pytest.param(attention_bhld_causal, [(1, 1, 300, 128)] * 3, BF16, 128, {}, id="causal-d128-ragged-step128"),
    pytest.param(sliding_window, [(1, 2, 300, 64)] * 3, BF16, 64, {}, id="sliding-window-bf16"),
    pytest.param(softcap_then_causal, [(1, 2, L, 64)] * 3, BF16, 64, {}, id="softcap-then-causal-bf16"),
    pytest.param(gqa_repeat, [(1, L, 4, 64), (1, L, 2, 64), (1, L, 2, 64)], BF16, 64, {}, id="gqa-repeat-bf16"),
    pytest.param(heads_split_causal, [(1, L, 128)] * 3, BF16, 64, {}, id="heads-split-causal-bf16"),
    # dQ fused: split by rows (128 stepped queries) or by columns (head dim 128); the masked blocks a warpgroup
    # would skip are taken by both (their dS meet in dQ), masked
    pytest.param(attention_bhld, [(2, 2, L, 64)] * 3, BF16, 128, F, id="fused-rows-ragged"),
    pytest.param(attention_bhld_causal, [(1, 1, 200, 128)] * 3, BF16, 64, F, id="fused-cols-causal-d128-ragged"),
    pytest.param(sliding_window, [(1, 2, 300, 64)] * 3, BF16, 128, F, id="fused-rows-sliding-window"),
    pytest.param(gqa_repeat, [(1, L, 4, 64), (1, L, 2, 64), (1, L, 2, 64)], BF16, 128, F, id="fused-rows-gqa"),
    # persistent dK/dV: 3 CTAs in interpret mode walking several (batch position, key block) tiles, the ring's slots
    # counted on across tiles (of unequal length where masked), K and V reloaded once the tile before's dK/dV are read
    pytest.param(attention_bhld, [(2, 1, 130, 64)] * 3, BF16, 64, P, id="persistent-bhld-ragged"),
    pytest.param(attention_bhld_causal, [(2, 1, 256, 64)] * 3, BF16, 128, {**F, **P}, id="persistent-fused-rows-causal"),
    pytest.param(sliding_window, [(1, 2, 200, 128)] * 3, F16, 64, {**F, **P}, id="persistent-fused-cols-sliding-window"),
    # score work reading other inputs: a key padding mask (bool, widened to int32 for 128-byte copies), per-batch
    # lengths of queries and keys (scalars per CTA), a slope per head (a scalar), a float32 vector along the queries;
    # vectors along the keys streamed in dq and held in dK/dV, along the queries the other way round
    pytest.param(padding_mask, [(2, 2, L, 64)] * 3 + [S((2, L), jnp.bool_)], BF16, 64, {}, id="padding-mask"),
    pytest.param(padding_mask, [(2, 2, L, 64)] * 3 + [S((2, L), jnp.bool_)], BF16, 128, F, id="fused-rows-padding-mask"),
    pytest.param(library_xla_lengths, [(2, L, 2, 128)] * 3 + [S((2,), jnp.int32)] * 2, BF16, 64, F,
                 id="fused-cols-query-and-key-lengths"),
    pytest.param(alibi_causal, [(1, 2, 200, 64)] * 3 + [S((2,), F32)], BF16, 64, {}, id="alibi-causal"),
    pytest.param(query_temperature, [(2, 1, L, 64)] * 3 + [S((2, L), F32)], BF16, 64, {}, id="query-vector"),
    pytest.param(query_temperature, [(2, 1, L, 64)] * 3 + [S((2, L), F32)], BF16, 128, F, id="fused-rows-query-vector"),
    # a [queries, keys] input (a bias [H, Lq, Lk]): a tile of it per step, in dK/dV from a keys-first copy (two
    # kernels: with dQ fused the tiles do not fit beside its buffers)
    pytest.param(bias_blhd, [(1, L, 2, 64)] * 3 + [S((2, L, L), F32)], BF16, 64, {}, id="bias-two-kernels"),
    pytest.param(bias_blhd, [(1, L, 2, 64)] * 3 + [S((2, L, L), BF16)], BF16, 128, {}, id="bias-bf16-step128"),
]


def _group(fn, shapes, dtype):
    g = autofuse.capture(fn, *[s if isinstance(s, S) else S(s, dtype) for s in shapes])
    c = max((c for c in enumerate_candidates(g) if c.template == "attention"), key=lambda c: len(c.nodes))
    return c.group, c.spec


def _input(key, aval, length: int):
    """A random input: masks mostly True, lengths in [1, length], floats normal."""
    if aval.dtype == jnp.bool_:
        return jax.random.bernoulli(key, 0.8, aval.shape)
    if jnp.issubdtype(aval.dtype, jnp.integer):
        return jax.random.randint(key, aval.shape, 1, length + 1, aval.dtype)
    return jax.random.normal(key, aval.shape, jnp.float32).astype(aval.dtype)


def _residuals(group, spec, seed=0):
    keys = jax.random.split(jax.random.key(seed), len(group.inputs) + 1)
    xs = [_input(k, a, spec.Lk) for k, a in zip(keys, group.input_avals())]
    out, lse = mgpu_forward.lower(group, spec, {"block_kv": 64}, interpret=True, emit_lse=True)(*xs)
    dout = jax.random.normal(keys[-1], out.shape, jnp.float32).astype(out.dtype)
    return xs, out, lse, dout


@pytest.mark.parametrize("fn,shapes,dtype,step,extra", slow_except(CASES, "fused-cols-causal-d128-ragged",
                                                                   "fused-rows-padding-mask"))
def test_interpret_matches_the_triton_backward(fn, shapes, dtype, step, extra):
    group, spec = _group(fn, shapes, dtype)
    xs, out, lse, dout = _residuals(group, spec)
    cfg = {"bwd_held": 64, "bwd_step": step, "bwd_stages": 2, **extra}
    got = mgpu_backward.lower(group, spec, cfg, interpret=True)(xs, out, lse, dout)
    small = {"bwd_held": 32, "bwd_step": 32, "bwd_warps": 4, "bwd_stages": 2}
    want = triton_backward.lower(group, spec, small, interpret=True)(xs, out, lse, dout)
    for name, a, b in zip("qkv", got, want):
        assert a.shape == b.shape and a.dtype == spec.dot_dtype1, (name, a.shape, b.shape, a.dtype)
        assert rel_err(a.astype(F32), b) <= 1e-2, (name, rel_err(a.astype(F32), b))


EXPORTED = CASES[:4] + [CASES[6]] + [
    pytest.param(attention_bhld, [(2, 2, L, 64)] * 3, BF16, 64, O, id="overlap-bhld-ragged"),
    pytest.param(attention_bhld, [(2, 2, L, 64)] * 3, BF16, 128, {**F, **O}, id="fused-rows-overlap-ragged"),
    pytest.param(attention_bhld_causal, [(1, 1, 300, 128)] * 3, BF16, 64, F, id="fused-cols-causal-d128-ragged"),
    pytest.param(attention_bhld_causal, [(1, 1, 300, 128)] * 3, BF16, 64, {**F, **O}, id="fused-cols-overlap-causal-d128"),
    pytest.param(attention_bhld_causal, [(8, 32, 2048, 128)] * 3, BF16, 64, {**F, **P}, id="persistent-fused-cols-causal-target"),
    pytest.param(attention_bhld, [(2, 2, 200, 64)] * 3, BF16, 64, P, id="persistent-two-kernels"),
    *[c for c in CASES if c.id in ("padding-mask", "fused-rows-padding-mask", "fused-cols-query-and-key-lengths",
                                   "alibi-causal", "fused-rows-query-vector", "bias-two-kernels", "bias-bf16-step128")],
]


@pytest.mark.parametrize("fn,shapes,dtype,step,extra", slow_except(EXPORTED, "fused-cols-causal-d128-ragged",
                                                                   "persistent-fused-cols-causal-target",
                                                                   "fused-cols-query-and-key-lengths"))
def test_lowers_for_cuda(fn, shapes, dtype, step, extra):
    """The real Mosaic GPU lowering (no GPU): wgmma with Pᵀ and dS from registers, the transposed tile's layouts, the
    fused dQ's transposed dSᵀ operand, its split of K and its TMA reduction (one kernel)."""
    group, spec = _group(fn, shapes, dtype)
    bwd = mgpu_backward.lower(group, spec, {"bwd_held": 64, "bwd_step": step, "bwd_stages": 2, **extra})
    n = len(group.inputs)
    out = group.output_avals()[0]

    def f(*a):
        return bwd(list(a[:n]), a[n], a[n + 1], a[n + 2])

    specs = [S(a.shape, a.dtype) for a in group.input_avals()] + [S(out.shape, out.dtype), S((spec.batch, spec.Lq), F32),
                                                                    S(out.shape, out.dtype)]
    exp = export_for_cuda(f, specs)
    assert exp.mlir_module().count("custom_call @mosaic_gpu_v2") == (1 if extra.get("bwd_fused") else 2)
    assert [o.shape for o in exp.out_avals] == [(spec.batch, spec.Lq, spec.D), (spec.batch, spec.Lk, spec.D), (spec.batch, spec.Lk, spec.Dv)]


@pytest.mark.parametrize("fn,step,extra", slow_except([
    pytest.param(key_lengths_blhd, 64, {}, id="key-lengths-two-kernels"),
    pytest.param(key_lengths_causal_blhd, 128, F, id="key-lengths-causal-fused-rows"),
    pytest.param(key_lengths_blhd, 64, P, id="key-lengths-persistent"),
], "key-lengths-causal-fused-rows"))
def test_key_lengths_visit_the_live_key_blocks_only(fn, step, extra):
    """With key lengths, `dq` stops at a row's last live key block and a `dkdv` CTA whose keys are all past it loads
    no query (its dK, dV zero): NaN planted past the live blocks stays out of the gradients, which match the Triton
    backward's on zeros there; where no key is live, every block is visited, as the forward does."""
    group, spec = _group(fn, [(4, 256, 2, 64)] * 3 + [S((4,), jnp.int32)], BF16)
    bwd = mgpu_backward.lower(group, spec, {"bwd_held": 64, "bwd_step": step, "bwd_stages": 2, **extra}, interpret=True)
    small = {"bwd_held": 32, "bwd_step": 32, "bwd_warps": 4, "bwd_stages": 2}
    for lengths, block in (([37, 128, 256, 200], 128), ([0, 1, 255, 64], 0)):
        planted, zeros = key_lengths_inputs(group, spec, lengths, block)
        out, lse = mgpu_forward.lower(group, spec, {"block_kv": 64}, interpret=True, emit_lse=True)(*zeros)
        dout = jax.random.normal(jax.random.key(1), out.shape, jnp.float32).astype(out.dtype)
        got = bwd(planted, out, lse, dout)
        want = triton_backward.lower(group, spec, small, interpret=True)(zeros, out, lse, dout)
        for name, a, b in zip("qkv", got, want):
            assert not jnp.isnan(a).any() and rel_err(a.astype(F32), b) <= 1e-2, (lengths, name, rel_err(a.astype(F32), b))
    exp = export_for_cuda(lambda *a: mgpu_backward.lower(group, spec, {"bwd_held": 64, "bwd_step": step, "bwd_stages": 2, **extra})(
        list(a[:4]), a[4], a[5], a[6]), [S(a.shape, a.dtype) for a in group.input_avals()]
        + [S(out.shape, out.dtype), S(lse.shape, F32), S(out.shape, out.dtype)])
    assert "mosaic_gpu" in exp.mlir_module()


def test_issue_target_shape_lowers_and_fits():
    group, spec = _group(attention_bhld_causal, [(8, 32, 2048, 128)] * 3, BF16)
    for step, stages in ((64, 2), (128, 2), (64, 3)):
        mgpu_backward.check_config(spec, mgpu_backward.Config(64, step, stages))
    with pytest.raises(Unsupported, match="shared memory"):
        mgpu_backward.check_config(spec, mgpu_backward.Config(64, 128, 4))


def test_declines_what_it_does_not_support():
    """Float32 attention stays with the Triton backward (a padding mask, a vector, does not); tiles other than 64 held
    rows and 64 or 128 stepped ones are refused."""
    cases = [(attention_bhld, [(1, 2, 64, 64)] * 3, F32, "float32 attention")]
    for fn, shapes, dtype, why in cases:
        g = autofuse.capture(fn, *[S(s, dtype) for s in shapes])
        spec = max((c for c in enumerate_candidates(g) if c.template == "attention"), key=lambda c: len(c.nodes)).spec
        with pytest.raises(Unsupported, match=why):
            mgpu_backward.check_group(spec)
    _, spec = _group(padding_mask, [(2, 2, 64, 64)] * 3 + [S((2, 64), jnp.bool_)], BF16)
    mgpu_backward.check_group(spec)
    _, spec = _group(attention_bhld, [(1, 2, 64, 64)] * 3, BF16)
    for cfg in (mgpu_backward.Config(32, 64, 2), mgpu_backward.Config(64, 32, 2), mgpu_backward.Config(64, 64, 1)):
        with pytest.raises(Unsupported):
            mgpu_backward.check_config(spec, cfg)
    with pytest.raises(Unsupported, match="bwd_fused with bwd_step=64 at head dim 64"):  # 32 columns: half a swizzle tile
        mgpu_backward.check_config(spec, mgpu_backward.Config(64, 64, 2, fused=True))
    mgpu_backward.check_config(spec, mgpu_backward.Config(64, 128, 2, fused=True))


def test_fused_dq_split_and_shared_memory():
    """The fused kernel's dQ split, and its shared memory: dSᵀ of both warpgroups twice and the float32 shares of dQ
    on top of the dK/dV kernel's."""
    _, d128 = _group(attention_bhld_causal, [(8, 32, 2048, 128)] * 3, BF16)
    _, d64 = _group(attention_bhld, [(8, 32, 2048, 64)] * 3, BF16)
    assert mgpu_backward.dq_split(d128, mgpu_backward.Config(64, 64, 2, fused=True)) == "cols"
    assert mgpu_backward.dq_split(d64, mgpu_backward.Config(64, 128, 2, fused=True)) == "rows"
    two = mgpu_backward.smem_bytes(d128, mgpu_backward.Config(64, 64, 2))[1]
    one = mgpu_backward.smem_bytes(d128, mgpu_backward.Config(64, 64, 2, fused=True))[1]
    assert one - two == 2 * 128 * 64 * 2 + 64 * 128 * 4 + 16  # dSᵀ [2 buffers, 128 keys, 64 queries]; 2 x [64, 64] f32; 2 barriers


def test_causal_key_blocks_split_into_masked_and_mask_free_query_blocks():
    """dK/dV's loop bounds per key block: the query blocks it is live in, and the run of those with no position
    masked (the masks are not evaluated there); `test_interpret_matches_the_triton_backward` runs both kinds."""
    from autofuse.kernels.attention_masks import key_block_ranges

    _, spec = _group(attention_bhld_causal, [(1, 2, 256, 64)] * 3, BF16)
    assert key_block_ranges(spec, 64, 64).tolist() == [[0, 1, 4, 4], [1, 2, 4, 4], [2, 3, 4, 4], [3, 3, 3, 4]]
    table = mgpu_backward._key_ranges(spec, 64, 64)  # per CTA of two key blocks: both blocks' ranges, the CTA's
    assert table.tolist() == [[0, 1, 4, 4, 1, 2, 4, 4, 0, 4], [2, 3, 4, 4, 3, 3, 3, 4, 2, 4]]
    _, spec = _group(attention_bhld, [(1, 2, 256, 64)] * 3, BF16)
    assert key_block_ranges(spec, 64, 64) is None and mgpu_backward._key_ranges(spec, 64, 64) is None


def test_default_backward_fuses_dq_where_it_can_split_it():
    """The flash pair's default backward (measured: results/attention_bwd_fused_h200.md): dQ fused, 64 queries a step
    at head dim 128 and 128 at 64; the two kernels where the split does not fit (64-wide heads at 64 queries or
    fewer); none for float32 (the Triton backward)."""
    from autofuse.kernels.mosaic_gpu.attention_vjp import mosaic_backward_default

    def pick(fn, shape, dtype=BF16):
        cfg = mosaic_backward_default(_group(fn, [shape] * 3, dtype)[1])
        return cfg and (cfg["bwd_step"], cfg["bwd_fused"])

    assert pick(attention_bhld_causal, (8, 32, 2048, 128)) == (64, 1)
    assert pick(attention_bhld, (8, 32, 2048, 64)) == (128, 1)
    assert pick(attention_bhld, (1, 2, 64, 64)) == (64, 0)
    assert pick(attention_bhld, (1, 2, 64, 64), F32) is None


def test_a_config_naming_some_backward_keys_keeps_the_default_backward_for_the_rest():
    """`{"bwd_overlap": 1}` over a forward config is the default backward (dQ fused) with its products in pairs, not
    the named keys' own defaults (the two kernels); keys that cannot run over the default are taken as named; a group
    the Mosaic GPU backward declines gets Triton's (`bwd_mosaic` 0)."""
    from autofuse.kernels.mosaic_gpu.attention_vjp import backward_config, mosaic_backward_default as mosaic_default

    _, d128 = _group(attention_bhld, [(8, 32, 2048, 128)] * 3, BF16)
    fwd = mgpu_forward.default_config(d128)
    assert {k: v for k, v in backward_config(d128, fwd).items() if k.startswith("bwd_")} == mosaic_default(d128)
    cfg = backward_config(d128, {**fwd, "bwd_overlap": 1})
    assert (cfg["bwd_mosaic"], cfg["bwd_fused"], cfg["bwd_step"], cfg["bwd_overlap"]) == (1, 1, 64, 1)
    # fused at 3 stages does not fit D128's shared memory: the two kernels at 3 stages, as named
    two = backward_config(d128, {**fwd, "bwd_stages": 3})
    assert (two["bwd_mosaic"], two.get("bwd_fused", 0), two["bwd_stages"]) == (1, 0, 3)
    assert backward_config(d128, {**fwd, "bwd_held": 128})["bwd_mosaic"] == 0  # no Mosaic GPU backward holds 128 rows
    _, f32 = _group(attention_bhld, [(1, 2, 256, 64)] * 3, F32)
    assert backward_config(f32, {"bwd_stages": 3})["bwd_mosaic"] == 0


@pytest.mark.slow
def test_persistent_backward_has_no_races_or_barrier_misuse():
    """Interpret mode's happens-before race detector over a persistent dK/dV kernel's TMA, SMEM and barriers: a tile's
    K and V land in the buffers the tile before stored its dK and dV from; causal tiles of unequal length. (Not the
    fused kernel: interpret mode adds its dQ parts by a read, add and write of GMEM, which the detector reports
    between CTAs with or without `persistent`; on the GPU they are TMA reductions.)"""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
    from jax.experimental.pallas import mosaic_gpu as plgpu

    group, spec = _group(attention_bhld_causal, [(1, 2, 192, 64)] * 3, BF16)  # 4 tiles of 1 or 2 query blocks over 3 CTAs
    xs, out, lse, dout = _residuals(group, spec)
    cfg = {"bwd_held": 64, "bwd_step": 128, "bwd_stages": 2, **P}
    got = mgpu_backward.lower(group, spec, cfg, interpret=plgpu.InterpretGPUParams(detect_races=True))(xs, out, lse, dout)
    jax.block_until_ready(got)
    assert not interpret_pallas_call.get_races().races_found
