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

Both kernels read the product rounded to the dot's dtype, as the program's dot returns it: stage 1 hands on
values made from that rounding (a bf16 max), which stage 2's product must meet. A backward that compares a value
it computes again with one stage 1 made (SPLADE's head: `jax.grad` of a max over the sequence) is refused
(`_compares_again`); `reduce_vjp` runs that head from the stored product. The split itself is `reread.py`'s.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..costmodel import H200, GPUModel
from ..graph import Graph, Group
from ..ops import OpClass, op_class
from . import matmul, matmul_reduce
from . import reread
from .reread import split, two_stages
from .template import Template

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
    parts = split(g, dots[0].id)  # the whole growth from the dot, not a part of it (one candidate per dot)
    if parts is None or parts[0] != set(group.node_ids):
        return None
    _, first, second = parts
    S = tuple(g.avals[dots[0].outputs[0]].shape)
    st = two_stages(group, first, second, S)
    if st is None or _compares_again(g, st.recomputed, set(st.private), S):
        return None
    forward_spec = matmul_reduce.TEMPLATE.match(st.forward)
    backward_spec = matmul.TEMPLATE.match(st.backward) if forward_spec is not None else None
    if backward_spec is None:
        return None
    # Stage 1 hands stage 2 values made from the product rounded to the dot's dtype (a max of bf16 logits): both
    # kernels read the product so rounded, or the logit at that max could exceed it by half a rounding step
    # (exp(0.25): the largest softmax entry 28% off at logits of ~100)
    forward_spec.round_product = backward_spec.round_product = True
    return MatmulReduceVJPSpec(group, frozenset(first), frozenset(second), st.forward, forward_spec, st.backward,
                               backward_spec, st.private)


def candidate_groups(graph: Graph, fusible) -> list[tuple[Group, MatmulReduceVJPSpec, tuple[frozenset[int], ...]]]:
    """Per dot whose product is reduced and read again after the reductions: the group grown from the dot."""
    return reread.candidate_groups(graph, fusible, lambda dot: split(graph, dot), TEMPLATE)


def stage_configs(config: dict) -> tuple[dict, dict]:
    """(stage 1's `matmul_reduce` config, stage 2's `matmul` config) of a config of this template."""
    fwd, bwd = reread.stage_configs(config, BWD)
    if "backend" in config:
        bwd["backend"] = config["backend"]
    return fwd, bwd


class MatmulReduceVJPTemplate(Template[MatmulReduceVJPSpec]):
    name = "matmul_reduce_vjp"
    backends = ("triton", "mosaic_gpu")

    def match(self, group: Group) -> MatmulReduceVJPSpec | None:
        """The two stages and their kernels' specs, or None."""
        return _match(group)

    def candidate_groups(self, graph: Graph, fusible: Callable[[int], bool]) -> list[tuple[Group, MatmulReduceVJPSpec, tuple[frozenset[int], ...]]]:
        return candidate_groups(graph, fusible)

    def stage_split(self, spec: MatmulReduceVJPSpec) -> tuple[frozenset[int], ...]:
        return spec.stage1, spec.stage2

    def facts(self, group: Group, spec: MatmulReduceVJPSpec) -> dict:
        """Stage 1's facts and stage 2's rows per outer index (search_spaces/matmul_reduce_vjp[.<backend>].toml
        tunes stage 1's parameters and stage 2's, under `bwd_`)."""
        f = spec.forward_spec
        itemsize = np.dtype(group.graph.avals[f.a].dtype).itemsize
        return {"M": f.M, "N": f.N, "K": f.K, "L": f.L, "over_n": int(f.over_n), "itemsize": itemsize, "smem_bytes": H200.smem_bytes,
                "outer_rows": spec.backward_spec.outer_rows}

    def model_time_ms(self, spec: MatmulReduceVJPSpec, config: dict, model: GPUModel = H200) -> float:
        """The two kernels' models."""
        fwd, bwd = stage_configs(config)
        return (matmul_reduce.TEMPLATE.model_time_ms(spec.forward_spec, fwd, model)
                + matmul.TEMPLATE.model_time_ms(spec.backward_spec, bwd, model))


TEMPLATE = MatmulReduceVJPTemplate()
