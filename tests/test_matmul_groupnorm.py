"""The `matmul` template with an epilogue that reduces over segments of a product row (GroupNorm after a matmul):
matching (the epilogue rewritten onto [..., N / seg, seg], `passes.split_columns`), enumeration of the whole
program as one candidate, and the Triton lowering in interpret mode against `jax.jit` on ragged shapes."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

import autofuse
from autofuse.graph import Group
from autofuse.kernels import TEMPLATES, matmul
from autofuse.plan import plan_from_choices
from autofuse.runner.evaluator import lowering_guard
from autofuse.runner.measure import check, cone_tolerances
from autofuse.tuning.partition import enumerate_candidates
from autofuse.tuning.space import SearchSpace
from benchmarks.workloads import matmul_bias_swish_groupnorm
from tests.quick import slow_except

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16


def gn_ex2(x, w, b, gamma, beta, groups=3):
    """GroupNorm in the E[x^2] - mean^2 form, B stored [N, K], no swish."""
    y = jnp.einsum("mk,nk->mn", x, w) + b
    yg = y.reshape(y.shape[0], groups, -1).astype(jnp.float32)
    mu = yg.mean(-1, keepdims=True)
    var = (yg * yg).mean(-1, keepdims=True) - mu * mu
    return (((yg - mu) * jax.lax.rsqrt(var + 1e-5)).reshape(y.shape) * gamma + beta).astype(x.dtype)


def gn_at(x, w, gamma, groups=3):
    """A stored [K, M]; the statistics in the operand dtype; a per-row scale after the norm."""
    y = jax.nn.relu(jnp.einsum("km,kn->mn", x, w))
    yg = y.reshape(y.shape[0], groups, -1)
    mu = yg.mean(-1, keepdims=True)
    var = ((yg - mu) ** 2).mean(-1, keepdims=True)
    return ((yg - mu) / jnp.sqrt(var + 1e-5)).reshape(y.shape) * gamma


def gn_3d(h, w, b, groups=2):
    """h [B, S, K] @ W: the rows are B * S; the max of each segment as well as the mean."""
    y = h @ w + b
    yg = y.reshape(*y.shape[:-1], groups, -1)
    return (yg - yg.mean(-1, keepdims=True) + yg.max(-1, keepdims=True)).reshape(y.shape)


GN4 = functools.partial(matmul_bias_swish_groupnorm, groups=4)
CASES = [
    pytest.param(GN4, ((100, 40), (40, 128), (128,), (128,), (128,)), BF16, id="swish-gn-bf16-ragged-M"),
    pytest.param(GN4, ((100, 40), (40, 128), (128,), (128,), (128,)), F32, id="swish-gn-f32"),
    pytest.param(gn_ex2, ((70, 48), (96, 48), (96,), (96,), (96,)), F16, id="Bt-ex2-gn-f16-ragged-N"),
    pytest.param(gn_at, ((40, 50), (40, 192), (50, 1)), BF16, id="At-gn-rowscale-bf16-seg64"),
    pytest.param(gn_3d, ((2, 37, 40), (40, 64), (64,)), F32, id="3d-lhs-mean-max-f32"),
]
SMALL = {"block_m": 32, "block_n": 64, "block_k": 16, "num_warps": 4, "num_stages": 2, "group_m": 4}


def _whole(fn, shapes, dtype):
    g = autofuse.capture(fn, *[jax.ShapeDtypeStruct(s, dtype) for s in shapes])
    return g, Group.of(g, [n.id for n in g.nodes])


@pytest.mark.parametrize("fn,shapes,dtype", slow_except(CASES, "swish-gn-bf16-ragged-M"))
def test_groupnorm_epilogue_matches_xla(fn, shapes, dtype):
    g, _ = _whole(fn, shapes, dtype)
    cands = [c for c in enumerate_candidates(g) if c.template == "matmul" and len(c.nodes) == len(g.nodes)]
    assert cands, "the tuner enumerates the whole program as one matmul candidate"
    spec = cands[0].spec
    assert spec.seg and spec.epi.reductions
    space = SearchSpace.of("matmul", cands[0].group, spec)
    seg_ok = [cfg for cfg in (matmul.default_config(spec), SMALL) if cfg["block_n"] % spec.seg == 0]
    assert not space.violated(space.default)
    for cfg in seg_ok:
        plan = plan_from_choices(g, [(cands[0].group, "matmul", cfg)])
        fused = autofuse.jit(fn, plan=plan)
        res = check(lambda *a, f=fused: jax.tree_util.tree_leaves(f(*a)), lambda *a: jax.tree_util.tree_leaves(jax.jit(fn)(*a)),
                    [g.avals[v] for v in g.inputs], (1, 2), cone_tolerances(g, [n.id for n in g.nodes], g.outputs))
        assert res.ok, (cfg, res.reason)
        assert fused.last_status.startswith("plan:")


def test_segments_split_the_columns_in_the_rewritten_epilogue():
    _, group = _whole(GN4, ((100, 40), (40, 128), (128,), (128,), (128,)), BF16)
    spec = matmul.match(group)
    assert spec.seg == 32 and spec.epi.shape == (100, 4, 32) and spec.epi.split == 1
    eg = spec.epi.group.graph
    assert not any(nd.name == "reshape" and eg.avals[nd.outputs[0]].shape != eg.avals[nd.inputs[0]].shape for nd in spec.epi.group.nodes)
    stats = [spec.epi.span[nd.outputs[0]] for nd in spec.epi.group.nodes if nd.name == "reduce_sum"]
    assert len(stats) == 2 and all(s.rows and s.cols and s.per_segment for s in stats)
    assert [spec.epi.layout2d(v) for v in group.outputs] == [(100, 128)]  # outputs keep their 2-D layout
    assert eg.avals[spec.b].shape == (40, 128)  # the dot's operands are untouched


def test_segments_must_fit_a_tile_and_be_a_power_of_two_on_triton():
    _, group = _whole(functools.partial(matmul_bias_swish_groupnorm, groups=4), ((64, 32), (32, 96), (96,), (96,), (96,)), BF16)
    spec = matmul.match(group)
    assert spec.seg == 24
    space = SearchSpace.of("matmul", group, spec)
    assert space.violated(space.default), "no Triton tile holds whole 24-column segments"
    with pytest.raises(NotImplementedError, match="segment"):
        TEMPLATES["matmul"].build(group, SMALL, interpret=True, spec=spec)


def test_a_reduction_over_the_whole_row_is_not_a_segmented_matmul():
    def ln(x, w):
        y = x @ w
        return y - y.mean(-1, keepdims=True)

    _, group = _whole(ln, ((64, 32), (32, 128)), F32)
    assert matmul.match(group) is None


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_groupnorm_kernel_passes_the_cuda_lowering_guard(dtype):
    shapes = ((300, 200), (200, 512), (512,), (512,), (512,))
    g, group = _whole(GN4, shapes, dtype)
    spec = matmul.match(group)
    for cfg in (matmul.default_config(spec), {**SMALL, "block_n": 128}):
        kernel = TEMPLATES["matmul"].build(group, cfg, interpret=False, spec=spec)
        lowering_guard(kernel, [jax.ShapeDtypeStruct(g.avals[v].shape, g.avals[v].dtype) for v in group.inputs])


# ---------------------------------------------------------------------------
# The Mosaic GPU lowering: one epilogue piece per segment (epi_tile_n = seg), the segment's statistics row
# reductions of the WGMMA piece; interpret mode against jax.jit, and the real lowering exported for CUDA.
MOSAIC_CASES = [
    pytest.param(GN4, ((100, 40), (40, 128), (128,), (128,), (128,)), BF16, None, id="swish-gn-bf16-ragged-M"),
    pytest.param(GN4, ((200, 96), (96, 256), (256,), (256,), (256,)), F16,
                 {"block_m": 64, "block_n": 128, "block_k": 32, "max_concurrent_steps": 2, "epi_tile_m": 64, "epi_tile_n": 64,
                  "grid_tile_width": 2, "grid_minor_dim": 0, "wg_dimension": 1}, id="swish-gn-f16-seg64-two-pieces-per-tile"),
    pytest.param(gn_ex2, ((70, 48), (96, 48), (96,), (96,), (96,)), F16, None, id="Bt-ex2-gn-f16-ragged-N"),
    pytest.param(gn_at, ((40, 50), (40, 192), (50, 1)), BF16, None, id="At-gn-rowscale-bf16-seg64"),
    pytest.param(gn_3d, ((2, 37, 40), (40, 64), (64,)), BF16, None, id="3d-lhs-mean-max-bf16"),
    pytest.param(GN4, ((200, 96), (96, 256), (256,), (256,), (256,)), BF16,
                 {"block_m": 64, "block_n": 128, "block_k": 32, "max_concurrent_steps": 2, "epi_tile_m": 64, "epi_tile_n": 64,
                  "grid_tile_width": 2, "grid_minor_dim": 0, "pingpong": 1}, id="swish-gn-bf16-seg64-pingpong"),
]


@pytest.mark.parametrize("fn,shapes,dtype,config", slow_except(MOSAIC_CASES, "swish-gn-f16-seg64-two-pieces-per-tile"))
def test_mosaic_groupnorm_interpret_matches_xla(fn, shapes, dtype, config):
    from autofuse.kernels.mosaic_gpu import matmul as mgpu_matmul
    from tests.kernel_checks import rel_err

    _, group = _whole(fn, shapes, dtype)
    spec = matmul.match(group)
    cfg = config or mgpu_matmul.default_config(spec)
    assert TEMPLATES["matmul"].unsupported(spec, "mosaic_gpu", cfg) is None
    kernel = mgpu_matmul.lower(group, spec, cfg, interpret=True, num_sms=2)
    keys = jax.random.split(jax.random.key(0), len(group.inputs))
    xs = [jax.random.normal(k, a.shape, jnp.float32).astype(a.dtype) for k, a in zip(keys, group.input_avals())]
    (out,) = jax.block_until_ready(kernel(*xs))
    ref = jax.jit(fn)(*xs)
    assert out.dtype == ref.dtype
    assert rel_err(out, ref) <= {BF16: 2e-2, F16: 4e-3}[dtype], cfg


@pytest.mark.parametrize("fn,shapes,dtype,config", MOSAIC_CASES)
def test_mosaic_groupnorm_lowers_for_cuda(fn, shapes, dtype, config):
    from autofuse.kernels.mosaic_gpu import matmul as mgpu_matmul
    from autofuse.runner.evaluator import export_for_cuda

    _, group = _whole(fn, shapes, dtype)
    spec = matmul.match(group)
    for cfg in ([config] if config else []) + [mgpu_matmul.default_config(spec)]:
        exp = export_for_cuda(mgpu_matmul.lower(group, spec, cfg), [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in group.input_avals()])
        assert "mosaic_gpu_v2" in exp.mlir_module()


@pytest.mark.slow
def test_mosaic_groupnorm_full_shape_configs_lower_and_fit():
    """The benchmark shape (16384x2048x4096, 32 groups of 128): the default and the probe's configs lower for CUDA
    within shared memory; a piece narrower than a segment is declined."""
    from autofuse.kernels.mosaic_gpu import matmul as mgpu_matmul
    from autofuse.kernels.mosaic_gpu.tiles import Unsupported
    from autofuse.runner.evaluator import export_for_cuda
    from benchmarks.mosaic_probe import MOSAIC

    shapes = ((16384, 2048), (2048, 4096), (4096,), (4096,), (4096,))
    _, group = _whole(matmul_bias_swish_groupnorm, shapes, BF16)
    spec = matmul.match(group)
    assert spec.seg == 128
    base = mgpu_matmul.default_config(spec)
    assert base["pingpong"] == 1  # K = 2048
    for extra in MOSAIC["groupnorm"]:  # (those without `pingpong`: over the cooperative schedule's default, as the probe runs them)
        cfg = {**(mgpu_matmul.default_config(spec, pingpong=False) if extra else base), **extra}
        assert TEMPLATES["matmul"].unsupported(spec, "mosaic_gpu", cfg) is None, cfg
        export_for_cuda(mgpu_matmul.lower(group, spec, cfg), [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in group.input_avals()])
    with pytest.raises(Unsupported, match="segment"):
        mgpu_matmul.lower(group, spec, {**base, "epi_tile_n": 64})


@pytest.mark.parametrize("small", [False, True], ids=["benchmark-shape", "small-shape"])
def test_tuner_offers_the_whole_groupnorm_program_on_both_backends(small):
    """The suite's workload (benchmarks/workloads.py) enumerates one matmul candidate covering every node, whose
    default config is feasible for Triton and, with the segment as its epilogue piece, for Mosaic GPU."""
    from autofuse.tuning.space import CandidateSpace
    from benchmarks.workloads import specs, workloads

    w = next(w for w in workloads(small) if w.name == "matmul_bias_swish_groupnorm")
    g = autofuse.capture(w.fn, *specs(w, BF16))
    whole = [c for c in enumerate_candidates(g) if c.template == "matmul" and len(c.nodes) == len(g.nodes)]
    assert len(whole) == 1
    spec = whole[0].spec
    assert spec.seg == w.shapes[1][1] // 32
    space = CandidateSpace.of("matmul", whole[0].group, spec, backends=("mosaic_gpu", "triton"))
    assert list(space.spaces) == ["mosaic_gpu", "triton"]
    for sp in space.spaces.values():
        assert not sp.violated(sp.default), sp.backend


def test_matmul_without_segments_keeps_its_triton_space():
    """A matmul whose epilogue reduces nothing (seg = 0) keeps every Triton config the segment rule would not touch:
    `seg == 0 or block_n % seg == 0` short-circuits as in Python (it once divided by zero and made every Triton
    config of matmul+bias+GELU infeasible on the GPU)."""
    from autofuse.tuning.space import CandidateSpace
    from benchmarks.workloads import specs, workloads

    w = next(w for w in workloads(True) if w.name == "matmul_bias_gelu")
    g = autofuse.capture(w.fn, *specs(w, BF16))
    cand = next(c for c in enumerate_candidates(g) if c.template == "matmul" and len(c.nodes) == len(g.nodes))
    assert not cand.spec.seg
    space = CandidateSpace.of("matmul", cand.group, cand.spec, backends=("mosaic_gpu", "triton"))
    for sp in space.spaces.values():
        assert not sp.violated(sp.default), sp.backend
    assert not space.spaces["triton"].violated({**space.spaces["triton"].default, "block_n": 32})
