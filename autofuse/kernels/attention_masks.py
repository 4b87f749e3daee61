"""Masks of an `attention` group known at build time: what depends on `iota` alone is evaluated on the host over the
whole [q, k] grid (in strips of rows, kept per 16 x 16 block: `LiveBlocks`), so a kernel skips the key blocks masked
out for a whole query block (`block_ranges`, `key_block_ranges`) and the mask arithmetic where no position is
masked; and a scale the scores can fold (`scale_fold`). Apart from matching: it runs on a matched spec, once per tiling."""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..graph import Lit, Node
from ..ops import OpClass, op_class
from .attention_spec import _MAX_GRID, _NEG, GRAIN, AttentionEval, AttentionSpec, KeyBound, LiveBlocks
from .tiling import cdiv, needed

# ---------------------------------------------------------------------------
# Masks known at build time.
def _known_consts(spec: AttentionSpec) -> dict[int, np.ndarray]:
    """The group's inputs that are the program's constants along one of the query and key axes (JAX's XLA path makes
    a sliding window's positions so): known at build time as an iota is."""
    g, out = spec.group.graph, {}
    for v in spec.tile.group.inputs:
        placed = [a for a in spec.tile.axes.get(v, ()) if a is not None]
        if v in g.consts and len(placed) == 1 and placed[0] in (spec.q_axis, spec.k_axis):
            out[v] = np.asarray(g.consts[v]).reshape(-1)
    return out


def _iota_only(spec: AttentionSpec) -> set[int]:
    """Score-space values computed from iota, literals and the program's constants (`_known_consts`) alone,
    constant over the batch axes."""
    out: set[int] = set(_known_consts(spec))
    batchy: set[int] = set()
    for nd in spec.pre:
        ins = [a for a in nd.inputs if isinstance(a, int)]
        if op_class(nd.name) in (OpClass.REDUCTION, OpClass.CONTRACTION) or not all(a in out for a in ins):
            continue
        v = nd.outputs[0]
        if op_class(nd.name) is OpClass.SOURCE:
            if spec.tile.axes[v][nd.params["dimension"]] in spec.batch_axes:
                batchy.add(v)
        elif any(a in batchy for a in ins):
            batchy.add(v)
        out.add(v)
    return out - batchy


_STRIP = 1 << 22  # score positions evaluated at once on the host (a float32 value of a strip: 16 MB)


def _host_values(spec: AttentionSpec, want: set[int], body: AttentionEval, nodes: list, q0: int, n: int) -> dict[int, np.ndarray]:
    """Evaluate iota-only values on the host over the grid's rows [q0, q0 + n) (`body`'s tile: [rows, Lk], n <= rows)."""
    env: dict = {}
    with jax.ensure_compile_time_eval():
        for v, x in _known_consts(spec).items():  # a query-axis constant as the strip's rows, a key-axis one whole
            if spec.q_axis in spec.tile.axes[v]:
                env[v] = jnp.asarray(np.pad(x[q0:q0 + body.bm], (0, max(0, q0 + body.bm - len(x)))).reshape(body.bm, 1))
            else:
                env[v] = jnp.asarray(x.reshape(1, -1))
        body.set_program([0] * len(spec.score_shape), q0, 0)
        for nd in nodes:
            body.eval_node(nd, env, 0, 0)
        return {v: np.asarray(jnp.broadcast_to(env[v], (body.bm, spec.Lk)))[:n] for v in want}


def _per_block(a: np.ndarray, rows: int, cols: int, pad_value: bool, reduce) -> np.ndarray:
    """`reduce` (np.any / np.all) over each [rows, cols] block of the 2-d `a`, its edges padded with `pad_value`."""
    n, m = a.shape
    padded = np.pad(a, ((0, cdiv(n, rows) * rows - n), (0, cdiv(m, cols) * cols - m)), constant_values=pad_value)
    return reduce(padded.reshape(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols), axis=(1, 3))


def _mask_steps(spec: AttentionSpec, iota: set[int]) -> list[tuple]:
    """The masks on the path from the scores to the max after the last op that could revive a masked score:
    (kind, node, score operand, predicate or added value, other case) with kind "select" (an iota-only predicate),
    "fill" (a runtime predicate) or "add" (an iota-only value added)."""
    y = spec.exp_branch[0].inputs[0]
    path = needed(spec.pre, {spec.x, y}, set())
    main = {spec.dot1.outputs[0]}
    steps = []  # (kind, node, score operand, iota value, other)
    for nd in path:
        ins = list(nd.inputs)
        m = [a for a in ins if isinstance(a, int) and a in main]
        if not m:
            continue
        main.add(nd.outputs[0])
        mv = m[0]
        others = [a for a in ins if a != mv]
        if nd.name == "select_n" and len(ins) == 3 and len(m) == 1 and ins[0] != mv:
            other = ins[1] if ins[2] == mv else ins[2]
            if isinstance(other, Lit) or other in iota:
                steps.append(("select" if ins[0] in iota else "fill", nd, mv, ins[0], other))
                continue
        if nd.name == "add" and len(m) == 1 and isinstance(others[0], int) and others[0] in iota:
            steps.append(("add", nd, mv, others[0], None))
            continue
        ok = (nd.name in ("convert_element_type", "stop_gradient") or op_class(nd.name) in (OpClass.BROADCAST, OpClass.LAYOUT)
              or nd.name in ("add", "sub") and len(m) == 1 and ins[0] == mv
              or nd.name == "add" and len(m) == 1
              or nd.name in ("mul", "div") and len(m) == 1 and ins[0] == mv and isinstance(ins[1], Lit) and float(ins[1].value) > 0
              or nd.name == "mul" and len(m) == 1 and isinstance(ins[0], Lit) and float(ins[0].value) > 0)
        if not ok:
            steps.clear()  # this op can revive what earlier masks masked; later masks still count
    return steps


def _analyze_masks(spec: AttentionSpec) -> None:
    """Positions masked out (for any runtime input) on the path from the scores to the max, the mask ops, and the
    bound on the live keys that runtime masks give (`key_bound`).

    A mask is a `select_n` with an iota-only predicate choosing a fill <= -1e4, or
    the addition of an iota-only value that is <= -1e4 where masked. Being masked
    survives converts, scaling by a positive literal, adding any other value (a bias is
    assumed far smaller than the fill), and further selects whose other case is such a fill;
    anything else after a mask (e.g. tanh soft-capping) could revive a masked score, so
    only masks after the last such op count.
    """
    if spec.masks_known:
        return
    spec.masks_known = True
    iota = _iota_only(spec)
    steps = _mask_steps(spec, iota)
    bound = _key_bound(spec, steps, iota)
    members = {nd.id for nd in spec.pre}
    # a runtime predicate's terms known at build time (JAX's XLA path joins causal and key lengths in one `and`), read
    # only beside a bound on the keys: the kernels then visit every block where no key is live, as XLA weighs such a
    # row's keys alike; beside any other runtime mask (a boolean padding mask, left-padded: a causal row with no live
    # key) the blocks a known mask kills must still be visited
    known_terms = {nd.id: [t for t in _terms(spec.group.graph, pred, "and" if _live_if_true(nd, mv) else "or", members)
                           if isinstance(t, int) and t in iota]
                   for kind, nd, mv, pred, _ in steps if kind == "fill"} if bound is not None else {}
    if not any(k in ("select", "add") for k, *_ in steps) and not any(known_terms.values()):
        spec.key_bound = bound
        return
    if spec.Lq * spec.Lk > _MAX_GRID:
        return
    want = ({st[3] for st in steps if st[0] != "fill"} | {st[4] for st in steps if isinstance(st[4], int)}
            | {t for ts in known_terms.values() for t in ts})
    rows = max(GRAIN, _STRIP // spec.Lk // GRAIN * GRAIN)  # a strip of rows at a time (a multiple of GRAIN)
    body, nodes = AttentionEval(spec, rows, spec.Lk), needed(spec.pre, want, set())
    nq, nk = cdiv(spec.Lq, GRAIN), cdiv(spec.Lk, GRAIN)
    any_live, all_live = np.zeros((nq, nk), bool), np.ones((nq, nk), bool)
    selects: dict[int, int] = {}
    first_key_dead = False  # some query has its first key masked by a mask known at build time
    adds = {nd.id: mv for kind, nd, mv, *_ in steps if kind == "add"}  # each one a 0 / fill mask until a strip says not
    for q0 in range(0, spec.Lq, rows):
        n = min(rows, spec.Lq - q0)
        host = _host_values(spec, want, body, nodes, q0, n)
        dead = np.zeros((n, spec.Lk), bool)

        def fill_of(other) -> np.ndarray:
            return np.broadcast_to(np.float32(other.value) if isinstance(other, Lit) else host[other].astype(np.float32), dead.shape)

        for kind, nd, mv, a, other in steps:
            if kind == "fill":  # a runtime predicate: only a very negative fill keeps masked scores masked
                if not np.all(fill_of(other) <= _NEG):
                    return
                for t in known_terms[nd.id]:  # one of an `and` that says live, or of an `or` that says masked
                    term = host[t].astype(bool)
                    dead |= ~term if _live_if_true(nd, mv) else term
            elif kind == "select":  # select_n(pred, c0, c1): True picks c1
                pred = host[a].astype(bool)
                picks_fill = ~pred if nd.inputs[2] == mv else pred
                if np.any(picks_fill & (fill_of(other) > _NEG)):
                    return  # a select that is not a mask
                dead |= picks_fill
                selects[nd.id] = mv
            else:
                bias = host[a].astype(np.float32)
                d = bias <= _NEG
                if not np.all(bias[~d] == 0):
                    adds.pop(nd.id, None)
                dead |= d
        first_key_dead |= bool(dead[:, 0].any())
        r = slice(q0 // GRAIN, q0 // GRAIN + cdiv(n, GRAIN))
        any_live[r] = _per_block(~dead, GRAIN, GRAIN, False, np.any)
        all_live[r] = _per_block(~dead, GRAIN, GRAIN, True, np.all)
    spec.live, spec.mask_selects, spec.mask_adds = LiveBlocks(some=any_live, every=all_live), selects, adds
    spec.key_bound = None if first_key_dead else bound


# ---------------------------------------------------------------------------
# Masks known at run time: a bound on the live keys.
_FLIP = {"lt": "gt", "gt": "lt", "le": "ge", "ge": "le"}


def _live_if_true(select: Node, score: int) -> bool:
    """Whether a masking `select_n(p, a, b)` keeps the score where p is True (b is the score; else it is a)."""
    return select.inputs[2] == score


def _key_bound(spec: AttentionSpec, steps: list[tuple], iota: set[int]) -> KeyBound | None:
    """The live keys' bound when every runtime mask (a "fill" step) masks exactly the keys from a per-CTA scalar on
    (`key < n`, `key <= n`, or masked where `key >= n`, joined by `and` / `or` with masks known at build time), else
    None. Keys past it are masked for
    every query, so a kernel need not visit them; that changes nothing only where every query keeps a live key, which
    the kernels make sure of (n >= 1 here; the masks known at build time leave every query its first key: checked by
    the caller), as a row with no live key weighs every key alike under XLA."""
    g = spec.group.graph
    members = {nd.id for nd in spec.pre}
    limits: list[tuple[int, bool]] = []
    selects: dict[int, int] = {}
    for kind, nd, mv, pred, other in steps:
        if kind != "fill":
            continue
        selects[nd.id] = mv
        fill = _const(g, other, members)
        if fill is None or fill > _NEG:
            return None
        live_if_true = _live_if_true(nd, mv)
        for term in _terms(g, pred, "and" if live_if_true else "or", members):
            if isinstance(term, int) and term in iota:
                continue  # known at build time (`_analyze_masks`)
            limit = _key_limit(spec, term, live_if_true, members)
            if limit is None:
                return None
            limits.append(limit)
    return KeyBound(tuple(limits), selects) if limits else None


def _terms(g, v, joiner: str, members: set[int]) -> list:
    """The operands whose `joiner` ("and" / "or") is the boolean v, through broadcasts, reshapes and converts; the
    joiner's identity (a literal True for "and", False for "or") left out."""
    if isinstance(v, Lit):
        return [] if bool(np.asarray(v.value)) == (joiner == "and") else [v]
    nid = g.producer.get(v)
    nd = g.node_index[nid] if nid in members else None
    if nd is not None and (nd.name in ("broadcast_in_dim", "reshape", "convert_element_type") and len(nd.inputs) == 1
                           and g.aval(nd.inputs[0]).dtype == np.dtype(bool)):
        return _terms(g, nd.inputs[0], joiner, members)
    if nd is not None and nd.name == joiner:
        return [t for a in nd.inputs for t in _terms(g, a, joiner, members)]
    return [v]


def _key_limit(spec: AttentionSpec, term, live_if_true: bool, members: set[int]) -> tuple[int, bool] | None:
    """(n, inclusive) when `term` compares the key position with a per-CTA integer scalar n so that the live keys
    are those < n (<= n where inclusive), else None."""
    g = spec.group.graph
    nid = g.producer.get(term) if isinstance(term, int) else None
    nd = g.node_index[nid] if nid in members else None
    if nd is None or nd.name not in _FLIP or not all(isinstance(a, int) for a in nd.inputs):
        return None
    (a, b), op = nd.inputs, nd.name
    if not _is_key_position(spec, a, members):
        (b, a), op = (a, b), _FLIP[op]
    span = spec.tile.span.get(b)
    if not _is_key_position(spec, a, members) or span is None or span.rows or span.cols \
            or not jnp.issubdtype(g.aval(b).dtype, jnp.integer):
        return None
    limit = {"lt": False, "le": True} if live_if_true else {"ge": False, "gt": True}  # key op n: live, or masked
    return (b, limit[op]) if op in limit else None


def _is_key_position(spec: AttentionSpec, v: int, members: set[int]) -> bool:
    """Whether v is each key's position: an iota along the key axis, through broadcasts, reshapes, integer converts
    and adding a literal 0."""
    g = spec.group.graph
    while True:
        nid = g.producer.get(v)
        if nid not in members:
            return False
        nd = g.node_index[nid]
        if nd.name == "iota":
            return spec.tile.axes[v][nd.params["dimension"]] == spec.k_axis
        if nd.name in ("broadcast_in_dim", "reshape") or (nd.name == "convert_element_type"
                                                         and jnp.issubdtype(g.avals[v].dtype, jnp.integer)):
            v = nd.inputs[0]
        elif nd.name == "add" and any(isinstance(a, Lit) and float(np.asarray(a.value)) == 0 for a in nd.inputs):
            v = next(a for a in nd.inputs if not isinstance(a, Lit))
        else:
            return False
        if not isinstance(v, int):
            return False


def key_bound(spec: AttentionSpec) -> KeyBound | None:
    """The runtime masks' bound on the live keys (`_key_bound`), or None."""
    _analyze_masks(spec)
    return spec.key_bound


def bound_inputs(spec: AttentionSpec) -> dict[int, int]:
    """The group's inputs that the runtime masks' bound reads as they are (through broadcasts, reshapes and integer
    converts: key lengths), each with the value at which every key is live: what a kernel visits with no padding.
    A group timed alone runs at these values (`Template.timing_inputs`): random small integers would stop it after a
    block or two and flatter it against XLA, whose work does not depend on them."""
    bound = key_bound(spec)
    if bound is None:
        return {}
    g, members, out = spec.group.graph, {nd.id for nd in spec.pre}, {}
    inputs = set(spec.tile.group.inputs)
    for v, inclusive in bound.limits:
        while v not in inputs:
            nd = g.node_index.get(g.producer.get(v))
            if nd is None or nd.id not in members or not (nd.name in ("broadcast_in_dim", "reshape", "convert_element_type")
                                                          and isinstance(nd.inputs[0], int)
                                                          and jnp.issubdtype(g.aval(nd.inputs[0]).dtype, jnp.integer)):
                break
            v = nd.inputs[0]
        if v in inputs:
            out[v] = spec.Lk - int(inclusive)
    return out


class LiveKeys(NamedTuple):
    """The runtime masks' bound in a kernel, in key blocks (int32 scalars; `live_blocks`)."""
    some: Any  # blocks holding a live key: [0, some)
    every: Any  # blocks whose keys are all live under the bound: [0, every)
    none: Any  # no key is live: every block is visited, masked (a row with no live key weighs every key alike in XLA)


def bound_blocks(spec: AttentionSpec, bound: KeyBound, env: dict, eval_node: Callable, scalar: Callable, block: int,
                 n_blocks: int) -> LiveKeys:
    """`live_blocks` of the bound in a kernel: its limits evaluated by the backend's tile evaluator (`eval_node(nd,
    env)`) from the score work's scalar inputs' values there (`env`), each made an int32 scalar by `scalar`."""
    env, limits = dict(env), []
    for value, inclusive in bound.limits:
        for nd in needed(spec.pre, {value}, set(env)):
            if nd.outputs[0] not in env:
                eval_node(nd, env)
        limits.append(scalar(env[value]) + int(inclusive))
    return live_blocks(limits, block, n_blocks)


def live_blocks(limits: list, block: int, n_blocks: int) -> LiveKeys:
    """The bound in blocks of `block` keys from a kernel's values of its limits (int32 scalars, each already + 1 where
    inclusive)."""
    n = functools.reduce(jnp.minimum, limits)
    return LiveKeys(jnp.minimum(lax.div(jnp.maximum(n, 1) + (block - 1), block), n_blocks),
                    jnp.minimum(lax.div(jnp.maximum(n, 0), block), n_blocks), n < 1)


def clip_ranges(ranges: tuple, live: LiveKeys, every: tuple) -> tuple:
    """Key block ranges clipped to the live blocks: `(lo, hi)` to [0, live.some); `(lo, full_lo, full_hi, hi)` so,
    with the mask-free middle (the bound's selects skipped, `KeyBound.selects`) ending where the keys stop being all
    live; `every` (each block visited, masks evaluated) where no key is live."""
    # int32 throughout: Pallas' Triton lowering makes a select of Python ints a select of i1 (the loop bounds' types
    # then disagree)
    ranges, every = tuple(jnp.asarray(r, jnp.int32) for r in ranges), tuple(jnp.asarray(e, jnp.int32) for e in every)
    if len(ranges) == 2:
        clipped = tuple(jnp.minimum(r, live.some) for r in ranges)
    else:
        lo, flo, fhi, hi = ranges
        flo = jnp.minimum(flo, live.some)
        clipped = (jnp.minimum(lo, live.some), flo, jnp.maximum(jnp.minimum(fhi, live.every), flo), jnp.minimum(hi, live.some))
    return tuple(jnp.where(live.none, e, r) for r, e in zip(clipped, every))


def _const(g, a, members: set[int]) -> float | None:
    """The value of a scalar constant operand (a literal, possibly broadcast or converted), else None."""
    while not isinstance(a, Lit):
        nid = g.producer.get(a)
        if nid not in members or g.node_index[nid].name not in ("broadcast_in_dim", "convert_element_type"):
            return None
        a = g.node_index[nid].inputs[0]
    return float(np.asarray(a.value))


def scale_fold(spec: AttentionSpec) -> tuple[int, int, float] | None:
    """(mul node, its score operand, c) when the scores reach the max as c * z through converts and masking selects.

    The kernel then evaluates z in place of c * z and puts c into the exp's FMA and the
    row max (c > 0 commutes with max), saving one multiply per score. A masking fill f
    then stands for f / c: still at or below -1e4 after scaling, so still masked.
    """
    g = spec.group.graph
    members = {nd.id for nd in spec.pre}
    if spec.exp_branch[0].inputs[0] != spec.x or set(g.consumers.get(spec.x, ())) != {spec.max_node.id, spec.exp_branch[0].id}:
        return None
    v, fills = spec.x, []
    while True:
        nid = g.producer.get(v)
        if nid not in members:
            return None
        nd = g.node_index[nid]
        ins = list(nd.inputs)
        if nd.name == "convert_element_type" and jnp.issubdtype(g.aval(ins[0]).dtype, jnp.floating) \
                and jnp.issubdtype(g.avals[v].dtype, jnp.floating):
            nxt = ins[0]
        elif nd.name == "select_n" and len(ins) == 3:
            consts = [_const(g, a, members) for a in ins[1:]]
            k = [i for i in (0, 1) if consts[i] is None]
            if len(k) != 1 or not isinstance(ins[1 + k[0]], int) or consts[1 - k[0]] > _NEG:
                return None
            fills.append(consts[1 - k[0]])
            nxt = ins[1 + k[0]]
        elif nd.name in ("mul", "div"):
            c = _const(g, ins[1], members)
            if c is None and nd.name == "mul":
                c, ins = _const(g, ins[0], members), ins[::-1]
            if c is None or not c > 0 or not isinstance(ins[0], int):
                return None
            c = c if nd.name == "mul" else 1.0 / c
            if any(f * c > _NEG for f in fills):
                return None
            return nd.id, ins[0], c
        else:
            return None
        if not isinstance(nxt, int) or g.consumers.get(nxt) != [nid]:
            return None
        v = nxt


def block_ranges(spec: AttentionSpec, bq: int, bk: int) -> np.ndarray | None:
    """Per query block: [lo, full_lo, full_hi, hi) key blocks (live range; the mask-free middle), or None. Found
    once per tile shape (the model asks per config: 5 ms each at L2048, a minute for attention_vjp's space)."""
    if (bq, bk) not in spec.ranges:
        spec.ranges[(bq, bk)] = _block_ranges(spec, bq, bk)
    return spec.ranges[(bq, bk)]


def key_block_ranges(spec: AttentionSpec, bq: int, bk: int) -> np.ndarray | None:
    """`block_ranges` transposed, the loop bounds of a backward's dK/dV programs: per key block, [lo, full_lo,
    full_hi, hi) query blocks (those with a live position in the pair; the middle with no position masked, empty
    where it is not one run), or None (no mask known)."""
    r = block_ranges(spec, bq, bk)
    if r is None:
        return None
    nk = cdiv(spec.Lk, bk)
    out = np.zeros((nk, 4), np.int32)
    for j in range(nk):
        live = np.nonzero((r[:, 0] <= j) & (j < r[:, 3]))[0]
        if not len(live):
            continue
        lo, hi = int(live[0]), int(live[-1]) + 1
        full = (r[lo:hi, 1] <= j) & (j < r[lo:hi, 2])
        idx = np.nonzero(full)[0]
        flo, fhi = (lo + int(idx[0]), lo + int(idx[-1]) + 1) if len(idx) and full[idx[0]:idx[-1] + 1].all() else (lo, lo)
        out[j] = (lo, flo, fhi, hi)
    return out


def _block_ranges(spec: AttentionSpec, bq: int, bk: int) -> np.ndarray | None:
    _analyze_masks(spec)
    if spec.live is None:
        return None
    assert bq % GRAIN == 0 and bk % GRAIN == 0, (bq, bk)
    nq, nk = cdiv(spec.Lq, bq), cdiv(spec.Lk, bk)
    any_live = _per_block(spec.live.some, bq // GRAIN, bk // GRAIN, False, np.any)
    all_live = _per_block(spec.live.every, bq // GRAIN, bk // GRAIN, True, np.all) & (np.arange(nk) * bk + bk <= spec.Lk)[None, :]
    out = np.zeros((nq, 4), np.int32)
    for i in range(nq):
        idx = np.nonzero(any_live[i])[0]
        lo, hi = (int(idx[0]), int(idx[-1]) + 1) if len(idx) else (0, 0)
        full = np.nonzero(all_live[i, lo:hi])[0] + lo
        flo, fhi = (int(full[0]), int(full[-1]) + 1) if len(full) and np.all(all_live[i, full[0]:full[-1] + 1]) else (lo, lo)
        out[i] = (lo, flo, fhi, hi)
    return out
