"""A cuDNN attention call (`jax.nn.dot_product_attention(..., implementation="cudnn")`) read as the attention it computes.

In a traced program the call is one opaque node: a `custom_vjp_call` whose primal is a single
`dot_product_attention_fwd_wrapper` (JAX's cuDNN fused attention), its scale, causal mask and [B, T, N, H] layout in
the node's parameters. `library_spec` recognises the cases that equal plain softmax attention (no bias, dropout,
padding, sliding window or paged keys; no mask or a causal one; as many key as query heads) and captures what the call
computes, `jax.nn.dot_product_attention` on JAX's own XLA path at the node's shapes and parameters, as a graph of its
own, whose group the `attention` template matches like any other (`AttentionSpec.group` is then that graph's group,
not the node's). The node's own group then has two options like every other: XLA's, which is the cuDNN call itself,
and the generated flash kernel, built from the captured group and fed the node's query, key and value
(`library_kernel`). Which is faster is the tuner's to measure on the GPU. Nothing here runs cuDNN: capturing the
program on a CPU needs JAX's cuDNN checks to pass, which is the caller's affair (the tests patch them).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ..graph import Graph, Group, Node, capture
from .template import NoMatch

FWD = "dot_product_attention_fwd_wrapper"


def cudnn_call(node: Node) -> dict | None:
    """The parameters of the cuDNN attention `node` computes as plain softmax attention ({"scale", "causal"}), or None
    for any other node (or a cuDNN call with a bias, dropout, padding, a window or paged keys)."""
    if node.name != "custom_vjp_call":
        return None
    inner = node.params.get("call_jaxpr")
    eqns = getattr(getattr(inner, "jaxpr", inner), "eqns", ())
    if len(eqns) != 1 or eqns[0].primitive.name != FWD:
        return None
    p = eqns[0].params
    mask = getattr(p.get("mask_type"), "name", None)
    plain = (p.get("dropout_rate") == 0 and p.get("sliding_window_length") is None and int(p.get("layout", -1)) == 0
             and not any(p.get("variadic_args", (True,))) and mask in ("NO_MASK", "CAUSAL"))
    return {"scale": float(p["scale"]), "causal": mask == "CAUSAL"} if plain else None


def library_group(graph: Graph, node: Node, match: Callable[[Group], Any]) -> tuple[Group, Any] | None:
    """The group of the cuDNN attention `node` alone and its `AttentionSpec` (`match`, the `attention` template's
    matcher, on the captured XLA-path graph), or None where the node is no such call or `match` raises NoMatch."""
    call = cudnn_call(node)
    if call is None:
        return None
    q, k, v = (graph.aval(a) for a in node.inputs[:3])
    if any(len(x.shape) != 4 for x in (q, k, v)) or any(graph.aval(a).size for a in node.inputs[3:]):
        return None
    spec = _spec(tuple((x.shape, np.dtype(x.dtype).name) for x in (q, k, v)), call["scale"], call["causal"], match)
    return (Group.of(graph, [node.id]), spec) if spec is not None else None


@functools.lru_cache(maxsize=64)
def _spec(qkv: tuple, scale: float, causal: bool, match: Callable[[Group], Any]) -> Any:
    def reference(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal, implementation="xla")

    sub = capture(reference, *(jax.ShapeDtypeStruct(s, d) for s, d in qkv))
    try:
        return match(Group.of(sub, [n.id for n in sub.nodes]))
    except NoMatch:
        return None


def library_kernel(group: Group, spec: Any, inner: Callable) -> Callable:
    """`inner` (a kernel of `spec.group`, the captured graph's group) as a function of the cuDNN node's group's inputs:
    the node's query, key and value go to the captured graph's inputs they stand for."""
    node = group.nodes[0]
    sub = spec.group.graph
    position = {v: i for i, v in enumerate(sub.inputs)}
    picks = [node.inputs[position[v]] for v in spec.group.inputs]
    at = {v: i for i, v in enumerate(group.inputs)}

    def kernel(*ins):
        return inner(*(ins[at[v]] for v in picks))

    return kernel
