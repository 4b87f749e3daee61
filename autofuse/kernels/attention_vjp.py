"""Template `attention_vjp`: an attention forward chain together with its own backward, as a gradient program
(`jax.grad(loss)`) holds them, run as the flash pair (the forward kernel emitting the row logsumexp, on Triton or
Mosaic GPU, and the generated backward kernels of `triton/attention_bwd.py`).

In the jaxpr of `jax.grad` of plain-jnp attention the forward chain (q·k, score work, max, exp, sum, divide, ·v)
is followed by its transposes: dV = Pᵀ·dO and dP = dO·Vᵀ read the probabilities and V, the softmax backward reads
exp(s - max), the row sum and (for a masked softmax) the mask, and dQ, dK contract dS with K and Q. The forward
chain alone has several outputs there (P, the exponentials, the sums, the masks), so the `attention` template
does not match it; this one takes the forward chain with every node of its backward.

Recognition is by derivation, not by pattern: the forward chain is matched by the `attention` template (with
its output as the only output), then `jax.vjp` of that chain's own equations is traced with the cotangent as an
extra input, and every node of the group must compute a value of that derivation (values are compared by a
hash of their whole computation from the chain's inputs and the cotangent). The group's outputs are the chain's
output and cotangents of the chain's inputs. Anything else (a custom JVP rule that differentiates otherwise, a
probability read by another consumer) does not match.

Where the group is convex (the cotangent does not depend on the output: a loss linear in the attention output)
it runs as one unit. In a real training step dO depends on O through the rest of the network and the loss, so
forward chain + backward is not convex; there the group runs in two stages (`plan.FusedGroup.stages`,
`stage_split`): the forward chain where the forward is (the flash forward, emitting O and the row logsumexp),
the backward nodes where the backward is (the two backward kernels), the logsumexp, inputs and O handed from
one to the other privately by the executor. The partitioner offers it as one candidate whose stages are each
convex; the cover (`tuning/select.py`) orders the stages as two units of one option. The group's trials and its
XLA reference run it as one function of the forward's inputs and dO (well defined even though dO depends on O
in the program), so measuring, caching and the store need nothing new.

Library attention is read as the attention it computes (`attention_library`): a cuDNN call's two primitives in a
gradient program (`library_match`), and the forward chain of `jax.nn.dot_product_attention` on JAX's XLA path with
grouped-query heads, whose scores it transposes between its products (`_attention_chain`). The spec's `forward` is
then a captured graph's group, fed the program's values (`AttentionVJPSpec.feeds`), and the pair replaces the
program's own nodes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import jax

from ..costmodel import H200, GPUModel
from ..differentiate import is_differentiable
from ..graph import Graph, Group, Node, capture, convex
from ..ops import OpClass, op_class
from . import attention
from .computation import value_hashes
from .attention_library import FWD, cudnn_pair, is_cudnn, layout_tail, library_spec, pair_factor, xla_path_spec
from .template import NoMatch, Template
from .tiling import next_pow2

_CHAIN = ("broadcast_in_dim", "reshape", "squeeze", "expand_dims")
_DERIVED: dict[tuple, tuple[set[str], dict[str, int]]] = {}  # (forward signature, cotangent aval) -> (hash set, output hashes)


@dataclass
class AttentionVJPSpec:
    group: Group
    forward: Group  # the forward chain, its output the only output
    attn: attention.AttentionSpec  # the forward chain as the `attention` template reads it
    dout: int  # the group input that is the output's cotangent
    grads: dict[int, int]  # group output -> the position in `forward.inputs` of the input whose cotangent it is
    out: int  # the forward output (a group output when something else reads it)
    # read as a library attention (a cuDNN pair: `library_match`; JAX's XLA path with grouped-query heads): `forward`
    # is then a captured graph's group, each of its inputs fed the program's value `feeds` names, and `first` holds
    # the group's own nodes that compute the forward
    feeds: dict[int, int] = field(default_factory=dict)
    first: frozenset[int] = frozenset()

    def forward_values(self) -> list[int]:
        """The group's values that feed the forward's inputs, in their order."""
        return [self.feeds.get(v, v) for v in self.forward.inputs]

    def first_stage(self) -> frozenset[int]:
        """The group's nodes that compute the forward."""
        return self.first or frozenset(self.forward.node_ids)


def _derivation(forward: Group, dout_aval) -> tuple[set[str], dict[str, int]]:
    """The hashes of every value of `jax.vjp` of the forward chain (its inputs and the cotangent as leaves), and
    the hash of the cotangent of each floating-point input -> that input's position."""
    key = (forward.signature, str(dout_aval))
    if key not in _DERIVED:
        avals = forward.input_avals()
        diff = [is_differentiable(a.dtype) for a in avals]  # (np.issubdtype misses bfloat16)

        def fwd_bwd(*args):
            ins, ct = list(args[:-1]), args[-1]

            def f(*d):
                it = iter(d)
                return forward.evaluate([next(it) if df else x for x, df in zip(ins, diff)])[0]

            out, pull = jax.vjp(f, *[x for x, df in zip(ins, diff) if df])
            return [out, *pull(ct)]

        specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals] + [jax.ShapeDtypeStruct(dout_aval.shape, dout_aval.dtype)]
        g2 = capture(fwd_bwd, *specs)
        h = value_hashes(g2, {v: f"in{i}" for i, v in enumerate(g2.inputs)})
        grads_for = [i for i, df in enumerate(diff) if df]
        grads = {h[a]: i for a, i in zip(g2.outputs[1:], grads_for) if isinstance(a, int) and a not in g2.inputs}
        _DERIVED[key] = ({x for v, x in h.items() if v not in g2.inputs}, grads)
    return _DERIVED[key]


def forward_chain(graph: Graph, dot2: int, members: set[int] | None = None, fusible: Callable[[int], bool] | None = None) -> set[int] | None:
    """The nodes of the attention forward chain ending at `dot2` (P·V): the probabilities' ancestors back to the
    scores' dot, the broadcasts/reshapes feeding the three operands; None when that is not one score dot.
    `members` limits the search to a group; `fusible` (without `members`) to fusible nodes."""
    ok = (lambda i: i in members) if members is not None else (fusible or (lambda i: True))
    nd2 = graph.node_index[dot2]
    out: set[int] = {dot2}

    def chain(v) -> None:
        while isinstance(v, int) and v in graph.producer and ok(graph.producer[v]):
            nd = graph.node_index[graph.producer[v]]
            if nd.name not in _CHAIN:
                return
            out.add(nd.id)
            v = nd.inputs[0]

    p_side = []
    for a in nd2.inputs:
        if not isinstance(a, int):
            return None
        seen, stack, dots, has_max = set(), [a], [], False
        while stack:
            v = stack.pop()
            pid = graph.producer.get(v)
            if pid is None or pid in seen or not ok(pid):
                continue
            seen.add(pid)
            nd = graph.node_index[pid]
            if op_class(nd.name) is OpClass.CONTRACTION:
                dots.append(pid)
                continue
            if op_class(nd.name) is OpClass.REDUCTION and not _reads_a_product(graph, nd, ok):
                seen.discard(pid)  # a side input's reduction (key lengths summed from a padding mask): an operand
                continue
            has_max |= nd.name == "reduce_max"
            stack.extend(x for x in nd.inputs if isinstance(x, int))
        if has_max:
            if len(dots) != 1:
                return None
            p_side.append((seen - set(dots), dots[0]))
        else:
            chain(a)
    if len(p_side) != 1:
        return None
    nodes, dot1 = p_side[0]
    out |= nodes | {dot1}
    for a in graph.node_index[dot1].inputs:
        chain(a)
    return out


def _reads_a_product(graph: Graph, nd: Node, ok: Callable[[int], bool]) -> bool:
    """Whether `nd` reads, through nodes `ok` admits, the result of a contraction: a softmax's reductions do (the
    scores), a reduction computing a mask's side input from the program's inputs does not."""
    stack, seen = [a for a in nd.inputs if isinstance(a, int)], set()
    while stack:
        pid = graph.producer.get(stack.pop())
        if pid is None or pid in seen or not ok(pid):
            continue
        seen.add(pid)
        up = graph.node_index[pid]
        if op_class(up.name) is OpClass.CONTRACTION:
            return True
        stack.extend(a for a in up.inputs if isinstance(a, int))
    return False


def _derived(hv: str | None, derived: set[str]) -> bool:
    """Whether a value of hash `hv` is one of the derivation's (a scalar constant always is: tracing may fold it)."""
    return hv is not None and (hv in derived or hv.startswith("lit("))


def _backward_op(name: str) -> bool:
    """Ops a backward may hold: those of the primitive table (no control flow, no custom calls) and the
    transposes' own `transpose` and `add_any`."""
    return op_class(name) is not OpClass.OPAQUE or name in ("transpose", "add_any")


def _forward_group(graph: Graph, ids: set[int], out: int) -> Group:
    g = Group.of(graph, ids)
    return Group(graph, g.node_ids, g.inputs, (out,))


def _match(group: Group) -> AttentionVJPSpec:
    g = group.graph
    dots = [n for n in group.nodes if op_class(n.name) is OpClass.CONTRACTION]
    if len(dots) < 4 or not any(n.name == "reduce_max" for n in group.nodes):
        raise NoMatch("not an attention chain with its backward")
    members = set(group.node_ids)
    for d in dots:
        chain = _attention_chain(g, d, members)
        if chain is None:
            continue
        _, fwd, attn = chain
        why = attention.flash_backward_unsupported(attn, side_gradients=False)
        if why is not None:
            raise NoMatch(why)
        extra = [v for v in group.inputs if v not in fwd.inputs]
        out = fwd.outputs[0]
        out_aval = g.avals[out]
        if len(extra) != 1 or g.avals[extra[0]] != out_aval:
            raise NoMatch("the backward reads more than the forward's inputs and one cotangent")
        derived, by_hash = _derivation(fwd, out_aval)
        h = value_hashes(g, {**{v: f"in{i}" for i, v in enumerate(fwd.inputs)}, extra[0]: f"in{len(fwd.inputs)}"}, group.nodes)
        if any(not _derived(h.get(v), derived) for n in group.nodes for v in n.outputs):
            raise NoMatch("a node is not part of the chain's derivative")
        grads = {}
        for v in group.outputs:
            if v == out:
                continue
            if h[v] not in by_hash:
                raise NoMatch("an output is neither the attention output nor a cotangent of its inputs")
            grads[v] = by_hash[h[v]]
        if not grads:
            raise NoMatch("no cotangent computed")
        fed = [attn.feeds.get(v, v) for v in attention.float_side_inputs(attn)]  # (library attention: the program's)
        side = {fwd.inputs.index(v) for v in fed if v in fwd.inputs}
        if side & set(grads.values()):
            raise NoMatch("a floating-point side input's gradient is read (the flash backward does not generate it)")
        if attn.feeds:  # read as the library's attention: the pair runs the captured graph, fed the program's values
            captured = {p: c for c, p in attn.feeds.items()}
            grads = {v: attn.group.inputs.index(captured[fwd.inputs[i]]) for v, i in grads.items()}
            return AttentionVJPSpec(group, attn.group, attn, extra[0], grads, out, attn.feeds, frozenset(fwd.node_ids))
        return AttentionVJPSpec(group, fwd, attn, extra[0], grads, out)
    raise NoMatch("no attention forward chain")


def library_match(group: Group) -> AttentionVJPSpec | None:
    """A gradient program's cuDNN attention as its two primitives (`attention_library.cudnn_pair`: the forward and
    the backward reading its statistics), read as the attention it computes on JAX's XLA path, whose flash pair
    replaces both; None for any other group (or a call the flash backward does not run)."""
    g = group.graph
    fwd = next((n for n in group.nodes if n.name == FWD), None)
    pair = cudnn_pair(g, fwd) if fwd is not None else None
    if pair is None or set(group.node_ids) != {pair[0].id, pair[1].id}:
        return None
    attn = library_spec(g, fwd, attention._match)
    if attn is None or attention.flash_backward_unsupported(attn) is not None:
        return None
    bwd, captured = pair[1], attn.group.graph.inputs
    # dQ, dK, dV by the position of their captured operand among the forward's inputs (q may be k's very value)
    grads = {d: attn.group.inputs.index(captured[i]) for i, d in enumerate(bwd.outputs) if captured[i] in attn.group.inputs}
    return AttentionVJPSpec(group, attn.group, attn, bwd.inputs[-1], grads, fwd.outputs[0], attn.feeds, frozenset({fwd.id}))


def library_groups(graph: Graph) -> list[tuple[Group, AttentionVJPSpec, tuple[frozenset[int], ...]]]:
    """Each cuDNN attention pair of a gradient program that the flash pair can run, with its stages (one unit where
    the pair is convex: a loss linear in the attention's output)."""
    out = []
    for nd in graph.nodes:
        pair = cudnn_pair(graph, nd) if nd.name == FWD else None
        spec = library_match(Group.of(graph, [pair[0].id, pair[1].id])) if pair is not None else None
        if spec is not None:
            out.append((spec.group, spec, () if convex(graph, set(spec.group.node_ids)) else TEMPLATE.stage_split(spec)))
    return out


def forward_chains(graph: Graph, fusible: Callable[[int], bool]) -> list[tuple[set[int], Group, attention.AttentionSpec]]:
    """Every attention forward chain of `graph` the flash pair can differentiate: (its nodes, the chain as a group
    with its output as the only output, the `attention` template's reading of it)."""
    out = []
    for d in graph.nodes:
        if op_class(d.name) is not OpClass.CONTRACTION or not fusible(d.id):
            continue
        chain = _attention_chain(graph, d, fusible=fusible)
        if chain is not None and attention.flash_backward_unsupported(chain[2], side_gradients=False) is None:
            out.append(chain)
    return out


def _attention_chain(graph: Graph, d: Node, members: set[int] | None = None, *,
                     fusible: Callable[[int], bool] | None = None) -> tuple[set[int], Group, attention.AttentionSpec] | None:
    """The attention forward chain ending at dot `d` (within `members`, or through `fusible` nodes): its nodes, the
    chain as a group with its output as the only output, and the `attention` template's reading of it; None where
    there is no chain or the template does not read it as attention."""
    ids = forward_chain(graph, d.id, members, fusible)
    if ids is not None:
        fwd = _forward_group(graph, ids, d.outputs[0])
        try:
            return ids, fwd, attention._match(fwd)
        except NoMatch:
            pass
    return _xla_path_chain(graph, d, members, fusible)


def _xla_path_chain(graph: Graph, d: Node, members: set[int] | None,
                    fusible: Callable[[int], bool] | None) -> tuple[set[int], Group, attention.AttentionSpec] | None:
    """`_attention_chain` of grouped-query `jax.nn.dot_product_attention` on JAX's XLA path, read as the library's
    attention (`attention_library.xla_path_spec`): its scores are transposed between the products (a transpose is no
    fusible op, taken here because the call is read as a whole) and its output lies past the layout ops after `d`."""
    if members is not None:
        ok = members.__contains__
    else:
        fusible = fusible or (lambda _: True)
        ok = lambda i: fusible(i) or graph.node_index[i].name == "transpose"  # noqa: E731
    ids = forward_chain(graph, d.id, members, None if members is not None else ok)
    d1 = next((graph.node_index[i] for i in ids or () if i != d.id and graph.node_index[i].name == "dot_general"), None)
    start = graph.producer.get(d1.inputs[0]) if d1 is not None and isinstance(d1.inputs[0], int) else None
    if start is None:
        return None
    ids = {i for i in ids if i >= start}  # the call's own equations, from the query's reshape on: not an operand's
    tail = layout_tail(graph, d, ok)
    for k, nd in enumerate(tail):
        if len(graph.avals[nd.outputs[0]].shape) == 4:
            longer = ids | {t.id for t in tail[:k + 1]}
            fwd = _forward_group(graph, longer, nd.outputs[0])
            attn = xla_path_spec(fwd, attention._match)
            return (longer, fwd, attn) if attn is not None else None
    return None


def candidate_groups(graph: Graph, fusible: Callable[[int], bool]) -> list[tuple[Group, AttentionVJPSpec, tuple[frozenset[int], ...]]]:
    """The groups this template could take in a gradient program, with their match and their stages: per forward chain, the chain
    with every node computing a value of its derivative from the chain's values and one cotangent. Where that
    group is convex it is one unit (stages `()`); where it is not (a training step: the cotangent depends on the
    output) it runs in two stages, the forward chain then the backward, when each of those is convex."""
    out = []
    for ids, fwd, attn in forward_chains(graph, fusible):
        for dout in cotangent_candidates(graph, ids, fwd, attn):  # the one whose derivation the readers compute
            members, one_unit = backward_of(graph, ids, fwd, attn, dout)
            if len(members) == len(ids):
                continue
            group = Group.of(graph, members)
            spec = TEMPLATE.match(group)
            if spec is None:
                continue
            if one_unit:
                out.append((group, spec, ()))
                break
            stages = TEMPLATE.stage_split(spec)
            if all(convex(graph, set(st)) for st in stages):
                out.append((group, spec, stages))
                break
    return out


def cotangent_candidates(graph: Graph, ids: set[int], fwd: Group, attn: attention.AttentionSpec) -> list[int]:
    """Values that could be the output's cotangent: of its aval, read beside the chain's values or inputs."""
    out = fwd.outputs[0]
    inside = {v for i in ids for v in graph.node_index[i].outputs} - {out}
    readers = {c for v in inside | set(fwd.inputs) for c in graph.consumers.get(v, ()) if c not in ids}
    read = {a for c in readers for a in graph.node_index[c].inputs if isinstance(a, int)}
    for _ in range(4):  # and what those read through layout ops (JAX's XLA path moves dO as it moved O)
        up = [graph.node_index[graph.producer[a]] for a in read if a in graph.producer]
        read |= {nd.inputs[0] for nd in up if nd.name in ("transpose", "reshape") and isinstance(nd.inputs[0], int)}
    return sorted(a for a in read if graph.producer.get(a) not in ids and a not in fwd.inputs and graph.avals[a] == graph.avals[out])


def backward_of(graph: Graph, ids: set[int], fwd: Group, attn: attention.AttentionSpec, dout: int) -> tuple[set[int], bool]:
    """The forward chain with every node computing a value of its derivative (`dout` the cotangent), and whether
    that set is convex."""
    derived, _ = _derivation(fwd, graph.avals[fwd.outputs[0]])
    leaves = {**{v: f"in{i}" for i, v in enumerate(fwd.inputs)}, dout: f"in{len(fwd.inputs)}"}
    members = set(ids)
    known = set(leaves) | {v for i in ids for v in graph.node_index[i].outputs}
    h = value_hashes(graph, leaves, [graph.node_index[i] for i in sorted(ids)])
    start = min(ids)

    def source(a) -> bool:  # an input-less value of the derivation (a broadcast zero): it joins
        nd = graph.node_index.get(graph.producer.get(a, -1))
        if nd is None or any(isinstance(x, int) for x in nd.inputs) or not _backward_op(nd.name):
            return False
        hv = value_hashes(graph, {}, [nd])
        if not all(_derived(hv.get(v), derived) for v in nd.outputs):
            return False
        members.add(nd.id)
        known.update(nd.outputs)
        h.update({v: hv[v] for v in nd.outputs})
        return True

    for nd in graph.nodes[start:]:  # the backward: any node (the pair replaces them all, none is lowered alone)
        if nd.id in members or not _backward_op(nd.name):
            continue
        ins = [a for a in nd.inputs if isinstance(a, int)]
        if not ins or not any(a in known for a in ins) or not all(a in known or source(a) for a in ins):
            continue
        text = value_hashes(graph, {a: h[a] for a in ins}, [nd])
        if all(_derived(text.get(v), derived) for v in nd.outputs):
            members.add(nd.id)
            known.update(nd.outputs)
            h.update({v: text[v] for v in nd.outputs})
    return members, convex(graph, members)


def backward_default_config(spec: attention.AttentionSpec) -> dict:
    """The backward kernels' tiles: each program holds `bwd_held` rows (keys for dK/dV, queries for dQ) and steps
    through the other side `bwd_step` rows at a time. 64 and 64 (five [64, 64] float32 tiles and two accumulators
    live at once), 4 warps, 2 stages: the best of the three tried at B8 H32 L2048 D128 on an H100
    (results/attention_grad_h100.md); 32 for short sequences or wide heads, and never longer than the sequence
    rounded up to a power of two (16 at least: a sequence of 16 has 16-row blocks, as the spaces' rule says). Here, not with the Triton backward, as the cost model reads them too."""
    small = min(spec.Lq, spec.Lk) < 64 or max(spec.D, spec.Dv) > 128
    n = min(32 if small else 64, max(16, next_pow2(min(spec.Lq, spec.Lk))))  # no block past the sequence
    return {"bwd_held": n, "bwd_step": n, "bwd_warps": 4, "bwd_stages": 2}


def backward_config(spec: attention.AttentionSpec, config: dict | None) -> dict:
    """The backward's parameters of a config (the `bwd_` keys of an `attention_vjp` config), the defaults for
    those it lacks (a forward template's config, or a plan stored before the backward was tuned)."""
    return {**backward_default_config(spec), **{k: v for k, v in (config or {}).items() if k.startswith("bwd_")}}


class AttentionVJPTemplate(Template[AttentionVJPSpec]):
    name = "attention_vjp"
    backends = ("triton", "mosaic_gpu")  # the forward's backend; the backward kernels are Triton's

    def match(self, group: Group) -> AttentionVJPSpec | None:
        """The forward chain, its cotangent input and the cotangents the group returns, or None. A cuDNN pair (two
        nodes) is read as the attention it computes (`library_match`)."""
        if len(group.node_ids) == 2:
            return library_match(group)
        try:
            return _match(group)
        except NoMatch:
            return None

    def candidate_groups(self, graph: Graph, fusible: Callable[[int], bool]) -> list[tuple[Group, AttentionVJPSpec, tuple[frozenset[int], ...]]]:
        return candidate_groups(graph, fusible) + library_groups(graph)

    def stage_split(self, spec: AttentionVJPSpec) -> tuple[frozenset[int], ...]:
        """Stage 1: the forward chain (the flash forward: O and the row logsumexp); stage 2: the backward nodes
        (the backward kernels: dQ, dK, dV from the saved inputs, O, the logsumexp and dO)."""
        fwd = spec.first_stage()
        return fwd, frozenset(spec.group.node_ids) - fwd

    def xla_model_ms(self, group: Group, spec: AttentionVJPSpec, model: GPUModel = H200) -> float:
        """A cuDNN pair's: the flash pair's modelled default over the ratio measured between them
        (`attention_library.CUDNN_PAIR_FACTOR`, by head dim); XLA's fusion's for any other group (JAX's XLA path with
        grouped-query heads, read as the library's attention, too)."""
        if spec is None or not is_cudnn(group):
            return super().xla_model_ms(group, spec, model)
        return pair_factor(spec.attn.D) * self.default_model_ms(spec, model)

    def timing_inputs(self, group: Group, spec: AttentionVJPSpec) -> dict[int, int]:
        return attention.timing_inputs(spec.attn)

    def facts(self, group: Group, spec: AttentionVJPSpec) -> dict:
        """The forward's facts (search_spaces/attention_vjp[.<backend>].toml tunes the forward's parameters and the
        backward's: in a training step the backward is most of the pair's time, and its best tiles are not the
        forward's)."""
        return attention.TEMPLATE.facts(spec.forward, spec.attn)

    def model_time_ms(self, spec: AttentionVJPSpec, config: dict, model: GPUModel = H200) -> float:
        """The forward's model, plus 2.5 times the same model at the backward's tiles (a program of `bwd_held`
        rows stepping `bwd_step` at a time): the backward's five products to the forward's two (its two kernels
        re-evaluate the scores, seven in all, at a lower efficiency than the forward's). A Mosaic GPU backward
        (`bwd_mosaic`) is modelled as the Mosaic GPU forward at its tiles."""
        b = backward_config(spec.attn, config)
        as_forward = {"block_q": b["bwd_held"], "block_k": b["bwd_step"], "num_warps": b["bwd_warps"], "num_stages": b["bwd_stages"]}
        if int(config.get("bwd_mosaic", 0)):
            as_forward = {"backend": "mosaic_gpu", "block_q": b["bwd_held"], "block_kv": b["bwd_step"], "max_concurrent_steps": b["bwd_stages"]}
        fwd = {k: v for k, v in config.items() if not k.startswith("bwd_")}
        return attention.TEMPLATE.model_time_ms(spec.attn, fwd, model) + 2.5 * attention.TEMPLATE.model_time_ms(spec.attn, as_forward, model)


TEMPLATE = AttentionVJPTemplate()
