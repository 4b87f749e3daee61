"""`reduce_vjp`: SPLADE's head under `jax.grad`, its stored logits reduced over the sequence by one kernel and read
again by the backward's, each tile holding a sequence whole: the backward makes the max it compares with itself
(CPU, interpret mode)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autofuse
from autofuse.graph import Group, stage_groups
from autofuse.kernels import TEMPLATES
from autofuse.kernels.tiling import NoMatch, analyze
from autofuse.plan import plan_from_choices
from autofuse.runner.measure import compare, random_inputs
from autofuse.tuning.partition import enumerate_candidates
from examples import splade
from tests import example_graphs
from tests.kernel_checks import assert_plan_matches_jit

NAME = "reduce_vjp"
CONFIG = {"block_cols": 16, "num_warps": 2, "bwd_block_cols": 32, "bwd_num_warps": 4}


def _candidates(fn, args):
    graph = autofuse.capture(fn, *args)
    return graph, [c for c in enumerate_candidates(graph) if c.template == NAME]


def _splade_step(shapes="small", layers=None):
    """(graph, this template's candidates, args) of SPLADE's training step, enumerated once per test process
    (`tests.example_graphs`: about 20 s a time on a 2-core machine)."""
    _, graph, args = example_graphs.program("splade", "grad_step", shapes, layers)
    return graph, [c for c in example_graphs.candidates("splade", "grad_step", shapes, layers) if c.template == NAME], args


def _heads(cands):
    return [c for c in cands if c.spec.forward_spec.inner]


def _check_group(c, config, tol=1e-5):
    kernel = TEMPLATES[NAME].build(c.group, config, interpret=True, spec=c.spec)
    ins = random_inputs(c.group.input_avals(), 5)
    outs, refs = kernel(*ins), c.group.evaluate(ins)
    for o, r in zip(outs, refs):
        ok, _, why = compare(o, r, tol)
        assert ok, why


def _head_loss(h, w, b, mask):
    rep = splade.splade_head(h, w, b, mask)
    return jnp.sum(jnp.log1p(rep) * jnp.arange(rep.shape[-1], dtype=rep.dtype))  # a cotangent that is not uniform


def _head_args(S=12, B=2, D=16, V=40, seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    h = jax.random.normal(k[0], (B, S, D), jnp.float32)
    w = 0.5 * jax.random.normal(k[1], (D, V), jnp.float32)
    b = 0.1 * jax.random.normal(k[2], (V,), jnp.float32)
    return h, w, b, jnp.arange(S)[None, :] < jnp.array([[S], [S // 2]])


@pytest.mark.slow
def test_splade_training_step_offers_each_head_in_two_stages():
    """Both heads (queries, documents): stage 1 reduces over the sequence and writes per-sequence values only;
    stage 2 evaluates the forward again (the max and the count of positions at it) and writes dlogits, reading the
    cotangent one row per tile; nothing passes between them but the program's own values."""
    graph, cands, _ = _splade_step()
    heads = _heads(cands)
    assert len(heads) == 2
    for c in heads:
        spec = c.spec
        assert len(c.stages) == 2 and spec.private == ()
        logits = next(graph.avals[v].shape for v in c.group.inputs if graph.producer.get(v) is not None
                      and graph.node_index[graph.producer[v]].name == "dot_general")
        B, S, V = logits
        assert spec.forward_spec.inner == spec.backward_spec.inner == S
        assert all(graph.avals[v].shape in ((B, V), (B, 1, V)) for v in spec.forward.outputs)
        assert [graph.avals[v].shape for v in spec.backward.outputs] == [logits, (V,)]  # dlogits, db
        assert {n.name for n in spec.backward.nodes} >= {"reduce_max", "reduce_sum", "eq"}
        # stage 1 reduces the logits themselves, log1p(relu(.)) once per column (`passes.hoist_monotone`)
        assert [spec.forward.graph.avals[n.outputs[0]].shape for n in spec.forward.nodes if n.name == "log1p"] == [(B, 1, V)]
        assert spec.backward_spec.outer and set(spec.backward_spec.outer.values()) == {S}
        # the bias's gradient (db: Σ over batch and sequence of dlogits) as a partial per sequence, in stage 2
        assert [graph.avals[v].shape for v in spec.backward_spec.col_sums] == [(V,)]


@pytest.mark.slow
def test_the_head_kernels_match_xla_on_random_inputs():
    _, cands, _ = _splade_step()
    for c in _heads(cands):
        _check_group(c, CONFIG)
        _check_group(c, TEMPLATES[NAME].default_config(c.spec))


@pytest.mark.slow
def test_a_ragged_sequence_is_masked():
    """S = 12: each tile has 16 rows, 4 of them masked (a max over them would see the next sequence's, and so
    would the bias's gradient, summed per sequence)."""
    fn = jax.grad(_head_loss, argnums=(0, 1, 2))
    args = _head_args()
    graph, cands = _candidates(fn, args)
    (c,) = _heads(cands)
    _check_group(c, CONFIG)
    space = TEMPLATES[NAME].space(c.group, c.spec)
    assert not space["space"].violated(space["default"], space["facts"])
    assert space["space"].violated({**CONFIG, "block_cols": 2048}, space["facts"])
    assert_plan_matches_jit(fn, plan_from_choices(graph, [(c.group, NAME, CONFIG, c.stages)]), args, 1e-5)


@pytest.mark.slow
def test_the_training_step_with_both_heads_fused_matches_jit():
    """The whole small grad_step with both heads' pairs (in stages): every gradient leaf as jax.jit's. The
    matmul pair failed this once its two kernels computed the logits in their own orders (the max's position
    lost), and so did this template while stage 2 compared with the max stage 1 made: on the CPU, log1p in two
    compiled loops differs in its last bit. Stage 2 now makes the max it compares with itself."""
    graph, cands, args = _splade_step()
    choices = [(c.group, NAME, TEMPLATES[NAME].default_config(c.spec), c.stages) for c in _heads(cands)]
    assert_plan_matches_jit(splade.grad_step, plan_from_choices(graph, choices), args, 1e-4, noise=True)


@pytest.mark.slow
def test_stage_one_writes_no_value_of_the_logits_shape():
    graph, cands, _ = _splade_step()
    c = _heads(cands)[0]
    first = stage_groups(c.group, c.stages)[0]
    stage1 = TEMPLATES[NAME].build_stages(c.group, c.stages, CONFIG, interpret=True, spec=c.spec)[0]
    outs, private = stage1(random_inputs(first.input_avals(), 3), None)
    assert outs and max(np.size(x) for x in outs) <= 2 * 200  # [B, V], not [B, S, V]
    assert set(private) <= set(first.inputs)  # the stored logits (and mask, bias) passed on: nothing stage 1 made


def test_inner_rows_refuse_a_value_that_varies_within_a_tile():
    """A reduction over the middle axis whose output is read beside a [B, S] value that is not a tile's whole
    rows: the tiling is refused, not silently wrong."""
    def f(x, y):
        return jnp.max(x, axis=1) + y[:, 0:1]  # [B, V] plus a value of [B, S]: covers the inner axis

    x, y = jnp.ones((2, 8, 16)), jnp.ones((2, 8))
    graph = autofuse.capture(f, x, y)
    group = Group.of(graph, [n.id for n in graph.nodes])
    with pytest.raises(NoMatch):
        analyze(group, (2, 8, 16), 2, inner=1)


def test_a_max_over_a_middle_axis_runs_as_stage_one_alone():
    """The forward kernel on its own: max and sum over the middle axis of [B, S, V], S not a power of two."""
    from autofuse.kernels import row_reduce

    def f(x):
        return jnp.max(x, axis=1), jnp.sum(jnp.exp(x), axis=1)

    x = jax.random.normal(jax.random.PRNGKey(2), (3, 10, 40))
    graph = autofuse.capture(f, x)
    group = Group.of(graph, [n.id for n in graph.nodes])
    spec = analyze(group, (3, 10, 40), 2, inner=1)
    kernel = row_reduce.TEMPLATE.build(group, {"block_rows": 1, "block_cols": 16, "num_warps": 1, "num_stages": 1},
                                       interpret=True, spec=spec)
    for o, r in zip(kernel(x), f(x)):
        np.testing.assert_allclose(o, r, rtol=1e-6)


def test_both_kernels_lower_for_cuda():
    """The Triton lowering of both stages for real (`jax.export` for CUDA, no GPU): axis-0 reductions of a
    [16, 32] tile, masked rows, one-row stores of the per-sequence values."""
    from autofuse.runner.evaluator import export_for_cuda

    fn = jax.grad(_head_loss, argnums=(0, 1, 2))
    _, cands = _candidates(fn, _head_args())
    (c,) = _heads(cands)
    kernel = TEMPLATES[NAME].build(c.group, CONFIG, interpret=False, spec=c.spec)
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in c.group.input_avals()]
    assert export_for_cuda(kernel, structs).mlir_module().count("xla.gpu.triton") == 2


@pytest.mark.slow
def test_the_cost_model_counts_xlas_passes_over_the_logits():
    """At SPLADE's published shapes (shapes only): XLA is modelled as one fusion per reduction depth (the max,
    the count at it, the backward), each reading the [32, 256, 30522] logits; the pair reads them twice. The
    pair must model faster, or a tuning job never gives it a trial. One encoder layer (of the same shapes as every
    other: the heads read the last one's output), the graph tests/test_two_stage.py enumerates too."""
    from autofuse.costmodel import H200, xla_group_time_ms

    graph, cands, _ = _splade_step("published", layers=1)
    heads = _heads(cands)
    assert len(heads) == 2
    logits_ms = 1e3 * 32 * 256 * 30522 * 2 / H200.bandwidth_Bps
    for c in heads:
        xla = xla_group_time_ms(c.group, H200)
        fused = TEMPLATES[NAME].model_time_ms(c.spec, TEMPLATES[NAME].default_config(c.spec), H200)
        assert xla > 3 * logits_ms and fused < xla
