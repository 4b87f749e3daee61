"""End to end: default_plan + autofuse.jit(fn, plan=...) against jax.jit (Pallas in interpret mode on the CPU)."""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autofuse
from autofuse import ops
from autofuse.runner.measure import check
from autofuse.kernels import TEMPLATES
from autofuse.ops import OpClass
from autofuse.plan import FusedGroup, Plan, bind_plan, build_group, plan_from_choices
from autofuse.tuning.select import default_plan
from benchmarks.workloads import layer_norm, log_relu_bias, logsumexp, rms_norm, softmax
from tests.quick import slow_except

S = jax.ShapeDtypeStruct
F32, BF16 = jnp.float32, jnp.bfloat16
SEEDS = (1, 2, 3)


def _specs(shapes, dtype):
    return [S(s, dtype) for s in shapes]


def _check_plan(fn, specs, plan=None, seeds=SEEDS, **jit_kw):
    """Capture, plan (default unless given), run through autofuse.jit and compare with jax.jit."""
    graph = autofuse.capture(fn, *specs, **{k: v for k, v in jit_kw.items() if k.startswith("static")})
    plan = default_plan(graph) if plan is None else plan
    fused = autofuse.jit(fn, plan=plan, on_miss="error", **jit_kw)
    ref = jax.jit(fn, **jit_kw)
    avals = [graph.avals[v] for v in graph.inputs]
    res = check(lambda *a: jax.tree_util.tree_leaves(fused(*a)), lambda *a: jax.tree_util.tree_leaves(ref(*a)), avals, seeds=seeds)
    assert fused.last_status.startswith("plan:")  # the fused program ran, not the XLA fallback
    assert res.ok, res.reason
    return graph, plan, res


def _compute_nodes(graph) -> set[int]:
    """Nodes that do arithmetic (what a fused group must cover; broadcasts/reshapes may stay in XLA)."""
    return {n.id for n in graph.nodes if ops.op_class(n.name) in (OpClass.ELEMENTWISE, OpClass.REDUCTION)}


def _reduce_nodes(graph) -> set[int]:
    return {n.id for n in graph.nodes if ops.op_class(n.name) is OpClass.REDUCTION}


def _with_config(plan: Plan, **cfg) -> Plan:
    return dataclasses.replace(plan, groups=tuple(dataclasses.replace(g, config={**g.config, **cfg}) for g in plan.groups))


# ---------------------------------------------------------------------------
# The suite workloads.
SUITE = [
    # (fn, shapes, dtype, expected template)
    pytest.param(log_relu_bias, ((1000, 777), (777,)), F32, "elementwise", id="log_relu_bias-1000x777-f32"),
    pytest.param(log_relu_bias, ((37, 300), (300,)), BF16, "elementwise", id="log_relu_bias-37x300-bf16"),
    pytest.param(softmax, ((37, 300),), F32, "row_reduce", id="softmax-37x300-f32"),
    pytest.param(softmax, ((1000, 777),), BF16, "row_reduce", id="softmax-1000x777-bf16"),
    pytest.param(layer_norm, ((37, 300), (300,), (300,)), F32, "row_reduce", id="layer_norm-37x300-f32"),
    pytest.param(layer_norm, ((37, 300), (300,), (300,)), BF16, "row_reduce", id="layer_norm-37x300-bf16"),
    pytest.param(rms_norm, ((37, 300), (300,)), F32, "row_reduce", id="rms_norm-37x300-f32"),
    pytest.param(rms_norm, ((37, 300), (300,)), BF16, "row_reduce", id="rms_norm-37x300-bf16"),
    pytest.param(logsumexp, ((37, 300),), F32, "row_reduce", id="logsumexp-37x300-f32"),
    pytest.param(logsumexp, ((37, 300),), BF16, "row_reduce", id="logsumexp-37x300-bf16"),
    pytest.param(softmax, ((3, 7, 130),), F32, "row_reduce", id="softmax-3x7x130-f32"),
    pytest.param(layer_norm, ((2, 9, 300), (300,), (300,)), BF16, "row_reduce", id="layer_norm-2x9x300-bf16"),
    pytest.param(rms_norm, ((64, 128), (128,)), F32, "row_reduce", id="rms_norm-64x128-divisible-f32"),
]


@pytest.mark.parametrize("fn,shapes,dtype,template", slow_except(SUITE, "log_relu_bias-37x300-bf16", "layer_norm-37x300-bf16", "softmax-3x7x130-f32"))
def test_suite_workload(fn, shapes, dtype, template):
    graph, plan, _ = _check_plan(fn, _specs(shapes, dtype))
    # One fused group of the expected template covering every arithmetic node (all reductions included).
    assert [g.template for g in plan.groups] == [template]
    (group,) = plan.groups
    assert _compute_nodes(graph) <= set(group.nodes)
    assert _reduce_nodes(graph) <= set(group.nodes)
    if template == "row_reduce":
        assert _reduce_nodes(graph)
    assert plan.fingerprint == graph.fingerprint
    assert plan.provenance.get("measure") == "default"


# ---------------------------------------------------------------------------
# Opaque ops between fusible regions.
def cumsum_sort_chain(x, b):
    h = jnp.tanh(x * 2.0 + b)
    h = jnp.cumsum(h, axis=-1)
    h = jnp.sort(h, axis=-1)
    return jax.nn.softmax(h * 0.5, axis=-1)


@pytest.mark.parametrize("dtype", [F32, pytest.param(BF16, marks=pytest.mark.slow)], ids=["f32", "bf16"])
def test_opaque_ops_split_the_chain(dtype):
    graph, plan, _ = _check_plan(cumsum_sort_chain, _specs(((37, 300), (300,)), dtype))
    by_name = {n.name: n.id for n in graph.nodes}
    opaque = {by_name["cumsum"], by_name["sort"]}
    assert all(ops.op_class(graph.node_index[i].name) is OpClass.OPAQUE for i in opaque)
    grouped = [set(g.nodes) for g in plan.groups]
    for nodes in grouped:
        assert not nodes & opaque
    assert sorted(g.template for g in plan.groups) == ["elementwise", "row_reduce"]
    ew = next(set(g.nodes) for g in plan.groups if g.template == "elementwise")
    rr = next(set(g.nodes) for g in plan.groups if g.template == "row_reduce")
    assert all(i < by_name["cumsum"] for i in ew) and all(i > by_name["sort"] for i in rr)
    assert {by_name["tanh"]} <= ew and _reduce_nodes(graph) <= rr
    assert _compute_nodes(graph) <= ew | rr


def test_opaque_op_inside_a_diamond_is_not_fused_around():
    # exp feeds both cumsum (opaque) and the add: fusing exp with the add would need the cumsum inside.
    def f(x):
        e = jnp.exp(x)
        return jnp.log(e + jnp.cumsum(e, axis=-1))

    graph, plan, _ = _check_plan(f, [S((37, 300), F32)])
    by_name = {n.name: n.id for n in graph.nodes}
    for g in plan.groups:
        assert by_name["cumsum"] not in g.nodes
        assert not {by_name["exp"], by_name["add"]} <= set(g.nodes)


# ---------------------------------------------------------------------------
# Explicit configs: the multi-chunk (in-kernel loop over column blocks) path of row_reduce.
def _kernel_loops(group, config) -> int:
    """Number of loops inside the generated kernel (fori_loop over column blocks lowers to scan/while)."""
    kernel = build_group(group, "row_reduce", config, interpret=False)
    jaxpr = jax.make_jaxpr(kernel)(*[S(a.shape, a.dtype) for a in group.input_avals()])
    (call,) = [e for e in jaxpr.eqns if e.primitive.name == "pallas_call"]

    def count(j) -> int:
        n = 0
        for e in j.eqns:
            n += e.primitive.name in ("scan", "while")
            for v in e.params.values():
                sub = getattr(v, "jaxpr", v)
                if hasattr(sub, "eqns"):
                    n += count(sub)
        return n

    return count(call.params["jaxpr"])


def ln_with_stats(x):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) / jnp.sqrt(v + 1e-5), m[:, 0], v


MULTI = [
    # fn, shapes, dtype, block_rows, block_cols, loops = reduction depths + (1 if a full-row output is written)
    pytest.param(softmax, ((37, 300),), F32, 4, 64, 3, id="softmax-f32-4x64"),
    pytest.param(softmax, ((37, 300),), BF16, 8, 128, 3, id="softmax-bf16-8x128"),
    pytest.param(layer_norm, ((37, 300), (300,), (300,)), F32, 4, 128, 3, id="layer_norm-f32-4x128"),
    pytest.param(layer_norm, ((37, 300), (300,), (300,)), BF16, 16, 64, 3, id="layer_norm-bf16-16x64"),
    pytest.param(rms_norm, ((37, 300), (300,)), F32, 2, 64, 2, id="rms_norm-f32-2x64"),
    pytest.param(rms_norm, ((37, 300), (300,)), BF16, 4, 256, 2, id="rms_norm-bf16-4x256"),
    pytest.param(logsumexp, ((37, 300),), F32, 4, 64, 2, id="logsumexp-f32-4x64"),
    pytest.param(logsumexp, ((37, 300),), BF16, 1, 128, 2, id="logsumexp-bf16-1x128"),
    pytest.param(ln_with_stats, ((37, 300),), F32, 4, 64, 3, id="ln_with_stats-f32-4x64"),
    pytest.param(softmax, ((3, 7, 130),), F32, 4, 32, 3, id="softmax-3d-f32-4x32"),
]


@pytest.mark.parametrize("fn,shapes,dtype,bm,bn,loops", slow_except(MULTI, "softmax-bf16-8x128", "layer_norm-f32-4x128"))
def test_row_reduce_multi_chunk(fn, shapes, dtype, bm, bn, loops):
    specs = _specs(shapes, dtype)
    graph = autofuse.capture(fn, *specs)
    base = default_plan(graph)
    assert [g.template for g in base.groups] == ["row_reduce"]
    ((group, fg),) = bind_plan(graph, base)
    C = TEMPLATES["row_reduce"].match(group).C  # the reduced row length
    assert C == math.prod(shapes[0][-1:])
    assert C > bn and C % bn != 0  # several column blocks, the last one partial
    assert _kernel_loops(group, fg.config) == 0  # the default config reduces in one pass
    config = {**fg.config, "block_rows": bm, "block_cols": bn}
    assert _kernel_loops(group, config) == loops  # ... this one loops over column blocks
    # Built with plan_from_choices, as a tuner would.
    plan = plan_from_choices(graph, [(group, "row_reduce", config)], {"measure": "test"})
    assert plan.groups[0].config["block_cols"] == bn
    _check_plan(fn, specs, plan=plan)


@pytest.mark.parametrize("bn", [64, 512], ids=["multi-chunk", "one-chunk"])
@pytest.mark.parametrize("dtype", [F32, pytest.param(BF16, marks=pytest.mark.slow)], ids=["f32", "bf16"])
def test_row_max_min_mask_the_tail(dtype, bn):
    # All-negative rows: a max that let masked (zero) lanes in would return 0; likewise a min over all-positive rows.
    def f(x):
        return jnp.max(x - 8.0, axis=-1), jnp.min(x + 8.0, axis=-1)

    graph = autofuse.capture(f, S((37, 300), dtype))
    base = default_plan(graph)
    assert sorted(g.template for g in base.groups) == ["row_reduce"] * len(base.groups) and base.groups
    _check_plan(f, [S((37, 300), dtype)], plan=_with_config(base, block_rows=4, block_cols=bn))


def test_multi_axis_reduction():
    def f(x):
        return jnp.sum(jnp.exp(x), axis=(1, 2))

    graph, plan, _ = _check_plan(f, [S((5, 6, 70), F32)])
    assert [g.template for g in plan.groups] == ["row_reduce"]
    _check_plan(f, [S((5, 6, 70), F32)], plan=_with_config(plan, block_rows=2, block_cols=64))


def test_elementwise_non_divisible_blocks():
    specs = _specs(((37, 300), (300,)), F32)
    graph = autofuse.capture(log_relu_bias, *specs)
    base = default_plan(graph)
    for bm, bn in ((4, 64), (16, 32), (1, 512)):
        _check_plan(log_relu_bias, specs, plan=_with_config(base, block_rows=bm, block_cols=bn), seeds=(1,))


# ---------------------------------------------------------------------------
# Through autofuse.jit: pytrees and static arguments.
def test_pytree_program_through_autofuse_jit():
    def f(params, x):
        h = rms_norm(x, params["scale"])
        return {"y": h, "lse": logsumexp(h.astype(F32) + params["bias"])}

    specs = ({"scale": S((130,), F32), "bias": S((130,), F32)}, S((24, 130), F32))
    graph = autofuse.capture(f, *specs)
    plan = default_plan(graph)
    assert plan.groups and all(g.template == "row_reduce" for g in plan.groups)
    fused = autofuse.jit(f, plan=plan, on_miss="error")
    rng = np.random.default_rng(0)
    params = {"scale": jnp.asarray(rng.standard_normal(130), F32), "bias": jnp.asarray(rng.standard_normal(130), F32)}
    x = jnp.asarray(rng.standard_normal((24, 130)), F32)
    out, ref = fused(params, x), jax.jit(f)(params, x)
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(ref)
    for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_static_argument_selects_the_program():
    def f(x, n):
        for _ in range(n):
            x = jnp.tanh(x) * 1.5 + 0.25
        return x

    x = jnp.asarray(np.random.default_rng(0).standard_normal((16, 128)), F32)
    graph2 = autofuse.capture(f, x, 2, static_argnums=(1,))
    plan2 = default_plan(graph2)
    assert [g.template for g in plan2.groups] == ["elementwise"]
    fused = autofuse.jit(f, plan=plan2, static_argnums=(1,))
    np.testing.assert_allclose(fused(x, 2), jax.jit(f, static_argnums=1)(x, 2), rtol=1e-6)
    assert fused.last_status.startswith("plan:")
    # n=3 is another program: the plan for n=2 must not be reused for it.
    np.testing.assert_allclose(fused(x, 3), jax.jit(f, static_argnums=1)(x, 3), rtol=1e-6)
    assert fused.last_status.startswith("xla")
    strict = autofuse.jit(f, plan=plan2, static_argnums=(1,), on_miss="error")
    with pytest.raises(autofuse.PlanError):
        strict(x, 3)


def test_xla_plan_runs_plain_jit():
    graph = autofuse.capture(softmax, S((8, 64), F32))
    fused = autofuse.jit(softmax, plan=Plan(graph.fingerprint))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 64)), F32)
    np.testing.assert_allclose(fused(x), jax.jit(softmax)(x), rtol=1e-6)


def test_fused_group_records_the_group_signature():
    graph = autofuse.capture(softmax, S((8, 64), F32))
    plan = default_plan(graph)
    ((group, fg),) = bind_plan(graph, plan)
    assert isinstance(fg, FusedGroup) and fg.signature == group.signature
