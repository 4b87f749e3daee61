"""Graph passes that matching runs on a group's epilogue before tiling it: each takes a group and returns the
same computation as a group on a rewritten copy of its graph (or the group itself when nothing applies).

- `fold_gathers`: a gather that picks one element per row (`take_along_axis(x, idx[:, None], axis=-1)`, the
  label's logit in a cross-entropy) becomes a one-hot sum, `sum(where(iota == idx, x, 0))`, which a reduction
  over N can run on tiles (`foldable_gather` tells the partitioner which gathers may join a group).
- `hoist_monotone`: a max or min over a monotone elementwise chain (`max(log1p(relu(x + b)) * mask)`) reduces the
  chain's base and runs the chain once on the result, so it is not evaluated on every element.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .. import ops
from ..graph import Aval, Graph, Group, Lit, Node, bind_node, capture
from ..ops import OpClass, op_class
from .template import NoMatch

# Ops that pass a value through unchanged but for its dtype or layout.
PASS_THROUGH = {"convert_element_type", "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "stop_gradient", "copy", "copy_p"}


def foldable_gather(graph: Graph, nd: Node) -> bool:
    """A gather that picks one element per row of a [M, N] value, `take_along_axis(x, idx[:, None], axis=-1)`:
    `fold_gathers` makes it `sum(where(iota == idx, x, 0))`, which a reduction over N runs on tiles."""
    if nd.name != "gather" or len(nd.inputs) != 2 or not all(isinstance(x, int) for x in nd.inputs):
        return False
    x, idx = (graph.avals[v] for v in nd.inputs)
    dn = nd.params["dimension_numbers"]
    return (len(x.shape) == 2 and idx.shape == (x.shape[0], 1, 1) and np.issubdtype(idx.dtype, np.integer)
            and tuple(nd.params["slice_sizes"]) == (1, 1) and tuple(dn.offset_dims) == () and tuple(dn.collapsed_slice_dims) == (1,)
            and tuple(dn.start_index_map) == (1,) and tuple(getattr(dn, "operand_batching_dims", ())) == (0,)
            and tuple(getattr(dn, "start_indices_batching_dims", ())) == (0,))


def _pick(x, idx, *, mode: str, fill):
    """What a foldable gather computes, written so the tile evaluator can run it."""
    i = jnp.reshape(idx, (idx.shape[0], 1))
    n = x.shape[1]
    if "CLIP" in mode:
        i = jnp.clip(i, 0, n - 1)
    hit = jax.lax.broadcasted_iota(i.dtype, (1, n), 1) == i
    picked = jnp.sum(jnp.where(hit, x, jnp.zeros((), x.dtype)), axis=1, keepdims=True)
    if "FILL" in mode:  # out-of-range indices give the fill value (NaN for floats)
        picked = jnp.where((i >= 0) & (i < n), picked, jnp.asarray(np.nan if fill is None else fill, x.dtype))
    return picked


def fold_gathers(sub: Group) -> Group:
    """`sub` on a copy of its graph in which each foldable gather is replaced by `_pick`'s equations (nodes
    renumbered in order); NoMatch for any other gather."""
    g = sub.graph
    gathers = [nd for nd in sub.nodes if nd.name == "gather"]
    if not gathers:
        return sub
    avals, fresh = dict(g.avals), max(g.avals) + 1
    members = set(sub.node_ids)
    order: list[tuple[bool, Node]] = []  # (member of the group, node)
    for nd in g.nodes:
        if nd.name != "gather" or nd.id not in members:
            order.append((nd.id in members, nd))
            continue
        if not foldable_gather(g, nd):
            raise NoMatch("a gather that does not pick one element per row")
        pick = functools.partial(_pick, mode=str(nd.params.get("mode")), fill=nd.params.get("fill_value"))
        spliced, _, fresh = _splice(pick, avals, list(nd.inputs), list(nd.outputs), fresh)
        order += [(True, n) for n in spliced]
    return _regroup(g, order, avals)


def _regroup(g: Graph, order: list[tuple[bool, Node]], avals: dict) -> Group:
    """The group of the member nodes of `order` (nodes renumbered in order) on a graph with `g`'s interface."""
    nodes = [Node(i, nd.primitive, nd.params, nd.inputs, nd.outputs) for i, (_, nd) in enumerate(order)]
    graph = Graph(nodes, avals, g.inputs, g.outputs, g.consts, g.in_tree, g.out_tree, g.static_repr)
    return Group.of(graph, [i for i, (member, _) in enumerate(order) if member])


# Monotone work after a max/min: max_l g(x_l) = g(max_l x_l) for g non-decreasing.
_MONO_UNARY = {"exp", "exp2", "expm1", "log", "log1p", "tanh", "logistic", "erf", "sqrt", "cbrt"}
_MONO_LAYOUT = {"reshape", "broadcast_in_dim", "squeeze", "expand_dims"}


@dataclass
class _Link:
    """One equation of a monotone chain: `pos` is the input that carries the chain, `d` the reduced dim of its
    output; a mask link keeps (live source value, how it reads as "live", fill atom or None for 0)."""

    node: Node
    pos: int
    d: int
    mask: tuple | None = None


def hoist_monotone(sub: Group) -> Group:
    """`sub` on a copy of its graph in which each max/min over a monotone chain reduces the chain's base instead.

    For `reduce_max(y)` (or min) with y = g(x), g a chain of single-use equations each non-decreasing in its one
    operand that varies along the reduced dim (the others invariant along it): add, x - c, max/min with c, mul
    by a positive constant or by a {0,1} factor converted from a bool, x / (positive constant), exp, exp2,
    expm1, log, log1p, tanh, logistic, erf, sqrt, cbrt, float conversions, layout ops, a `select_n` whose
    predicate is invariant. At most one mask along the reduced dim: `where(m, y, c)` or `y * f(m_bool)`
    (c = 0). The group then reduces `where(live, x, -inf)` (and, with a mask, counts the live elements) and
    applies the chain once to the result: g2(max(where(any live, g1(max x), -inf), where(any dead, c, -inf))),
    g1 / g2 the chain below / above the mask, so an all-dead slice gives g2(c) even where g1(-inf) is NaN.

    Exact except for NaN, which the rewrite cannot keep: an element that the chain alone turns into NaN (log
    or sqrt of a negative, inf * 0, inf - inf) makes the original's max NaN, while here the chain sees only
    the max of x; a masked-out inf times the 0 factor is NaN in the original and the fill 0 here. With
    finite inputs and a chain defined on them (log1p(relu(.)), a bool mask) both agree. A zero's sign may
    differ (y * 0 is -0 for a negative y).
    """
    g = sub.graph
    members = set(sub.node_ids)
    chains = {nd.id: c for nd in sub.nodes if nd.name in ("reduce_max", "reduce_min") for c in [_monotone_chain(g, members, nd)] if c}
    if not chains:
        return sub
    removed = {ln.node.id for _, _, links in chains.values() for ln in links}
    avals, fresh = dict(g.avals), max(g.avals) + 1
    order: list[tuple[bool, Node]] = []
    for nd in g.nodes:
        if nd.id in removed:
            continue
        if nd.id not in chains:
            order.append((nd.id in members, nd))
            continue
        x, d, links = chains[nd.id]
        try:
            spliced, fresh = _rewrite(g, members, nd, x, d, links, avals, fresh)
        except (NoMatch, TypeError, ValueError):  # the chain does not trace on the reduced shapes
            return sub
        order += [(True, n) for n in spliced]
    new = _regroup(g, _prune(order, set(g.output_values)), avals)
    return new if set(new.inputs) == set(sub.inputs) and set(new.outputs) == set(sub.outputs) else sub


def _monotone_chain(g: Graph, members: set, red: Node) -> tuple[int, int, list[_Link]] | None:
    """(base value x, its reduced dim, the chain's links from x up) for a max/min, or None when there is no
    chain worth moving."""
    y = red.inputs[0]
    if not isinstance(y, int) or not jnp.issubdtype(g.avals[y].dtype, jnp.floating):
        return None
    dims = [d for d in red.params["axes"] if g.avals[y].shape[d] != 1]
    if len(dims) != 1:
        return None
    cur, nxt, d, links = y, red.id, dims[0], []
    while True:
        pid = g.producer.get(cur)
        if pid is None or pid not in members or cur in g.output_values or g.consumers.get(cur) != [nxt]:
            break
        step = _link(g, members, g.node_index[pid], d, masked=any(ln.mask for ln in links))
        if step is None:
            break
        links.append(step[0])
        cur, nxt, d = step[1], pid, step[2]
    links.reverse()
    if not any(ln.mask is None and ln.node.name not in _MONO_LAYOUT | PASS_THROUGH for ln in links):
        return None
    for ln in links:  # the live source must broadcast onto x (only elementwise links lie between them)
        src, xs = g.avals[ln.mask[0]].shape if ln.mask else (), g.avals[cur].shape
        if ln.mask and (len(src) != len(xs) or any(s not in (1, t) for s, t in zip(src, xs))):
            return None
    return cur, d, links


def _link(g: Graph, members: set, nd: Node, d: int, masked: bool) -> tuple[_Link, int, int] | None:
    """The link `nd` makes (with its chain operand and that operand's reduced dim), or None."""
    name, ins, out = nd.name, nd.inputs, nd.outputs[0]
    if len(nd.outputs) != 1:
        return None
    if name in _MONO_LAYOUT:
        d_in = _dim_before(g, nd, d)
        return None if masked or d_in is None else (_Link(nd, 0, d), ins[0], d_in)
    if name in ("copy", "copy_p") or name == "convert_element_type" and jnp.issubdtype(g.aval(ins[0]).dtype, jnp.floating) \
            and jnp.issubdtype(g.avals[out].dtype, jnp.floating):
        return _Link(nd, 0, d), ins[0], d
    var = [i for i, a in enumerate(ins) if not _invariant(g, members, a, d)]
    if any(len(g.avals[ins[i]].shape) != len(g.avals[out].shape) for i in var):
        return None
    one = var[0] if len(var) == 1 else None
    if name in _MONO_UNARY or name in ("add", "max", "min"):
        return None if one is None else (_Link(nd, one, d), ins[one], d)
    if name in ("sub", "div"):
        ok = one == 0 and (name == "sub" or _positive(g, members, ins[1]))
        return (_Link(nd, 0, d), ins[0], d) if ok else None
    if name == "mul" and one is not None:
        ok = _positive(g, members, ins[1 - one]) or _from_bool(g, members, ins[1 - one])
        return (_Link(nd, one, d), ins[one], d) if ok else None
    if name == "mul" and len(var) == 2 and not masked:
        for k in (0, 1):
            if _from_bool(g, members, ins[k]):
                return _Link(nd, 1 - k, d, (_narrow(g, members, ins[k]), "factor", None)), ins[1 - k], d
        return None
    if name == "select_n" and len(ins) == 3:
        cases = [i for i in (1, 2) if i in var]
        if len(cases) != 1:
            return None
        k = cases[0]
        if 0 not in var:
            return _Link(nd, k, d), ins[k], d
        if masked:
            return None
        p = _narrow(g, members, ins[0])
        how = ("eq", k - 1) if g.avals[p].dtype != np.dtype(bool) else "true" if k == 2 else "false"
        return _Link(nd, k, d, (p, how, ins[3 - k])), ins[k], d
    return None


def _dim_before(g: Graph, nd: Node, d: int) -> int | None:
    """The dim of a layout op's operand that becomes dim `d` of its output (None: the op makes it)."""
    ish, osh = g.aval(nd.inputs[0]).shape, g.avals[nd.outputs[0]].shape
    if nd.name == "broadcast_in_dim":
        bd = tuple(nd.params["broadcast_dimensions"])
        return bd.index(d) if d in bd and ish[bd.index(d)] == osh[d] else None
    if nd.params.get("dimensions") is not None:
        return None
    i_nu, o_nu = [k for k, s in enumerate(ish) if s != 1], [k for k, s in enumerate(osh) if s != 1]
    if [ish[k] for k in i_nu] != [osh[k] for k in o_nu] or d not in o_nu:
        return None
    return i_nu[o_nu.index(d)]


def _invariant(g: Graph, members: set, a, d: int, leaves: list | None = None) -> bool:
    """Whether atom `a` (of the chain's rank, or a scalar) is constant along its dim `d`, as a value the group can
    rebuild with that dim of size 1 (`_keep`) from `leaves` (collected here) by its own equations."""
    if isinstance(a, Lit):
        return True
    sh = g.avals[a].shape
    if not sh or d < len(sh) and sh[d] == 1:
        if leaves is not None:
            leaves.append(a)
        return True
    pid = g.producer.get(a)
    if d >= len(sh) or pid is None or pid not in members:
        return False
    nd = g.node_index[pid]
    if nd.name == "broadcast_in_dim" and isinstance(nd.inputs[0], int):
        bd = tuple(nd.params["broadcast_dimensions"])
        if d not in bd:
            if leaves is not None:
                leaves.append(nd.inputs[0])
            return True
        return _invariant(g, members, nd.inputs[0], bd.index(d), leaves)
    if op_class(nd.name) is OpClass.ELEMENTWISE and len(nd.outputs) == 1:
        return all(_invariant(g, members, b, d, leaves) for b in nd.inputs)
    return False


def _keep(g: Graph, a, d: int, env: dict):
    """An invariant atom with its dim `d` of size 1, rebuilt from the leaves in `env` (see `_invariant`)."""
    if isinstance(a, Lit):
        return a.value
    sh = g.avals[a].shape
    if not sh or sh[d] == 1:
        return env[a]
    nd = g.node_index[g.producer[a]]
    if nd.name == "broadcast_in_dim":
        bd = tuple(nd.params["broadcast_dimensions"])
        u = env[nd.inputs[0]] if d not in bd else _keep(g, nd.inputs[0], bd.index(d), env)
        return jax.lax.broadcast_in_dim(u, _unit(sh, d), bd)
    return bind_node(nd, [_keep(g, b, d, env) for b in nd.inputs])[0]


def _unit(shape: tuple, d: int) -> tuple:
    return tuple(1 if k == d else s for k, s in enumerate(shape))


def _const(g: Graph, members: set, a) -> np.ndarray | None:
    """The value of an atom computed from a literal by the group's own conversions and layout ops, else None.

    Only facts inside the group count: the group is checked (and may be reused)
    on its own, with any values for its inputs, constants of the program included."""
    if isinstance(a, Lit):
        return np.asarray(a.value)
    pid = g.producer.get(a)
    nd = g.node_index[pid] if pid is not None and pid in members else None
    if nd is None or nd.name not in _MONO_LAYOUT | PASS_THROUGH:
        return None
    c = _const(g, members, nd.inputs[0])
    return c.astype(nd.params["new_dtype"]) if c is not None and nd.name == "convert_element_type" else c


def _positive(g: Graph, members: set, a) -> bool:
    c = _const(g, members, a)
    return c is not None and bool(np.all(c > 0))


def _from_bool(g: Graph, members: set, a) -> bool:
    """Whether a float value is a bool converted to {0, 1} (through layout ops) inside the group (a float input
    holds any values when the group is checked alone: SPLADE's mask converted outside the group is not a bool)."""
    while isinstance(a, int) and jnp.issubdtype(g.avals[a].dtype, jnp.floating):
        pid = g.producer.get(a)
        nd = g.node_index[pid] if pid is not None and pid in members else None
        if nd is None or nd.name not in _MONO_LAYOUT | {"convert_element_type", "copy", "copy_p"}:
            return False
        a = nd.inputs[0]
        if nd.name == "convert_element_type" and g.aval(a).dtype == np.dtype(bool):
            return True
    return False


def _narrow(g: Graph, members: set, v: int) -> int:
    """`v` before the group's broadcasts that keep its rank (the mask [B, S, 1] rather than [B, S, V])."""
    while True:
        pid = g.producer.get(v)
        nd = g.node_index[pid] if pid is not None else None
        if nd is None or pid not in members or nd.name != "broadcast_in_dim" or not isinstance(nd.inputs[0], int) \
                or len(g.avals[nd.inputs[0]].shape) != len(g.avals[v].shape):
            return v
        v = nd.inputs[0]


def _rewrite(g: Graph, members: set, red: Node, x: int, d: int, links: list[_Link], avals: dict, fresh: int) -> tuple[list[Node], int]:
    """The equations that replace `red` and its chain: the reduction of the base (masked), then the chain once."""
    kind = ops.reduction_kind(red.name)
    ident = -np.inf if kind == "max" else np.inf
    opt = jnp.maximum if kind == "max" else jnp.minimum
    mi = next((i for i, ln in enumerate(links) if ln.mask), None)
    mask = links[mi].mask if mi is not None else None
    fill = _const(g, members, mask[2]) if mask is not None and mask[2] is not None else np.zeros(())
    count = mask is not None and (mi > 0 or fill is None or not np.all(fill == ident))  # else dead elements add nothing
    L = g.avals[x].shape[d]

    def live_of(src):
        how = mask[1]
        return src if how == "true" else ~src if how == "false" else src != 0 if how == "factor" else src == how[1]

    def pre(xv, *src):
        live = live_of(src[0]) if mask else None
        r = jnp.max if kind == "max" else jnp.min
        outs = [r(jnp.where(live, xv, ident) if mask else xv, axis=d)]
        if count:
            outs.append(jnp.sum(live.astype(jnp.float32), axis=d))
        return outs

    leaves: list[int] = []
    for ln in links:
        if ln.mask:
            atoms = [] if ln.mask[2] is None else [ln.mask[2]]
        else:
            atoms = [] if ln.node.name in _MONO_LAYOUT else [a for i, a in enumerate(ln.node.inputs) if i != ln.pos]
        for a in atoms:
            _invariant(g, members, a, ln.d, leaves)
    leaves = list(dict.fromkeys(leaves))

    def post(r1, *rest):
        cnt = rest[0] if count else None
        env = dict(zip(leaves, rest[1 if count else 0:]))
        cur = jnp.reshape(r1, r1.shape[:d] + (1,) + r1.shape[d:])
        for ln in links:
            nd, osh = ln.node, _unit(g.avals[ln.node.outputs[0]].shape, ln.d)
            if ln.mask:
                if count:
                    c = jnp.reshape(cnt, _unit(g.avals[ln.mask[0]].shape, ln.d))
                    fill = 0 if ln.mask[2] is None else _keep(g, ln.mask[2], ln.d, env)
                    cur = opt(jnp.where(c > 0, cur, ident), jnp.where(c < L, fill, ident))
                cur = cur.astype(g.avals[nd.outputs[0]].dtype)
            elif nd.name == "broadcast_in_dim":
                cur = jax.lax.broadcast_in_dim(cur, osh, tuple(nd.params["broadcast_dimensions"]))
            elif nd.name in _MONO_LAYOUT:
                cur = jnp.reshape(cur, osh)
            else:
                ins = [cur if i == ln.pos else _keep(g, a, ln.d, env) for i, a in enumerate(nd.inputs)]
                cur = bind_node(nd, ins)[0]
            cur = jnp.broadcast_to(cur, osh)
        return jnp.reshape(cur, g.avals[red.outputs[0]].shape)

    pre_nodes, mid, fresh = _splice(pre, avals, [x] + ([mask[0]] if mask else []), None, fresh)
    post_nodes, _, fresh = _splice(post, avals, mid + leaves, [red.outputs[0]], fresh)
    return pre_nodes + post_nodes, fresh


def _splice(fn: Callable, avals: dict, args: list[int], outs: list[int] | None, fresh: int) -> tuple[list[Node], list[int], int]:
    """The equations of `fn` traced on values `args`, renumbered into a graph whose values are `avals` (new ones
    added from `fresh` on); its results named `outs` (new values when None). NoMatch when it needs constants."""
    traced = capture(fn, *[jax.ShapeDtypeStruct(avals[v].shape, avals[v].dtype) for v in args])
    res = traced.outputs
    if traced.consts or not all(isinstance(o, int) and o not in traced.inputs for o in res) or len(set(res)) != len(res):
        raise NoMatch("a spliced computation needs constants or passes a value through")
    rename = dict(zip(traced.inputs, args))
    if outs is not None:
        rename.update(zip(res, outs))
    for v, av in traced.avals.items():
        if v not in rename:
            rename[v], fresh = fresh, fresh + 1
            avals[rename[v]] = av
    nodes = [Node(-1, pn.primitive, pn.params, tuple(rename[a] if isinstance(a, int) else a for a in pn.inputs),
                  tuple(rename[v] for v in pn.outputs)) for pn in traced.nodes]
    return nodes, [rename[o] for o in res], fresh


def _prune(order: list[tuple[bool, Node]], keep: set) -> list[tuple[bool, Node]]:
    """`order` without the group's equations whose results nothing reads any more."""
    while True:
        used = keep | {a for _, nd in order for a in nd.inputs if isinstance(a, int)}
        kept = [(m, nd) for m, nd in order if not m or any(v in used for v in nd.outputs)]
        if len(kept) == len(order):
            return order
        order = kept


# ---------------------------------------------------------------------------
# Segments of a product row: [M, N] viewed as [M, N / seg, seg] throughout an epilogue.
def segment_length(sub: Group, col: int) -> int | None:
    """The segment length `seg` when the epilogue `sub` of the product `col` ([..., N]) splits N into
    [N / seg, seg] with a reshape and reduces over the segments (a GroupNorm); None otherwise.

    A cheap look at the equations (no tracing), so that matching other matmul groups costs nothing."""
    g = sub.graph
    N = g.avals[col].shape[-1]
    if not any(op_class(nd.name) is OpClass.REDUCTION for nd in sub.nodes):
        return None
    segs = set()
    for nd in sub.nodes:
        if nd.name != "reshape" or not isinstance(nd.inputs[0], int):
            continue
        ish, osh = g.avals[nd.inputs[0]].shape, g.avals[nd.outputs[0]].shape
        if len(ish) >= 1 and ish[-1] == N and len(osh) == len(ish) + 1 and osh[:-2] == ish[:-1] and osh[-2] * osh[-1] == N \
                and 1 < osh[-1] < N:
            segs.add(osh[-1])
    return segs.pop() if len(segs) == 1 else None


def split_columns(sub: Group, col: int, seg: int) -> Group:
    """`sub` (the epilogue of the product `col`, [..., N]) as a group of its own graph in which every value that
    carries the product's column axis carries it as two axes [N / seg, seg] instead, so that the reshapes to
    [..., N / seg, seg] and back are no-ops and reductions over the last axis are reductions over segments.

    The values keep their ids; the graph's avals give the new shapes (inputs and outputs included: a bias [N]
    is a [N / seg, seg] value here, a result [M, N] an [M, N / seg, seg] one), in the same element order, so
    a lowering reads and writes them through their usual 2-D layouts. NoMatch where an equation cannot be
    rewritten so (a transpose, a gather, a reshape that mixes the column axis with another one)."""
    g = sub.graph
    N = g.avals[col].shape[-1]
    G = N // seg
    cd: dict[int, int | None] = {col: len(g.avals[col].shape) - 1}  # value -> its dim along the product's columns

    def put(v, d) -> bool:
        if not isinstance(v, int) or d is None:
            return False
        if d >= len(g.avals[v].shape) or g.avals[v].shape[d] not in (1, N):
            raise NoMatch(f"value %{v} {g.avals[v]} has no column axis at dim {d}")
        if cd.get(v, d) != d:
            raise NoMatch(f"value %{v} meets the column axis at dims {cd[v]} and {d}")
        new = v not in cd
        cd[v] = d
        return new

    def reshape_map(src_shape, d, dst_shape):
        """The dim of `dst_shape` holding the same columns as dim `d` of `src_shape` (None: none does)."""
        pre = math.prod(src_shape[:d])
        for k in range(len(dst_shape)):
            if math.prod(dst_shape[:k]) == pre and dst_shape[k] == src_shape[d]:
                return k
        return None

    changed = True
    while changed:
        changed = False
        for nd in sub.nodes:
            cls, out = op_class(nd.name), nd.outputs[0]
            orank = len(g.avals[out].shape)
            vals = [a for a in nd.inputs if isinstance(a, int)]
            if cls in (OpClass.ELEMENTWISE, OpClass.SOURCE):
                same = [v for v in vals + [out] if len(g.avals[v].shape) == orank and orank]
                known = {cd[v] for v in same if v in cd}
                for d in known:
                    for v in same:
                        changed |= put(v, d)
            elif cls is OpClass.BROADCAST:
                if not vals:
                    continue
                bd = tuple(nd.params["broadcast_dimensions"])
                if vals[0] in cd and cd[vals[0]] is not None:
                    changed |= put(out, bd[cd[vals[0]]])
                if out in cd:
                    changed |= put(vals[0], bd.index(cd[out]) if cd[out] in bd else None)
            elif cls is OpClass.LAYOUT:
                ish, osh = g.avals[vals[0]].shape, g.avals[out].shape
                if vals[0] in cd and out not in cd and cd[vals[0]] is not None:
                    k = reshape_map(ish, cd[vals[0]], osh)
                    pre = math.prod(ish[:cd[vals[0]]])
                    if k is None and not any(math.prod(osh[:j]) == pre and osh[j:j + 2] == (G, seg) for j in range(len(osh) - 1)):
                        raise NoMatch(f"{nd.name} {ish} -> {osh} mixes the column axis with another")
                    cd[out] = k  # None: the reshape splits the columns into [N / seg, seg] (it becomes a no-op)
                    changed = True
                elif out in cd and vals[0] not in cd and cd[out] is not None:
                    k = reshape_map(osh, cd[out], ish)
                    if k is not None:
                        changed |= put(vals[0], k)
                elif out not in cd:  # [..., N / seg, seg] merged back into [..., N]
                    for j in range(len(ish) - 1):
                        k = reshape_map(ish[:j] + (N,) + ish[j + 2:], j, osh) if ish[j:j + 2] == (G, seg) else None
                        if k is not None:
                            changed |= put(out, k)
                            break
            elif cls is OpClass.REDUCTION:
                x = vals[0]
                if x in cd and out not in cd and cd[x] is not None:
                    axes = tuple(nd.params["axes"])
                    cd[out] = None if cd[x] in axes else cd[x] - sum(a < cd[x] for a in axes)
                    changed = True
            else:
                raise NoMatch(f"{nd.name} cannot run on segments of a row")

    def expand(v) -> tuple[int, ...]:
        sh, d = g.avals[v].shape, cd.get(v)
        if d is None:
            return sh
        return sh[:d] + ((G, seg) if sh[d] == N else (1, 1)) + sh[d + 1:]

    def new_dims(v, d) -> list[int]:
        """The new dims of value `v`'s dim `d`."""
        c = cd.get(v)
        if c is None or d < c:
            return [d]
        return [c, c + 1] if d == c else [d + 1]

    def run(*xs):
        env = dict(zip(sub.inputs, xs))
        for nd in sub.nodes:
            cls, out = op_class(nd.name), nd.outputs[0]
            ins = [a.value if isinstance(a, Lit) else env[a] for a in nd.inputs]
            if cls is OpClass.ELEMENTWISE:
                r = bind_node(nd, ins)[0]
            elif cls is OpClass.BROADCAST:
                if not isinstance(nd.inputs[0], int):
                    r = jax.lax.broadcast_in_dim(ins[0], expand(out), ())
                else:
                    bd = [k for i, j in enumerate(nd.params["broadcast_dimensions"]) for k in
                          (new_dims(out, j) if cd.get(nd.inputs[0]) == i else new_dims(out, j)[:1])]
                    r = jax.lax.broadcast_in_dim(ins[0], expand(out), tuple(bd))
            elif cls is OpClass.LAYOUT:
                r = jnp.reshape(ins[0], expand(out))
            elif cls is OpClass.REDUCTION:
                axes = tuple(k for a in nd.params["axes"] for k in new_dims(nd.inputs[0], a))
                r = bind_node(Node(nd.id, nd.primitive, {**nd.params, "axes": axes}, nd.inputs, nd.outputs), ins)[0]
            else:  # iota
                dt, d, sh = nd.params["dtype"], nd.params["dimension"], expand(out)
                if cd.get(out) == d and g.avals[out].shape[d] == N:
                    r = jax.lax.broadcasted_iota(dt, sh, d) * seg + jax.lax.broadcasted_iota(dt, sh, d + 1)
                else:
                    r = jax.lax.broadcasted_iota(dt, sh, new_dims(out, d)[0])
            env[out] = r
        return [env[v] for v in sub.outputs]

    avals = dict(g.avals)
    for v in cd:
        avals[v] = Aval(expand(v), g.avals[v].dtype)
    try:
        nodes, _, _ = _splice(run, avals, list(sub.inputs), list(sub.outputs), max(g.avals) + 1)
    except (TypeError, ValueError) as e:
        raise NoMatch(f"the epilogue does not trace on segments: {e}") from e
    graph = Graph([Node(i, nd.primitive, nd.params, nd.inputs, nd.outputs) for i, nd in enumerate(nodes)], avals,
                  list(sub.inputs), list(sub.outputs), {}, None, None)
    return Group.of(graph, list(range(len(nodes))))
