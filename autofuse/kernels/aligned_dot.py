"""Template `aligned_dot`: a dot whose operands' or product's rows are not 16-byte aligned, run by XLA on operands
padded with zeros to a multiple of `align` elements along each such dimension (its product sliced back).

A row stride that is not a multiple of 16 bytes is one that TMA cannot describe, and XLA's GEMMs there leave most of
the card idle: GPT-2's vocabulary (50257 bf16 columns, 100514-byte rows) ran its training step's three LM-head GEMMs
at 216-478 TFLOP/s, and at 739-800 padded to 50304 (H100, results/composition_h100.md). The zeros added along a
contracted dimension add nothing to any sum; those along a free dimension make rows or columns the slice drops. So
the padded program computes the same numbers, and the tuner times it against XLA's own in the program like any
kernel (the pad of an operand another kernel makes is a copy; one XLA makes, XLA may write padded at once).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import costmodel
from ..costmodel import H200, GPUModel, unaligned_dot
from ..graph import Graph, Group, Node
from .template import Template


@dataclass(frozen=True)
class AlignedDotSpec:
    group: Group
    dot: Node


def padded_shapes(spec: AlignedDotSpec, align: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The operands' shapes padded: every dimension but a batch one whose size is over `align` and not a multiple."""
    g, nd = spec.group.graph, spec.dot
    (lc, rc), (lb, rb) = nd.params["dimension_numbers"]

    def up(shape: tuple[int, ...], batch: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(n if d in batch or n <= align or n % align == 0 else -(-n // align) * align for d, n in enumerate(shape))

    lhs, rhs = (tuple(g.aval(a).shape) for a in nd.inputs)
    out_l, out_r = up(lhs, tuple(lb)), up(rhs, tuple(rb))
    for a, b in zip(lc, rc):  # a contracted pair padded alike
        n = max(out_l[a], out_r[b])
        out_l = out_l[:a] + (n,) + out_l[a + 1:]
        out_r = out_r[:b] + (n,) + out_r[b + 1:]
    return out_l, out_r


class AlignedDotTemplate(Template[AlignedDotSpec]):
    name = "aligned_dot"
    backends = ("xla_ops",)

    def match(self, group: Group) -> AlignedDotSpec | None:
        """A group of one unaligned dot_general."""
        if len(group.nodes) != 1 or not unaligned_dot(group.graph, group.nodes[0]):
            return None
        spec = AlignedDotSpec(group, group.nodes[0])
        lhs, rhs = (tuple(group.graph.aval(a).shape) for a in spec.dot.inputs)
        return spec if padded_shapes(spec, 8) != (lhs, rhs) else None  # nothing to pad: the unaligned array is tiny

    def candidate_groups(self, graph: Graph, fusible) -> list[tuple[Group, AlignedDotSpec, tuple]]:
        """Each unaligned dot on its own (the partitioner grows no group without elementwise work)."""
        out = []
        for nd in graph.nodes:
            if fusible(nd.id) and unaligned_dot(graph, nd):
                group = Group.of(graph, [nd.id])
                spec = self.match(group)
                if spec is not None:
                    out.append((group, spec, ()))
        return out

    def facts(self, group: Group, spec: AlignedDotSpec) -> dict:
        return {"itemsize": max(np.dtype(group.graph.aval(a).dtype).itemsize for a in spec.dot.inputs)}

    def model_time_ms(self, spec: AlignedDotSpec, config: dict, model: GPUModel = H200) -> float:
        """XLA's aligned GEMM over the padded operands, and a copy of each operand padded."""
        lhs, rhs = padded_shapes(spec, config["align"])
        (lc, _), (lb, _) = spec.dot.params["dimension_numbers"]
        k, batch = (int(np.prod([lhs[d] for d in dims])) for dims in (lc, lb))
        flops = 2.0 * np.prod(lhs) * np.prod(rhs) / (k * batch)
        itemsize = self.facts(spec.group, spec)["itemsize"]
        padded = float(np.prod(lhs) + np.prod(rhs)) * itemsize
        gemm = costmodel.kernel_time_ms(padded + spec.group.output_avals()[0].nbytes, flops, model, itemsize <= 2)
        return gemm * costmodel.XLA_FACTOR["matmul"] + costmodel.kernel_time_ms(2 * padded, 0.0, model)


TEMPLATE = AlignedDotTemplate()
