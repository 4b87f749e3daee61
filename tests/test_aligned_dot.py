"""`aligned_dot`: a dot whose rows are not 16 bytes apart (GPT-2's vocabulary of 50257), run by XLA on operands padded
with zeros to aligned rows, its product sliced back. No Pallas kernel: the same numbers as jax.jit, values and
gradients, and the cost model says why it is worth a trial."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import autofuse
from autofuse import costmodel
from autofuse.kernels import TEMPLATES
from autofuse.kernels.aligned_dot import padded_shapes
from autofuse.plan import plan_from_choices
from autofuse.runner.measure import compare
from autofuse.tuning.partition import enumerate_candidates
from tests import example_graphs
from tests.quick import slow_except

NAME = "aligned_dot"


def head(h, w, targets):
    """A vocabulary head's cross-entropy (w as GPT-2's tied embedding, [V, D])."""
    logits = (h @ w.T).astype(jnp.float32)
    return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, targets[..., None], -1)[..., 0])


def _args(V, dtype=jnp.bfloat16):
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    return (jax.random.normal(k[0], (2, 48, 32), jnp.float32).astype(dtype), (0.2 * jax.random.normal(k[1], (V, 32))).astype(dtype),
            jax.random.randint(k[2], (2, 48), 0, V))


def _candidates(fn, args):
    graph = autofuse.capture(fn, *args)
    return graph, [c for c in enumerate_candidates(graph) if c.template == NAME]


@pytest.mark.slow
def test_the_unaligned_dots_of_a_vocabulary_head_are_candidates_and_aligned_ones_are_not():
    fn = jax.grad(head, argnums=(0, 1))
    graph, cands = _candidates(fn, _args(203))  # 406-byte rows
    assert len(cands) == 3  # the logits, dh = dlogits @ w, dw = dlogits^T @ h
    assert all(len(c.group.nodes) == 1 and c.group.nodes[0].name == "dot_general" for c in cands)
    assert {padded_shapes(c.spec, 64) for c in cands} == {((2, 48, 32), (32, 256)), ((2, 48, 256), (32, 256)), ((2, 48, 256), (2, 48, 32))}
    assert _candidates(fn, _args(256))[1] == []
    assert _candidates(fn, _args(204, jnp.float32))[1] == []  # 816-byte rows: aligned, as 408 bf16 ones are not
    assert len(_candidates(fn, _args(204))[1]) == 3


@pytest.mark.parametrize("align", slow_except([8, 64, 128], "64"))
def test_the_padded_plan_computes_jax_jits_values_and_gradients(align):
    """Every unaligned dot padded (the contracted vocabulary of dh, the free one of the logits and of dw, whose
    contraction runs over the batch and sequence): the gradients as jax.jit's, and differentiable again."""
    fn = jax.grad(head, argnums=(0, 1))
    args = _args(203)
    graph, cands = _candidates(fn, args)
    plan = plan_from_choices(graph, [(c.group, NAME, {"align": align, "backend": "xla_ops"}) for c in cands])
    fused = autofuse.jit(fn, plan=plan, on_miss="error")
    outs, refs = fused(*args), jax.jit(fn)(*args)
    assert fused.last_status.startswith("plan: 3 fused groups (aligned_dot×3)"), fused.last_status
    for o, r in zip(outs, refs):
        assert o.shape == r.shape
        ok, _, why = compare(o, r, 1e-2)
        assert ok, why
    graph_f, (c,) = _candidates(lambda h, w, t: head(h, w, t), args)
    loss_plan = plan_from_choices(graph_f, [(c.group, NAME, {"align": align, "backend": "xla_ops"})])
    grads = jax.grad(autofuse.jit(head, plan=loss_plan, on_miss="error"), argnums=(0, 1))(*args)
    for g, r in zip(grads, refs):
        ok, _, why = compare(g, r, 1e-2)
        assert ok, why


def test_the_lowering_exports_for_cuda():
    """The plan's group lowers for a CUDA GPU through `jax.export` (no GPU here): XLA's dot and pads, no Pallas."""
    from autofuse.runner.evaluator import export_for_cuda

    _, (c,) = _candidates(head, _args(203))
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in c.group.input_avals()]
    text = export_for_cuda(TEMPLATES[NAME].build(c.group, {"align": 64}, backend="xla_ops", spec=c.spec), structs).mlir_module()
    assert "dot_general" in text and "pad" in text and "mosaic_gpu" not in text


@pytest.mark.slow
def test_the_model_prefers_it_at_gpt2s_vocabulary():
    """At GPT-2 medium's shapes the cost model puts each LM-head dot's padded run ahead of XLA's (whose unaligned
    GEMMs run at a third of their aligned speed), so the budget reaches them."""
    _, graph, _ = example_graphs.program("gpt2", "grad_step", "published", 1)
    cands = [c for c in example_graphs.candidates("gpt2", "grad_step", "published", 1) if c.template == NAME]
    assert len(cands) == 3
    for c in cands:
        padded = TEMPLATES[NAME].model_time_ms(c.spec, TEMPLATES[NAME].default_config_of(c.spec, "xla_ops"))
        assert padded < 0.8 * costmodel.xla_group_time_ms(c.group), (padded, costmodel.xla_group_time_ms(c.group))


@pytest.mark.slow
def test_xla_is_modelled_slow_where_it_reads_unaligned_rows_and_less_where_it_only_writes_them():
    """The logits `h @ w.T` read `w` itself in the program (XLA folds the transpose) and only write unaligned rows
    (1.4x on an H200); dh and dw read the logits' gradient's unaligned rows (2.5-3.3x)."""
    fn = jax.grad(head, argnums=(0, 1))
    graph, cands = _candidates(fn, _args(203))
    factors = {}
    for c in cands:
        nd = c.group.nodes[0]
        reads_logits = any(graph.aval(a).shape[-1] == 203 and costmodel.as_xla_reads(graph, a).shape[-1] == 203 for a in nd.inputs)
        factors.setdefault("reads" if reads_logits else "writes", []).append(costmodel.xla_unaligned_factor(graph, nd))
    assert factors == {"reads": [costmodel.XLA_UNALIGNED_READ] * 2, "writes": [costmodel.XLA_UNALIGNED_WRITE]}
    aligned, _ = _candidates(fn, _args(256))
    assert all(costmodel.xla_unaligned_factor(aligned, n) == 1.0 for n in aligned.nodes if n.name == "dot_general")
