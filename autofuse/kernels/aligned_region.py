"""Template `aligned_region`: a dot with an unaligned free dimension, the work that reduces and reads its product
along it, and the unaligned dots that contract what that work makes, all run by XLA with that dimension padded.

`aligned_dot` pads one dot's operands and slices its product back. In a training step's cross-entropy over GPT-2's
vocabulary (50257 columns, rows not 16-byte aligned) that loses memory: jax.jit writes dlogits over the logits in
place (XLA shares a buffer between an elementwise fusion's operand and its output), and a padded product read
through a slice, or dlogits padded for the backward's dots, is no longer elementwise to XLA, so the two
[rows, vocabulary] arrays (1.5 GiB each at B8 S2048) are both held: +1.4-1.6 GiB of peak memory for any of the
three padded dots (H200, results/aligned_region_h200.md). Here the padding runs through the region instead: every
value carrying the vocabulary dimension is computed padded (its padded entries are arbitrary), reductions over it
read their identity there, the contractions over it read zeros there, and only the region's outputs are sliced
back. The GEMMs run aligned, and dh and dW read one dlogits. (On an H200 XLA still held the padded logits and
dlogits apart: the region alone restored `aligned_dot`'s peak, not jax.jit's.) Where the region can run over
chunks of the product's leading axis (`chunking`), one chunk's logits and dlogits are held at a time.

Which axes are padded is found by unifying the axes the region's equations equate (`padded_axes`): the product's
unaligned free axis and every axis of the same extent an elementwise op, broadcast, reshape, reduction or
contraction ties to it. The rows chunked are found the same way from the product's leading axis. The region is
`reread.split`'s group of the dot (what reduces the product and reads it again) with the unaligned dots that read
it. Where it is not convex (a backward whose cotangent depends on the forward's result, as a squared loss's does),
it runs in two stages, the first handing the second its padded product and row values.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .. import costmodel
from ..costmodel import H200, GPUModel, unaligned_dot
from ..graph import Graph, Group, convex
from ..ops import FUSIBLE, OpClass, op_class
from . import reread
from .template import Template

Axis = tuple[int, int]  # (value id, axis)


@dataclass(frozen=True)
class AlignedRegionSpec:
    group: Group
    dot: int  # the dot whose product's unaligned free axis the region pads
    extent: int  # that axis' size
    axes: dict[int, int]  # value id -> its padded axis (the values carrying the extent; others are not padded)
    stages: tuple[frozenset[int], ...]  # () where the region is convex (one unit), else (the forward, the rest)
    rows: int = 0  # the product's leading axis, where the region can run in chunks of it (`chunking`); else 0
    row_axes: dict[int, int] = dataclasses.field(default_factory=dict)  # value id -> its axis tied to those rows
    sinks: frozenset[int] = frozenset()  # the nodes that sum over the rows (dW's dot): partials added over chunks


def _ties(g: Graph, nd) -> list[tuple[Axis, Axis]]:
    """The (value, axis) pairs an equation equates, of equal extent above 1."""
    out_v = nd.outputs[0]
    oshape = tuple(g.avals[out_v].shape)
    ties: list[tuple[Axis, Axis]] = []

    def tie(a: int, i: int, b: int, j: int) -> None:
        if g.aval(a).shape[i] == g.aval(b).shape[j] != 1:
            ties.append(((a, i), (b, j)))

    ins = [a for a in nd.inputs if isinstance(a, int)]
    cls = op_class(nd.name)
    if cls is OpClass.ELEMENTWISE:
        for a in ins:
            if len(g.aval(a).shape) == len(oshape):
                for k in range(len(oshape)):
                    tie(a, k, out_v, k)
    elif cls is OpClass.BROADCAST:
        for i, d in enumerate(nd.params["broadcast_dimensions"]):
            tie(ins[0], i, out_v, int(d))
    elif cls is OpClass.LAYOUT:
        ishape = tuple(g.aval(ins[0]).shape)
        for i, n in enumerate(ishape):
            for j, m in enumerate(oshape):
                if n == m and np.prod(ishape[:i]) == np.prod(oshape[:j]):  # the same axis, neither merged nor split
                    tie(ins[0], i, out_v, j)
    elif cls is OpClass.REDUCTION:
        axes = set(int(a) for a in nd.params["axes"])
        kept = [i for i in range(len(g.aval(ins[0]).shape)) if i not in axes]
        for j, i in enumerate(kept):
            tie(ins[0], i, out_v, j)
    elif cls is OpClass.CONTRACTION:
        (lc, rc), (lb, rb) = nd.params["dimension_numbers"]
        lhs, rhs = nd.inputs[0], nd.inputs[1]
        if isinstance(lhs, int) and isinstance(rhs, int):
            for i, j in zip(lc, rc):
                tie(lhs, int(i), rhs, int(j))
        k = 0
        for i, j in zip(lb, rb):
            if isinstance(lhs, int):
                tie(lhs, int(i), out_v, k)
            if isinstance(rhs, int):
                tie(rhs, int(j), out_v, k)
            k += 1
        for x, c, b in ((lhs, lc, lb), (rhs, rc, rb)):
            if not isinstance(x, int):
                continue
            for i in range(len(g.aval(x).shape)):
                if i not in set(map(int, c)) | set(map(int, b)):
                    tie(x, i, out_v, k)
                    k += 1
    return ties


def padded_axes(g: Graph, nodes: list[int], start: Axis) -> dict[int, int] | None:
    """Each value the region's equations tie to `start` (made or read by `nodes`) -> its tied axis; None where a
    value would have two (an axis padded twice) or the ties reach no further than `start`."""
    parent: dict[Axis, Axis] = {start: start}

    def find(x: Axis) -> Axis:
        while parent[x] != x:
            parent[x] = parent[parent[x]]  # halve the path
            x = parent[x]
        return x

    for i in nodes:
        for a, b in _ties(g, g.node_index[i]):
            parent.setdefault(a, a)
            parent.setdefault(b, b)
            ra, rb = find(a), find(b)
            if ra != rb:
                parent[ra] = rb
    root = find(start)
    out: dict[int, int] = {}
    for x in list(parent):
        if find(x) == root:
            if out.get(x[0], x[1]) != x[1]:
                return None
            out[x[0]] = x[1]
    return out if len(out) > 1 else None


#: Sinks whose partial results over chunks of rows add up to the whole: a sum over them, a dot contracting them
_SUM_SINKS = ("reduce_sum", "dot_general")


def chunking(g: Graph, members: frozenset[int], product: int) -> tuple[int, dict[int, int], frozenset[int]] | None:
    """(rows, each value's axis tied to them, the sinks) where the region can run over chunks of its product's
    leading axis, one chunk after another: every node maps a chunk to a chunk, or sums over the rows (a sink, whose
    result only the program reads: its partials are added), or reads no rows at all (done once, before the chunks).
    Then no [rows, vocabulary] array is held whole (the logits and dlogits of one chunk at a time). None where a
    node would need other chunks (an iota along the rows, a sum over them read again inside the region)."""
    rows = g.avals[product].shape[0]
    axes = padded_axes(g, sorted(members), (product, 0))
    if rows < 2 or axes is None or any(g.aval(v).shape[a] != rows for v, a in axes.items()):
        return None
    inside = {a for i in members for a in g.node_index[i].inputs if isinstance(a, int)}
    sinks = set()
    for i in members:
        nd = g.node_index[i]
        reads = any(isinstance(a, int) and a in axes for a in nd.inputs)
        makes = any(v in axes for v in nd.outputs)
        if op_class(nd.name) is OpClass.SOURCE and makes and nd.params.get("dimension") == axes[nd.outputs[0]]:
            return None  # an iota along the rows: each chunk would count from zero
        if reads and not makes:
            if nd.name not in _SUM_SINKS or any(v in inside for v in nd.outputs):
                return None
            sinks.add(i)
    return rows, axes, frozenset(sinks)


def region(g: Graph, dot: int) -> frozenset[int] | None:
    """The region grown from `dot`: `reread.split`'s group with the unaligned dots that read a value it makes."""
    parts = reread.split(g, dot)
    if parts is None:
        return None
    members = set(parts[0])
    made = {v for i in members for v in g.node_index[i].outputs}
    for i in sorted({c for i in members for c in g.succs(i)} - members):
        nd = g.node_index[i]
        if op_class(nd.name) is OpClass.CONTRACTION and unaligned_dot(g, nd) and any(a in made for a in nd.inputs if isinstance(a, int)):
            members.add(i)
    return frozenset(members) if len(members) > len(parts[0]) else None


def analyse(g: Graph, dot: int, members: frozenset[int]) -> AlignedRegionSpec | None:
    """The spec of the region `members` grown from `dot`, or None where it cannot run padded."""
    nd = g.node_index[dot]
    if any(op_class(g.node_index[i].name) not in FUSIBLE for i in members):  # `_ties` knows what each equates
        return None
    out_shape = tuple(g.avals[nd.outputs[0]].shape)
    if not costmodel.unaligned_rows(g.avals[nd.outputs[0]]):  # the product's last axis is the one padded
        return None
    start = (nd.outputs[0], len(out_shape) - 1)
    axes = padded_axes(g, sorted(members), start)
    if axes is None:
        return None
    extent = out_shape[start[1]]
    if any(g.aval(v).shape[a] != extent for v, a in axes.items()):
        return None
    group = Group.of(g, sorted(members))
    if convex(g, set(members)):
        stages: tuple[frozenset[int], ...] = ()
    else:
        first = reread.split(g, dot)[1]
        rest = frozenset(members - first)
        if not (convex(g, set(first)) and convex(g, set(rest))):
            return None
        stages = (frozenset(first), rest)
    spec = AlignedRegionSpec(group, dot, int(extent), axes, stages)
    found = chunking(g, members, nd.outputs[0]) if not stages else None
    if found is not None and all(found[1].get(v) != a for v, a in axes.items()):
        spec = dataclasses.replace(spec, rows=found[0], row_axes=found[1], sinks=found[2])
    return spec


def _regions(g: Graph) -> dict[int, AlignedRegionSpec]:
    """Every region of the graph by its dot (found once per graph: `match` asks for each group with dots)."""
    cache = g.extra.get("aligned_region")
    if cache is None:
        cache = {}
        for nd in g.nodes:
            if op_class(nd.name) is OpClass.CONTRACTION and unaligned_dot(g, nd):
                members = region(g, nd.id)
                spec = analyse(g, nd.id, members) if members is not None else None
                if spec is not None:
                    cache[nd.id] = spec
        g.extra["aligned_region"] = cache
    return cache


class AlignedRegionTemplate(Template[AlignedRegionSpec]):
    name = "aligned_region"
    backends = ("xla_ops",)
    defaults = {"chunks": 1}

    def match(self, group: Group) -> AlignedRegionSpec | None:
        """The region whose nodes are exactly the group's."""
        ids = frozenset(group.node_ids)
        for spec in _regions(group.graph).values():
            if frozenset(spec.group.node_ids) == ids:
                return spec
        return None

    def candidate_groups(self, graph: Graph, fusible: Callable[[int], bool]) -> list[tuple[Group, AlignedRegionSpec, tuple[frozenset[int], ...]]]:
        """One region per unaligned dot whose product is reduced and read again, with every node fusible."""
        return [(s.group, s, s.stages) for s in _regions(graph).values() if all(fusible(i) for i in s.group.node_ids)]

    def stage_split(self, spec: AlignedRegionSpec) -> tuple[frozenset[int], ...] | None:
        return spec.stages or None

    def leaner_config(self, spec: AlignedRegionSpec, config: dict) -> dict | None:
        """The most chunks of the search space's that split the rows, where the region runs whole."""
        chunks = next((c for c in (8, 4, 2) if spec.rows and spec.rows % c == 0), 1)
        return {**config, "chunks": chunks} if config.get("chunks", 1) < chunks else None

    def facts(self, group: Group, spec: AlignedRegionSpec) -> dict:
        return {"extent": spec.extent, "rows": spec.rows}

    def model_time_ms(self, spec: AlignedRegionSpec, config: dict, model: GPUModel = H200) -> float:
        """XLA's time of the same work without the unaligned rows' penalty on its dots, at the padded extent."""
        g = spec.group.graph
        scale = (-(-spec.extent // config["align"]) * config["align"]) / spec.extent
        penalty = max(costmodel.xla_unaligned_factor(g, nd) for nd in spec.group.nodes)
        return costmodel.xla_group_time_ms(spec.group, model) / penalty * scale


TEMPLATE = AlignedRegionTemplate()
