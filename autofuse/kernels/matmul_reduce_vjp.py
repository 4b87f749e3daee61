"""Template `matmul_reduce_vjp`: a matmul with reductions of its product, and a later elementwise reader of that
product (its backward, in a gradient program), the product computed twice and never stored.

In `jax.grad` of a cross-entropy over a vocabulary (logits = h @ W, logsumexp over the vocabulary), the forward
reduces the logits to a few values per row and the backward reads the logits again to form dlogits =
(exp(logits - lse) - onehot) * g, which two dots contract with h and W. XLA writes the [rows, vocabulary]
logits (and the exponentials) in the forward and reads them in the backward. Here the forward is one
`matmul_reduce` kernel (stage 1: the reductions and the row work after them, nothing [rows, columns] written)
and the backward's elementwise work up to the value the dots read runs as the epilogue of a `matmul` kernel
that computes the product again (stage 2: the product, the forward's elementwise chain re-evaluated on it, the
backward's elementwise work; only dlogits written). The dots that contract dlogits stay outside (XLA's, or
another group's).

Recognition is structural, from one dot: the group is the dot with every later node of the product's shape or
of a reduced shape that reads what the group computes (elementwise, broadcasts, reshapes, reductions over one
axis of the product), and the producers only it reads of its side inputs (a one-hot's iota and broadcast).
Stage 1 is every node a reduction needs and the row work computable from the reductions alone; stage 2 the
rest. A value of the product's shape that stage 1 makes is never handed to stage 2: stage 2 re-evaluates it.
Where the group is not convex (a training step: the backward's cotangent depends on the forward's outputs) the
two stages run as two units, as `attention_vjp`'s do; where it is (the cotangent a constant) as one.

The SPLADE head is the other case: its forward reduces over the sequence (max of log1p(relu(h @ W + b)) * mask,
and the count of positions at the max that `jax.grad` of `max` adds: `matmul_reduce`'s "eq" rescale), and its
backward's epilogue reads per-sequence values ([B, 1, V]: the max, the cotangent over the count) beside the
[B, S, V] product (`TileSpec.outer`). Both kernels read the product rounded to the dot's dtype, as the program's
dot returns it: stage 1 hands on values made from that rounding (a bf16 max), which stage 2's product must meet.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from ..costmodel import H200, GPUModel
from ..graph import Graph, Group, convex
from ..ops import OpClass, op_class
from . import matmul, matmul_reduce
from .template import Template
from .tiling import template_space

_MEMBER_OPS = (OpClass.ELEMENTWISE, OpClass.BROADCAST, OpClass.LAYOUT, OpClass.REDUCTION, OpClass.SOURCE)
BWD = "bwd_"  # the prefix of stage 2's (the `matmul` kernel's) config keys


@dataclass
class MatmulReduceVJPSpec:
    group: Group
    stage1: frozenset[int]  # the forward's nodes (the group's plan stage 1)
    stage2: frozenset[int]  # the backward's nodes (stage 2)
    forward: Group  # what stage 1's kernel runs: stage 1's live nodes, its outputs the row values read after it
    forward_spec: matmul_reduce.MatmulReduceSpec
    backward: Group  # what stage 2's kernel runs: stage 2 with the product and the chain it re-evaluates
    backward_spec: matmul.MatmulSpec
    private: tuple[int, ...]  # stage 1's outputs that only stage 2 reads (handed on, never in the program)


def _ancestors(graph: Graph, starts, within: set[int]) -> set[int]:
    out: set[int] = set()
    stack = [i for i in starts if i in within]
    while stack:
        i = stack.pop()
        if i not in out:
            out.add(i)
            stack.extend(p for p in graph.preds(i) if p in within)
    return out


def _descendants(graph: Graph, starts) -> set[int]:
    out: set[int] = set()
    stack = list(starts)
    while stack:
        for c in graph.succs(stack.pop()):
            if c not in out:
                out.add(c)
                stack.append(c)
    return out


def split(graph: Graph, dot: int) -> tuple[set[int], set[int], set[int]] | None:
    """(the group, stage 1, stage 2) grown from `dot`, or None where the product is not reduced or nothing of its
    shape is read after the reductions."""
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
        if op_class(nd.name) not in _MEMBER_OPS:
            continue
        if op_class(nd.name) is OpClass.REDUCTION:
            axes = tuple(nd.params["axes"])
            if len(axes) != 1 or not shaped(nd.inputs[0]) or axis not in (None, axes[0]):
                continue
            axis = axes[0]
        elif not (shaped(nd.outputs[0]) or row(nd.outputs[0])):
            continue
        members.add(nd.id)
        made.update(nd.outputs)
        for c in graph.succs(nd.id):
            if c not in seen:
                seen.add(c)
                heapq.heappush(frontier, c)
    if axis is None:
        return None
    # side inputs of the product's shape made from smaller values (a one-hot: iota, broadcast, eq, convert), read
    # by the group alone: made inside, so that no [rows, columns] array is an input (not the dot's operands)
    operands = _ancestors(graph, graph.preds(dot), set(range(dot)))
    grown = True
    while grown:
        grown = False
        for nd in reversed(graph.nodes[:max(members)]):
            if nd.id in members or nd.id in operands or op_class(nd.name) not in _MEMBER_OPS \
                    or op_class(nd.name) is OpClass.REDUCTION or any(v in graph.outputs for v in nd.outputs):
                continue
            readers = {c for v in nd.outputs for c in graph.consumers.get(v, ())}
            if readers and readers <= members:
                members.add(nd.id)
                grown = True
    reductions = [i for i in members if op_class(graph.node_index[i].name) is OpClass.REDUCTION]
    first = _ancestors(graph, reductions, members)
    after = _descendants(graph, members)
    for i in sorted(members - first):  # the row work on the reductions alone
        nd = graph.node_index[i]
        if shaped(nd.outputs[0]):
            continue
        if all(graph.producer.get(a) in first or (graph.producer.get(a) not in members and graph.producer.get(a) not in after)
               for a in nd.inputs if isinstance(a, int)):
            first.add(i)
    second = members - first
    if not any(shaped(v) for i in second for v in graph.node_index[i].outputs):
        return None
    return members, first, second


def _recomputed(graph: Graph, first: set[int], second: set[int], S: tuple) -> set[int]:
    """Stage 2's nodes with the nodes of stage 1 it evaluates again: back from what it reads, every node of the
    product's shape (to the dot) and every node that no reduction precedes (a one-hot's iota). What it reads
    that a reduction made (a row value) is handed on from stage 1 instead."""
    reductions = [i for i in first if op_class(graph.node_index[i].name) is OpClass.REDUCTION]
    after = _descendants(graph, reductions) | set(reductions)
    out = set(second)
    stack = [p for i in second for p in graph.preds(i) if p in first]
    while stack:
        i = stack.pop()
        if i in out or (i in after and tuple(graph.avals[graph.node_index[i].outputs[0]].shape) != S):
            continue
        out.add(i)
        stack.extend(p for p in graph.preds(i) if p in first)
    return out


_EXACT = ("eq", "ne")


def _compares_again(g: Graph, back_ids: set[int], private: set[int], S: tuple) -> bool:
    """Whether stage 2 tests a recomputed value of the product's shape for equality with a value stage 1 made (a
    max's location: `eq(x, max x)`, as `jax.grad` of `max` has it). Two kernels compute the product in their own
    order, so the recomputed x may miss the max by its last bit, and the position that carries the whole
    gradient is lost (SPLADE's head: 6% off on the CPU once XLA compiled the two kernels into one program).
    Continuous work (exp(x - lse)) only moves by rounding; a comparison with a constant (relu's x > 0) flips only
    where its gradient is about to vanish anyway."""
    for i in back_ids:
        nd = g.node_index[i]
        if nd.name not in _EXACT:
            continue
        ins = [a for a in nd.inputs if isinstance(a, int)]
        if any(tuple(g.avals[a].shape) == S and g.producer.get(a) in back_ids for a in ins) and any(
                a in private or (g.producer.get(a) in back_ids and not tuple(g.avals[a].shape) == S and _from(g, a, private, back_ids))
                for a in ins):
            return True
    return False


def _from(g: Graph, v: int, private: set[int], within: set[int]) -> bool:
    """Whether `v` (made in `within`) is computed from one of the `private` values."""
    stack, seen = [v], set()
    while stack:
        x = stack.pop()
        if x in private:
            return True
        p = g.producer.get(x)
        if p in within and x not in seen:
            seen.add(x)
            stack.extend(a for a in g.node_index[p].inputs if isinstance(a, int))
    return False


def _match(group: Group) -> MatmulReduceVJPSpec | None:
    g = group.graph
    dots = [n for n in group.nodes if op_class(n.name) is OpClass.CONTRACTION]
    if len(dots) != 1:
        return None
    members = set(group.node_ids)
    parts = split(g, dots[0].id)  # the whole growth from the dot, not a part of it (one candidate per dot)
    if parts is None or parts[0] != members:
        return None
    _, first, second = parts
    S = tuple(g.avals[dots[0].outputs[0]].shape)
    out_of = lambda ids: {v for i in ids for v in g.node_index[i].outputs}  # noqa: E731
    made1 = out_of(first)
    if any(tuple(g.avals[v].shape) == S for v in made1 & set(group.outputs)):
        return None  # stage 1 would have to write a value of the product's shape
    back_ids = _recomputed(g, first, second, S)
    read2 = {a for i in back_ids for a in g.node_index[i].inputs if isinstance(a, int)} - out_of(back_ids)
    private = tuple(sorted(v for v in read2 & made1))
    if _compares_again(g, back_ids, set(private), S):
        return None
    fwd_outs = tuple(v for i in sorted(first) for v in g.node_index[i].outputs if v in set(group.outputs) | set(private))
    if not fwd_outs:
        return None
    live = _ancestors(g, [g.producer[v] for v in fwd_outs], first)
    fwd = Group.of(g, sorted(live))
    forward = Group(g, fwd.node_ids, fwd.inputs, fwd_outs)
    bwd = Group.of(g, sorted(back_ids))
    backward = Group(g, bwd.node_ids, bwd.inputs, tuple(v for v in bwd.outputs if v in group.outputs))
    if not backward.outputs or set(group.outputs) - set(forward.outputs) - set(backward.outputs):
        return None
    forward_spec = matmul_reduce.TEMPLATE.match(forward)
    backward_spec = matmul.TEMPLATE.match(backward) if forward_spec is not None else None
    if backward_spec is None:
        return None
    # Stage 1 hands stage 2 values made from the product rounded to the dot's dtype (a max of bf16 logits): both
    # kernels read the product so rounded, or the logit at that max could exceed it by half a rounding step
    # (exp(0.25): the largest softmax entry 28% off at logits of ~100)
    forward_spec.round_product = backward_spec.round_product = True
    return MatmulReduceVJPSpec(group, frozenset(first), frozenset(second), forward, forward_spec, backward, backward_spec, private)


def candidate_groups(graph: Graph, fusible) -> list[tuple[Group, tuple[frozenset[int], ...]]]:
    """Per dot whose product is reduced and read again after the reductions: the group with its stages (`()` where
    the group is convex and runs as one unit, else the forward then the backward, each convex)."""
    out = []
    for nd in graph.nodes:
        if op_class(nd.name) is not OpClass.CONTRACTION or not fusible(nd.id):
            continue
        parts = split(graph, nd.id)
        if parts is None:
            continue
        members, first, second = parts
        group = Group.of(graph, sorted(members))
        spec = TEMPLATE.match(group)
        if spec is None:
            continue
        if convex(graph, members):
            out.append((group, ()))
        elif convex(graph, first) and convex(graph, second):
            out.append((group, TEMPLATE.stage_split(spec)))
    return out


def stage_configs(config: dict) -> tuple[dict, dict]:
    """(stage 1's `matmul_reduce` config, stage 2's `matmul` config) of a config of this template."""
    fwd = {k: v for k, v in config.items() if not k.startswith(BWD)}
    bwd = {k[len(BWD):]: v for k, v in config.items() if k.startswith(BWD)}
    if "backend" in config:
        bwd["backend"] = config["backend"]
    return fwd, bwd


class MatmulReduceVJPTemplate(Template[MatmulReduceVJPSpec]):
    name = "matmul_reduce_vjp"
    params = matmul_reduce.TEMPLATE.params + tuple(BWD + p for p in matmul.TEMPLATE.params)
    backends = ("triton", "mosaic_gpu")

    def match(self, group: Group) -> MatmulReduceVJPSpec | None:
        """The two stages and their kernels' specs, or None."""
        return _match(group)

    def stage_split(self, spec: MatmulReduceVJPSpec) -> tuple[frozenset[int], ...]:
        return spec.stage1, spec.stage2

    def default_config(self, spec: MatmulReduceVJPSpec) -> dict:
        return {**matmul_reduce.TEMPLATE.default_config(spec.forward_spec),
                **{BWD + k: v for k, v in matmul.TEMPLATE.default_config(spec.backward_spec).items()}}

    def space(self, group: Group, spec: MatmulReduceVJPSpec | None = None) -> dict:
        """Stage 1's parameters and stage 2's (`bwd_` keys), search_spaces/matmul_reduce_vjp.toml."""
        spec = spec or self.match(group)
        f = spec.forward_spec
        itemsize = np.dtype(group.graph.avals[f.a].dtype).itemsize
        return template_space(self.name, self.default_config(spec), {
            "M": f.M, "N": f.N, "K": f.K, "L": f.L, "over_n": int(f.over_n), "itemsize": itemsize, "smem_bytes": H200.smem_bytes,
            "outer_rows": spec.backward_spec.outer_rows})

    def model_time_ms(self, spec: MatmulReduceVJPSpec, config: dict, model: GPUModel = H200) -> float:
        """The two kernels' models."""
        fwd, bwd = stage_configs(config)
        return (matmul_reduce.TEMPLATE.model_time_ms(spec.forward_spec, fwd, model)
                + matmul.TEMPLATE.model_time_ms(spec.backward_spec, bwd, model))


TEMPLATE = MatmulReduceVJPTemplate()
