"""Template `reduce_vjp`: reductions of a stored value over a middle axis, with the backward that reads it again,
as two memory-bound kernels whose tiles hold that axis whole.

SPLADE's head under `jax.grad`: the logits x = h @ W [B, S, V] are reduced over the sequence (m = max of
log1p(relu(x + b)) * mask), and the backward reads x again to send the cotangent to the positions at the max,
divided by their count (`jax.grad` of `max`: eq(log1p(relu(x + b)) * mask, m)). XLA runs that as four passes over
the logits (the max, the count, dlogits with db, dlogits again). Here the dot stays XLA's (or another group's) and
the nodes that grow from its product (`reread.split`) run as two `row_reduce` kernels over tiles of one sequence
and a block of columns, the sequence whole (`TileSpec.inner`):
  - stage 1, what the program reads of the forward (the max: of the logits, the monotone log1p(relu(.)) applied
    once per column, `passes.hoist_monotone`), [B, V] only written;
  - stage 2, the backward with the forward evaluated again, the max and the count included (`reread.recomputed`
    with `whole`), reading the cotangent [B, V] one row per tile (`TileSpec.outer`), writing dlogits and the
    bias's gradient (db = Σ dlogits over batch and sequence) as a partial per sequence (`TileSpec.col_sums`).
Stage 2 compares values with a max it made itself from the same tile, so the comparison holds whatever the
compiled arithmetic (`matmul_reduce_vjp`, which hands the max on and computes the product again, cannot promise
that and refuses such a group).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..costmodel import H200, GPUModel
from ..graph import Graph, Group
from ..ops import OpClass, op_class
from .passes import hoist_monotone
from . import reread
from .reread import split, two_stages
from .template import NoMatch, Template
from .tiling import TileSpec, analyze, next_pow2, tile_time_ms

BWD = "bwd_"  # the prefix of stage 2's config keys
MAX_INNER = 1024  # the longest reduced middle axis a tile holds whole (with 16 columns: a 16K-element tile)


@dataclass
class ReduceVJPSpec:
    group: Group
    stage1: frozenset[int]  # the forward's nodes (the group's plan stage 1)
    stage2: frozenset[int]  # the backward's nodes (stage 2)
    forward: Group  # stage 1's kernel: the forward's nodes the program reads (a max over a monotone chain
    # reducing the chain's base: `passes.hoist_monotone`, on a copy of the graph)
    forward_spec: TileSpec  # a `row_reduce` tiling with inner rows
    backward: Group  # stage 2's kernel: stage 2 with the forward it evaluates again
    backward_spec: TileSpec  # likewise
    private: tuple[int, ...] = ()  # stage 1's outputs only stage 2 reads: none, stage 2 evaluates them again


def _grown(graph: Graph, dot: int) -> tuple[frozenset[int], frozenset[int], frozenset[int]] | None:
    """`reread.split` from `dot` without the dot: (the group, stage 1, stage 2), its product an input."""
    parts = split(graph, dot, column_sums=True)
    if parts is None:
        return None
    members, first, second = parts
    return members - {dot}, first - {dot}, second


def _inner_spec(kernel: Group, S: tuple) -> TileSpec | None:
    """A tiling of one stage with its reductions over one middle axis of S, held whole per tile (and sums over
    all the rows, written as a partial per tile: `TileSpec.col_sums`)."""
    g = kernel.graph
    axes = {tuple(nd.params["axes"]) for nd in kernel.nodes if op_class(nd.name) is OpClass.REDUCTION
            and len(g.aval(nd.inputs[0]).shape) == len(S) and any(g.aval(nd.inputs[0]).shape[d] != 1 for d in nd.params["axes"])}
    axes.discard(tuple(range(len(S) - 1)))  # a column's sum
    if len(axes) != 1 or len(next(iter(axes))) != 1:
        return None
    ((axis,),) = axes
    if axis == len(S) - 1 or S[axis] > MAX_INNER:
        return None  # a trailing axis is a row's reduction (`row_reduce`, `matmul_reduce_vjp`)
    try:
        return analyze(kernel, S, axis + 1, inner=axis, column_sums=True)
    except NoMatch:
        return None


def _match(group: Group) -> ReduceVJPSpec | None:
    g = group.graph
    if any(op_class(n.name) in (OpClass.CONTRACTION, OpClass.OPAQUE) for n in group.nodes):
        return None
    members = set(group.node_ids)
    for v in group.inputs:
        dot = g.producer.get(v)
        if dot is None or op_class(g.node_index[dot].name) is not OpClass.CONTRACTION:
            continue
        parts = _grown(g, dot)
        if parts is None or parts[0] != members:
            continue
        _, first, second = parts
        S = tuple(g.avals[v].shape)
        st = two_stages(group, first, second, S, whole=True)
        if st is None or st.private:
            return None
        forward = hoist_monotone(st.forward.alone())  # the max of the logits, log1p(relu(.)) once per column
        forward_spec = _inner_spec(forward, S) or _inner_spec(st.forward, S)
        backward_spec = _inner_spec(st.backward, S) if forward_spec is not None else None
        if backward_spec is None or backward_spec.inner != forward_spec.inner:
            return None
        return ReduceVJPSpec(group, frozenset(first), frozenset(second), forward_spec.group, forward_spec, st.backward,
                             backward_spec)
    return None


def candidate_groups(graph: Graph, fusible) -> list[tuple[Group, ReduceVJPSpec, tuple[frozenset[int], ...]]]:
    """Per dot whose product is reduced over a middle axis and read again: the group grown from its product."""
    return reread.candidate_groups(graph, fusible, lambda dot: _grown(graph, dot), TEMPLATE)


def stage_configs(config: dict) -> tuple[dict, dict]:
    """(stage 1's `row_reduce` config, stage 2's) of a config of this template."""
    return reread.stage_configs(config, BWD)


class ReduceVJPTemplate(Template[ReduceVJPSpec]):
    name = "reduce_vjp"

    def match(self, group: Group) -> ReduceVJPSpec | None:
        """The two stages and their kernels' tilings, or None."""
        return _match(group)

    def candidate_groups(self, graph: Graph, fusible: Callable[[int], bool]) -> list[tuple[Group, ReduceVJPSpec, tuple[frozenset[int], ...]]]:
        return candidate_groups(graph, fusible)

    def stage_split(self, spec: ReduceVJPSpec) -> tuple[frozenset[int], ...]:
        return spec.stage1, spec.stage2

    def facts(self, group: Group, spec: ReduceVJPSpec) -> dict:
        """What search_spaces/reduce_vjp.toml's constraints on each stage's columns per tile and warps read."""
        return {"C": spec.forward_spec.C, "inner": spec.forward_spec.inner}

    def model_time_ms(self, spec: ReduceVJPSpec, config: dict, model: GPUModel = H200) -> float:
        """Each stage one program per sequence and block of columns, one read of its inputs."""
        return sum(tile_time_ms(s, row_config(s, c), model, two_d_grid=True)
                   for s, c in zip((spec.forward_spec, spec.backward_spec), stage_configs(config)))


def row_config(spec: TileSpec, config: dict) -> dict:
    """A stage's config as `row_reduce` runs it: the tile's rows are the inner rows, one pass."""
    return {**config, "block_rows": next_pow2(spec.inner), "num_stages": 1}


TEMPLATE = ReduceVJPTemplate()
