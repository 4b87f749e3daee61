"""`matmul_reduce_vjp`: a cross-entropy over a vocabulary under `jax.grad`, its logits computed twice (the
forward's reductions in one `matmul_reduce` kernel, the backward's dlogits as the epilogue of a `matmul` kernel)
and never stored (CPU, interpret mode)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autofuse
from autofuse.graph import Group, execution_order, stage_groups
from autofuse.kernels import TEMPLATES
from autofuse.plan import plan_from_choices
from autofuse.runner.measure import compare, random_inputs
from autofuse.tuning.partition import enumerate_candidates
from autofuse.tuning.select import default_plan
from tests import example_graphs
from tests.kernel_checks import assert_plan_matches_jit

NAME = "matmul_reduce_vjp"
CONFIG = {"block_m": 32, "block_n": 64, "block_k": 32, "num_warps": 4, "num_stages": 3, "split": 2,
          "bwd_block_m": 32, "bwd_block_n": 64, "bwd_block_k": 64, "bwd_num_warps": 4, "bwd_num_stages": 3, "bwd_group_m": 8}


def cross_entropy(h, w, targets):
    """Mean cross-entropy of logits h @ w against integer targets (logsumexp minus the target's logit, picked by a
    one-hot as in examples/gpt2.py: `take_along_axis`'s backward is a scatter, which stays in XLA)."""
    logits = (h @ w).astype(jnp.float32)
    target = jnp.sum(jax.nn.one_hot(targets, logits.shape[-1]) * logits, axis=-1)
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - target)


def log_cross_entropy(h, w, targets):
    """A loss whose cotangent of the logsumexp depends on the forward's result (as in a training step)."""
    return jnp.log(cross_entropy(h, w, targets))


def _args(dtype=jnp.float32, B=2, S=48, D=64, V=200, seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    h = jax.random.normal(k[0], (B, S, D), jnp.float32).astype(dtype)
    w = (0.2 * jax.random.normal(k[1], (D, V), jnp.float32)).astype(dtype)
    return h, w, jax.random.randint(k[2], (B, S), 0, V)


def _candidates(fn, args):
    graph = autofuse.capture(fn, *args)
    return graph, [c for c in enumerate_candidates(graph) if c.template == NAME]


def _example_candidates(model):
    """(graph, this template's candidates) of `examples.<model>:grad_step` at its small inputs, enumerated once
    per test process (`tests.example_graphs`)."""
    return example_graphs.program(model)[1], [c for c in example_graphs.candidates(model) if c.template == NAME]


def _check_group(c, config, backend="triton", interpret=True, tol=1e-4):
    kernel = TEMPLATES[NAME].build(c.group, config, backend=backend, interpret=interpret, spec=c.spec)
    ins = random_inputs(c.group.input_avals(), 7)
    outs, refs = kernel(*ins), c.group.evaluate(ins)
    for o, r in zip(outs, refs):
        ok, _, why = compare(o, r, tol)
        assert ok, why


@pytest.mark.slow
def test_the_gradient_of_a_cross_entropy_is_one_candidate():
    """The logits' dot, the forward's reductions and the backward's dlogits are one convex group (the cotangent
    is a constant): stage 1 writes row values only, stage 2 writes dlogits, read by the two dots outside."""
    graph, cands = _candidates(jax.grad(cross_entropy, argnums=(0, 1)), _args())
    assert len(cands) == 1
    c = cands[0]
    assert c.stages == ()
    spec = c.spec
    product = graph.avals[next(n for n in c.group.nodes if n.name == "dot_general").outputs[0]].shape
    assert all(graph.avals[v].shape != product for v in spec.forward.outputs)
    assert [graph.avals[v].shape for v in spec.backward.outputs] == [product]
    assert all(graph.node_index[k].name == "dot_general" for v in spec.backward.outputs for k in graph.consumers[v])
    assert spec.stage1 | spec.stage2 == frozenset(c.group.node_ids) and not spec.stage1 & spec.stage2
    assert all(graph.avals[v].shape != product for v in spec.private)


@pytest.mark.slow
def test_the_kernels_match_xla_on_random_inputs():
    _, (c,) = _candidates(jax.grad(cross_entropy, argnums=(0, 1)), _args())
    _check_group(c, CONFIG)
    _check_group(c, TEMPLATES[NAME].default_config(c.spec))


@pytest.mark.slow
def test_a_training_step_runs_it_in_two_stages_and_matches_jit():
    """Where the cotangent depends on the loss the group is not convex: two stages, the row values handed on
    privately; the plan's gradients equal jax.jit's."""
    fn = jax.grad(log_cross_entropy, argnums=(0, 1))
    args = _args()
    graph, (c,) = _candidates(fn, args)
    assert len(c.stages) == 2
    with pytest.raises(ValueError):
        execution_order(graph, [c.nodes])
    execution_order(graph, list(c.stages), [[0, 1]])
    assert_plan_matches_jit(fn, plan_from_choices(graph, [(c.group, NAME, CONFIG, c.stages)]), args, 1e-4)


def test_no_logits_are_handed_between_the_stages():
    """The product and everything of its shape stage 1 computes are computed again by stage 2, not kept."""
    fn = jax.grad(log_cross_entropy, argnums=(0, 1))
    graph, (c,) = _candidates(fn, _args())
    product = graph.avals[next(n for n in c.group.nodes if n.name == "dot_general").outputs[0]].shape
    first = stage_groups(c.group, c.stages)[0]
    stage1 = TEMPLATES[NAME].build_stages(c.group, c.stages, CONFIG, interpret=True, spec=c.spec)[0]
    outs, private = stage1(random_inputs(first.input_avals(), 3), None)
    assert private and all(np.shape(x) != product for x in [*outs, *private.values()])


@pytest.mark.slow
def test_default_plan_takes_it_and_the_gradient_matches():
    """The cover of the modelled costs takes the pair; `jax.grad` through the plan equals `jax.grad` itself."""
    fn = jax.grad(cross_entropy, argnums=(0, 1))
    args = _args()
    graph = autofuse.capture(fn, *args)
    plan = default_plan(graph)
    assert any(g.template == NAME for g in plan.groups), [g.template for g in plan.groups]
    assert_plan_matches_jit(fn, plan, args, 1e-4)


@pytest.mark.slow
def test_the_small_gpt2_training_step_offers_it():
    """GPT-2's grad_step: the vocabulary head's forward and backward are one candidate; its kernels match XLA."""
    graph, cands = _example_candidates("gpt2")
    assert len(cands) == 1
    _check_group(cands[0], TEMPLATES[NAME].default_config(cands[0].spec))


@pytest.mark.slow
def test_mosaic_gpu_kernels_match_xla_in_interpret_mode_and_lower_for_cuda():
    """Both kernels on Mosaic GPU: interpret mode (TMA, barriers, warpgroups simulated) against XLA on a ragged
    vocabulary, and the real CUDA lowering of the pair through `jax.export` (no GPU)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from autofuse.kernels.mosaic_gpu import matmul_reduce_vjp as mgpu
    from autofuse.runner.evaluator import export_for_cuda

    _, (c,) = _candidates(jax.grad(cross_entropy, argnums=(0, 1)), _args(jnp.bfloat16, B=1, S=128, D=64, V=320))
    assert TEMPLATES[NAME].unsupported(c.spec, "mosaic_gpu") is None
    config = mgpu.default_config(c.spec)
    _check_group(c, config, backend="mosaic_gpu", interpret=plgpu.InterpretGPUParams(), tol=2e-2)
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in c.group.input_avals()]
    text = export_for_cuda(mgpu.lower(c.group, c.spec, config), structs).mlir_module()
    assert text.count("mosaic_gpu") >= 2


@pytest.mark.slow
def test_a_recomputed_max_location_is_refused():
    """SPLADE's heads under jax.grad: the backward tests each logit for equality with the forward's max (where the
    max's gradient goes). Two kernels computing the product in their own order may miss it by the last bit and
    lose that gradient whole (6% off on the CPU, found by the fused whole-program check), so no pair is offered;
    a head whose backward is continuous (a cross-entropy's) is."""
    from examples import splade

    graph, cands = _example_candidates("splade")
    assert cands == []
    dots = [n.id for n in graph.nodes if n.name == "dot_general" and graph.avals[n.outputs[0]].shape[-1] == splade.SMALL.vocab]
    from autofuse.kernels import reread

    parts = [reread.split(graph, d) for d in dots]
    assert any(p is not None for p in parts)  # the structure is there: only the exactness test refuses it
    assert all(TEMPLATES[NAME].match(Group.of(graph, sorted(p[0]))) is None for p in parts if p is not None)


def test_an_epilogue_reads_a_value_per_outer_index():
    """A matmul epilogue with a [B, 1, N] input beside the [B, S, N] product (one row per tile: block_m divides S)."""
    def f(h, w, per_seq):
        return jnp.tanh(h @ w) * per_seq

    h = jax.random.normal(jax.random.PRNGKey(0), (2, 48, 32))
    w = jax.random.normal(jax.random.PRNGKey(1), (32, 80))
    per_seq = jax.random.normal(jax.random.PRNGKey(2), (2, 1, 80))
    graph = autofuse.capture(f, h, w, per_seq)
    group = Group.of(graph, [n.id for n in graph.nodes])
    spec = TEMPLATES["matmul"].match(group)
    assert spec is not None and spec.outer_rows == 48
    assert TEMPLATES["matmul"].default_config(spec)["block_m"] in (16,)
    assert TEMPLATES["matmul"].unsupported(spec, "mosaic_gpu") is not None  # Triton only, so far
    config = {"block_m": 16, "block_n": 32, "block_k": 32, "num_warps": 4, "num_stages": 2, "group_m": 4}
    (out,) = TEMPLATES["matmul"].build(group, config, interpret=True, spec=spec)(h, w, per_seq)
    ok, _, why = compare(out, f(h, w, per_seq), 1e-5)
    assert ok, why
    with pytest.raises(NotImplementedError, match="divide"):
        TEMPLATES["matmul"].build(group, {**config, "block_m": 32}, interpret=True, spec=spec)


def test_a_count_of_the_maximum_rescales_online():
    """matmul_reduce alone: sum(x == max(x)) over the sequence, folded block by block (reset when the max moves)."""
    def count_of_max(h, w):
        x = h @ w
        return jnp.sum((x == jnp.max(x, axis=1, keepdims=True)).astype(jnp.float32), axis=1)

    h = jnp.round(jax.random.normal(jax.random.PRNGKey(0), (2, 64, 16)))  # small integers: ties happen
    w = jnp.round(jax.random.normal(jax.random.PRNGKey(1), (16, 48)))
    graph = autofuse.capture(count_of_max, h, w)
    from autofuse.kernels import matmul_reduce

    group = Group.of(graph, [n.id for n in graph.nodes])
    spec = matmul_reduce.TEMPLATE.match(group)
    assert spec is not None and not spec.over_n
    kernel = matmul_reduce.TEMPLATE.build(group, {"block_m": 16, "block_n": 16, "block_k": 16, "num_warps": 4, "num_stages": 2,
                                                  "split": 1}, interpret=True, spec=spec)
    (out,) = kernel(h, w)
    ref = count_of_max(h, w)
    assert float(jnp.max(ref)) > 1  # ties were counted
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


@pytest.mark.slow
def test_xla_is_modelled_as_two_fusions_each_reading_the_product():
    """XLA cannot fuse the forward's reductions with the backward's reader of the product (a training step puts the
    cotangent between them): its modelled time is the two parts', each reading the product, not one pass's."""
    from autofuse import costmodel

    _, (c,) = _candidates(jax.grad(log_cross_entropy, argnums=(0, 1)), _args())
    g = c.group.graph
    first = sorted(i for i in c.group.node_ids if i in c.spec.stage1 or g.node_index[i].name == "reduce_sum")
    parts = costmodel._reduced_then_read(c.group)
    assert parts is not None and parts[0] and parts[1]
    whole = costmodel.xla_group_time_ms(c.group)
    assert whole == pytest.approx(sum(costmodel.xla_group_time_ms(Group.of(g, ids)) for ids in parts))
    assert whole > costmodel.xla_group_time_ms(Group.of(g, first))


@pytest.mark.parametrize("tail, grown", [(10, True), (300, False)])
def test_a_growth_along_a_long_chain_of_the_products_shape_is_given_up(tail, grown):
    """A log-softmax of a product, then `tail` elementwise steps on its result: the growth from the dot takes them all
    (each keeps the product's shape) and is a two-stage group while it stays within `reread.MAX_MEMBERS`; past that,
    the growth stops and no group is made (a projection onto a residual stream grew through every later layer of
    GPT-2 medium's forward, 48 unique growths of up to 1105 nodes, each matched and declined: a third of the
    enumeration; the candidates are the same without them)."""
    from autofuse.kernels import reread

    def fn(x, w):
        z = jax.nn.log_softmax(x @ w, axis=-1)
        for _ in range(tail):
            z = z * 1.001
        return z

    g = autofuse.capture(fn, jax.ShapeDtypeStruct((64, 32), jnp.float32), jax.ShapeDtypeStruct((32, 128), jnp.float32))
    (dot,) = [n.id for n in g.nodes if n.name == "dot_general"]
    parts = reread.split(g, dot)
    assert (parts is not None) == grown
    if grown:
        assert tail < len(parts[0]) <= reread.MAX_MEMBERS and parts[1] and parts[2]
