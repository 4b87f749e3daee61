"""The `matmul` template (dot + epilogue in one kernel) in interpret mode, and its CUDA lowering."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import autofuse
from autofuse.runner.evaluator import lowering_guard
from autofuse.graph import Group
from autofuse.kernels import matmul
from autofuse.runner.measure import check, cone_tolerances
from autofuse.tuning.partition import enumerate_candidates
from autofuse.plan import build_group, plan_from_choices
from tests.quick import slow_except

F32, BF16 = jnp.float32, jnp.bfloat16


def mm_bias_gelu(x, w, b):
    return jax.nn.gelu(x @ w + b, approximate=True)


def mm_bt_scale_tanh(x, w, s):
    return jnp.tanh(jnp.einsum("mk,nk->mn", x, w) * s)


def mm_at_residual_relu(x, w, r):
    return jax.nn.relu(jnp.einsum("km,kn->mn", x, w) + r)


def bmm_scale(x, w, s):
    return jnp.einsum("bij,bjk->bik", x, w) * s


def bmm_bt_bias_relu(x, w, b):
    return jax.nn.relu(jnp.einsum("bmk,bnk->bmn", x, w) + b)


def mm_prologue_scale_cast(x, w, s):
    return jax.nn.relu((x * s).astype(jnp.bfloat16) @ w.astype(jnp.bfloat16))


def mm_bt_prologue_scale(x, w, s):
    return jnp.einsum("mk,nk->mn", x, w * s)


def mm_rounded_bias_gelu(x, w, b):
    """As a `jax.checkpoint` forward keeps a GEMM's result: rounded to its own dtype (`reduce_precision`)."""
    return jax.nn.gelu(jax.lax.reduce_precision(x @ w + b, exponent_bits=8, mantissa_bits=7), approximate=True)


def mm_silu_two_outputs(x, w):
    h = x @ w
    return h, jax.nn.silu(h)


CASES = [
    pytest.param(mm_bias_gelu, ((100, 70), (70, 90), (90,)), F32, id="bias-gelu-f32-odd"),
    pytest.param(mm_bias_gelu, ((100, 70), (70, 90), (90,)), BF16, id="bias-gelu-bf16-odd"),
    pytest.param(mm_bt_scale_tanh, ((64, 48), (80, 48), ()), BF16, id="Bt-scale-tanh-bf16"),
    pytest.param(mm_at_residual_relu, ((40, 33), (40, 50), (33, 50)), F32, id="At-residual-relu-f32"),
    pytest.param(mm_silu_two_outputs, ((32, 64), (64, 48)), F32, id="two-outputs-f32"),
    pytest.param(mm_rounded_bias_gelu, ((100, 70), (70, 90), (90,)), BF16, id="rounded-bias-gelu-bf16-odd"),
    pytest.param(bmm_scale, ((3, 40, 24), (3, 24, 50), ()), F32, id="batched-scale-f32-odd"),
    pytest.param(bmm_scale, ((2, 64, 32), (2, 32, 48), ()), BF16, id="batched-scale-bf16"),
    pytest.param(mm_bias_gelu, ((2, 37, 40), (40, 50), (50,)), BF16, id="3d-lhs-bias-gelu-bf16-odd"),
    pytest.param(mm_prologue_scale_cast, ((100, 70), (70, 90), (70,)), F32, id="prologue-scale-cast-to-bf16-odd"),
    pytest.param(mm_bt_prologue_scale, ((64, 40), (80, 40), ()), BF16, id="Bt-prologue-scale-bf16"),
    pytest.param(bmm_bt_bias_relu, ((3, 33, 20), (3, 45, 20), (45,)), BF16, id="batched-Bt-bias-relu-bf16-odd"),
]
SMALL = {"block_m": 32, "block_n": 32, "block_k": 16, "num_warps": 4, "num_stages": 2, "group_m": 4}


def _matmul_candidate(graph):
    cands = [c for c in enumerate_candidates(graph) if c.template == "matmul"]
    assert cands, "a matmul + epilogue candidate is enumerated"
    return max(cands, key=lambda c: len(c.nodes))


@pytest.mark.parametrize("fn,shapes,dtype", slow_except(CASES, "two-outputs-f32", "Bt-prologue-scale-bf16", "rounded-bias-gelu-bf16-odd"))
def test_matmul_epilogue_matches_xla(fn, shapes, dtype):
    specs = [jax.ShapeDtypeStruct(s, dtype) for s in shapes]
    g = autofuse.capture(fn, *specs)
    cand = _matmul_candidate(g)
    assert len(cand.nodes) == len(g.nodes), "the whole program is one matmul group"
    for cfg in (matmul.default_config(cand.spec), SMALL):  # one block, and many blocks with ragged edges
        plan = plan_from_choices(g, [(cand.group, "matmul", cfg)])
        fused = autofuse.jit(fn, plan=plan)
        res = check(lambda *a: jax.tree_util.tree_leaves(fused(*a)), lambda *a: jax.tree_util.tree_leaves(jax.jit(fn)(*a)),
                    [g.avals[v] for v in g.inputs], (1, 2), cone_tolerances(g, [n.id for n in g.nodes], g.outputs))
        assert res.ok, (cfg, res.reason)
        assert fused.last_status.startswith("plan:")


def test_batched_dot_is_one_kernel_and_high_precision_stays_in_xla():
    x = jax.ShapeDtypeStruct((4, 32, 32), F32)
    g = autofuse.capture(lambda a, b: jnp.tanh(a @ b), x, x)
    assert _matmul_candidate(g).spec.batch == 4
    y = jax.ShapeDtypeStruct((32, 32), F32)
    g = autofuse.capture(lambda a, b: jnp.tanh(jnp.dot(a, b, precision=jax.lax.Precision.HIGH)), y, y)
    assert not [c for c in enumerate_candidates(g) if c.template == "matmul"]


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("cfg", [SMALL, {"block_m": 128, "block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 3, "group_m": 8}])
def test_matmul_kernels_pass_the_cuda_lowering_guard(dtype, cfg):
    specs = [jax.ShapeDtypeStruct(s, dtype) for s in ((300, 200), (200, 260), (260,))]
    g = autofuse.capture(mm_bias_gelu, *specs)
    cand = _matmul_candidate(g)
    kernel = build_group(cand.group, "matmul", cfg, interpret=False)
    lowering_guard(kernel, [jax.ShapeDtypeStruct(g.avals[v].shape, g.avals[v].dtype) for v in cand.group.inputs])


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("fn,shapes", [(bmm_bt_bias_relu, ((3, 100, 70), (3, 90, 70), (90,))),
                                       (mm_prologue_scale_cast, ((100, 70), (70, 90), (70,))), (mm_bt_prologue_scale, ((64, 40), (80, 40), ())),
                                       (mm_rounded_bias_gelu, ((100, 70), (70, 90), (90,)))],
                         ids=["batched", "prologue-cast", "Bt-prologue", "rounded"])
def test_batched_and_prologue_kernels_pass_the_cuda_lowering_guard(fn, shapes, dtype):
    specs = [jax.ShapeDtypeStruct(s, dtype) for s in shapes]
    g = autofuse.capture(fn, *specs)
    cand = _matmul_candidate(g)
    kernel = build_group(cand.group, "matmul", SMALL, interpret=False)
    lowering_guard(kernel, [jax.ShapeDtypeStruct(g.avals[v].shape, g.avals[v].dtype) for v in cand.group.inputs])


def test_tune_considers_the_matmul_candidate():
    """A job whose budget covers every candidate's default tries the matmul candidate (at these shapes every candidate
    is a modelled loss: a shorter budget goes to those nearest to break-even, the elementwise ones)."""
    specs = [jax.ShapeDtypeStruct(s, BF16) for s in ((256, 128), (128, 256), (256,))]
    rep = autofuse.tune(mm_bias_gelu, *specs, trials=12, quiet=True, store=False, isolate=False)
    assert len(rep.candidates) <= 12
    assert "matmul" in {c.template for c in rep.candidates}
    assert any(c.template == "matmul" and c.trials for c in rep.candidates)
    g = autofuse.capture(mm_bias_gelu, *specs)
    assert Group.of(g, rep.candidates[0].nodes).signature == rep.candidates[0].signature
