"""`aligned_region`: a cross-entropy over an unaligned vocabulary run by XLA with the vocabulary padded through the
whole region (the logits' dot, the reductions, dlogits, the dots that contract it), so that XLA can write dlogits
over the logits in place as jax.jit does. The same numbers as jax.jit where the padding would change them (a max
and a sum over the vocabulary, contractions over it), in one unit and in two stages."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import autofuse
import autofuse.graph
import autofuse.plan
from autofuse.kernels import TEMPLATES
from autofuse.graph import stage_groups
from autofuse.kernels.aligned_region import padded_axes
from autofuse.plan import plan_from_choices
from autofuse.runner.measure import compare
from autofuse.tuning.partition import enumerate_candidates
from examples import gpt2
from tests.quick import slow_except

NAME = "aligned_region"


def cross_entropy(h, w, targets):
    """GPT-2's head: logits against the tied embedding, the mean of logsumexp minus the target's logit (one-hot)."""
    logits = (h @ w.T).astype(jnp.float32)
    target = jnp.sum(jax.nn.one_hot(targets, logits.shape[-1]) * logits, axis=-1)
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - target)


def squared(h, w, targets):
    """The loss squared: the backward's cotangent depends on the forward's value, so the region is not convex."""
    return cross_entropy(h, w, targets) ** 2


def _args(V, negative=False, dtype=jnp.bfloat16):
    """h and w; with `negative`, every logit is below zero, so a padded zero would win an unmasked max and add
    exp(0 - max) to an unmasked sum."""
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    h = jax.random.normal(k[0], (2, 48, 32), jnp.float32)
    w = 0.2 * jax.random.normal(k[1], (V, 32))
    if negative:
        h, w = jnp.abs(h), -jnp.abs(w) - 0.1
    return h.astype(dtype), w.astype(dtype), jax.random.randint(k[2], (2, 48), 0, V)


def _regions(fn, args):
    graph = autofuse.capture(fn, *args)
    return graph, [c for c in enumerate_candidates(graph) if c.template == NAME]


def _check(fn, args, align, tol=1e-2):
    graph, cands = _regions(fn, args)
    assert len(cands) == 1
    plan = plan_from_choices(graph, [(c.group, NAME, {"align": align, "backend": "xla_ops"}, c.stages) for c in cands])
    fused = autofuse.jit(fn, plan=plan, on_miss="error")
    outs, refs = fused(*args), jax.jit(fn)(*args)
    assert fused.last_status.startswith("plan: 1 fused group (aligned_region)"), fused.last_status
    for o, r in zip(jax.tree.leaves(outs), jax.tree.leaves(refs)):
        assert o.shape == r.shape
        ok, _, why = compare(o, r, tol)
        assert ok, why
    return cands[0]


@pytest.mark.parametrize("align", slow_except([8, 64, 128], "64"))
def test_the_gradient_of_a_vocabulary_head_runs_padded_with_jax_jits_numbers(align):
    """One region: the logits' dot, the reductions and dlogits, and both dots that contract dlogits (dh, dw); the
    logits all below zero, where a padded zero read by the max or the sum would change every gradient."""
    fn = jax.grad(cross_entropy, argnums=(0, 1))
    c = _check(fn, _args(203, negative=True), align)
    dots = [n for n in c.group.nodes if n.name == "dot_general"]
    assert len(dots) == 3 and c.stages == ()
    assert c.spec.extent == 203


def test_a_region_whose_backward_waits_on_its_forward_runs_in_two_stages():
    """The squared loss's cotangent is computed from the loss, outside the region: stage 1 (the forward) hands
    stage 2 its padded values privately."""
    c = _check(jax.grad(squared, argnums=(0, 1)), _args(203, negative=True), 64)
    assert len(c.stages) == 2
    first = {c.group.graph.node_index[i].name for i in c.stages[0]}
    assert "reduce_max" in first and "dot_general" in first


def squared_with_bias(h, w, b, targets):
    """`squared` with a bias on the logits: stage 2 evaluates the biased logits again and needs the bias, which only
    stage 1 reads as an input."""
    logits = (h @ w.T + b).astype(jnp.float32)
    target = jnp.sum(jax.nn.one_hot(targets, logits.shape[-1]) * logits, axis=-1)
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - target) ** 2


def test_stage_two_gets_the_inputs_of_what_it_evaluates_again():
    h, w, t = _args(203)
    b = (0.1 * jax.random.normal(jax.random.PRNGKey(5), (203,))).astype(jnp.bfloat16)
    c = _check(jax.grad(squared_with_bias, argnums=(0, 1, 2)), (h, w, b, t), 64)
    assert len(c.stages) == 2


def test_aligned_rows_and_a_forward_alone_make_no_region():
    assert _regions(jax.grad(cross_entropy, argnums=(0, 1)), _args(256))[1] == []  # 512-byte rows
    assert _regions(cross_entropy, _args(203))[1] == []  # nothing reads the logits after their reductions


@pytest.mark.slow
def test_gpt2s_training_step_at_an_unaligned_vocabulary():
    """The example model's step (one block, a vocabulary of 250): the region takes the head's three dots and
    every gradient is jax.jit's."""
    cfg = gpt2.Config(vocab=250, d_model=64, n_layers=1, max_seq=32)
    args = gpt2.make_inputs(cfg, batch=2, seq=32)
    for step in (gpt2.grad_step_cudnn, gpt2.grad_step_cudnn_remat):
        c = _check(step, args, 64)
        assert sum(n.name == "dot_general" for n in c.group.nodes) == 3


def test_padded_axes_follow_broadcasts_reshapes_and_contractions_but_not_a_reduced_axis():
    fn = jax.grad(cross_entropy, argnums=(0, 1))
    graph, (c,) = _regions(fn, _args(203))
    g, spec = graph, c.spec
    assert all(g.aval(v).shape[a] == 203 for v, a in spec.axes.items())
    for nd in c.group.nodes:
        if nd.name == "reduce_max":  # the vocabulary reduced: the row maximum carries no padded axis
            assert nd.inputs[0] in spec.axes and nd.outputs[0] not in spec.axes
    dot = g.node_index[spec.dot]
    assert padded_axes(g, [dot.id], (dot.outputs[0], 2)) == {dot.outputs[0]: 2, dot.inputs[1]: 1}


def test_the_lowering_exports_for_cuda():
    """XLA's own operations for a CUDA GPU through `jax.export` (no GPU here): no Pallas kernel."""
    from autofuse.runner.evaluator import export_for_cuda

    _, (c,) = _regions(jax.grad(cross_entropy, argnums=(0, 1)), _args(203))
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in c.group.input_avals()]
    for chunks in (1, 2):  # at once, and as a scan over chunks of the rows
        kernel = TEMPLATES[NAME].build(c.group, {"align": 64, "chunks": chunks}, backend="xla_ops", spec=c.spec)
        text = export_for_cuda(kernel, structs).mlir_module()
        assert "dot_general" in text and "pad" in text and "mosaic_gpu" not in text
        assert ("stablehlo.while" in text) == (chunks > 1)


def test_stage_one_hands_on_the_product_and_row_values_only():
    """A stage's results are materialised: the [rows, vocabulary] values stage 2 reads (the float32 logits, their
    exponentials) are evaluated again there from the padded product, the one such array handed on (jax.jit too
    holds only the logits between its forward and backward)."""
    fn = jax.grad(squared, argnums=(0, 1))
    args = _args(203)
    graph, (c,) = _regions(fn, args)
    first, _ = TEMPLATES[NAME].build_stages(c.group, c.stages, {"align": 64}, backend="xla_ops", spec=c.spec)
    unit = stage_groups(c.group, c.stages)[0]
    _, handed = first([jnp.ones(graph.aval(v).shape, graph.aval(v).dtype) for v in unit.inputs], None)
    wide = {v: x for v, x in handed.items() if 203 in graph.aval(v).shape}
    assert list(wide) == [graph.node_index[c.spec.dot].outputs[0]]
    (x,) = wide.values()
    assert x.dtype == jnp.bfloat16 and x.shape[-1] == 256


def log_square(h, w):
    """A backward that is infinite at a zero logit (d log x² = 2 / x): the padded logits are exactly zero, so the
    contraction over the vocabulary must read zeros at the padding, not inf · 0."""
    logits = (h @ w.T).astype(jnp.float32)
    return jnp.mean(jnp.sum(jnp.log(jnp.square(logits)), axis=-1))


def test_a_contraction_over_the_padding_reads_zeros_there_even_where_the_backward_is_infinite():
    h, w, _ = _args(203)
    c = _check(jax.grad(log_square, argnums=(0, 1)), (h, w), 64, tol=2e-2)
    assert sum(n.name == "dot_general" for n in c.group.nodes) == 3


def test_both_dots_read_one_dlogits():
    """dh contracts the vocabulary and dW the rows: both read the same zero-padded dlogits, so XLA writes it once
    (zeroed only for dh, it wrote two [rows, vocabulary] arrays: 1.5 GiB more at GPT-2's head)."""
    fn = jax.grad(cross_entropy, argnums=(0, 1))
    _, (c,) = _regions(fn, _args(203))
    kernel = TEMPLATES[NAME].build(c.group, {"align": 64}, backend="xla_ops", spec=c.spec)
    jaxpr = jax.make_jaxpr(kernel)(*[jnp.ones(a.shape, a.dtype) for a in c.group.input_avals()]).jaxpr
    dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 3
    read = [{str(v) for v in e.invars} for e in dots[1:]]
    assert read[0] & read[1], "dh and dW read different arrays"


def test_a_region_runs_in_chunks_of_its_rows_with_jax_jits_numbers():
    """Chunks of the product's leading axis one after another (a scan): each node maps a chunk to a chunk but
    dW's dot, which sums over the rows (its partials added in float32)."""
    for fn, args in ((jax.grad(cross_entropy, argnums=(0, 1)), _args(203, negative=True)),
                     (jax.grad(log_square, argnums=(0, 1)), _args(203)[:2])):
        graph, (c,) = _regions(fn, args)
        assert c.spec.rows == 2 and [graph.node_index[i].name for i in c.spec.sinks] == ["dot_general"]
        plan = plan_from_choices(graph, [(c.group, NAME, {"align": 64, "chunks": 2, "backend": "xla_ops"}, c.stages)])
        run = autofuse.plan.executor(graph, plan)
        flat = autofuse.graph.flatten_args(graph, fn, args, {})
        assert "scan" in str(jax.make_jaxpr(lambda *xs: run(xs))(*flat))
        for o, r in zip(jax.jit(lambda *xs: run(xs))(*flat), jax.jit(lambda *xs: graph.evaluate(xs))(*flat)):
            ok, _, why = compare(o, r, 1e-2)
            assert ok, why
    assert TEMPLATES[NAME].unsupported(c.spec, "xla_ops", {"align": 64, "chunks": 4}) is not None  # 2 rows: no 4 chunks


def test_a_staged_region_does_not_run_in_chunks():
    """The squared loss's backward waits on the loss of every row: no chunk can finish before the others."""
    _, (c,) = _regions(jax.grad(squared, argnums=(0, 1)), _args(203))
    assert c.spec.rows == 0 and TEMPLATES[NAME].unsupported(c.spec, "xla_ops", {"align": 64, "chunks": 2}) is not None


def test_in_chunks_no_array_of_the_logits_size_is_held_whole():
    """GPT-2's step at its vocabulary (8 sequences of 256 tokens, d = 64): XLA's temporaries on this CPU against
    jax.jit's, whose logits and float32 work over [2048, 50257] dominate them. In 8 chunks a chunk's are held at a
    time: under half of jax.jit's, and the gradients the same."""
    cfg = gpt2.Config(vocab=50257, d_model=64, n_layers=1, max_seq=256)
    args = gpt2.make_inputs(cfg, batch=8, seq=256)
    fn = gpt2.grad_step_cudnn
    graph, (c,) = _regions(fn, args)
    flat = autofuse.graph.flatten_args(graph, fn, args, {})
    ref = jax.jit(lambda *xs: graph.evaluate(xs))

    def temp(chunks):
        run = autofuse.plan.executor(graph, plan_from_choices(graph, [(c.group, NAME, {"align": 64, "chunks": chunks, "backend": "xla_ops"})]))
        f = jax.jit(lambda *xs: run(xs))
        return f, f.lower(*flat).compile().memory_analysis().temp_size_in_bytes

    chunked, chunked_bytes = temp(8)
    whole = ref.lower(*flat).compile().memory_analysis().temp_size_in_bytes
    assert chunked_bytes < 0.5 * whole, (chunked_bytes, whole)
    assert chunked_bytes < 0.5 * temp(1)[1]
    for o, r in zip(chunked(*flat), ref(*flat)):
        ok, _, why = compare(o, r, 1e-2)
        assert ok, why


def test_a_plan_over_the_memory_cap_is_tried_again_in_chunks():
    """`tune(max_memory=)`: a plan whose region runs whole is over the cap (the device stood in for: 3 GiB whole,
    1 GiB in chunks, jax.jit 2 GiB); before any smaller plan it is validated again with its groups' leaner configs,
    the region in chunks, which is kept."""
    from autofuse.plan import Plan
    from autofuse.runner.protocol import Timing, ValidationResult
    from autofuse.status import TrialStatus
    from autofuse.tuning.budget import parse_bytes
    from autofuse.tuning.select import Cover
    from autofuse.tuning.validate import validate

    fn = jax.grad(cross_entropy, argnums=(0, 1))
    graph, (c,) = _regions(fn, _args(203))
    plan = plan_from_choices(graph, [(c.group, NAME, {"align": 64, "chunks": 1, "backend": "xla_ops"})])
    t = lambda ms: Timing(ms, ms * 0.99, ms * 1.01, ms * 0.995, ms * 1.005)  # noqa: E731
    seen = []

    class Device:
        def call(self, req):
            groups = Plan.from_json(req.plan_json).groups
            chunks = groups[0].config["chunks"] if groups else 0
            seen.append(chunks)
            return ValidationResult(TrialStatus.OK, 0.0, baseline=t(10.0), plan=t(9.0 if groups else 10.0), ratio=t(0.9 if groups else 1.0),
                                    peak_bytes={0: 2, 1: 3, 2: 1}[chunks] * 2**30, baseline_peak_bytes=2 * 2**30)

    rep = validate(graph, Cover(plan, 1.0, 0.5), Device(), "device", "ce", [], 0, 0.0, max_memory_bytes=parse_bytes("2.5GiB"))
    assert seen[:2] == [1, 2], seen
    assert [g.config["chunks"] for g in rep.plan.groups] == [2]
    assert rep.plan.provenance["peak_bytes"] == 2**30


def test_the_memory_probe_builds_a_templates_own_plans_without_a_tuning_job():
    """`python -m benchmarks profile memory --template NAME`: the plan of every group the template finds by itself
    at its default config, then each alone (where there are several); each runs the program as jax.jit does."""
    from benchmarks.memory_probe import template_plans

    fn = jax.grad(cross_entropy, argnums=(0, 1))
    args = _args(203)
    graph = autofuse.capture(fn, *args)
    flat = autofuse.graph.flatten_args(graph, fn, args, {})
    dots = template_plans(graph, "aligned_dot")
    assert [len(p.groups) for _, p in dots] == [3, 1, 1, 1] and dots[0][0] == "all 3 aligned_dot groups"
    (name, region), = template_plans(graph, NAME)
    assert [g.template for g in region.groups] == [NAME]
    (chunked_name, chunked), = template_plans(graph, NAME, {"chunks": 2})
    assert [g.config["chunks"] for g in chunked.groups] == [2] and chunked_name.endswith('{"chunks": 2}')
    want = jax.jit(lambda *xs: graph.evaluate(xs))(*flat)
    for _, plan in dots + [(name, region), (chunked_name, chunked)]:
        run = autofuse.plan.executor(graph, plan)
        for o, r in zip(jax.jit(lambda *xs: run(xs))(*flat), want):
            ok, _, why = compare(o, r, 1e-2)
            assert ok, why
