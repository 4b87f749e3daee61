"""A norm's backward as one `row_reduce` kernel: dx and the sums over the rows of each column (dγ = Σ dy·x̂,
dβ = Σ dy), written per block of rows as partials and added after the kernel (CPU, interpret mode)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autofuse
from autofuse.kernels import TEMPLATES
from autofuse.plan import plan_from_choices
from autofuse.runner.measure import compare, random_inputs
from autofuse.tuning.partition import enumerate_candidates
from benchmarks.norm_grad import layer_norm_grad as layer_norm_vjp
from benchmarks.norm_grad import rms_norm_grad as rms_norm_vjp
from tests.kernel_checks import assert_plan_matches_jit

ONE_PASS = {"block_rows": 4, "block_cols": 256, "num_warps": 4, "num_stages": 1}  # a row in one column block
LOOPED = {"block_rows": 8, "block_cols": 64, "num_warps": 4, "num_stages": 1}  # rows longer than a block: column loops
WALKED = {**ONE_PASS, "row_steps": 8}  # each program walks 8 blocks of rows: 32 rows a partial, the last program past R
WALKED_ALL = {**ONE_PASS, "row_steps": 32}  # one program walks every row: one partial


R, C = (3, 37), 200  # rows not a multiple of a block, columns not a power of two
CASES = [(layer_norm_vjp, (R + (C,), (C,), (C,), R + (C,)), 2), (rms_norm_vjp, (R + (C,), (C,), R + (C,)), 1)]


def _whole(fn, shapes):
    graph = autofuse.capture(fn, *[jnp.zeros(s, jnp.float32) for s in shapes])
    whole = [c for c in enumerate_candidates(graph) if c.template == "row_reduce" and len(c.group.node_ids) == len(graph.nodes)]
    return graph, whole


@pytest.mark.parametrize("fn,shapes,sums", CASES)
def test_the_whole_backward_is_one_row_reduce_candidate(fn, shapes, sums):
    """Forward statistics, dx and every column sum (dβ reads only dy: offered beside the rest) in one group."""
    graph, whole = _whole(fn, shapes)
    assert len(whole) == 1
    spec = whole[0].spec
    assert len(spec.col_sums) == sums and all(graph.avals[v].shape == (C,) for v in spec.col_sums)


@pytest.mark.parametrize("config", [ONE_PASS, LOOPED, WALKED, WALKED_ALL], ids=["one pass", "column loops", "walked", "walked whole"])
@pytest.mark.parametrize("fn,shapes,sums", CASES)
def test_the_kernel_matches_xla(fn, shapes, sums, config):
    _, (c,) = _whole(fn, shapes)
    kernel = TEMPLATES["row_reduce"].build(c.group, config, interpret=True, spec=c.spec)
    for seed in (1, 2):
        ins = random_inputs(c.group.input_avals(), seed)
        for o, r in zip(kernel(*ins), c.group.evaluate(ins)):
            ok, _, why = compare(o, r, 1e-5)
            assert ok, why


@pytest.mark.parametrize("fn,shapes,sums", CASES[:1])
def test_programs_that_walk_row_blocks_write_fewer_partials(fn, shapes, sums):
    """row_steps = k: a k-th of the programs, so a k-th of the partials (the pallas_call's [blocks, C] outputs)."""
    _, (c,) = _whole(fn, shapes)
    ins = random_inputs(c.group.input_avals(), 0)

    def partial_rows(config):
        k = TEMPLATES["row_reduce"].build(c.group, config, interpret=True, spec=c.spec)
        (call,) = [e for e in jax.make_jaxpr(k)(*ins).eqns if e.primitive.name == "pallas_call"]
        rows = math.prod(R)  # dx's rows, not a partial's
        return sorted({v.aval.shape[0] for v in call.outvars if v.aval.shape[1:] == (C,) and v.aval.shape[0] != rows})

    assert partial_rows(ONE_PASS) == [28] and partial_rows(WALKED) == [4] and partial_rows(WALKED_ALL) == [1]


def test_walking_row_blocks_is_a_column_sums_config_by_default_at_a_models_size():
    """GPT-2 medium's layer norm backward (16384 x 1024): the default walks row blocks (about PROGRAMS_WITH_SUMS
    programs), the model prices the partials it saves, and a config that walks rows longer than one column block, or
    a group without column sums, is refused before it compiles."""
    from autofuse.kernels.triton import row_reduce as lowering

    shapes = ((16384, 1024), (1024,), (1024,), (16384, 1024))
    graph = autofuse.capture(layer_norm_vjp, *[jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes])
    (c,) = [c for c in enumerate_candidates(graph) if c.template == "row_reduce" and len(c.group.node_ids) == len(graph.nodes)]
    tmpl = TEMPLATES["row_reduce"]
    default = tmpl.default_config_of(c.spec, "triton")
    programs = 16384 // (default["block_rows"] * default["row_steps"])
    assert default["row_steps"] > 1 and lowering.PROGRAMS_WITH_SUMS // 2 < programs <= lowering.PROGRAMS_WITH_SUMS
    assert default["block_rows"] == 1 and default["num_warps"] == 8  # one row a block (results/row_reduce_sums_h200.md)
    narrow = autofuse.capture(layer_norm_vjp, *[jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((1 << 20, 64), (64,), (64,), (1 << 20, 64))])
    (n,) = [c for c in enumerate_candidates(narrow) if c.template == "row_reduce" and len(c.group.node_ids) == len(narrow.nodes)]
    d = tmpl.default_config_of(n.spec, "triton")  # rows of 64: blocks of 1024 elements still (16 rows), 32 steps each
    assert d["block_rows"] * d["block_cols"] == lowering.WALKED_BLOCK and (1 << 20) // (d["block_rows"] * d["row_steps"]) == 2048
    assert tmpl.model_time_ms(c.spec, default) < tmpl.model_time_ms(c.spec, {**default, "row_steps": 1})
    assert tmpl.unsupported(c.spec, "triton", {**default, "block_cols": 256}) is not None
    softmax = autofuse.capture(lambda x: jax.nn.softmax(x, axis=-1), jax.ShapeDtypeStruct((4096, 1024), jnp.float32))
    (s,) = [c for c in enumerate_candidates(softmax) if c.template == "row_reduce" and len(c.group.node_ids) == len(softmax.nodes)]
    assert tmpl.default_config_of(s.spec, "triton")["row_steps"] == 1
    assert tmpl.space_of(s.group, s.spec, "triton")["params"]["row_steps"] == [1]  # searched only where it can apply
    assert len(tmpl.space_of(c.group, c.spec, "triton")["params"]["row_steps"]) > 1
    assert tmpl.unsupported(s.spec, "triton", {**tmpl.default_config_of(s.spec, "triton"), "row_steps": 2}) is not None


@pytest.mark.slow
def test_a_plan_of_it_matches_jit_in_bfloat16():
    """The plan's gradients (the partials added in float32, then rounded) against jax.jit's, bf16 inputs."""
    shapes = (R + (C,), (C,), (C,), R + (C,))
    args = [jax.random.normal(jax.random.PRNGKey(i), s, jnp.float32).astype(jnp.bfloat16) for i, s in enumerate(shapes)]
    graph = autofuse.capture(layer_norm_vjp, *args)
    (c,) = [c for c in enumerate_candidates(graph) if c.template == "row_reduce" and len(c.group.node_ids) == len(graph.nodes)]
    for config in (LOOPED, WALKED):
        assert_plan_matches_jit(layer_norm_vjp, plan_from_choices(graph, [(c.group, "row_reduce", config)]), args, 2e-2)


def test_a_sum_over_the_rows_read_inside_the_group_is_refused():
    """A column sum that the group uses again (here: normalising by it) is not a partial any more: no match."""
    def f(x):
        s = jnp.sum(x, axis=(0, 1))
        return x / jnp.sum(x, axis=-1, keepdims=True) + s

    graph = autofuse.capture(f, jnp.zeros(R + (C,), jnp.float32))
    from autofuse.graph import Group

    assert TEMPLATES["row_reduce"].match(Group.of(graph, [n.id for n in graph.nodes])) is None
    assert np.all(np.isfinite(jax.jit(f)(jnp.ones(R + (C,)))))
