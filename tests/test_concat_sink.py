"""`concat_sink`: a concatenation whose readers (dots, sums, elementwise ops of it) run on its parts, so it is never
written. The backward of a fused QKV projection split in three (GPT-2) concatenates the parts' gradients and reads
that with two GEMMs and a sum: the same numbers as jax.jit, values and gradients, and none of it concatenated."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import autofuse
from autofuse import costmodel
from autofuse.kernels import TEMPLATES
from autofuse.plan import plan_from_choices
from autofuse.runner.measure import compare
from autofuse.tuning.partition import enumerate_candidates
from tests import example_graphs
from tests.quick import slow_except

NAME = "concat_sink"


def qkv_block(x, w, b, wo):
    """A fused QKV projection split in three, its parts mixed (a stand-in for attention) and projected back."""
    q, k, v = jnp.split(x @ w + b, 3, axis=-1)
    return jnp.sum(((q * jnp.tanh(k) + v) @ wo).astype(jnp.float32) ** 2)


def _args(dtype, D=16, M=24):
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    return (jax.random.normal(k[0], (2, M, D)).astype(dtype), (0.3 * jax.random.normal(k[1], (D, 3 * D))).astype(dtype),
            (0.1 * jax.random.normal(k[2], (3 * D,))).astype(dtype), (0.3 * jax.random.normal(k[3], (D, D))).astype(dtype))


def _candidates(fn, args):
    graph = autofuse.capture(fn, *args)
    return graph, [c for c in enumerate_candidates(graph) if c.template == NAME]


def _concatenations(fn, args) -> list[tuple[int, ...]]:
    """Shapes of every concatenation in `fn`'s jaxpr."""
    return [tuple(e.outvars[0].aval.shape) for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns if e.primitive.name == "concatenate"]


def _parts_concatenated(fn, args) -> bool:
    """Whether `fn` concatenates any of its own arguments (the parts)."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    return any(e.primitive.name == "concatenate" and set(e.invars) & set(jaxpr.invars) for e in jaxpr.eqns)


def test_the_gradient_of_a_split_projection_is_a_candidate_with_its_three_readers():
    fn = jax.grad(qkv_block, argnums=(0, 1, 2))
    graph, cands = _candidates(fn, _args(jnp.float32))
    (c,) = cands
    assert sorted(n.name for n in c.group.nodes) == ["concatenate", "dot_general", "dot_general", "reduce_sum"]
    assert c.spec.axis == 2 and c.spec.sizes == (16, 16, 16)
    cat = c.spec.concat.outputs[0]
    assert cat not in c.group.outputs and len(c.group.outputs) == 3


def _barriers(fn, args) -> int:
    return sum(e.primitive.name == "optimization_barrier" for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns)


@pytest.mark.parametrize("dtype,accumulate,contracted,kept", slow_except([
    pytest.param(jnp.float32, 0, 1, 0, id="float32-0-1-0"), pytest.param(jnp.bfloat16, 0, 1, 0, id="bfloat16-0-1-0"),
    pytest.param(jnp.bfloat16, 1, 1, 0, id="bfloat16-1-1-0"), pytest.param(jnp.bfloat16, 0, 0, 0, id="bfloat16-0-0-0"),
    pytest.param(jnp.bfloat16, 0, 0, 1, id="bfloat16-0-0-1")], "bfloat16-0-1-0", "bfloat16-0-0-1"))
def test_the_plan_computes_jax_jits_gradients_without_the_concatenation(dtype, accumulate, contracted, kept):
    """The weight's gradient (the concatenated axis kept: the parts' products concatenated, [D, 3D], small; with
    `kept` = 1 the one dot on the concatenation), the input's (contracted: the parts' dots added, or with
    `contracted` = 0 the one dot on the concatenation) and the bias's (kept: the parts' sums concatenated). A
    concatenation that dots read is written once for all of them, behind one optimisation barrier."""
    fn = jax.grad(qkv_block, argnums=(0, 1, 2))
    args = _args(dtype)
    graph, (c,) = _candidates(fn, args)
    config = {"accumulate": accumulate, "contracted": contracted, "kept": kept}
    kernel = TEMPLATES[NAME].build(c.group, config, backend="xla_ops", spec=c.spec)
    ins = [jax.random.normal(jax.random.PRNGKey(i), graph.avals[v].shape).astype(graph.avals[v].dtype) for i, v in enumerate(c.group.inputs)]
    made = sorted(_concatenations(kernel, ins))
    whole = [(2, 24, 48)] if not (contracted and not kept) else []  # dx's or dW's operand, written once
    assert made == sorted(whole + [(48,)] + ([] if kept else [(48, 16)]))  # the small results
    assert _parts_concatenated(kernel, ins) == bool(whole) and _barriers(kernel, ins) == len(whole)
    for o, r in zip(jax.jit(kernel)(*ins), c.group.evaluate(ins)):
        assert o.shape == r.shape and o.dtype == r.dtype
        ok, _, why = compare(o, r, 2e-2 if dtype == jnp.bfloat16 else 1e-5)
        assert ok, why
    plan = plan_from_choices(graph, [(c.group, NAME, {**config, "backend": "xla_ops"})])
    fused = autofuse.jit(fn, plan=plan, on_miss="error")
    outs, refs = fused(*args), jax.jit(fn)(*args)
    assert fused.last_status.startswith("plan: 1 fused group (concat_sink)"), fused.last_status
    for o, r in zip(outs, refs):
        ok, _, why = compare(o, r, 2e-2 if dtype == jnp.bfloat16 else 1e-5)
        assert ok, why


@pytest.mark.parametrize("case", ["contracted", "kept-lhs", "kept-rhs", "converted", "sums"])
def test_each_kind_of_reader_takes_the_parts(case):
    """A dot contracting the concatenated axis, a dot keeping it on either side (its output axis found among the
    batch and free axes), an elementwise op of it before the dot, sums over it and over another axis."""
    k = jax.random.split(jax.random.PRNGKey(1), 4)
    a, b = jax.random.normal(k[0], (5, 3, 8)), jax.random.normal(k[1], (5, 3, 4))
    w, y = jax.random.normal(k[2], (12, 6)), jax.random.normal(k[3], (5, 7, 3))
    fns = {
        "contracted": lambda a, b, w, y: jnp.concatenate([a, b], -1) @ w,
        "kept-lhs": lambda a, b, w, y: jnp.einsum("bij,bik->jbk", jnp.concatenate([a, b], -1), y[:, :3, :3]),
        "kept-rhs": lambda a, b, w, y: jnp.einsum("bmi,bij->bmj", y, jnp.concatenate([a, b], -1)),
        "converted": lambda a, b, w, y: jnp.concatenate([a, b], -1).astype(jnp.bfloat16) @ w.astype(jnp.bfloat16),
        "sums": lambda a, b, w, y: (jnp.sum(jnp.concatenate([a, b], -1), axis=(0, 2)), jnp.sum(jnp.concatenate([a, b], -1), axis=0)),
    }
    fn = fns[case]
    graph, cands = _candidates(fn, (a, b, w, y))
    if case == "sums":  # two concatenations (one each), same parts
        assert len(cands) == 2
    else:
        (c,) = cands
    for c in cands:
        kernel = TEMPLATES[NAME].build(c.group, {"accumulate": 0}, backend="xla_ops", spec=c.spec)
        ins = [jax.random.normal(jax.random.PRNGKey(i), graph.avals[v].shape).astype(graph.avals[v].dtype) for i, v in enumerate(c.group.inputs)]
        assert not _parts_concatenated(kernel, ins)
        for o, r in zip(jax.jit(kernel)(*ins), c.group.evaluate(ins)):
            assert o.shape == r.shape
            ok, _, why = compare(o, r, 2e-2 if case == "converted" else 1e-5)  # bf16: the parts' dots rounded, then added
            assert ok, why


def test_a_concatenation_read_whole_is_no_candidate():
    """A reader that cannot take parts (a program output, a transpose, a dot of it with itself) leaves the
    concatenation written: no candidate."""
    a, b, w = jnp.ones((4, 8)), jnp.ones((4, 8)), jnp.ones((16, 4))

    def returned(a, b, w):
        c = jnp.concatenate([a, b], 1)
        return c @ w, c
    transposed = lambda a, b, w: jnp.concatenate([a, b], 1).T @ a  # noqa: E731

    def squared(a, b, w):  # a dot of two piece-wise operands (both the concatenation's)
        c = jnp.concatenate([a, b], 1)
        return jnp.einsum("ij,ij->i", c, jnp.tanh(c))

    for fn in (returned, transposed, squared):
        assert _candidates(fn, (a, b, w))[1] == [], fn


def test_the_lowering_exports_for_cuda():
    """The group lowers for a CUDA GPU through `jax.export` (no GPU here): XLA's dots on the parts, no Pallas."""
    from autofuse.runner.evaluator import export_for_cuda

    _, (c,) = _candidates(jax.grad(qkv_block, argnums=(0, 1, 2)), _args(jnp.bfloat16))
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in c.group.input_avals()]
    text = export_for_cuda(TEMPLATES[NAME].build(c.group, {"accumulate": 0}, backend="xla_ops", spec=c.spec), structs).mlir_module()
    assert text.count("stablehlo.dot_general") == 6 and "mosaic_gpu" not in text


def test_the_model_counts_xlas_concatenation_once_per_gemm_and_prefers_the_parts_at_gpt2s_shapes():
    """XLA writes the concatenation once for each GEMM that reads it (two in GPT-2's step on an H200), which the
    parts never do: at GPT-2 medium's shapes the group is a modelled saving, so a small budget reaches it."""
    _, graph, _ = example_graphs.program("gpt2", "grad_step_cudnn", "published", 1)
    (grp, spec, _), = TEMPLATES[NAME].candidate_groups(graph, lambda i: True)
    cat = costmodel.node_time_ms(graph, spec.concat.id)
    readers = sum(costmodel.xla_group_time_ms(type(grp).of(graph, [n.id])) for n in grp.nodes if n.name != "concatenate")
    xla = costmodel.xla_group_time_ms(grp)
    assert xla == pytest.approx(2 * cat + readers)
    parts, keep_dx = (TEMPLATES[NAME].model_time_ms(spec, {"accumulate": 0, "contracted": k}) for k in (1, 0))
    assert parts < 0.95 * xla and keep_dx < 0.95 * xla  # both are worth a trial
    once = TEMPLATES[NAME].model_time_ms(spec, {"accumulate": 0, "contracted": 0, "kept": 1})
    sums = sum(costmodel.xla_group_time_ms(type(grp).of(graph, [n.id])) for n in grp.nodes if n.name == "reduce_sum")
    assert once < xla - 0.9 * cat and once > xla - cat - sums  # XLA's GEMMs, one copy fewer (the bias's sum on the parts)
