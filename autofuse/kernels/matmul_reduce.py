"""Template `matmul_reduce`: a dot whose epilogue ends in reductions over one axis of the product, in one kernel.

The product O = A @ B (A: [..., K] or [K, M]; B: [K, N] or [N, K]) is never
written. Two loop structures, by the reduced axis:
- over N (the columns): each program owns a block of rows (and, with
  `split` > 1, one of `split` ranges of N) and loops over N in block_n steps:
  row max / sum / logsumexp, softmax-then-reduce, cross-entropy over a large
  vocabulary. With `split` > 1 each range leaves its running values, merged
  by a few row-sized XLA ops (more programs when there are few row blocks);
- over an axis L of A's free axes (e.g. the sequence axis of [B, S, V]): each
  program owns (p, a block of N), p indexing the axes before L, and loops
  over L in block_m steps (the SPLADE head, max over the sequence).
Each step computes one [block_m, block_n] product tile (a K loop in float32,
`matmul.dot_tile`), runs the group's own elementwise work on it (the shared
tile evaluator) and folds it into running reductions. A reduction that
depends on an earlier one (`sum(exp(x - max))`) is rescaled online: the
template reads from the jaxpr how its summand scales when the earlier
results change (`exp(a - c)`: by exp(c_old - c_new); `x * c`, `x / c`: by the
ratio) and rejects the group otherwise. The work after the reductions runs
once, on the final values; a max or min over a monotone elementwise chain
(`max(log1p(relu(x + b)) * mask)`) reduces the chain's base and runs the
chain after the loop too (`_hoist_monotone`). Batched dots, prologues and
`precision=HIGHEST` stay in XLA.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .. import costmodel, ops
from ..graph import Graph, Group, Lit, Node, bind_node, capture, read_atom
from ..ops import OpClass, op_class
from .matmul import default_precision, dot_tile
from .tiling import NoMatch, Span, TileConfig, TileSpec, _Body, analyze, next_pow2, template_space

NAME = "matmul_reduce"
PARAMS = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "split")
_DTYPES = {np.dtype("float32"), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)}
_PASS = {"convert_element_type", "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "stop_gradient", "copy", "copy_p"}


@dataclass
class MatmulReduceSpec:
    group: Group
    dot: Node
    a: int
    b: int
    over_n: bool  # reduce over N (loop over column blocks); else over the A axis L (loop over row blocks)
    P: int  # programs' outer index (over_n: 1)
    L: int  # rows per outer index (over_n: M)
    N: int
    K: int
    a_km: bool
    b_nk: bool
    tile: TileSpec  # the epilogue on the product's shape; `span` is one program's view (rows: L or M, columns: N)
    layout: dict  # input/output value -> (rows: "M" | "P" | None, has columns)
    level: dict  # node id -> level of the latest reduction it depends on (-1: none); a reduction: its own level
    reductions: list  # reduction node ids, in order
    scale: dict  # dependent reduction id -> [(kind "exp" | "mul", value, sign)]: how its summand rescales

    @property
    def M(self) -> int:
        return self.P * self.L

    def loop(self, v: int) -> bool:
        """Whether value `v` varies along the reduced (looped) axis."""
        s = self.tile.span[v]
        return s.cols if self.over_n else s.rows

    def layout2d(self, v: int) -> tuple[int, int]:
        rows, cols = self.layout[v]
        return ({"M": self.M, "P": self.P, None: 1}[rows], self.N if cols else 1)


def match(group: Group) -> MatmulReduceSpec | None:
    """A spec when the group is one plain dot, elementwise work, and reductions over one axis of the product."""
    g = group.graph
    dots = [n for n in group.nodes if op_class(n.name) is OpClass.CONTRACTION]
    if len(dots) != 1 or any(op_class(n.name) is OpClass.OPAQUE and not foldable_gather(g, n) for n in group.nodes):
        return None
    if not any(op_class(n.name) is OpClass.REDUCTION for n in group.nodes):
        return None
    dot = dots[0]
    a, b = dot.inputs
    if not (isinstance(a, int) and isinstance(b, int) and a in group.inputs and b in group.inputs):
        return None
    (lc, rc), (lb, rb) = dot.params["dimension_numbers"]
    av, bv = g.avals[a], g.avals[b]
    if lb or rb or len(bv.shape) != 2 or len(lc) != 1 or len(rc) != 1 or not default_precision(dot):
        return None
    if av.dtype != bv.dtype or np.dtype(av.dtype) not in _DTYPES:
        return None
    a_km = len(av.shape) == 2 and lc[0] == 0
    if not a_km and lc[0] != len(av.shape) - 1:
        return None
    b_nk = rc[0] == 1
    K, N = av.shape[lc[0]], bv.shape[0] if b_nk else bv.shape[1]
    S = g.avals[dot.outputs[0]].shape
    if min(N, K) < 16 or math.prod(S) == 0:
        return None
    if dot.outputs[0] in group.outputs:
        return None  # the product itself is a result: nothing to save
    sub = Group.of(g, [n.id for n in group.nodes if n.id != dot.id])
    if {a, b} & set(sub.inputs):
        return None  # an operand of the dot also read by the epilogue
    sub = _fold_gathers(sub)
    hoisted = _hoist_monotone(sub)
    n = len(S)
    for epilogue in [hoisted, sub] if hoisted is not sub else [sub]:  # the rewrite first; as written where it fails
        for axis in [n - 1] + list(range(n - 2, -1, -1)):
            try:
                return _spec(group, epilogue, dot, a, b, S, axis, K, N, a_km, b_nk)
            except NoMatch:
                continue
    return None


def _spec(group: Group, sub: Group, dot: Node, a: int, b: int, S: tuple, axis: int, K: int, N: int, a_km: bool, b_nk: bool) -> MatmulReduceSpec:
    n = len(S)
    over_n = axis == n - 1
    if not over_n and any(S[d] != 1 for d in range(axis + 1, n - 1)):
        raise NoMatch("A's free axes after the reduced one must be unit")
    tile = analyze(sub, S, n - 1, reduce_axes=[axis])
    out = dot.outputs[0]
    tile.axes[out] = tuple(range(n))
    row_axes = {d for d in range(n - 1) if S[d] != 1}
    p_axes = set() if over_n else {d for d in row_axes if d < axis}

    def lay(v: int) -> tuple:
        has = {x for x in tile.axes[v] if x is not None}
        r = has & row_axes
        rows = "M" if r and r == row_axes else "P" if r and r == p_axes else None if not r else "bad"
        if rows == "bad":
            raise NoMatch(f"value %{v} covers part of the rows")
        return rows, (n - 1) in has

    layout = {v: lay(v) for v in list(sub.inputs) + list(sub.outputs) if v != out}
    span = {v: Span(layout[v][0] == "M", layout[v][1]) for v in sub.inputs if v != out}
    span[out] = Span(True, True)
    level: dict[int, int] = {}
    vlevel = {v: -1 for v in sub.inputs}
    reductions = []
    for nd in sub.nodes:
        ins = [span[x] for x in nd.inputs if isinstance(x, int)]
        lv = max([vlevel[x] for x in nd.inputs if isinstance(x, int)], default=-1)
        cls = op_class(nd.name)
        if cls is OpClass.REDUCTION:
            s = ins[0]
            span[nd.outputs[0]] = Span(s.rows, False) if over_n else Span(False, s.cols)
            lv += 1
            reductions.append(nd.id)
        elif cls is OpClass.SOURCE:
            d = tile.axes[nd.outputs[0]][nd.params["dimension"]]
            span[nd.outputs[0]] = Span(d is not None and d < n - 1, d is not None and d >= n - 1)
        else:
            span[nd.outputs[0]] = Span(any(s.rows for s in ins), any(s.cols for s in ins))
        level[nd.id] = lv
        for v in nd.outputs:
            vlevel[v] = lv
    view = TileSpec(sub, tuple(S), n - 1, tile.axes, span, reductions)
    spec = MatmulReduceSpec(group, dot, a, b, over_n, math.prod(S[:axis]) if not over_n else 1,
                            S[axis] if not over_n else math.prod(S[:-1]), N, K, a_km, b_nk, view, layout, level, reductions, {})
    for v in sub.outputs:
        if spec.loop(v):
            raise NoMatch("an output varies along the reduced axis")
        rows, cols = layout[v]
        if over_n and (rows != "M" or cols):
            raise NoMatch("an output is not one value per row")
        if not over_n and (not cols or rows != ("P" if p_axes else None)):
            raise NoMatch("an output is not one value per (outer index, column)")
    prod = {v: nd for nd in sub.nodes for v in nd.outputs}
    for rid in reductions:
        nd = sub.graph.node_index[rid]
        if level[rid] > 0:
            if ops.reduction_kind(nd.name) != "sum":
                raise NoMatch("only a sum may depend on an earlier reduction")
            spec.scale[rid] = _terms(nd.inputs[0], spec, prod, vlevel, additive=False)
    return spec


def foldable_gather(graph: Graph, nd: Node) -> bool:
    """A gather that picks one element per row of a [M, N] value, `take_along_axis(x, idx[:, None], axis=-1)`:
    the template folds it into the reduction over N as `sum(where(iota == idx, x, 0))`."""
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


def _fold_gathers(sub: Group) -> Group:
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


def _hoist_monotone(sub: Group) -> Group:
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
    if not any(ln.mask is None and ln.node.name not in _MONO_LAYOUT | _PASS for ln in links):
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
    if nd is None or nd.name not in _MONO_LAYOUT | _PASS:
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


def _terms(v, spec: MatmulReduceSpec, prod: dict, vlevel: dict, *, additive: bool) -> list:
    """How value `v` changes when earlier reductions change: multiplicative factors (or, with `additive`, the
    terms of an exponent), as [(kind, value, sign)] over values that do not vary along the reduced axis."""
    if not isinstance(v, int) or vlevel.get(v, -1) < 0:
        return []
    if not spec.loop(v):
        return [("exp" if additive else "mul", v, 1)]
    nd = prod[v]
    x = nd.inputs

    def t(atom, add=additive):
        return _terms(atom, spec, prod, vlevel, additive=add)

    def flip(ts):
        return [(k, u, -s) for k, u, s in ts]

    name = nd.name
    if name in _PASS:
        if name == "convert_element_type" and not jnp.issubdtype(nd.params["new_dtype"], jnp.floating):
            raise NoMatch("a rescaled value converted to an integer")
        return t(x[0])
    if additive:
        if name == "add":
            return t(x[0]) + t(x[1])
        if name == "sub":
            return t(x[0]) + flip(t(x[1]))
        if name == "neg":
            return flip(t(x[0]))
    else:
        if name == "mul":
            return t(x[0]) + t(x[1])
        if name == "div":
            return t(x[0]) + flip(t(x[1]))
        if name == "neg":
            return t(x[0])
        if name == "exp":
            return t(x[0], True)
        if name == "select_n" and vlevel.get(x[0], -1) < 0:
            cases = [t(c) for c in x[1:] if not _is_zero(c, prod)]
            if all(c == cases[0] for c in cases):
                return cases[0] if cases else []
    raise NoMatch(f"cannot rescale through {name}")


def _is_zero(atom, prod: dict) -> bool:
    if isinstance(atom, Lit):
        return bool(np.all(np.asarray(atom.value) == 0))
    nd = prod.get(atom)
    return nd is not None and nd.name in ("broadcast_in_dim", "convert_element_type") and _is_zero(nd.inputs[0], prod)


def _factor(terms: list, old: dict, new: dict):
    """The factor by which a rescalable sum changes from the `old` to the `new` values of its terms."""
    expo, ratio = None, None
    for kind, v, sign in terms:
        o, n_ = old[v].astype(jnp.float32), new[v].astype(jnp.float32)
        if kind == "exp":
            d = (n_ - o) if sign > 0 else (o - n_)
            expo = d if expo is None else expo + d
        else:
            r = (n_ / o) if sign > 0 else (o / n_)
            ratio = r if ratio is None else ratio * r
    f = jnp.exp(expo) if expo is not None else None
    return ratio if f is None else f if ratio is None else f * ratio


# ---------------------------------------------------------------------------
def default_config(spec: MatmulReduceSpec) -> dict:
    """Large tiles where the shapes allow (the best of a few configs timed on the H200, results/matmul_reduce_h200.md);
    over N, enough ranges of N that the programs fill the SMs."""
    if not spec.over_n:
        bm = min(256, max(16, next_pow2(spec.L)))
        return {"block_m": bm, "block_n": 128, "block_k": 64, "num_warps": 8 if bm >= 128 else 4, "num_stages": 3, "split": 1}
    bm = 128 if spec.M >= 4096 else 64
    bn = 256 if spec.N >= 4096 and bm == 128 else 128
    n_m, n_n = -(-spec.M // bm), -(-spec.N // bn)
    split = 1
    while n_m * split * 2 <= 132 and split < 8 and split * 2 <= n_n:
        split *= 2
    return {"block_m": bm, "block_n": bn, "block_k": 32 if spec.K < 64 else 64, "num_warps": 8 if bm == 128 else 4,
            "num_stages": 3, "split": split}


def space(group: Group, spec: MatmulReduceSpec | None = None) -> dict:
    """Tunable parameters (search_spaces/matmul_reduce.yaml), the default config and the constraint facts."""
    spec = spec or match(group)
    out = template_space(NAME, spec.tile, default_config(spec))
    itemsize = np.dtype(group.graph.avals[spec.a].dtype).itemsize
    out["facts"] = {"M": spec.M, "N": spec.N, "K": spec.K, "L": spec.L, "over_n": int(spec.over_n), "itemsize": itemsize,
                    "smem_bytes": out["facts"]["smem_bytes"]}
    return out


def model_time_ms(spec: MatmulReduceSpec, config: dict, model: costmodel.GPUModel = costmodel.H200) -> float:
    """Roofline: the product's flops at a tile efficiency, the epilogue's elementwise work, operand traffic,
    and the share of SMs the programs can fill."""
    bm, bn, bk, split = (int(config[k]) for k in ("block_m", "block_n", "block_k", "split"))
    g = spec.group.graph
    low = np.dtype(g.avals[spec.a].dtype) != np.dtype("float32")
    n_m, n_n, n_l = -(-spec.M // bm), -(-spec.N // bn), -(-spec.L // bm)
    padded_m, padded_n = (n_m * bm if spec.over_n else spec.P * n_l * bm), n_n * bn
    flops = 2.0 * padded_m * padded_n * spec.K
    eff = min(1.0, (bm * bn) / (128 * 256)) ** 0.5 * min(1.0, bk / 64) ** 0.25
    programs = n_m * split if spec.over_n else spec.P * n_n
    occupancy = min(1.0, programs / 132)
    itemsize = np.dtype(g.avals[spec.a].dtype).itemsize
    operand_bytes = (spec.M + spec.N) * spec.K * itemsize
    out_bytes = sum(a.nbytes for a in spec.group.output_avals())
    per_element = sum(spec.loop(v) for nd in spec.tile.group.nodes for v in nd.outputs)
    epilogue_s = per_element * padded_m * padded_n / 60e12  # the epilogue's work on every product element
    t_flops = flops / ((model.flops_bf16 if low else model.flops_f32) * max(eff, 0.05))
    t = max(t_flops, (operand_bytes + out_bytes) / model.bandwidth_Bps) / occupancy + epilogue_s
    return 1e3 * (t + model.launch_s * (2 if split > 1 else 1))


# ---------------------------------------------------------------------------
def build(group: Group, config: dict, *, interpret: bool = False, spec: MatmulReduceSpec | None = None) -> Callable:
    spec = spec or match(group)
    if spec is None:
        raise NoMatch("matmul_reduce does not match this group")
    bm, bn, bk, split = (int(config[k]) for k in ("block_m", "block_n", "block_k", "split"))
    if split > 1 and not spec.over_n:
        raise NoMatch("split applies to reductions over N only")
    g = spec.tile.group.graph  # the group's graph, with gathers folded into one-hot sums
    cfg = TileConfig(bm, bn, int(config["num_warps"]), int(config["num_stages"]))
    body = _Body(spec.tile, cfg, 0)
    sub = spec.tile.group
    out_v = spec.dot.outputs[0]
    nodes = sub.nodes
    lvl = spec.level
    maxlvl = max(lvl[r] for r in spec.reductions)
    hoisted = [nd for nd in nodes if lvl[nd.id] < 0 and not any(spec.loop(v) for v in nd.outputs)]
    hoisted_ids = {nd.id for nd in hoisted}
    stages = [[nd for nd in nodes if lvl[nd.id] == k - 1 and nd.id not in hoisted_ids and nd.id not in spec.reductions]
              for k in range(maxlvl + 1)]
    late = [nd for nd in nodes if lvl[nd.id] >= 0 and nd.id not in spec.reductions and not any(spec.loop(v) for v in nd.outputs)]
    red_nodes = [g.node_index[r] for r in spec.reductions]
    kinds = [ops.reduction_kind(nd.name) for nd in red_nodes]
    epi_inputs = [v for v in sub.inputs if v != out_v]
    hoist_in = [v for v in epi_inputs if not spec.loop(v)]
    loop_in = [v for v in epi_inputs if spec.loop(v)]
    in_order = list(group.inputs)
    M, N, L, P = spec.M, spec.N, spec.L, spec.P
    n_m, n_n, n_l = -(-M // bm), -(-N // bn), -(-L // bm)
    per = -(-n_n // split)
    carry_shape = (bm, 1) if spec.over_n else (1, bn)
    red_axis = 1 if spec.over_n else 0
    outs_final = list(group.outputs) if split == 1 else []

    def load(ref, v, r0, p, c0, row_ok, col_ok):
        rows, cols = spec.layout[v]
        ri = pl.ds(r0, bm) if rows == "M" else pl.ds(p, 1) if rows == "P" else pl.ds(0, 1)
        ci = pl.ds(c0, bn) if cols else pl.ds(0, 1)
        m = _mask(row_ok if rows == "M" else None, col_ok if cols else None, (bm if rows == "M" else 1, bn if cols else 1))
        x = plgpu.load(ref.at[ri, ci], mask=m, other=0 if m is not None else None)
        if g.avals[v].dtype == np.bool_:  # passed as int8 (as the attention template does)
            return x != 0
        return x.astype(ops.compute_dtype(x.dtype))

    def store(ref, v, x, r0, p, c0, row_ok, col_ok):
        rows, cols = spec.layout[v]
        shape = (bm if rows == "M" else 1, bn if cols else 1)
        ri = pl.ds(r0, bm) if rows == "M" else pl.ds(p, 1) if rows == "P" else pl.ds(0, 1)
        ci = pl.ds(c0, bn) if cols else pl.ds(0, 1)
        x = jnp.broadcast_to(x, shape).astype(g.avals[v].dtype)
        plgpu.store(ref.at[ri, ci], x, mask=_mask(row_ok if rows == "M" else None, col_ok if cols else None, shape))

    def reduce(kind, x, loop_ok):
        full = (x.shape[0], bn) if spec.over_n else (bm, x.shape[1])
        x = jnp.broadcast_to(x, full)
        if loop_ok is not None:
            x = jnp.where(jnp.broadcast_to(loop_ok, full), x, ops.reduction_identity(kind, x.dtype))
        return jnp.broadcast_to(ops.reduce_tile(kind, x, axis=red_axis), carry_shape)

    def kernel(*refs):
        ins = dict(zip(in_order, refs[: len(in_order)]))
        outs = refs[len(in_order):]
        if spec.over_n:
            p, r_base = 0, pl.program_id(0) * bm
            s = pl.program_id(1) if split > 1 else 0
            c_fixed = None
            row_ok = (r_base + jax.lax.broadcasted_iota(jnp.int32, (bm, 1), 0)) < M if M % bm else None
        else:
            p, r_base, s = pl.program_id(0), pl.program_id(0) * L, 0
            c_fixed = pl.program_id(1) * bn
            row_ok = None
        col_fixed = (c_fixed + jax.lax.broadcasted_iota(jnp.int32, (1, bn), 1)) < N if c_fixed is not None and N % bn else None
        env = {v: load(ins[v], v, r_base, p, c_fixed if c_fixed is not None else 0, row_ok, col_fixed) for v in hoist_in}
        for nd in hoisted:
            body.eval_node(nd, env, r_base, c_fixed if c_fixed is not None else 0)

        def step(j, carry):
            if spec.over_n:
                r0, c0 = r_base, (s * per + j) * bn
                cidx = c0 + jax.lax.broadcasted_iota(jnp.int32, (1, bn), 1)
                r_ok, c_ok = row_ok, (cidx < N) if N % bn or per * split != n_n else None
                loop_ok = c_ok
            else:
                l0 = j * bm
                r0, c0 = r_base + l0, c_fixed
                r_ok, c_ok = ((l0 + jax.lax.broadcasted_iota(jnp.int32, (bm, 1), 0)) < L) if L % bm else None, col_fixed
                loop_ok = r_ok
            local = dict(env)
            local[out_v] = dot_tile(ins[spec.a], ins[spec.b], r0, c0, r_ok, c_ok, bm=bm, bn=bn, bk=bk, K=spec.K, a_km=spec.a_km, b_nk=spec.b_nk)
            for v in loop_in:
                local[v] = load(ins[v], v, r0, p, c0, r_ok, c_ok)
            old = None
            if spec.scale:
                old = dict(env)
                old.update({nd.outputs[0]: c for nd, c in zip(red_nodes, carry)})
                for nd in late:
                    body.eval_node(nd, old, r0, c0)
            new = list(carry)
            for k in range(maxlvl + 1):
                for nd in stages[k]:
                    body.eval_node(nd, local, r0, c0)
                for i, nd in enumerate(red_nodes):
                    if lvl[nd.id] != k:
                        continue
                    part = reduce(kinds[i], local[nd.inputs[0]], loop_ok)
                    if k == 0:
                        new[i] = ops.combine(kinds[i], carry[i], part)
                    else:
                        f = jnp.broadcast_to(_factor(spec.scale[nd.id], old, local), carry_shape)
                        new[i] = jnp.where(carry[i] == 0, 0.0, carry[i] * f).astype(carry[i].dtype) + part
                    local[nd.outputs[0]] = new[i]
            return tuple(new)

        init = tuple(jnp.full(carry_shape, ops.reduction_identity(k, ops.compute_dtype(g.avals[nd.outputs[0]].dtype)))
                     for nd, k in zip(red_nodes, kinds))
        final = jax.lax.fori_loop(0, per if spec.over_n else n_l, step, init)
        c_out = c_fixed if c_fixed is not None else 0
        if split > 1:  # this range's running values; merged outside
            for ref, x in zip(outs, final):
                plgpu.store(ref.at[pl.ds(s * M + r_base, bm), pl.ds(0, 1)], x.astype(jnp.float32), mask=row_ok)
            return
        env.update({nd.outputs[0]: x for nd, x in zip(red_nodes, final)})
        for nd in late:
            body.eval_node(nd, env, r_base, c_out)
        for ref, v in zip(outs, outs_final):
            store(ref, v, env[v], r_base, p, c_out, row_ok, col_fixed)

    if split > 1:
        out_shape = [jax.ShapeDtypeStruct((split * M, 1), jnp.float32) for _ in red_nodes]
    else:
        out_shape = [jax.ShapeDtypeStruct(spec.layout2d(v), g.avals[v].dtype) for v in group.outputs]
    call = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(n_m, split) if spec.over_n and split > 1 else (n_m,) if spec.over_n else (P, n_n),
        interpret=interpret,
        name=f"autofuse_matmul_reduce_{group.signature[:8]}",
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
    )

    def run(*xs):
        env = dict(zip(group.inputs, xs))
        args = []
        for v in in_order:
            x = env[v]
            if v == spec.a:
                args.append(x if spec.a_km else jnp.reshape(x, (M, spec.K)))
            elif v == spec.b:
                args.append(x)
            else:
                args.append(jnp.reshape(x.astype(jnp.int8) if x.dtype == jnp.bool_ else x, spec.layout2d(v)))
        res = call(*args)
        if split > 1:
            return _merge(spec, [jnp.reshape(r, (split, M)) for r in res], env)
        return [jnp.reshape(o, g.avals[v].shape) for v, o in zip(group.outputs, res)]

    return run


def _mask(row_ok, col_ok, shape):
    masks = [m for m in (row_ok, col_ok) if m is not None]
    if not masks:
        return None
    return jnp.broadcast_to(masks[0] if len(masks) == 1 else masks[0] & masks[1], shape)


def _merge(spec: MatmulReduceSpec, parts: list, inputs: dict) -> list:
    """Merge the running values of `split` ranges of N (row-sized XLA work), then run the work after the reductions.

    The group's row-level equations run on whole arrays here, as in the jaxpr;
    a sum that depends on earlier reductions is rescaled from each range's
    values of its terms to the merged ones, as inside the kernel.
    """
    sub = spec.tile.group
    g = sub.graph
    red_nodes = [g.node_index[r] for r in spec.reductions]
    row_nodes = [nd for nd in sub.nodes if nd.id not in spec.reductions and not any(spec.loop(v) for v in nd.outputs)]

    def state(vals: dict) -> dict:  # reduction output value -> its merged (or one range's) values
        env = dict(inputs)
        for v, x in vals.items():
            env[v] = jnp.reshape(x, g.avals[v].shape).astype(g.avals[v].dtype)
        for nd in row_nodes:
            if all(not isinstance(a, int) or a in env for a in nd.inputs):
                env.update(zip(nd.outputs, bind_node(nd, [read_atom(env, a) for a in nd.inputs])))
        return env

    n_split = parts[0].shape[0]
    ranges = [state({nd.outputs[0]: p[i] for nd, p in zip(red_nodes, parts)}) for i in range(n_split)]
    merged: dict = {}
    for k in range(max(spec.level[r] for r in spec.reductions) + 1):
        now = state(merged) if k else None
        for nd, p in zip(red_nodes, parts):
            if spec.level[nd.id] != k:
                continue
            kind = ops.reduction_kind(nd.name)
            if k == 0:
                merged[nd.outputs[0]] = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min}[kind](p, axis=0)
            else:
                total = 0.0
                for i in range(n_split):
                    f = jnp.reshape(_factor(spec.scale[nd.id], ranges[i], now), (-1,))
                    total = total + jnp.where(p[i] == 0, 0.0, p[i] * f)
                merged[nd.outputs[0]] = total
    env = state(merged)
    return [jnp.reshape(env[v], g.avals[v].shape) for v in spec.group.outputs]
