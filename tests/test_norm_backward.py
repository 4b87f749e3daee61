"""A norm's backward as one `row_reduce` kernel: dx and the sums over the rows of each column (dγ = Σ dy·x̂,
dβ = Σ dy), written per block of rows as partials and added after the kernel (CPU, interpret mode)."""
from __future__ import annotations

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


@pytest.mark.parametrize("config", [ONE_PASS, LOOPED], ids=["one pass", "column loops"])
@pytest.mark.parametrize("fn,shapes,sums", CASES)
def test_the_kernel_matches_xla(fn, shapes, sums, config):
    _, (c,) = _whole(fn, shapes)
    kernel = TEMPLATES["row_reduce"].build(c.group, config, interpret=True, spec=c.spec)
    for seed in (1, 2):
        ins = random_inputs(c.group.input_avals(), seed)
        for o, r in zip(kernel(*ins), c.group.evaluate(ins)):
            ok, _, why = compare(o, r, 1e-5)
            assert ok, why


@pytest.mark.slow
def test_a_plan_of_it_matches_jit_in_bfloat16():
    """The plan's gradients (the partials added in float32, then rounded) against jax.jit's, bf16 inputs."""
    shapes = (R + (C,), (C,), (C,), R + (C,))
    args = [jax.random.normal(jax.random.PRNGKey(i), s, jnp.float32).astype(jnp.bfloat16) for i, s in enumerate(shapes)]
    graph = autofuse.capture(layer_norm_vjp, *args)
    (c,) = [c for c in enumerate_candidates(graph) if c.template == "row_reduce" and len(c.group.node_ids) == len(graph.nodes)]
    assert_plan_matches_jit(layer_norm_vjp, plan_from_choices(graph, [(c.group, "row_reduce", LOOPED)]), args, 2e-2)


def test_a_sum_over_the_rows_read_inside_the_group_is_refused():
    """A column sum that the group uses again (here: normalising by it) is not a partial any more: no match."""
    def f(x):
        s = jnp.sum(x, axis=(0, 1))
        return x / jnp.sum(x, axis=-1, keepdims=True) + s

    graph = autofuse.capture(f, jnp.zeros(R + (C,), jnp.float32))
    from autofuse.graph import Group

    assert TEMPLATES["row_reduce"].match(Group.of(graph, [n.id for n in graph.nodes])) is None
    assert np.all(np.isfinite(jax.jit(f)(jnp.ones(R + (C,)))))
