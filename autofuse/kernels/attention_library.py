"""Library attention (`jax.nn.dot_product_attention`: a cuDNN call, or JAX's XLA path with grouped-query heads) read as
the attention it computes.

In a traced program a cuDNN call is one opaque node: a `custom_vjp_call` whose primal is a single
`dot_product_attention_fwd_wrapper` (JAX's cuDNN fused attention), its scale, causal mask and [B, T, N, H] layout in
the node's parameters. `library_spec` recognises the cases that equal plain softmax attention (no bias, dropout,
padding, sliding window or paged keys; no mask or a causal one) and captures what the call computes,
`jax.nn.dot_product_attention` on JAX's own XLA path at the node's shapes and parameters (with grouped-query heads
the same in plain jnp, the key and value heads repeated: `repeated_heads`), as a graph of its own, whose group the
`attention` template matches like any other (`AttentionSpec.group` is then that graph's group, not the node's, and
`AttentionSpec.feeds` names the program's values its inputs stand for). The node's own group then has two options like every other: XLA's, which is the cuDNN call itself,
and the generated flash kernel, built from the captured group and fed the node's query, key and value
(`library_kernel`). Which is faster is the tuner's to measure on the GPU. Nothing here runs cuDNN: capturing the
program on a CPU needs JAX's cuDNN checks to pass, which is the caller's affair (the tests patch them).

JAX's own XLA path of the function (its default implementation) is ordinary equations in the program, which the
`attention` template reads itself, except with grouped-query heads: there it transposes the scores between its two
products, which the tiling does not take. Such a group is recognised by what it computes (`xla_path_spec`: its
value hashes against the function captured at its shapes, with a bias or query / key lengths where it reads them:
`XlaCall`; a sliding window's positions, constants of the trace, by their contents) and read like a cuDNN call
(`xla_path_groups` finds them).

In a gradient program (`jax.grad`) the call is two primitives instead: the forward (`FWD`, emitting its softmax
statistics) and the backward (`BWD`) reading them (`cudnn_pair`); `attention_vjp` runs the two as the flash pair, in
two stages where they are. The model prices XLA's option of either as the generated kernels' own modelled time over
the ratio measured between them (`CUDNN_FORWARD_FACTOR`, `CUDNN_PAIR_FACTOR`).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..graph import Graph, Group, Lit, Node, capture
from .computation import value_hashes
from .template import NoMatch

FWD = "dot_product_attention_fwd_wrapper"
BWD = "dot_product_attention_bwd_wrapper"
# cuDNN's time against the generated flash kernels' at their default configs, measured in alternating pairs of
# sustained calls on an H200 at B8 H32 L2048 bf16 (results/kernels_pairs_h200.md, results/attention_grad_pairs_h200.md):
# the forward 0.89-0.94x cuDNN's, forward + backward 0.93-0.95x at head dim 64 and 1.02x at 128. The model prices
# XLA's option of a cuDNN call as the kernel's own modelled time over those ratios, so that a tie at stake is timed
# (priced at its memory floor, the call was a modelled loss that a short budget never reached).
CUDNN_FORWARD_FACTOR = 1.08
CUDNN_PAIR_FACTOR = {64: 1.06, 128: 0.98}  # by head dim, the nearest at or above it


def _plain(params: dict) -> dict | None:
    """{"scale", "causal"} of a cuDNN attention primitive's `params` that compute plain softmax attention (no
    bias, dropout, padding, sliding window or paged keys; no mask or a causal one), else None."""
    mask = getattr(params.get("mask_type"), "name", None)
    plain = (params.get("dropout_rate") == 0 and params.get("sliding_window_length") is None and int(params.get("layout", -1)) == 0
             and not any(params.get("variadic_args", (True,))) and mask in ("NO_MASK", "CAUSAL"))
    return {"scale": float(params["scale"]), "causal": mask == "CAUSAL"} if plain else None


def cudnn_call(node: Node) -> dict | None:
    """The parameters of the cuDNN attention `node` computes as plain softmax attention ({"scale", "causal"}), or None
    for any other node (or a cuDNN call with a bias, dropout, padding, a window or paged keys)."""
    if node.name != "custom_vjp_call":
        return None
    inner = node.params.get("call_jaxpr")
    eqns = getattr(getattr(inner, "jaxpr", inner), "eqns", ())
    if len(eqns) != 1 or eqns[0].primitive.name != FWD:
        return None
    return _plain(eqns[0].params)


def cudnn_pair(graph: Graph, node: Node) -> tuple[Node, Node] | None:
    """A gradient program's cuDNN attention as its two primitives: `node`, the forward (`FWD`, its output and its
    softmax statistics), and the one backward (`BWD`) that reads those statistics, the same query, key, value and
    parameters, and the forward's output; None where `node` is no such plain forward."""
    call = _plain(node.params) if node.name == FWD else None
    if call is None or len(node.outputs) != 2:
        return None
    out, stats = node.outputs
    readers = [graph.node_index[c] for c in graph.consumers.get(stats, ())]
    if len(readers) != 1 or readers[0].name != BWD:
        return None
    bwd = readers[0]
    if (list(bwd.inputs[:3]) != list(node.inputs[:3]) or list(bwd.inputs[-3:-1]) != [stats, out] or _plain(bwd.params) != call
            or len(bwd.outputs) != 3 or any(graph.aval(a).size for a in (*node.inputs[3:], *bwd.inputs[3:-3]))):
        return None
    return node, bwd


def library_spec(graph: Graph, node: Node, match: Callable[[Group], Any]) -> Any:
    """The `AttentionSpec` (`match`, the `attention` template's matcher) of what the cuDNN attention `node` (a call or
    a gradient program's forward primitive) computes, read on its captured XLA path; None where it is no plain
    softmax attention of [B, T, N, H] operands or `match` raises NoMatch."""
    call = cudnn_call(node) if node.name == "custom_vjp_call" else _plain(node.params) if node.name == FWD else None
    if call is None:
        return None
    q, k, v = (graph.aval(a) for a in node.inputs[:3])
    if any(len(x.shape) != 4 for x in (q, k, v)) or any(graph.aval(a).size for a in node.inputs[3:]):
        return None
    return _fed(_spec(_avals(graph, node.inputs[:3]), XlaCall(call["scale"], call["causal"]), match), node.inputs[:3])


@dataclasses.dataclass(frozen=True)
class XlaCall:
    """A `jax.nn.dot_product_attention` call on JAX's XLA path as read off its equations: its scale, causal mask and
    sliding window, and what its inputs after the query, key and value are (`extras`, in order: "bias",
    "key_lengths", "query_lengths", or "lengths" for one array passed as both)."""
    scale: float
    causal: bool
    extras: tuple[str, ...] = ()
    window: tuple[int, int] | None = None  # `local_window_size`

    def __call__(self, q, k, v, *xs):
        kw = dict(zip(self.extras, xs))
        both = kw.get("lengths")
        return jax.nn.dot_product_attention(q, k, v, bias=kw.get("bias"), scale=self.scale, is_causal=self.causal,
                                            query_seq_lengths=kw.get("query_lengths", both),
                                            key_value_seq_lengths=kw.get("key_lengths", both),
                                            local_window_size=self.window, implementation="xla")


#: the inputs after the query, key and value, by their kinds: a floating-point array is a bias (first), an int [B]
#: array lengths
_LENGTHS = {"": ((),), "int": (("key_lengths",), ("lengths",), ("query_lengths",)),
            "int,int": (("key_lengths", "query_lengths"), ("query_lengths", "key_lengths"))}
_EXTRAS = {**_LENGTHS, **{",".join(filter(None, ("float", k))): tuple(("bias", *e) for e in v) for k, v in _LENGTHS.items()}}


def xla_path_spec(group: Group, match: Callable[[Group], Any]) -> Any:
    """The `AttentionSpec` of a group that is, node for node, `jax.nn.dot_product_attention` on JAX's own XLA path
    (its default implementation) with grouped-query heads, no mask or a causal one, and optionally a bias, query or
    key lengths and a sliding window, read as `library_spec` reads a cuDNN call: with grouped-query heads that path
    transposes the scores between its two products, which the `attention` template's tiling does not take.
    Recognised by computation (`computation.value_hashes`): the group's output, from its inputs (constants of the
    trace, a window's positions, by their contents), hashes as the output of the function captured at their shapes,
    at a scale among the group's literals, masked or not, at a window among its integer literals; None for any other
    group."""
    g = group.graph
    names = [n.name for n in group.nodes]
    if len(group.outputs) != 1 or names.count("dot_general") != 2 or names.count("reduce_max") != 1:
        return None
    consts = {a: _const_text(g.consts[a]) for a in group.inputs if a in g.consts}
    args = [a for a in group.inputs if a not in consts]
    heads = [a for a in args if len(g.aval(a).shape) == 4 and g.aval(a).dtype == g.aval(args[0]).dtype]
    rest = [a for a in args if a not in heads]
    if len(heads) == 4:  # a bias besides q, k, v: the one whose last dim (a sequence) is not their head dim
        odd = [a for a in heads if sum(g.aval(b).shape[-1] == g.aval(a).shape[-1] for b in heads) == 1]
        if len(odd) != 1:
            return None
        rest, heads = odd + rest, [a for a in heads if a != odd[0]]
    if len(heads) != 3 or len(rest) > 3:
        return None
    q, k, v = sorted(heads, key=lambda a: -g.aval(a).shape[2])  # the query: the most heads
    (B, _, N, H), (Bk, _, K, Hk) = g.aval(q).shape, g.aval(k).shape
    if (B, H) != (Bk, Hk) or g.aval(v).shape[:3] != g.aval(k).shape[:3] or K == N or N % K:
        return None  # (equal heads: the template reads JAX's path itself)
    is_float = {a: jnp.issubdtype(g.aval(a).dtype, jnp.floating) for a in rest}  # (np.issubdtype misses bfloat16)
    rest.sort(key=lambda a: not is_float[a])  # a bias first, as `XlaCall` takes it
    kinds = ",".join("float" if is_float[a] else "int" for a in rest)
    if kinds not in _EXTRAS or any(g.aval(a).shape != (B,) for a in rest if not is_float[a]):
        return None
    literals = [a for n in group.nodes for a in n.inputs if isinstance(a, Lit) and a.aval.shape == ()]
    scales = {float(a.value) for a in literals if np.issubdtype(a.aval.dtype, np.floating) and 0 < float(a.value) < np.inf}
    sides = sorted({int(a.value) for a in literals if np.issubdtype(a.aval.dtype, np.integer) and int(a.value) >= 0})
    windows = [(left, right) for left in sides for right in sides] if consts else [None]  # (a window's positions: constants)
    orders = [(q, k, v)] + ([(q, v, k)] if g.aval(v).shape == g.aval(k).shape else [])  # which of the two is the key
    for extras in _EXTRAS[kinds]:
        for ops in orders:
            ins = (*ops, *rest)
            (out,) = group.outputs
            have = value_hashes(g, {**consts, **{a: f"in{i}" for i, a in enumerate(ins)}}, group.nodes).get(out)
            for scale in sorted(scales):
                for causal in (True, False):
                    for window in windows:
                        call = XlaCall(scale, causal, extras, window)
                        if have is not None and have == _xla_path_hash(_avals(g, ins), call):
                            return _fed(_spec(_avals(g, ins), call, match), ins, {t: a for a, t in consts.items()})
    return None


def xla_path_groups(graph: Graph, match: Callable[[Group], Any]) -> list[tuple[Group, Any]]:
    """Each `jax.nn.dot_product_attention` on JAX's XLA path with grouped-query heads in `graph`, as its group and spec
    (`xla_path_spec`): the equations of one call lie together in the traced program, from the query's reshape into
    key-head groups to the output's reshape back, so each softmax's max finds them (growth by neighbours, the lowest
    first, wanders into the projections that make the operands before it reaches the second product)."""
    out = []
    for m in graph.nodes:
        d1 = _dot_near(graph, m, forward=False) if m.name == "reduce_max" else None
        d2 = _dot_near(graph, m, forward=True) if d1 is not None else None
        start = graph.node_index.get(graph.producer.get(d1.inputs[0], -1)) if d2 is not None else None
        if start is None or start.name != "reshape" or len(graph.aval(start.inputs[0]).shape) != 4:
            continue
        tail = [nd for nd in layout_tail(graph, d2) if len(graph.avals[nd.outputs[0]].shape) == 4]
        if tail and graph.avals[tail[0].outputs[0]].shape == graph.aval(start.inputs[0]).shape:
            group = Group.of(graph, [n.id for n in graph.nodes if start.id <= n.id <= tail[0].id])
            spec = xla_path_spec(group, match)
            if spec is not None:
                out.append((group, spec))
    return out


def layout_tail(graph: Graph, d2: Node, ok: Callable[[int], bool] = lambda i: True) -> list[Node]:
    """The transposes and reshapes after the second product `d2`, each the only reader of the one before (and `ok`):
    JAX's XLA path moves its grouped-query output back to [B, T, N, H] through them."""
    out, v = [], d2.outputs[0]
    while True:
        readers = graph.consumers.get(v, ())
        nd = graph.node_index[readers[0]] if len(readers) == 1 and ok(readers[0]) else None
        if nd is None or nd.name not in ("transpose", "reshape"):
            return out
        out.append(nd)
        v = nd.outputs[0]


def _dot_near(graph: Graph, node: Node, *, forward: bool) -> Node | None:
    """The nearest dot_general before `node` (through its operands' producers) or after it (through its readers)."""
    seen, todo = set(), [node.id]
    while todo:
        nd = graph.node_index[todo.pop(0)]
        if nd.id != node.id and nd.name == "dot_general":
            return nd
        nxt = graph.succs(nd.id) if forward else graph.preds(nd.id)
        todo += [i for i in nxt if i not in seen]
        seen.update(nxt)
    return None


@functools.lru_cache(maxsize=64)
def _xla_path_hash(avals: tuple, call: XlaCall) -> str:
    sub = capture(call, *(jax.ShapeDtypeStruct(s, d) for s, d in avals))
    leaves = {**{c: _const_text(x) for c, x in sub.consts.items()}, **{a: f"in{i}" for i, a in enumerate(sub.inputs)}}
    return value_hashes(sub, leaves).get(sub.outputs[0], "")


def _const_text(x: np.ndarray) -> str:
    """A constant of a trace named by its contents (a window's positions: the same in the program and the capture)."""
    x = np.ascontiguousarray(x)
    return f"const({x.dtype}{list(x.shape)}:{hashlib.sha256(x.tobytes()).hexdigest()[:16]})"


def _avals(graph: Graph, values) -> tuple:
    return tuple((graph.aval(a).shape, np.dtype(graph.aval(a).dtype).name) for a in values)


def _fed(spec: Any, values, consts: dict[str, int] | None = None) -> Any:
    """`spec` (of a captured graph) with the program's values that its inputs (query, key, value, and any bias or
    lengths) stand for, and its constants (`consts`: the program's constant values by their contents); None where
    the captured group reads a constant the program's group does not have."""
    if spec is None:
        return None
    feeds = dict(zip(spec.group.graph.inputs, values))
    sub = spec.group.graph
    for c in spec.group.inputs:
        if c in sub.consts:
            program = (consts or {}).get(_const_text(sub.consts[c]))
            if program is None:
                return None
            feeds[c] = program
    return dataclasses.replace(spec, feeds=feeds)


def is_cudnn(group: Group) -> bool:
    """Whether `group` is a cuDNN attention call alone or a gradient program's cuDNN pair (XLA's option: cuDNN's
    kernels, not a fusion of XLA's)."""
    nodes = group.nodes
    if len(nodes) == 1:
        return cudnn_call(nodes[0]) is not None
    pair = cudnn_pair(group.graph, nodes[0]) if len(nodes) == 2 else None
    return pair is not None and pair[1].id == nodes[1].id


def library_group(graph: Graph, node: Node, match: Callable[[Group], Any]) -> tuple[Group, Any] | None:
    """The group of the cuDNN attention call `node` alone and its `AttentionSpec` (`library_spec`), or None."""
    if node.name != "custom_vjp_call":
        return None
    spec = library_spec(graph, node, match)
    return (Group.of(graph, [node.id]), spec) if spec is not None else None


def pair_factor(head_dim: int) -> float:
    """`CUDNN_PAIR_FACTOR` at `head_dim`: the nearest measured head dim at or above it (the widest past them)."""
    return next((f for d, f in sorted(CUDNN_PAIR_FACTOR.items()) if head_dim <= d), CUDNN_PAIR_FACTOR[max(CUDNN_PAIR_FACTOR)])


@functools.lru_cache(maxsize=64)
def _spec(avals: tuple, call: XlaCall, match: Callable[[Group], Any]) -> Any:
    """`match` of what `call` computes at `avals`, captured: with grouped-query heads the key and value heads
    repeated (`repeated_heads`; with a bias, lengths or a window, the library itself on the repeated heads, whose XLA
    path the template reads where the heads are equal)."""
    def repeated(q, k, v, *xs):
        return call(q, *_repeat_kv(q, k, v), *xs)

    grouped = avals[0][0][2] != avals[1][0][2]
    fn = (call if not grouped else repeated if call.extras or call.window
          else functools.partial(repeated_heads, scale=call.scale, causal=call.causal))
    sub = capture(fn, *(jax.ShapeDtypeStruct(s, d) for s, d in avals))
    try:
        return match(Group.of(sub, [n.id for n in sub.nodes]))
    except NoMatch:
        return None


def repeated_heads(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float, causal: bool) -> jax.Array:
    """What `jax.nn.dot_product_attention` computes for [B, T, N, H] operands, written in plain jnp with the key and
    value heads repeated for grouped-query heads (JAX's own XLA path transposes the scores between its two products
    there, which the tiling does not take): scores in float32, the causal mask top-left aligned, the probabilities
    in the values' dtype."""
    k, v = _repeat_kv(q, k, v)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    if causal:
        s = jnp.where(jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool)), s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def _repeat_kv(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The key and value heads of [B, T, N, H] operands repeated to the query's (each key/value head for its group)."""
    group = q.shape[2] // k.shape[2]
    return jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)


def library_kernel(group: Group, spec: Any, inner: Callable) -> Callable:
    """`inner` (a kernel of `spec.group`, the captured graph's group) as a function of `group`'s inputs: the query,
    key and value go to the captured graph's inputs they stand for (`spec.feeds`)."""
    picks = [spec.feeds[v] for v in spec.group.inputs]
    at = {v: i for i, v in enumerate(group.inputs)}

    def kernel(*ins):
        return inner(*(ins[at[v]] for v in picks))

    return kernel
