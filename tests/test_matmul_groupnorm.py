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


@pytest.mark.parametrize("fn,shapes,dtype", CASES)
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
