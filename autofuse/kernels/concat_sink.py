"""Template `concat_sink`: a concatenation whose readers all take its parts one by one, so it is never written.

The gradient of a fused projection split in parts (GPT-2's `jnp.split(x @ W_qkv + b, 3)`) is the concatenation of
the parts' gradients, read by the weight's gradient (`x^T @ dqkv`), the input's (`dqkv @ W^T`) and the bias's
(`sum(dqkv)`). XLA writes that concatenation (twice, in two layouts: 2.2 ms of GPT-2 medium's step on an H200,
results/xla_time_h200) before its GEMMs read it. Each reader is linear in it, so it can read the parts instead:
- a dot contracting the concatenated axis is the sum of the parts' dots with the other operand's matching slices;
- a dot keeping it is the concatenation of the parts' (smaller) products along the matching output axis;
- a sum over it is the sum of the parts' sums; a sum keeping it, the concatenation of the parts' sums;
- an elementwise op of it alone (a convert) is the op of each part.
The lowering is XLA's own operations on the parts (backend `xla_ops`), so XLA fuses around them as it likes; the
tuner times it against the group as written, in the program, like any kernel.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Collection

import numpy as np

from .. import costmodel, ops
from ..costmodel import H200, GPUModel
from ..graph import Graph, Group, Node, convex
from ..ops import OpClass
from .template import Template

SINKS = ("dot_general", "reduce_sum")


@dataclass(frozen=True)
class ConcatSinkSpec:
    group: Group
    concat: Node
    axis: int  # the concatenated axis
    sizes: tuple[int, ...]  # the parts' sizes along it
    pieces: frozenset[int]  # values the group holds as parts: the concatenation and elementwise ops of it alone


def _piecewise(node: Node, pieces: set[int], graph: Graph) -> bool:
    """An elementwise op of one piece-wise value and nothing else but scalars: it runs on each part."""
    if ops.op_class(node.name) is not OpClass.ELEMENTWISE or len(node.outputs) != 1:
        return False
    ins = [a for a in node.inputs if isinstance(a, int)]
    return len(ins) == 1 and ins[0] in pieces and all(graph.aval(a).size == 1 for a in node.inputs if not isinstance(a, int))


def piece_side(node: Node, pieces: Collection[int]) -> int | None:
    """Which operand of a dot is held in parts (0 or 1); None where neither or both are."""
    sides = [i for i, a in enumerate(node.inputs) if isinstance(a, int) and a in pieces]
    return sides[0] if len(sides) == 1 else None


def _sink_axis_ok(node: Node, pieces: set[int], axis: int) -> bool:
    """A reader that takes the parts: a sum, or a dot of one piece-wise operand where the concatenated axis is not a
    batch axis."""
    if node.name == "reduce_sum":
        return True
    side = piece_side(node, pieces)
    _, batch = node.params["dimension_numbers"]
    return side is not None and axis not in batch[side]


def closure(graph: Graph, concat: Node, fusible) -> tuple[list[int], frozenset[int]] | None:
    """The concatenation with every reader down to its sinks: (node ids, piece-wise values), or None where some
    reader can take no parts (the concatenation would be written anyway)."""
    (out,) = concat.outputs
    axis = concat.params["dimension"]
    pieces, ids, todo = {out}, [concat.id], [out]
    while todo:
        v = todo.pop()
        if v in graph.output_values:
            return None
        for r in graph.consumers.get(v, ()):
            nd = graph.node_index[r]
            if r in ids:
                continue
            if not fusible(r):
                return None
            if _piecewise(nd, pieces, graph):
                pieces.add(nd.outputs[0])
                todo.append(nd.outputs[0])
            elif nd.name in SINKS and _sink_axis_ok(nd, pieces, axis):
                pass
            else:
                return None
            ids.append(r)
    sinks = [graph.node_index[i] for i in ids if graph.node_index[i].name in SINKS]
    if not all(_sink_axis_ok(nd, pieces, axis) for nd in sinks):  # a dot of two piece-wise operands, found late
        return None
    return sorted(ids), frozenset(pieces)


class ConcatSinkTemplate(Template[ConcatSinkSpec]):
    name = "concat_sink"
    backends = ("xla_ops",)
    defaults = {"contracted": 1, "kept": 0}  # plans stored before the parameters were searched

    def match(self, group: Group) -> ConcatSinkSpec | None:
        """A group of one concatenation and all its readers down to sums and dots (`closure`)."""
        g = group.graph
        cats = [n for n in group.nodes if n.name == "concatenate"]
        if len(cats) != 1 or not all(isinstance(a, int) for a in cats[0].inputs) or len(cats[0].inputs) < 2:
            return None
        cat, members = cats[0], set(group.node_ids)
        found = closure(g, cat, members.__contains__)
        if found is None or tuple(found[0]) != tuple(group.node_ids) or not set(group.outputs).isdisjoint(found[1]):
            return None
        if not any(n.name in SINKS for n in group.nodes):
            return None
        axis = cat.params["dimension"]
        return ConcatSinkSpec(group, cat, axis, tuple(int(g.avals[a].shape[axis]) for a in cat.inputs), found[1])

    def candidate_groups(self, graph: Graph, fusible) -> list[tuple[Group, ConcatSinkSpec, tuple]]:
        """Each concatenation with its readers (the partitioner grows no group through a concatenation, an op no
        fusion of XLA's or ours takes)."""
        out = []
        for nd in graph.nodes:
            if nd.name != "concatenate":
                continue
            found = closure(graph, nd, fusible)
            if found is None or not convex(graph, set(found[0])):
                continue
            group = Group.of(graph, found[0])
            spec = self.match(group)
            if spec is not None:
                out.append((group, spec, ()))
        return out

    def facts(self, group: Group, spec: ConcatSinkSpec) -> dict:
        return {"parts": len(spec.sizes)}

    def model_time_ms(self, spec: ConcatSinkSpec, config: dict, model: GPUModel = H200) -> float:
        """Each sink run once per part (its operands' parts read, its partial results written), and the partial
        results combined: added (a kernel reading each partial and writing the sum: on an H200 the K-split of
        GPT-2's QKV input gradient cost about what its concatenation did; float32 partials where `accumulate` says
        so, written and read back) or concatenated (copied). With `contracted` = 0 a dot contracting the
        concatenated axis reads the concatenation, with `kept` = 1 a dot keeping it: written once for all such dots."""
        g = spec.group.graph
        n = len(spec.sizes)
        t = 0.0
        whole = False  # the concatenation written, for the dots that contract it
        for nd in spec.group.nodes:
            if nd.name not in SINKS:
                continue
            summed = reduces_the_axis(nd, spec)
            if nd.name == "dot_general" and not (config.get("contracted", 1) if summed else not config.get("kept", 0)):
                whole = True
                t += costmodel.xla_group_time_ms(Group.of(g, [nd.id]), model)
                continue
            out = g.avals[nd.outputs[0]]
            ins = sum(g.aval(a).nbytes for a in nd.inputs if isinstance(a, int))
            low = all(np.dtype(g.aval(a).dtype).itemsize <= 2 for a in nd.inputs)
            part_bytes = out.nbytes * (4 / out.dtype.itemsize if summed and config.get("accumulate") else 1.0)
            flops = costmodel.node_flops(g, nd.id)
            factor = costmodel.XLA_FACTOR["matmul"] if nd.name == "dot_general" else 1.0
            t += sum(costmodel.kernel_time_ms((ins + (part_bytes if summed else out.nbytes)) / n, flops / n, model, low) * factor
                     for _ in range(n))
            combine = ((n + 1) + (n if config.get("accumulate") else 0)) * part_bytes if summed else 2 * out.nbytes
            t += costmodel.kernel_time_ms(combine, 0.0, model)
        return t + (costmodel.node_time_ms(g, spec.concat.id, model) if whole else 0.0)


def reduces_the_axis(node: Node, spec: ConcatSinkSpec) -> bool:
    """Whether a sink sums over the concatenated axis (its parts' results are added) rather than keeping it (they
    are concatenated)."""
    if node.name == "reduce_sum":
        return spec.axis in node.params["axes"]
    contract, _ = node.params["dimension_numbers"]
    return spec.axis in contract[piece_side(node, spec.pieces)]


TEMPLATE = ConcatSinkTemplate()
