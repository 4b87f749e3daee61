"""A group timed alone as the program runs it: its inputs made by the layout ops (and widening conversions) that make them there.

A group's input that the program produces by a transpose, broadcast or reshape is, timed alone, a materialised
array in row-major order, which inside the program it never is: XLA folds a transpose into the GEMM that reads it
(cuBLAS reads either operand order) and a broadcast into the fusion that reads it. GPT-2's LM head reads the
embedding as `transpose(wte)`: alone, XLA's GEMM read a [1024, 50257] copy with 100514-byte rows and took 7.89 ms
(10.1 for the gradient's), inside the program it reads `wte` itself and takes 3.29 ms (7.10): the job counted
savings that the program could not give back (results/models_cudnn_h200.md §2, §4). So the XLA reference and every
kernel are timed with those producers in front, on the producers' inputs: XLA fuses them into its own GEMMs and
fusions as in the program, and a kernel pays for the copy its call needs, as in the program.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import jax

from ..graph import Aval, Graph, Group, Node, bind_node, read_atom
from ..ops import OpClass, op_class, widening


def free_in_program(g: Graph, nd: Node) -> bool:
    """A producer that costs nothing in the program where XLA fuses it into its reader, and a copy where a kernel
    reads it: a transpose, broadcast or reshape, or a conversion to a wider float (bf16 -> float32: a layer norm's
    `x.astype(float32)`, which XLA fuses into every reader, and undoes where a kernel converts back). Any other
    conversion is not one: XLA may as well fuse it into the value's producer."""
    if nd.name == "transpose" or op_class(nd.name) in (OpClass.BROADCAST, OpClass.LAYOUT):
        return True
    return nd.name == "convert_element_type" and isinstance(nd.inputs[0], int) and widening(g.avals[nd.inputs[0]].dtype, g.avals[nd.outputs[0]].dtype)


#: How many such ops in a row are followed back from a group's input (transpose of a reshape of a broadcast).
MAX_CHAIN = 4


@dataclass(frozen=True)
class InProgram:
    """A group with the layout ops in front of it (`prologue`, in program order), as a function of `inputs`; the
    program's constants it reads (`consts`: a sliding window's positions) at their values, never random inputs."""

    group: Group
    prologue: tuple[Node, ...]
    inputs: tuple[int, ...]
    consts: dict[int, Any] = field(default_factory=dict, compare=False)  # (arrays: no equality of their own)

    def input_avals(self) -> list[Aval]:
        return [self.group.graph.avals[v] for v in self.inputs]

    def structs(self) -> list[jax.ShapeDtypeStruct]:
        """The inputs as the shapes the timed executables are compiled for."""
        return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in self.input_avals()]

    def around(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn` of the group's inputs as a function of `inputs`: the constants and the prologue first (nothing where
        there are none)."""
        if not self.prologue and not self.consts:
            return fn

        def run(*xs: Any) -> Any:
            env: dict[int, Any] = {**self.consts, **dict(zip(self.inputs, xs))}
            for nd in self.prologue:
                env.update(zip(nd.outputs, bind_node(nd, [read_atom(env, a) for a in nd.inputs])))
            return fn(*[env[v] for v in self.group.inputs])

        return run


def in_program(group: Group) -> InProgram:
    """`group` with the chains of layout ops that produce its inputs (outside it) in front of it."""
    g = group.graph
    members = set(group.node_ids)
    taken: dict[int, Node] = {}

    def take(v: int, depth: int) -> None:
        p = g.producer.get(v)
        if p is None or p in members or depth >= MAX_CHAIN or not free_in_program(g, g.node_index[p]):
            return
        nd = taken.setdefault(p, g.node_index[p])
        for a in nd.inputs:
            if isinstance(a, int):
                take(a, depth + 1)

    for v in group.inputs:
        take(v, 0)
    made = {v for nd in taken.values() for v in nd.outputs}
    inputs: list[int] = []
    consts: dict[int, Any] = {}

    def roots(v: int) -> None:
        if v in made:
            for a in g.node_index[g.producer[v]].inputs:
                if isinstance(a, int):
                    roots(a)
        elif v in g.consts:
            consts[v] = g.consts[v]
        elif v not in inputs:
            inputs.append(v)

    for v in group.inputs:
        roots(v)
    return InProgram(group, tuple(sorted(taken.values(), key=lambda n: n.id)), tuple(inputs), consts)  # a node's id is its place
