"""A value reduced and read again after its reductions: the group that grows from it, split into two stages.

In a gradient program the forward reduces a large value (the logits: a cross-entropy's logsumexp over the
vocabulary, SPLADE's max over the sequence) and the backward reads that value again beside the reductions'
results. The group grown from the node that makes the value (`split`) runs as two kernels: stage 1, the
reductions and the row work computable from them; stage 2, the rest, with every value of the large shape that
stage 1 made evaluated again (`two_stages`), so that nothing of that shape passes between them. The templates
`matmul_reduce_vjp` (the value a dot's product, computed in both stages) and `reduce_vjp` (the value stored,
read by both) build their kernels on this split.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..graph import Graph, Group, convex
from ..ops import OpClass, op_class

MEMBER_OPS = (OpClass.ELEMENTWISE, OpClass.BROADCAST, OpClass.LAYOUT, OpClass.REDUCTION, OpClass.SOURCE)
#: Nodes a growth from one dot may take before it is given up: no kernel of two stages holds more (a training step's
#: cross-entropy pair is ~50, an attention backward ~65), and a projection onto a residual stream grows along it
#: through every later layer (GPT-2 medium's forward: 48 growths of 24-1105 nodes, each unique, each matched and
#: declined: a third of the program's enumeration).
MAX_MEMBERS = 256


@dataclass(frozen=True)
class Stages:
    """A group's two kernels: what each runs and what stage 1 hands stage 2 alone."""

    forward: Group  # stage 1's live nodes; its outputs: the group's outputs it makes and the private values
    backward: Group  # stage 2 with the stage 1 nodes it evaluates again; its outputs: the group's it makes
    private: tuple[int, ...]  # stage 1's outputs that only stage 2 reads (handed on, never in the program)
    recomputed: frozenset[int]  # stage 2's nodes (`backward`'s), stage 1's evaluated again among them


def ancestors(graph: Graph, starts, within: set[int]) -> set[int]:
    out: set[int] = set()
    stack = [i for i in starts if i in within]
    while stack:
        i = stack.pop()
        if i not in out:
            out.add(i)
            stack.extend(p for p in graph.preds(i) if p in within)
    return out


def descendants(graph: Graph, starts) -> set[int]:
    out: set[int] = set()
    stack = list(starts)
    while stack:
        for c in graph.succs(stack.pop()):
            if c not in out:
                out.add(c)
                stack.append(c)
    return out


Parts = tuple[frozenset[int], frozenset[int], frozenset[int]]


def split(graph: Graph, dot: int, *, column_sums: bool = False) -> Parts | None:
    """(the group, stage 1, stage 2) grown from `dot`, or None where the product is not reduced or nothing of its
    shape is read after the reductions. `column_sums`: the group also takes the sums over every axis but the
    last of a value of the product's shape it makes (a bias's gradient, db = Σ dlogits), with the reshapes,
    unit-axis sums and one conversion after them, into stage 2.

    Found once per graph and dot (kept in `graph.extra`): the templates' `match` asks it of every group holding one
    dot, 7203 times in GPT-2 medium's training step, for 300 dots (118 of the enumeration's 190 s on 2 cores)."""
    cache = graph.extra.setdefault("reread.split", {})
    key = (dot, column_sums)
    if key not in cache:
        cache[key] = _split(graph, dot, column_sums)
    return cache[key]


def _split(graph: Graph, dot: int, column_sums: bool) -> Parts | None:
    S = tuple(graph.avals[graph.node_index[dot].outputs[0]].shape)
    axis = None

    def shaped(v: int) -> bool:
        return tuple(graph.avals[v].shape) == S

    def row(v: int) -> bool:
        sh = tuple(graph.avals[v].shape)
        return axis is not None and sh in (S[:axis] + S[axis + 1:], S[:axis] + (1,) + S[axis + 1:])

    members, made = {dot}, set(graph.node_index[dot].outputs)
    frontier = sorted(graph.succs(dot))  # the readers of what the group makes, in program order
    seen = set(frontier)
    while frontier:
        nd = graph.node_index[heapq.heappop(frontier)]
        if op_class(nd.name) not in MEMBER_OPS:
            continue
        if op_class(nd.name) is OpClass.REDUCTION:
            axes = tuple(nd.params["axes"])
            if len(axes) != 1 or not shaped(nd.inputs[0]) or axis not in (None, axes[0]):
                continue
            axis = axes[0]
        elif not (shaped(nd.outputs[0]) or row(nd.outputs[0])):
            continue
        members.add(nd.id)
        if len(members) > MAX_MEMBERS:
            return None
        made.update(nd.outputs)
        for c in graph.succs(nd.id):
            if c not in seen:
                seen.add(c)
                heapq.heappush(frontier, c)
    if axis is None:
        return None
    # side inputs of the product's shape made from smaller values (a one-hot: iota, broadcast, eq, convert), read
    # by the group alone: made inside, so that no [rows, columns] array is an input (not the dot's operands)
    operands = ancestors(graph, graph.preds(dot), set(range(dot)))
    grown = True
    while grown:
        grown = False
        for nd in reversed(graph.nodes[:max(members)]):
            if nd.id in members or nd.id in operands or op_class(nd.name) not in MEMBER_OPS \
                    or op_class(nd.name) is OpClass.REDUCTION or any(v in graph.output_values for v in nd.outputs):
                continue
            readers = {c for v in nd.outputs for c in graph.consumers.get(v, ())}
            if readers and readers <= members:
                members.add(nd.id)
                grown = True
    sums = _column_sums(graph, members, S) if column_sums else set()
    reductions = [i for i in members if op_class(graph.node_index[i].name) is OpClass.REDUCTION]
    members |= sums
    first = ancestors(graph, reductions, members)
    after = descendants(graph, members)
    for i in sorted(members - first - sums):  # the row work on the reductions alone
        nd = graph.node_index[i]
        if shaped(nd.outputs[0]):
            continue
        if all(graph.producer.get(a) in first or (graph.producer.get(a) not in members and graph.producer.get(a) not in after)
               for a in nd.inputs if isinstance(a, int)):
            first.add(i)
    second = members - first
    if not any(shaped(v) for i in second for v in graph.node_index[i].outputs):
        return None
    return frozenset(members), frozenset(first), frozenset(second)


def _column_sums(graph: Graph, members: set[int], S: tuple) -> set[int]:
    """The sums over every axis but the last of the product-shaped values `members` make, and the chains after
    them that only move or cast the sum (reshape, a sum over unit axes, one conversion)."""
    out: set[int] = set()
    leading = tuple(range(len(S) - 1))
    for i in sorted(members):
        for v in graph.node_index[i].outputs:
            if tuple(graph.avals[v].shape) != S:
                continue
            for c in graph.consumers.get(v, ()):
                nd = graph.node_index[c]
                if nd.name != "reduce_sum" or tuple(nd.params["axes"]) != leading or c in members:
                    continue
                chain, cur, cast = {c}, nd.outputs[0], False
                while len(graph.consumers.get(cur, ())) == 1 and cur not in graph.output_values:
                    nxt = graph.node_index[graph.consumers[cur][0]]
                    unit = op_class(nxt.name) is OpClass.REDUCTION and all(graph.avals[cur].shape[d] == 1 for d in nxt.params["axes"])
                    step = op_class(nxt.name) is OpClass.LAYOUT or unit or (nxt.name == "convert_element_type" and not cast)
                    if not step or len([a for a in nxt.inputs if isinstance(a, int)]) != 1:
                        break
                    cast |= nxt.name == "convert_element_type"
                    chain.add(nxt.id)
                    cur = nxt.outputs[0]
                out |= chain
    return out


def recomputed(graph: Graph, first: set[int], second: set[int], S: tuple, *, whole: bool = False) -> set[int]:
    """Stage 2's nodes with the nodes of stage 1 it evaluates again: back from what it reads, every node of the
    product's shape (to the dot) and every node that no reduction precedes (a one-hot's iota). What it reads
    that a reduction made (a row value) is handed on from stage 1 instead; with `whole` (stage 2's tiles hold
    the reduced axis whole) the reductions and the row work after them are evaluated again too, nothing handed
    on: a comparison of a value with its own max then meets it whatever the two kernels' arithmetic (the CPU's
    log1p differs in its last bit from one compiled loop to another)."""
    reductions = [i for i in first if op_class(graph.node_index[i].name) is OpClass.REDUCTION]
    after = set() if whole else descendants(graph, reductions) | set(reductions)
    out = set(second)
    stack = [p for i in second for p in graph.preds(i) if p in first]
    while stack:
        i = stack.pop()
        if i in out or (i in after and tuple(graph.avals[graph.node_index[i].outputs[0]].shape) != S):
            continue
        out.add(i)
        stack.extend(p for p in graph.preds(i) if p in first)
    return out


def two_stages(group: Group, first: set[int], second: set[int], S: tuple, *, whole: bool = False) -> Stages | None:
    """The kernels of `group` split into `first` and `second` (`split`), or None where stage 1 would write a value
    of the large shape `S`, or stage 2 makes none of the group's outputs. `whole`: see `recomputed`."""
    g = group.graph
    out_of = lambda ids: {v for i in ids for v in g.node_index[i].outputs}  # noqa: E731
    made1 = out_of(first)
    if any(tuple(g.avals[v].shape) == S for v in made1 & set(group.outputs)):
        return None
    back_ids = recomputed(g, first, second, S, whole=whole)
    read2 = {a for i in back_ids for a in g.node_index[i].inputs if isinstance(a, int)} - out_of(back_ids)
    private = tuple(sorted(v for v in read2 & made1))
    fwd_outs = tuple(v for i in sorted(first) for v in g.node_index[i].outputs if v in set(group.outputs) | set(private))
    if not fwd_outs:
        return None
    live = ancestors(g, [g.producer[v] for v in fwd_outs], first)
    fwd = Group.of(g, sorted(live))
    forward = Group(g, fwd.node_ids, fwd.inputs, fwd_outs)
    bwd = Group.of(g, sorted(back_ids))
    backward = Group(g, bwd.node_ids, bwd.inputs, tuple(v for v in bwd.outputs if v in group.outputs and v not in fwd_outs))
    if not backward.outputs or set(group.outputs) - set(forward.outputs) - set(backward.outputs):
        return None
    return Stages(forward, backward, private, frozenset(back_ids))


def candidate_groups(graph: Graph, fusible: Callable[[int], bool], grow: Callable[[int], tuple | None],
                     template: Any) -> list[tuple[Group, Any, tuple[frozenset[int], ...]]]:
    """Per dot whose product is reduced and read again after the reductions, the group `grow(dot)` makes (its
    nodes, stage 1, stage 2) where `template` matches it, with that match and its stages: `()` where the group is convex and
    runs as one unit, else the forward then the backward, each convex (a training step)."""
    out = []
    declined: set[tuple] = set()  # structures (with their stages) `template` did not take: a repeated layer's dots
    for nd in graph.nodes:
        if op_class(nd.name) is not OpClass.CONTRACTION:
            continue
        parts = grow(nd.id)
        if parts is None or not all(fusible(i) for i in parts[0]):
            continue
        members, first, second = parts
        group = Group.of(graph, sorted(members))
        at = {i: k for k, i in enumerate(group.node_ids)}
        shape = (group.signature, tuple(sorted(at[i] for i in first if i in at)), tuple(sorted(at[i] for i in second if i in at)))
        if shape in declined:  # matched once per layer's structure, not once per layer (0.1 s each in GPT-2's step)
            continue
        spec = template.match(group)
        if spec is None:
            declined.add(shape)
            continue
        if convex(graph, members):
            out.append((group, spec, ()))
        elif convex(graph, first) and convex(graph, second):
            out.append((group, spec, template.stage_split(spec)))
    return out


def stage_configs(config: dict, prefix: str) -> tuple[dict, dict]:
    """A two-kernel template's config as (stage 1's, stage 2's): stage 2's keys carry `prefix`."""
    fwd = {k: v for k, v in config.items() if not k.startswith(prefix)}
    bwd = {k[len(prefix):]: v for k, v in config.items() if k.startswith(prefix)}
    return fwd, bwd
