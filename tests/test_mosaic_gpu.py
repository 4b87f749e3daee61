"""The Mosaic GPU (Hopper: TMA, wgmma, warp specialisation) lowering of the `matmul` template, on the CPU.

Numerics run under Mosaic GPU interpret mode (`plgpu.InterpretGPUParams`: it
simulates GMEM/SMEM, the three warpgroups, barriers and TMA, zero-filling
out-of-bounds TMA reads and dropping out-of-bounds TMA writes as the hardware
does) against `jax.jit` of the same function. Interpret mode does not check
wgmma's shape / swizzle rules, register layouts or Mosaic's TMA tiling rules;
`jax.export` for CUDA under an abstract H100 runs the real Mosaic GPU lowering
(up to the mgpu dialect, layout checks and the shared-memory limit included)
with no GPU, so every case is also exported.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

import autofuse
from autofuse.graph import Group
from autofuse.kernels import matmul
from autofuse.kernels.mosaic_gpu import matmul as mgpu_matmul
from autofuse.kernels.mosaic_gpu.gemm import approximate_math
from autofuse.kernels.mosaic_gpu.tiles import Unsupported
from autofuse.runner.evaluator import export_for_cuda
from tests.kernel_checks import rel_err
from tests.quick import slow_except

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
TOL = {np.dtype(BF16): 2e-2, np.dtype(F16): 4e-3, np.dtype(F32): 2e-5}  # relative error norms, as the project's checks
S = jax.ShapeDtypeStruct


def rounded_bias_gelu(x, w, b):
    """A `jax.checkpoint` forward's GEMM: its result rounded to its own dtype (`reduce_precision`) before GELU."""
    return jax.nn.gelu(jax.lax.reduce_precision(x @ w + b, exponent_bits=8, mantissa_bits=7), approximate=True)


def bias_gelu(x, w, b):
    return jax.nn.gelu(x @ w + b, approximate=True)


def rowscale_residual(x, w, s, r):
    return (x @ w) * s + r


def at_bias_gelu(x, w, b):  # A stored [K, M]
    return jax.nn.gelu(jnp.einsum("km,kn->mn", x, w) + b, approximate=True)


def bt_rowscale_residual(x, w, s, r):  # B stored [N, K]
    return jnp.einsum("mk,nk->mn", x, w) * s + r


def atbt_bias_tanh(x, w, b):  # both transposed
    return jnp.tanh(jnp.einsum("km,nk->mn", x, w) + b)


def swish_two_outputs(x, w):
    h = x @ w
    return h, h * jax.nn.sigmoid(h)


def scalar_scale_tanh_f32(x, w, s):
    return jnp.tanh((x @ w) * s).astype(jnp.float32)


M, N, K = 200, 136, 96  # ragged against every tile size
# Many tiles per CTA, several epilogue pieces per warpgroup, the warpgroups split along N, a snake along M.
SMALL = {"block_m": 64, "block_n": 64, "block_k": 32, "max_concurrent_steps": 2, "epi_tile_m": 64, "epi_tile_n": 32,
         "grid_tile_width": 2, "grid_minor_dim": 0, "wg_dimension": 1}
WIDE = {"block_m": 128, "block_n": 128, "block_k": 64, "max_concurrent_steps": 3, "epi_tile_m": 64, "epi_tile_n": 64,
        "grid_tile_width": 8, "grid_minor_dim": 1, "wg_dimension": 0}

CASES = [
    pytest.param(bias_gelu, [(M, K), (K, N), (N,)], BF16, None, id="bias-gelu-bf16-ragged"),
    pytest.param(bias_gelu, [(256, 128), (128, 256), (256,)], F16, WIDE, id="bias-gelu-f16-divisible"),
    pytest.param(rowscale_residual, [(M, K), (K, N), (M, 1), (M, N)], BF16, SMALL, id="rowscale-residual-bf16-ragged"),
    pytest.param(rowscale_residual, [(M, K), (K, N), (M, 1), (M, N)], F16, None, id="rowscale-residual-f16-ragged"),
    pytest.param(at_bias_gelu, [(K, M), (K, N), (N,)], BF16, SMALL, id="At-bias-gelu-bf16-ragged"),
    pytest.param(bt_rowscale_residual, [(M, K), (N, K), (M, 1), (M, N)], F16, WIDE, id="Bt-rowscale-residual-f16-ragged"),
    pytest.param(bt_rowscale_residual, [(256, 128), (128, 128), (256, 1), (256, 128)], BF16, None, id="Bt-rowscale-residual-bf16-divisible"),
    pytest.param(atbt_bias_tanh, [(72, 100), (90, 72), (90,)], F16, None, id="AtBt-bias-tanh-f16-padded"),
    pytest.param(rowscale_residual, [(100, 72), (72, 90), (100, 1), (100, 90)], BF16, None, id="rowscale-residual-bf16-padded"),
    pytest.param(swish_two_outputs, [(M, K), (K, N)], BF16, SMALL, id="swish-two-outputs-bf16"),
    pytest.param(scalar_scale_tanh_f32, [(M, K), (K, N), ()], BF16, None, id="scalar-scale-tanh-to-f32"),
    pytest.param(bias_gelu, [(2, 37, 40), (40, 50), (50,)], BF16, None, id="3d-lhs-bias-gelu-bf16"),
    pytest.param(bias_gelu, [(M, K), (K, N), (N,)], F32, None, id="bias-gelu-f32-tf32"),
    pytest.param(at_bias_gelu, [(K, M), (K, N), (N,)], F32, None, id="At-bias-gelu-f32-transposed-outside"),
    # the epilogue in its own warpgroup: a column vector, a row vector and a tile input, two outputs, both splits
    pytest.param(bias_gelu, [(M, K), (K, N), (N,)], BF16, {"epilogue_wg": 1}, id="epilogue-wg-bias-gelu-bf16-ragged"),
    pytest.param(bt_rowscale_residual, [(M, K), (N, K), (M, 1), (M, N)], F16, {**WIDE, "epilogue_wg": 1, "max_concurrent_steps": 2},
                 id="epilogue-wg-Bt-rowscale-residual-f16-ragged"),
    pytest.param(swish_two_outputs, [(M, K), (K, N)], BF16, {**SMALL, "epilogue_wg": 1}, id="epilogue-wg-swish-two-outputs-split-n"),
    # 2-CTA clusters along M and N (an odd number of tiles: a CTA of the last cluster wholly past the edge)
    pytest.param(bt_rowscale_residual, [(M, K), (N, K), (M, 1), (M, N)], F16, {**SMALL, "cluster": 1},
                 id="cluster-m-Bt-rowscale-residual-f16-ragged"),
    pytest.param(at_bias_gelu, [(K, M), (K, N), (N,)], BF16, {**SMALL, "cluster": 2}, id="cluster-n-At-bias-gelu-bf16-ragged"),
    # ping-pong: the compute warpgroups take turns at whole tiles (one wgmma step in flight, or each step waited for)
    pytest.param(bias_gelu, [(M, K), (K, N), (N,)], BF16, {**SMALL, "pingpong": 1}, id="pingpong-bias-gelu-bf16-ragged"),
    pytest.param(rounded_bias_gelu, [(M, K), (K, N), (N,)], BF16, {**SMALL, "pingpong": 1}, id="pingpong-rounded-bias-gelu-bf16-ragged"),
    pytest.param(bt_rowscale_residual, [(M, K), (N, K), (M, 1), (M, N)], F16, {**WIDE, "pingpong": 1},
                 id="pingpong-Bt-rowscale-residual-f16-ragged"),
    pytest.param(swish_two_outputs, [(M, K), (K, N)], BF16, {**SMALL, "pingpong": 1, "block_k": 64}, id="pingpong-swish-two-outputs"),
    pytest.param(at_bias_gelu, [(K, M), (K, N), (N,)], F32, {**SMALL, "pingpong": 1}, id="pingpong-At-bias-gelu-f32-tf32"),
    # ping-pong in 2-CTA clusters (cuBLAS's K = 1024 schedule): B multicast along M, A along N; the last cluster's second
    # CTA wholly past the edge (4 tiles of 64 rows for 200, 3 of 64 columns for 136)
    pytest.param(bias_gelu, [(M, K), (K, N), (N,)], BF16, {**SMALL, "pingpong": 1, "cluster": 1, "max_concurrent_steps": 3},
                 id="pingpong-cluster-m-bias-gelu-bf16-ragged"),
    pytest.param(bt_rowscale_residual, [(M, K), (N, K), (M, 1), (M, N)], F16, {**SMALL, "pingpong": 1, "cluster": 2},
                 id="pingpong-cluster-n-Bt-rowscale-residual-f16-ragged"),
    # the ping-pong default's 192-column tiles (three 64-column epilogue pieces), the last one ragged (400 = 2 x 192 + 16)
    pytest.param(bias_gelu, [(M, K), (K, 400), (400,)], BF16, {**SMALL, "pingpong": 1, "block_n": 192, "block_k": 64,
                                                                "max_concurrent_steps": 3, "epi_tile_n": 64}, id="pingpong-192-bias-gelu-bf16-ragged"),
]


def _group(fn, shapes, dtype):
    g = autofuse.capture(fn, *[S(s, dtype) for s in shapes])
    group = Group.of(g, [n.id for n in g.nodes])  # the whole program is one matmul group
    spec = matmul.match(group)
    assert spec is not None, "the program is one dot plus an elementwise epilogue"
    return g, group, spec


def _inputs(group, seed=0):
    keys = jax.random.split(jax.random.key(seed), len(group.inputs))
    return [jax.random.normal(k, a.shape, jnp.float32).astype(a.dtype) for k, a in zip(keys, group.input_avals())]


@pytest.mark.parametrize("fn,shapes,dtype,config", slow_except(CASES, "bias-gelu-bf16-ragged",
                                                                    "epilogue-wg-swish-two-outputs-split-n", "pingpong-rounded-bias-gelu-bf16-ragged",
                                                                    "pingpong-cluster-m-bias-gelu-bf16-ragged"))  # ping-pong quick in a cluster
def test_interpret_matches_xla(fn, shapes, dtype, config):
    g, group, spec = _group(fn, shapes, dtype)
    cfg = config or mgpu_matmul.default_config(spec)
    kernel = mgpu_matmul.lower(group, spec, cfg, interpret=True, num_sms=2)
    xs = _inputs(group)
    outs = jax.block_until_ready(kernel(*xs))
    refs = jax.tree_util.tree_leaves(jax.jit(fn)(*xs))
    assert len(outs) == len(refs) == len(group.outputs)
    for o, r in zip(outs, refs):
        assert o.dtype == r.dtype
        err = rel_err(o, r)
        assert err <= TOL[np.dtype(dtype)], (cfg, err)


@pytest.mark.parametrize("fn,shapes,dtype,config", slow_except(CASES, "bias-gelu-bf16-ragged", "Bt-rowscale-residual-f16-ragged", "bias-gelu-f32-tf32",
                                                                    "epilogue-wg-bias-gelu-bf16-ragged", "cluster-n-At-bias-gelu-bf16-ragged",
                                                                    "pingpong-cluster-n-Bt-rowscale-residual-f16-ragged",
                                                                    "pingpong-rounded-bias-gelu-bf16-ragged"))
def test_lowers_for_cuda(fn, shapes, dtype, config):
    """The real Mosaic GPU lowering (no GPU): catches wgmma, layout, TMA-tiling and shared-memory errors interpret mode lets through."""
    g, group, spec = _group(fn, shapes, dtype)
    for cfg in ([config] if config else []) + [mgpu_matmul.default_config(spec)]:
        kernel = mgpu_matmul.lower(group, spec, cfg)
        exp = export_for_cuda(kernel, [S(a.shape, a.dtype) for a in group.input_avals()])
        assert "mosaic_gpu_v2" in exp.mlir_module()
        assert [(o.shape, o.dtype) for o in exp.out_avals] == [(a.shape, a.dtype) for a in group.output_avals()]


@pytest.mark.slow
def test_no_races_or_barrier_misuse():
    """Interpret mode's happens-before race detector over TMA, SMEM and barriers (several tiles per CTA and pieces per
    tile), with each tile's pipeline on its own (3 K steps, a ring of 2) and with the tiles' pipelines chained (a ring
    of 3: the producer fetches the next tile's operands during the epilogue), and with the epilogue in its own
    warpgroup (the product handed over through SMEM while the compute warpgroups start the next tile), with a
    2-CTA cluster multicasting A, and with the compute warpgroups taking turns at whole tiles (ping-pong: one ring,
    per-warpgroup barriers, a slot released a step late, the ring wrapping within and across tiles), also in 2-CTA
    clusters (a slot refilled by multicast once both CTAs' warpgroups released it)."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

    g, group, spec = _group(bt_rowscale_residual, [(M, K), (N, K), (M, 1), (M, N)], BF16)
    xs = _inputs(group)
    ref = jax.jit(bt_rowscale_residual)(*xs)
    for extra in ({"max_concurrent_steps": 2}, {"max_concurrent_steps": 3}, {"max_concurrent_steps": 2, "epilogue_wg": 1},
                  {"max_concurrent_steps": 2, "cluster": 2}, {"max_concurrent_steps": 2, "pingpong": 1},
                  {"max_concurrent_steps": 3, "pingpong": 1, "block_k": 16}, {"max_concurrent_steps": 3, "pingpong": 1, "cluster": 1},
                  {"max_concurrent_steps": 3, "pingpong": 1, "cluster": 2, "block_k": 16}):
        kernel = mgpu_matmul.lower(group, spec, {**SMALL, **extra}, interpret=plgpu.InterpretGPUParams(detect_races=True), num_sms=2)
        (out,) = jax.block_until_ready(kernel(*xs))
        assert not interpret_pallas_call.get_races().races_found, extra
        assert rel_err(out, ref) <= TOL[np.dtype(BF16)], extra


def test_declines_what_it_does_not_support():
    x, w = S((64, 32), BF16), S((32, 48), BF16)
    cases = {
        "batched": (lambda a, b: jnp.tanh(jnp.einsum("bij,bjk->bik", a, b)), [S((2, 64, 32), BF16), S((2, 32, 48), BF16)]),
        "not affine": (lambda a, b: jnp.einsum("mk,kn->mn", jnp.tanh(a), b), [x, w]),  # a prologue that does not fold
        "log1p": (lambda a, b: jnp.log1p(jax.nn.relu(a @ b)), [x, w]),
    }
    for what, (fn, specs) in cases.items():
        g = autofuse.capture(fn, *specs)
        group = Group.of(g, [n.id for n in g.nodes])
        spec = matmul.match(group)
        assert spec is not None, what
        with pytest.raises(Unsupported, match=what):
            mgpu_matmul.lower(group, spec, {})
        assert issubclass(Unsupported, NotImplementedError)  # what the tuner counts as an infeasible config

    g, group, spec = _group(bias_gelu, [(M, 512), (512, N), (N,)], BF16)  # 8 K steps: the pipeline keeps 4 stages
    for bad, why in [({"block_m": 32}, "block_m"), ({"block_n": 512}, "block_n"), ({"epi_tile_m": 96}, "epi_tile_m"),
                     ({"block_m": 256, "block_n": 256, "max_concurrent_steps": 4}, "shared memory")]:
        with pytest.raises(Unsupported, match=why):
            mgpu_matmul.lower(group, spec, bad)


def swish_f32(x, w):  # a bf16 dot whose epilogue writes float32 through exp only
    y = (x @ w).astype(jnp.float32)
    return y * jax.nn.sigmoid(y)


@pytest.mark.parametrize("fn,shapes,dtype,approx", [
    (bias_gelu, [(M, K), (K, N), (N,)], BF16, True),
    (bias_gelu, [(M, K), (K, N), (N,)], F16, True),
    (bias_gelu, [(M, K), (K, N), (N,)], F32, False),
    (scalar_scale_tanh_f32, [(M, K), (K, N), ()], BF16, False),  # float32 out of a bf16 dot, through tanh
    (swish_f32, [(M, K), (K, N)], BF16, True),  # float32 out of a bf16 dot, through exp only
    (swish_f32, [(M, K), (K, N)], F32, False),
])
def test_approximate_transcendentals_where_the_dtypes_allow(fn, shapes, dtype, approx):
    """tanh.approx (about 2^-11 relative) is finer than a 16-bit float's rounding, not a float32's; ex2.approx and
    lg2.approx (a few float32 ulps) are fine for a float32 that carries a 16-bit float's error."""
    _, group, _ = _group(fn, shapes, dtype)
    assert approximate_math(group) is approx


def test_the_default_schedule_is_ping_pong_up_to_k_2048_but_for_a_dual_gemm():
    """Measured on an H200 (results/gemm_pingpong_h200.md): ping-pong ahead on GEMMs with an epilogue at K = 1024-2048,
    tied at 4096, behind at 8192, on SwiGLU's dual GEMM and with a bias's gradient summed; its ring three deep at least;
    192-column tiles on wide 16-bit products (results/gemm_clocks_h200.md)."""
    from autofuse.kernels.matmul import TEMPLATE

    def default(K, fn=bias_gelu, shapes=None, **kw):
        _, _, spec = _group(fn, shapes or [(4096, K), (K, 1024), (1024,)], BF16)
        return mgpu_matmul.default_config(spec, **kw)

    for K in (1024, 2048):
        cfg = default(K)
        assert cfg["pingpong"] == 1 and cfg["max_concurrent_steps"] >= 3 and cfg["grid_tile_width"] == 16, cfg
    # 192 columns where eight such tiles fit across N (GPT-2's 3072- and 4096-wide products), 128 below and for TF32
    wide = default(1024, shapes=[(4096, 1024), (1024, 4096), (4096,)])
    assert (wide["block_n"], wide["max_concurrent_steps"]) == (192, 4) and 192 % wide["epi_tile_n"] == 0, wide
    assert default(1024)["block_n"] == 128  # N = 1024
    _, _, f32_spec = _group(bias_gelu, [(4096, 1024), (1024, 4096), (4096,)], F32)
    assert mgpu_matmul.default_config(f32_spec)["block_n"] == 128
    assert default(4096)["pingpong"] == 0 and default(1024, pingpong=False)["pingpong"] == 0
    dual = lambda h, wg, wu: jax.nn.silu(h @ wg) * (h @ wu)  # noqa: E731
    g = autofuse.capture(dual, S((1024, 1024), BF16), S((1024, 2048), BF16), S((1024, 2048), BF16))
    group = Group.of(g, [n.id for n in g.nodes])
    spec = TEMPLATE.match(group)
    assert spec is not None and spec.dot2 is not None and mgpu_matmul.default_config(spec)["pingpong"] == 0
    from benchmarks.mosaic_probe import _group as probe_group, dgrad_gelu_dbias  # a dgrad GEMM with its bias's gradient

    _, cand = probe_group(dgrad_gelu_dbias, [S((4096, 1024), BF16), S((4096, 1024), BF16), S((4096, 4096), BF16)])
    assert cand.spec.epi.col_sums and mgpu_matmul.default_config(cand.spec)["pingpong"] == 0


def test_the_default_narrows_its_epilogue_pieces_before_it_settles_for_a_two_deep_ring():
    """Where the epilogue's output buffers leave room for a 2-deep ring of 128-byte K steps only, the default takes
    32-column epilogue pieces and a 3-deep ring (the tile kept): on an H200 (results/dual_ring_h200.md) Llama's SwiGLU
    dual GEMM writing three [8192, 8192] outputs ran 0.788 against 0.892 ms, GPT-2's down-projection + residual
    writing two 0.200 against 0.235. A GEMM whose ring fits as deep as it is keeps 64-column pieces. The defaults
    lower for CUDA."""
    def dual3(h, wg, wu):  # a training step's: the products kept for the backward
        gate, up = h @ wg, h @ wu
        return jax.nn.silu(gate) * up, gate, up

    dual1 = lambda h, wg, wu: jax.nn.silu(h @ wg) * (h @ wu)  # noqa: E731

    def residual2(x, w, b, r):  # two [M, N] outputs
        y = x @ w + b + r
        return y, y.astype(F32)

    cases = [(dual3, [S((1024, 2048), BF16), S((2048, 2048), BF16), S((2048, 2048), BF16)], (3, 32)),
             (dual1, [S((1024, 2048), BF16), S((2048, 2048), BF16), S((2048, 2048), BF16)], (None, 64)),
             (residual2, [S((1024, 4096), BF16), S((4096, 1024), BF16), S((1024,), BF16), S((1024, 1024), BF16)], (3, 32))]
    for fn, specs, (steps, piece) in cases:
        g = autofuse.capture(fn, *specs)
        spec = matmul.TEMPLATE.match(Group.of(g, [n.id for n in g.nodes]))
        cfg = mgpu_matmul.default_config(spec)
        assert cfg["epi_tile_n"] == piece and (steps is None or cfg["max_concurrent_steps"] == steps), (fn, cfg)
        assert cfg["block_k"] * 2 >= 128 or cfg["max_concurrent_steps"] >= 3, cfg  # never a 2-deep ring of 128-byte steps
        assert mgpu_matmul.smem_bytes(spec, mgpu_matmul.Config.of(cfg)) <= mgpu_matmul.SMEM_LIMIT
        group = spec.group
        exp = export_for_cuda(mgpu_matmul.lower(group, spec, cfg), [S(a.shape, a.dtype) for a in group.input_avals()])
        assert len(exp.out_avals) == len(group.output_avals())


def test_an_operand_is_padded_in_its_own_shape_so_that_xla_pads_it_once():
    """An operand whose minor axis must grow is padded in its own shape, then reshaped: the same pad `aligned_dot` (or
    another group) makes of the same array, so XLA makes one copy, where a pad of its 2-D reshape was a second one
    (GPT-2's step held its logits' gradient padded twice: 1.6 GB more at the peak, results/memory_h200.md)."""
    import re

    from autofuse.kernels.mosaic_gpu.gemm import pad, pad_2d

    x = jax.random.normal(jax.random.key(0), (2, 8, 201), BF16)
    w = jnp.ones((256, 4), BF16)
    assert jnp.array_equal(pad_2d(x, (16, 201), (16, 256)), pad(jnp.reshape(x, (16, 201)), (16, 256)))
    for padding, pads in ((lambda x: pad_2d(x, (16, 201), (16, 256)), 1), (lambda x: pad(jnp.reshape(x, (16, 201)), (16, 256)), 2)):
        hlo = jax.jit(lambda x: (padding(x) @ w, jnp.pad(x, [(0, 0), (0, 0), (0, 55)]) @ w)).lower(x).compile().as_text()
        assert len(re.findall(r"= \S+ pad\(", hlo)) == pads
