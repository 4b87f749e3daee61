"""The Mosaic GPU (Hopper: TMA, wgmma, warp specialisation) lowering of the `matmul_reduce` template, on the CPU.

Numerics run under Mosaic GPU interpret mode (`plgpu.InterpretGPUParams`: GMEM/SMEM, the three warpgroups,
barriers and TMA simulated, out-of-bounds TMA reads zero-filled and writes dropped as on the hardware) against
`jax.jit` of the same program, on ragged shapes; every case is also exported for CUDA under an abstract H100, which
runs the real Mosaic GPU lowering (wgmma, layouts, TMA tiling, shared memory) with no GPU.

Interpret mode needs an XLA:CPU flag on small machines: tests/conftest.py sets it.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

import autofuse
from autofuse.graph import Group
from autofuse.kernels import matmul_reduce
from autofuse.kernels.mosaic_gpu import matmul_reduce as mgpu
from autofuse.kernels.mosaic_gpu.tiles import Unsupported
from autofuse.runner.evaluator import export_for_cuda
from autofuse.tuning.partition import enumerate_candidates
from tests.quick import slow_except

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
TOL = {np.dtype(BF16): 2e-2, np.dtype(F16): 4e-3, np.dtype(F32): 2e-5}  # relative error norms, as the project's checks
S = jax.ShapeDtypeStruct


# Over N: one value per row of the product.
def logsumexp(x, w):
    return jax.nn.logsumexp(x @ w, axis=-1)


def logsumexp_bt(x, w):  # B stored [N, K]
    return jax.nn.logsumexp(jnp.einsum("mk,nk->mn", x, w), axis=-1)


def logsumexp_at(x, w):  # A stored [K, M]
    return jax.nn.logsumexp(jnp.einsum("km,kn->mn", x, w), axis=-1)


def cross_entropy(h, w, target):  # benchmarks/workloads.py: the target logit picked by a one-hot `where`
    logits = h @ w
    hit = jnp.arange(logits.shape[-1])[None, :] == target[:, None]
    return jax.nn.logsumexp(logits, axis=-1) - jnp.sum(jnp.where(hit, logits, 0), axis=-1)


def cross_entropy_take_along_axis(h, w, target):  # the gather folded into the group as a one-hot sum
    logits = h @ w
    return jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, target[:, None], axis=-1)[:, 0]


def softmax_weighted_sum(x, w, v):  # a sum rescaled by two earlier reductions; a per-column input
    return jnp.sum(jax.nn.softmax(x @ w, axis=-1) * v, axis=-1)


def max_and_sumexp(x, w):  # two outputs
    logits = x @ w
    m = jnp.max(logits, axis=-1, keepdims=True)
    return m[:, 0], jnp.sum(jnp.exp(logits - m), axis=-1)


def max_monotone_chain(x, w, b, r):  # per-row and per-column inputs; the chain after the bias runs after the max
    return jnp.max(jnp.exp(jnp.tanh(x @ w + b) * 2.0 - r[:, None]), axis=-1)


def log1p_small(x, w):  # log1p of ~1e-4: log(1 + x) would lose three digits in float32
    return jnp.max(jnp.log1p(jax.nn.relu(x @ w) * 1e-4), axis=-1)


# Over L: one value per (outer index, column).
def splade_head(h, w, bias, mask):  # benchmarks/workloads.py
    return jnp.max(jnp.log1p(jax.nn.relu(h @ w + bias)) * mask[..., None], axis=1)


def splade_head_bt(h, w, bias, mask):
    return jnp.max(jnp.log1p(jax.nn.relu(jnp.einsum("bsk,nk->bsn", h, w) + bias)) * mask[..., None], axis=1)


def column_sum_tanh(x, w):
    return jnp.sum(jnp.tanh(x @ w), axis=0)


def column_min_masked(x, w, keep):
    return jnp.min(jnp.where(keep[:, None], jax.nn.sigmoid(x @ w) / 4.0, 3.0), axis=0)


def masked_log_max(h, w, mask):
    return jnp.max(jnp.where(mask[..., None], jnp.log(h @ w + 100.0), -jnp.inf), axis=1)


# Configs: several units per CTA (num_sms=2), several epilogue pieces per step, split ranges of N with an empty tail
# step, K steps chained (K iterations divisible by the ring depth) or not.
OVER_N = {"block_m": 64, "block_n": 64, "block_k": 32, "max_concurrent_steps": 3, "epi_tile": 32, "split": 1}  # chained
SPLIT = {"block_m": 64, "block_n": 64, "block_k": 64, "max_concurrent_steps": 2, "epi_tile": 32, "split": 4}
UNCHAINED = {"block_m": 64, "block_n": 128, "block_k": 32, "max_concurrent_steps": 2, "epi_tile": 64, "split": 2}
OVER_L = {"block_m": 32, "block_n": 64, "block_k": 32, "max_concurrent_steps": 2, "epi_tile": 32, "split": 1}

I32, BOOL = ("i32",), ("bool",)
M, N, K = 200, 300, 96  # ragged against every tile size
CASES = [
    pytest.param(logsumexp, [(M, K), (K, N)], BF16, None, id="logsumexp-bf16"),
    pytest.param(logsumexp, [(M, K), (K, N)], F16, OVER_N, id="logsumexp-f16-chained"),
    pytest.param(logsumexp_bt, [(130, 40), (N, 40)], F16, UNCHAINED, id="logsumexp-f16-Bt-unchained"),
    pytest.param(logsumexp_at, [(K, M), (K, N)], BF16, SPLIT, id="logsumexp-bf16-At-split"),
    pytest.param(logsumexp, [(100, 40), (40, N)], F32, None, id="logsumexp-f32-tf32"),
    pytest.param(cross_entropy, [(M, K), (K, N), I32 + ((M,),)], BF16, None, id="ce-bf16"),
    pytest.param(cross_entropy, [(M, K), (K, N), I32 + ((M,),)], F16, SPLIT, id="ce-f16-split"),
    pytest.param(cross_entropy_take_along_axis, [(130, 48), (48, N), I32 + ((130,),)], BF16, OVER_N, id="ce-take-along-axis-bf16"),
    pytest.param(softmax_weighted_sum, [(140, 24), (24, 100), (100,)], F16, None, id="softmax-then-sum-f16"),
    pytest.param(max_and_sumexp, [(140, 24), (24, 130)], BF16, UNCHAINED, id="max-and-sumexp-two-outputs-bf16"),
    pytest.param(max_monotone_chain, [(150, 40), (40, N), (N,), (150,)], BF16, OVER_N, id="max-monotone-chain-bf16"),
    pytest.param(log1p_small, [(100, 40), (40, N)], F32, None, id="log1p-small-f32"),
    pytest.param(splade_head, [(3, 37, 64), (64, N), (N,), (3, 37)], BF16, None, id="splade-bf16"),
    pytest.param(splade_head, [(3, 37, 64), (64, N), (N,), BOOL + ((3, 37),)], BF16, OVER_L, id="splade-bool-mask-bf16"),
    pytest.param(splade_head_bt, [(2, 70, 64), (N, 64), (N,), BOOL + ((2, 70),)], F16, None, id="splade-Bt-bool-mask-f16"),
    pytest.param(column_sum_tanh, [(145, 64), (64, 200)], BF16, None, id="column-sum-bf16"),
    pytest.param(column_min_masked, [(145, 32), (32, 200), BOOL + ((145,),)], BF16, OVER_L, id="column-min-masked-bf16"),  # f16: XLA's
    # own float16 sigmoid of large negative products is subnormal and 6% off the float32 result (this kernel: 0.1%)
    pytest.param(masked_log_max, [(3, 37, 64), (64, 130), BOOL + ((3, 37),)], BF16, None, id="masked-log-max-bf16"),
]


def _specs(shapes, dtype):
    """("i32", shape) is an integer argument, ("bool", shape) a mask, any other shape has `dtype`."""
    kinds = {"i32": jnp.int32, "bool": jnp.bool_}
    return [S(s[1], kinds[s[0]]) if s and s[0] in kinds else S(s, dtype) for s in shapes]


def _group(fn, shapes, dtype):
    g = autofuse.capture(fn, *_specs(shapes, dtype))
    cands = [c for c in enumerate_candidates(g) if c.template == "matmul_reduce"]
    assert cands, "a matmul_reduce candidate is enumerated"
    cand = max(cands, key=lambda c: len(c.nodes))
    assert set(cand.group.inputs) == set(g.inputs) and set(g.outputs) <= set(cand.group.outputs), "the whole program"
    return g, cand.group, cand.spec


def _inputs(g, group, seed=0):
    keys = jax.random.split(jax.random.key(seed), len(group.inputs))
    n_cols = max(a.shape[-1] for a in group.input_avals() if len(a.shape) == 2)
    xs = []
    for k, a in zip(keys, group.input_avals()):
        if a.dtype == jnp.int32:
            xs.append(jax.random.randint(k, a.shape, 0, n_cols))
        elif a.dtype == jnp.bool_:
            xs.append(jax.random.bernoulli(k, 0.7, a.shape))
        else:
            xs.append(jax.random.normal(k, a.shape, jnp.float32).astype(a.dtype))
    return xs


def _rel_err(out, ref) -> float:
    o, r = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert o.shape == r.shape
    fin = np.isfinite(r)
    assert (np.isfinite(o) == fin).all() and (o[~fin] == r[~fin]).all(), "non-finite values differ"
    return float(np.linalg.norm(o[fin] - r[fin]) / max(np.linalg.norm(r[fin]), 1e-30))


def _check(fn, g, group, spec, cfg, xs, *, num_sms=2, interpret=True):
    kernel = mgpu.lower(group, spec, cfg, interpret=interpret, num_sms=num_sms)
    outs = dict(zip(group.outputs, jax.block_until_ready(kernel(*xs))))
    refs = jax.tree_util.tree_leaves(jax.jit(fn)(*[xs[list(group.inputs).index(v)] for v in g.inputs]))
    dtype = np.dtype(g.avals[spec.a].dtype)
    for v, r in zip(g.outputs, refs):
        assert outs[v].dtype == r.dtype and outs[v].shape == r.shape
        err = _rel_err(outs[v], r)
        assert err <= TOL[dtype], (cfg, err)


@pytest.mark.parametrize("fn,shapes,dtype,config", slow_except(CASES, "ce-bf16"))
def test_interpret_matches_xla(fn, shapes, dtype, config):
    g, group, spec = _group(fn, shapes, dtype)
    _check(fn, g, group, spec, config or mgpu.default_config(spec), _inputs(g, group))


@pytest.mark.parametrize("fn,shapes,dtype,config", slow_except(CASES, "logsumexp-bf16", "logsumexp-f32-tf32", "ce-f16-split", "splade-bool-mask-bf16",
                                                                    "column-sum-bf16", "max-and-sumexp-two-outputs-bf16"))
def test_lowers_for_cuda(fn, shapes, dtype, config):
    """The real Mosaic GPU lowering (no GPU): wgmma, layout, TMA-tiling and shared-memory errors interpret mode lets through."""
    g, group, spec = _group(fn, shapes, dtype)
    for cfg in ([config] if config else []) + [mgpu.default_config(spec)]:
        exp = export_for_cuda(mgpu.lower(group, spec, cfg), [S(a.shape, a.dtype) for a in group.input_avals()])
        assert "mosaic_gpu_v2" in exp.mlir_module()
        assert [(o.shape, o.dtype) for o in exp.out_avals] == [(a.shape, a.dtype) for a in group.output_avals()]


@pytest.mark.parametrize("fn,dtype", [(splade_head, BF16), (masked_log_max, F16)])
@pytest.mark.slow
def test_fully_masked_slices_keep_their_value(fn, dtype):
    """Batch element 1 is all padding: SPLADE gives 0 there, the masked log -inf (the max is rewritten with a count
    of unmasked positions, a reduction of a value constant along the kept axis)."""
    B, L, Kd, Nd = 3, 37, 64, 130
    shapes = [(B, L, Kd), (Kd, Nd), (Nd,), BOOL + ((B, L),)] if fn is splade_head else [(B, L, Kd), (Kd, Nd), BOOL + ((B, L),)]
    g, group, spec = _group(fn, shapes, dtype)
    xs = _inputs(g, group)
    mask = jnp.arange(L)[None, :] < jnp.array([20, 0, L])[:, None]
    xs[[i for i, a in enumerate(group.input_avals()) if a.dtype == jnp.bool_][0]] = mask
    _check(fn, g, group, spec, OVER_L, xs)
    out = mgpu.lower(group, spec, OVER_L, interpret=True, num_sms=2)(*xs)[0]
    assert bool(jnp.all(out[1] == (0 if fn is splade_head else -jnp.inf)))


def test_loop_structures_and_units():
    """Over N the kernel's rows are M and split ranges of N are merged outside; over L the kernel runs the transposed
    product (rows: N) one outer index at a time."""
    _, group, spec = _group(cross_entropy, [(M, K), (K, N), I32 + ((M,),)], BF16)
    k = mgpu._Kernel(group, spec, mgpu.Config.of(SPLIT))
    assert (k.R, k.C, k.n_rb, k.per, k.n_s, k.units, k.split_out) == (M, N, 2, 2, 3, 6, True)  # 5 steps of 64: ranges 2+2+1
    assert [x.kind for x in mgpu.epi_inputs(spec)] == ["rows"]  # the target, one per row
    _, group, spec = _group(splade_head, [(3, 37, 64), (64, N), (N,), (3, 37)], BF16)
    k = mgpu._Kernel(group, spec, mgpu.Config.of(OVER_L))
    assert (k.Q, k.R, k.C, k.units, k.per) == (3, N, 37, 3 * 3, 2)
    assert sorted(x.kind for x in mgpu.epi_inputs(spec)) == ["cols", "rows"]  # the mask along L, the bias along N
    assert (k.ops.a_km, k.ops.b_nk) == (True, True)  # W [K, N] read as a [K, M] operand, h [B*S, K] as an [N, K] one


def test_output_rows_hold_whole_row_blocks():
    """Each unit stores 2 x block rows of an output row (an outer index p over L, a range of N with split > 1) by TMA.
    On the H100 a store past the end of a row is not clipped but lands in the next row, another unit's output (the
    SPLADE head was wrong there; interpret mode drops it), so the kernel's output rows hold whole row blocks and are
    cut to the kept extent after the kernel."""
    for fn, shapes, cfg in [(splade_head, [(3, 37, 64), (64, N), (N,), (3, 37)], OVER_L),
                            (cross_entropy, [(M, K), (K, N), I32 + ((M,),)], SPLIT)]:
        _, group, spec = _group(fn, shapes, BF16)
        k = mgpu._Kernel(group, spec, mgpu.Config.of(cfg))
        for q, rows in k._out_shape():
            assert q == (k.n_s if k.split_out else k.Q) > 1
            assert rows == k.n_rb * 2 * k.bm >= k.R and rows > k.R  # ragged: the last row block runs past R


@pytest.mark.slow
def test_no_races_or_barrier_misuse():
    """Interpret mode's happens-before race detector over TMA, SMEM and barriers: several units per CTA, chained step
    pipelines, vector inputs fetched per step, running values kept in SMEM."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

    for fn, shapes, cfg in [(cross_entropy, [(M, K), (K, N), I32 + ((M,),)], {**OVER_N, "split": 2}),
                            (splade_head, [(3, 37, 64), (64, N), (N,), BOOL + ((3, 37),)], OVER_L)]:
        g, group, spec = _group(fn, shapes, BF16)
        kernel = mgpu.lower(group, spec, cfg, interpret=plgpu.InterpretGPUParams(detect_races=True), num_sms=1)
        jax.block_until_ready(kernel(*_inputs(g, group)))
        assert not interpret_pallas_call.get_races().races_found, fn.__name__


def test_shared_memory_estimate_is_what_mosaic_counts():
    """`smem_bytes` equals the `smem_bytes=` of Mosaic GPU's 'exceeds available shared memory' error (forced here by
    lowering its bound to one byte), so `check_config` declines exactly the configs Mosaic GPU would."""
    from jax.experimental.mosaic.gpu import core as mgpu_core

    if not hasattr(mgpu_core, "_SMEM_SIZE_BOUND"):
        pytest.skip("Mosaic GPU's shared-memory bound moved")
    cases = [(cross_entropy, [(M, K), (K, N), I32 + ((M,),)], BF16, {"block_m": 128, "block_k": 32, "split": 1}),
             (softmax_weighted_sum, [(140, 24), (24, 100), (100,)], F16, SPLIT),
             (splade_head, [(3, 37, 64), (64, N), (N,), BOOL + ((3, 37),)], BF16, {**OVER_L, "block_n": 128}),
             (logsumexp, [(100, 40), (40, N)], F32, None)]
    old = mgpu_core._SMEM_SIZE_BOUND
    mgpu_core._SMEM_SIZE_BOUND = 1
    try:
        for fn, shapes, dtype, cfg in cases:
            g, group, spec = _group(fn, shapes, dtype)
            cfg = {**mgpu.default_config(spec), **(cfg or {})}
            with pytest.raises(Exception, match="smem_bytes=") as info:
                export_for_cuda(mgpu.lower(group, spec, cfg), [S(a.shape, a.dtype) for a in group.input_avals()])
            counted = int(re.search(r"smem_bytes=(\d+)", str(info.value)).group(1))
            assert mgpu.smem_bytes(spec, mgpu.Config.of(cfg)) == counted, (fn.__name__, cfg)
    finally:
        mgpu_core._SMEM_SIZE_BOUND = old


def test_default_configs_of_the_benchmark_workloads():
    """Cross-entropy over a 32000-word vocabulary and the SPLADE head at their benchmark shapes: the default config
    is legal, fills an H100's 132 SMs, chains the K pipelines, and lowers."""
    from benchmarks.workloads import cross_entropy as ce_w, splade_head as splade_w

    for fn, specs, over_n in [(ce_w, [S((8192, 4096), BF16), S((4096, 32000), BF16), S((8192,), jnp.int32)], True),
                              (splade_w, [S((32, 256, 768), BF16), S((768, 30522), BF16), S((30522,), BF16), S((32, 256), BF16)], False)]:
        g = autofuse.capture(fn, *specs)
        cand = max((c for c in enumerate_candidates(g) if c.template == "matmul_reduce"), key=lambda c: len(c.nodes))
        spec = cand.spec
        assert spec.over_n is over_n
        cfg = mgpu.default_config(spec)
        choices = matmul_reduce.TEMPLATE.space_of(cand.group, spec, "mosaic_gpu")["params"]  # search_spaces/matmul_reduce.mosaic_gpu.toml
        assert set(cfg) == set(mgpu.DEFAULTS) == set(choices) and all(cfg[k] in choices[k] for k in cfg)
        assert matmul_reduce.TEMPLATE.unsupported(spec, "mosaic_gpu", cfg) is None
        mgpu.check_config(spec, mgpu.Config.of(cfg))
        k = mgpu._Kernel(cand.group, spec, mgpu.Config.of(cfg))
        assert k.units >= 128 and k.chain, (cfg, k.units)
        exp = export_for_cuda(mgpu.lower(cand.group, spec, cfg), [S(a.shape, a.dtype) for a in cand.group.input_avals()])
        assert "mosaic_gpu_v2" in exp.mlir_module()


def test_declines_what_it_does_not_support():
    x, w = S((64, 32), BF16), S((32, 48), BF16)
    cases = {
        "varies along both": (lambda a, b, r: jnp.max((a @ b) * r, axis=-1), [x, w, S((64, 48), BF16)]),
        "bool output": (lambda a, b: jnp.max(a @ b, axis=-1) > 0, [x, w]),
        "floor": (lambda a, b: jnp.max(jnp.floor(a @ b), axis=-1), [x, w]),
    }
    for what, (fn, specs) in cases.items():
        g = autofuse.capture(fn, *specs)
        group = Group.of(g, [n.id for n in g.nodes])
        spec = matmul_reduce.match(group)
        assert spec is not None, what
        with pytest.raises(Unsupported, match=what):
            mgpu.lower(group, spec, {})
    assert issubclass(Unsupported, NotImplementedError)  # what the tuner counts as an infeasible config

    _, group, spec = _group(cross_entropy, [(M, 512), (512, N), I32 + ((M,),)], BF16)
    for bad, why in [({"block_m": 32}, "block_m"), ({"block_n": 512}, "block_n"), ({"epi_tile": 48}, "epi_tile"),
                     ({"block_m": 128, "block_n": 256}, "registers"),
                     ({"block_m": 128, "block_n": 128, "block_k": 128, "max_concurrent_steps": 6}, "shared memory")]:
        with pytest.raises(Unsupported, match=why):
            mgpu.lower(group, spec, bad)
    _, group, spec = _group(softmax_weighted_sum, [(140, 24), (24, 100), (100,)], BF16)  # v: one per column of a step
    with pytest.raises(Unsupported, match="multiple of 128 bytes"):
        mgpu.lower(group, spec, {"block_n": 48, "epi_tile": 48})
    _, group, spec = _group(splade_head, [(3, 37, 64), (64, N), (N,), (3, 37)], BF16)
    with pytest.raises(Unsupported, match="split"):
        mgpu.lower(group, spec, {**OVER_L, "split": 2})
    with pytest.raises(Unsupported, match="block_n=32"):  # over L, block_n is the kept axis: wgmma's 64 rows
        mgpu.lower(group, spec, {**OVER_L, "block_n": 32})
