"""Map a group onto a 2-D tile space and generate its Pallas (Triton) kernel.

A group's iteration shape S (rank n) is split at axis k into rows (S[:k],
flattened to R) and columns (S[k:], flattened to C). Every value of the group
is then a register tile that varies along rows, columns, both, or neither:
broadcasts stay lazy (a bias is a [1, bn] tile until it meets a full tile),
and a reduction over the columns leaves a [bm, 1] tile. The arithmetic is the
group's own jaxpr, re-run equation by equation on tiles (`ops.py`).
Low-precision floats are held in float32 inside the kernel and rounded when
stored or explicitly converted (XLA's `xla_allow_excess_precision` default).

Rows and columns that run past the array are masked (GPU_NOTES: no automatic
edge masking on the GPU); every tile has power-of-two sides.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .. import ops
from ..graph import Group, Lit, Node
from ..ops import OpClass


class NoMatch(Exception):
    """The group cannot be tiled this way (the reason is the message)."""


@dataclass(frozen=True)
class Span:
    rows: bool
    cols: bool


@dataclass
class TileSpec:
    """How a group maps onto [R, C] tiles."""

    group: Group
    shape: tuple[int, ...]
    split: int
    axes: dict[int, tuple]  # value -> S-axis of each of its dims (None: unit dim)
    span: dict[int, Span]  # value -> what its register tile varies along
    reductions: list[int]  # node ids of column reductions

    @property
    def R(self) -> int:
        return math.prod(self.shape[: self.split])

    @property
    def C(self) -> int:
        return math.prod(self.shape[self.split :])

    def layout_span(self, v: int) -> Span:
        """What a group input/output spans in memory (by its logical axes, not its lazy tile)."""
        ax = [a for a in self.axes[v] if a is not None]
        return Span(any(a < self.split for a in ax), any(a >= self.split for a in ax))

    def layout2d(self, v: int) -> tuple[int, int]:
        """The 2-D shape a group input/output is reshaped to outside the kernel."""
        sp = self.layout_span(v)
        return (self.R if sp.rows else 1, self.C if sp.cols else 1)


def next_pow2(x: int) -> int:
    return 1 << max(0, int(x - 1).bit_length())


def facts(spec: TileSpec, smem_bytes: int = 227 * 1024) -> dict:
    """What search-space constraints may refer to besides the parameters."""
    g = spec.group
    avals = g.input_avals() + g.output_avals()
    return {
        "R": spec.R,
        "C": spec.C,
        "itemsize": max(np.dtype(a.dtype).itemsize for a in avals),
        "n_inputs": len(g.inputs),
        "n_outputs": len(g.outputs),
        "n_reductions": len(spec.reductions),
        "smem_bytes": smem_bytes,
    }


def template_space(template: str, spec: TileSpec, default: dict, space=None) -> dict:
    """A template's search space (its YAML file, or `space` given), with the default config and the group's facts."""
    from ..spaces import load_spaces

    space = space or load_spaces()[template]
    snapped = {k: _snap(v, space.params[k]) if k in space.params else v for k, v in default.items()}
    return {"params": space.params, "default": snapped, "facts": facts(spec), "space": space}


def _snap(value: int, choices: list) -> int:
    """The nearest choice at or above `value` (else the largest)."""
    above = [c for c in sorted(choices) if c >= value]
    return above[0] if above else max(choices)


# ---------------------------------------------------------------------------
# Analysis.
def analyze(group: Group, shape: Sequence[int], split: int, *, reduce_axes: Sequence[int] | None = None) -> TileSpec:
    """Assign every value of `group` its S-axes and tile span, or raise NoMatch.

    Reductions must cover the trailing axes from `split`, or exactly the S-axes
    `reduce_axes` when given; then inputs and outputs need not be 2-D views
    (the caller lays them out itself).
    """
    g = group.graph
    S = tuple(shape)
    n = len(S)
    values = list(group.inputs) + [v for nd in group.nodes for v in nd.outputs]
    axes = place_axes(g, group.nodes, values, S)

    for v in values:
        if v not in axes:
            raise NoMatch(f"cannot place value %{v} of shape {g.avals[v].shape} in {S}")
        ax = [a for a in axes[v] if a is not None]
        if ax != sorted(ax) or len(set(ax)) != len(ax):
            raise NoMatch(f"value %{v} is a transpose of the iteration space")
    if reduce_axes is None:
        for v in list(group.inputs) + list(group.outputs):
            _check_2d(v, axes[v], S, split)
    want = {d for d in (range(split, n) if reduce_axes is None else reduce_axes) if S[d] != 1}

    span: dict[int, Span] = {}
    for v in group.inputs:
        ax = [a for a in axes[v] if a is not None]
        span[v] = Span(any(a < split for a in ax), any(a >= split for a in ax))
    reductions = []
    for nd in group.nodes:
        cls = ops.op_class(nd.name)
        ins = [span[a] for a in nd.inputs if isinstance(a, int)]
        if cls is OpClass.REDUCTION:
            red = {axes[nd.inputs[0]][d] for d in nd.params["axes"]} - {None}
            if red != want:
                raise NoMatch(f"{nd.name} over S-axes {sorted(red)} is not a reduction over the S-axes {sorted(want)}")
            if reduce_axes is None:
                span[nd.outputs[0]] = Span(ins[0].rows, False)
            else:
                span[nd.outputs[0]] = Span(ins[0].rows and not any(d < split for d in want), ins[0].cols and not any(d >= split for d in want))
            reductions.append(nd.id)
        elif cls is OpClass.SOURCE:
            d = axes[nd.outputs[0]][nd.params["dimension"]]  # the S-axis it counts along (an iota may have fewer dims than S)
            span[nd.outputs[0]] = Span(False, False) if d is None else Span(d < split, d >= split)
        else:
            span[nd.outputs[0]] = Span(any(s.rows for s in ins), any(s.cols for s in ins))
    return TileSpec(group, S, split, axes, span, reductions)


def place_axes(g: Any, nodes: Sequence[Node], values: Sequence[int], S: tuple, *, seed: dict[int, tuple] | None = None,
               strict: bool = True) -> dict[int, tuple]:
    """The S-axis of every dim of each value that can be placed (None: a unit dim).

    A value of S's rank aligns dim by dim (`strict`: one that cannot align is a
    NoMatch; otherwise it is left to propagation); the others get their axes by
    propagation through `nodes` from their neighbours; `seed` fixes some first.
    """
    n = len(S)
    axes: dict[int, tuple] = dict(seed or {})

    def put(v: int, ax: tuple) -> bool:
        old = axes.get(v)
        if old is None:
            axes[v] = ax
            return True
        if old != ax:
            raise NoMatch(f"value %{v} maps to S-axes {old} and {ax}")
        return False

    for v in values:
        av = g.avals[v]
        if av.size == 1:
            put(v, (None,) * len(av.shape))
        elif len(av.shape) == n:
            if all(s in (1, S[d]) for d, s in enumerate(av.shape)):
                put(v, tuple(d if s != 1 else None for d, s in enumerate(av.shape)))
            elif strict:
                raise NoMatch(f"value %{v} of shape {av.shape} does not align with {S}")
    changed = True
    while changed:
        changed = False
        for nd in nodes:
            changed |= _propagate(nd, g.avals, axes, put)
    return axes


def _check_2d(v: int, ax: tuple, S: tuple, split: int) -> None:
    """An input/output must reshape to [R|1, C|1] without moving data."""
    have = {a for a in ax if a is not None}
    for lo, hi in ((0, split), (split, len(S))):
        part = {a for a in have if lo <= a < hi}
        full = {d for d in range(lo, hi) if S[d] != 1}
        if part and part != full:
            raise NoMatch(f"value %{v} covers S-axes {sorted(part)} of {sorted(full)}: needs a gather")


def _propagate(nd: Node, avals: dict, axes: dict, put: Callable) -> bool:
    cls = ops.op_class(nd.name)
    vals = [a for a in nd.inputs if isinstance(a, int)]
    out = nd.outputs[0]
    oshape = avals[out].shape
    changed = False
    if cls is OpClass.ELEMENTWISE:
        same = [v for v in vals + [out] if len(avals[v].shape) == len(oshape) and avals[v].size > 1]
        known = [axes[v] for v in same if v in axes]
        if known:
            merged = tuple(next((k[d] for k in known if k[d] is not None), None) for d in range(len(oshape)))
            for v in same:
                sh = avals[v].shape
                changed |= put(v, tuple(merged[d] if sh[d] != 1 else None for d in range(len(sh))))
    elif cls is OpClass.BROADCAST and vals:
        op, bd = vals[0], nd.params["broadcast_dimensions"]
        ish = avals[op].shape
        if out in axes and op not in axes:
            changed |= put(op, tuple(axes[out][bd[i]] if ish[i] != 1 else None for i in range(len(ish))))
        elif op in axes and out not in axes:
            ax: list = [None] * len(oshape)
            for i, j in enumerate(bd):
                if ish[i] != 1:
                    ax[j] = axes[op][i]
            if any(ax[j] is None and oshape[j] != 1 for j in range(len(oshape))):
                raise NoMatch("broadcast to a new non-unit axis outside the iteration shape")
            changed |= put(out, tuple(ax))
    elif cls is OpClass.LAYOUT:
        op = vals[0]
        if nd.name == "reshape" and nd.params.get("dimensions") is not None:
            raise NoMatch("reshape with dimensions")
        ish = avals[op].shape
        i_nu = [d for d, s in enumerate(ish) if s != 1]
        o_nu = [d for d, s in enumerate(oshape) if s != 1]
        if [ish[d] for d in i_nu] != [oshape[d] for d in o_nu]:
            raise NoMatch(f"{nd.name} {ish} -> {oshape} moves data")
        if op in axes and out not in axes:
            ax = [None] * len(oshape)
            for di, do in zip(i_nu, o_nu):
                ax[do] = axes[op][di]
            changed |= put(out, tuple(ax))
        elif out in axes and op not in axes:
            ax = [None] * len(ish)
            for di, do in zip(i_nu, o_nu):
                ax[di] = axes[out][do]
            changed |= put(op, tuple(ax))
    elif cls is OpClass.REDUCTION:
        op = vals[0]
        if op in axes and out not in axes:
            red = set(nd.params["axes"])
            changed |= put(out, tuple(a for d, a in enumerate(axes[op]) if d not in red))
    elif cls is OpClass.BROADCAST:
        pass  # a broadcast literal: placed by its consumers
    elif cls is OpClass.SOURCE:
        if len(oshape) != len(axes.get(out, oshape)):
            raise NoMatch("iota outside the iteration shape")
    else:
        raise NoMatch(f"{nd.name} cannot be tiled")
    return changed


# ---------------------------------------------------------------------------
# Code generation.
@dataclass(frozen=True)
class TileConfig:
    block_rows: int
    block_cols: int
    num_warps: int
    num_stages: int
    col_major: int = 0  # 2-D grids: 1 walks the column blocks of a row block first (contiguous memory)


class _Body:
    """Evaluates a group's equations on tiles inside one kernel instance."""

    def __init__(self, spec: TileSpec, cfg: TileConfig, n_in: int):
        self.spec, self.cfg, self.n_in = spec, cfg, n_in
        self.g = spec.group.graph
        self.bm, self.bn = cfg.block_rows, cfg.block_cols

    # masks / indices -------------------------------------------------------
    def row_idx(self, r0):
        return r0 + jax.lax.broadcasted_iota(jnp.int32, (self.bm, 1), 0)

    def col_idx(self, c0):
        return c0 + jax.lax.broadcasted_iota(jnp.int32, (1, self.bn), 1)

    def mask(self, span: Span, r0, c0):
        m = None
        if span.rows and self.spec.R % self.bm:
            m = self.row_idx(r0) < self.spec.R
        if span.cols and self.spec.C % self.bn:
            cm = self.col_idx(c0) < self.spec.C
            m = cm if m is None else m & cm
        if m is not None:
            m = jnp.broadcast_to(m, self.tile_shape(span))
        return m

    def tile_shape(self, span: Span) -> tuple[int, int]:
        return (self.bm if span.rows else 1, self.bn if span.cols else 1)

    def _index(self, span: Span, r0, c0):
        return (pl.ds(r0, self.bm) if span.rows else pl.ds(0, 1), pl.ds(c0, self.bn) if span.cols else pl.ds(0, 1))

    # memory ------------------------------------------------------------------
    def load(self, ref, v: int, r0, c0):
        span = self.spec.span[v]
        m = self.mask(span, r0, c0)
        x = plgpu.load(ref.at[self._index(span, r0, c0)], mask=m, other=0 if m is not None else None)
        return x.astype(ops.compute_dtype(x.dtype))

    def store(self, ref, v: int, x, r0, c0):
        span = self.spec.layout_span(v)
        x = jnp.broadcast_to(x, self.tile_shape(span)).astype(self.g.avals[v].dtype)
        plgpu.store(ref.at[self._index(span, r0, c0)], x, mask=self.mask(span, r0, c0))

    # arithmetic --------------------------------------------------------------
    def atom(self, env: dict, a) -> Any:
        if isinstance(a, Lit):
            return jnp.asarray(np.array(a.value, ops.compute_dtype(a.aval.dtype)))
        return env[a]

    def eval_node(self, nd: Node, env: dict, r0, c0, colmask=None) -> None:
        cls = ops.op_class(nd.name)
        out = nd.outputs[0]
        odt = self.g.avals[out].dtype
        if cls in (OpClass.BROADCAST, OpClass.LAYOUT):
            env[out] = self.atom(env, nd.inputs[0])
        elif cls is OpClass.ELEMENTWISE:
            env[out] = ops.eval_elementwise(nd.primitive, nd.params, odt, [self.atom(env, a) for a in nd.inputs],
                                            [self.g.aval(a).dtype for a in nd.inputs])
        elif cls is OpClass.SOURCE:
            env[out] = self.iota(nd, r0, c0)
        elif cls is OpClass.REDUCTION:
            env[out] = self.reduce_partial(nd, env, colmask)
        else:  # pragma: no cover - analysis rejects these
            raise NoMatch(nd.name)

    def reduce_partial(self, nd: Node, env: dict, colmask):
        kind = ops.reduction_kind(nd.name)
        x = env[nd.inputs[0]]
        if not self.spec.span[nd.inputs[0]].cols:  # constant along the row
            return x * self.spec.C if kind == "sum" else x
        if colmask is not None:
            x = jnp.where(colmask, x, ops.reduction_identity(kind, x.dtype))
        return ops.reduce_tile(kind, x, axis=1)

    def iota(self, nd: Node, r0, c0):
        S, k, d = self.spec.shape, self.spec.split, self.spec.axes[nd.outputs[0]][nd.params["dimension"]]
        if d is None:  # along a unit axis: all zeros
            return jnp.zeros((1, 1), ops.compute_dtype(nd.params["dtype"]))
        if d >= k:
            idx, stride = self.col_idx(c0), math.prod(S[d + 1 :])
        else:
            idx, stride = self.row_idx(r0), math.prod(S[d + 1 : k])
        return ((idx // stride) % S[d]).astype(ops.compute_dtype(nd.params["dtype"]))


def _needed(nodes: list[Node], targets: set[int], stop: set[int], through: dict[int, int] | None = None) -> list[Node]:
    """The nodes (in order) that the values `targets` depend on, stopping at `stop`; a node in `through`
    (node id -> one of its inputs) depends on that input alone (a mask op where nothing is masked)."""
    prod = {v: nd for nd in nodes for v in nd.outputs}
    keep: set[int] = set()
    todo = [t for t in targets if t not in stop]
    while todo:
        v = todo.pop()
        nd = prod.get(v)
        if nd is None or nd.id in keep:
            continue
        keep.add(nd.id)
        ins = [through[nd.id]] if through and nd.id in through else nd.inputs
        todo.extend(a for a in ins if isinstance(a, int) and a not in stop)
    return [nd for nd in nodes if nd.id in keep]


def make_kernel(spec: TileSpec, cfg: TileConfig, *, two_d_grid: bool) -> Callable:
    """The kernel body: single pass when one column block covers C, else staged loops."""
    group = spec.group
    nodes = group.nodes
    n_in = len(group.inputs)
    body = _Body(spec, cfg, n_in)
    nchunks = -(-spec.C // cfg.block_cols)
    single = two_d_grid or nchunks == 1

    def kernel(*refs):
        in_refs = dict(zip(group.inputs, refs[:n_in]))
        out_refs = dict(zip(group.outputs, refs[n_in:]))
        rows_axis, cols_axis = (1, 0) if two_d_grid and cfg.col_major else (0, 1)
        r0 = pl.program_id(rows_axis) * cfg.block_rows
        c0 = pl.program_id(cols_axis) * cfg.block_cols if two_d_grid else 0
        if single:
            env = {v: body.load(in_refs[v], v, r0, c0) for v in group.inputs}
            colmask = body.mask(Span(False, True), r0, c0)
            for nd in nodes:
                body.eval_node(nd, env, r0, c0, colmask)
            for v in group.outputs:
                body.store(out_refs[v], v, env[v], r0, c0)
        else:
            _staged(body, spec, in_refs, out_refs, r0, nchunks)

    return kernel


def _staged(body: _Body, spec: TileSpec, in_refs: dict, out_refs: dict, r0, nchunks: int) -> None:
    """Rows longer than one block: one loop over column blocks per reduction depth, then one to write."""
    group, span = spec.group, spec.span
    nodes = group.nodes
    bn = body.bn
    env = {v: body.load(in_refs[v], v, r0, 0) for v in group.inputs if not span[v].cols}
    col_inputs = [v for v in group.inputs if span[v].cols]
    done: set[int] = set()

    def row_pass():
        for nd in nodes:
            if nd.id in done or span[nd.outputs[0]].cols:
                continue
            if nd.id in spec.reductions and span[nd.inputs[0]].cols:
                continue
            if all(not isinstance(a, int) or a in env for a in nd.inputs):
                body.eval_node(nd, env, r0, 0)
                done.add(nd.id)

    def col_loop(targets: set[int], fn: Callable, init):
        stop = set(env)
        sl = _needed([nd for nd in nodes if nd.id not in done], targets, stop)
        need_in = {a for nd in sl for a in nd.inputs if isinstance(a, int)} | targets
        loads = [v for v in col_inputs if v in need_in]

        def step(c, carry):
            c0 = c * bn
            local = dict(env)
            local.update({v: body.load(in_refs[v], v, r0, c0) for v in loads})
            colmask = body.mask(Span(False, True), r0, c0)
            for nd in sl:
                if nd.id in spec.reductions:
                    continue
                body.eval_node(nd, local, r0, c0, colmask)
            return fn(local, c0, colmask, carry)

        return jax.lax.fori_loop(0, nchunks, step, init)

    row_pass()
    while True:
        # A reduction is computable in this pass when every reduction it depends on is done.
        pending = [rid for rid in spec.reductions if rid not in done]
        if not pending:
            break
        this = [rid for rid in pending if not _depends_on(group, rid, {p for p in pending if p != rid})]
        reds = [group.graph.node_index[r] for r in this]
        kinds = [ops.reduction_kind(nd.name) for nd in reds]
        init = tuple(
            jnp.full((body.bm if span[nd.inputs[0]].rows else 1, 1), ops.reduction_identity(k, ops.compute_dtype(group.graph.avals[nd.outputs[0]].dtype)))
            for nd, k in zip(reds, kinds)
        )

        def acc(local, c0, colmask, carry, reds=reds, kinds=kinds):
            return tuple(
                ops.combine(k, cr, body.reduce_partial(nd, local, colmask)) for nd, k, cr in zip(reds, kinds, carry)
            )

        res = col_loop({nd.inputs[0] for nd in reds}, acc, init)
        for nd, r in zip(reds, res):
            env[nd.outputs[0]] = r
            done.add(nd.id)
        row_pass()

    col_outs = [v for v in group.outputs if span[v].cols]
    if col_outs:
        def write(local, c0, colmask, carry):
            for v in col_outs:
                body.store(out_refs[v], v, local[v], r0, c0)
            return carry

        col_loop(set(col_outs), write, 0)
    for v in group.outputs:
        if not span[v].cols:
            body.store(out_refs[v], v, env[v], r0, 0)


def _depends_on(group: Group, node_id: int, others: set[int]) -> bool:
    """Whether node `node_id` (transitively, inside the group) reads an output of any of `others`."""
    g = group.graph
    members = set(group.node_ids)
    seen: set[int] = set()
    todo = [node_id]
    while todo:
        nid = todo.pop()
        for p in g.preds(nid):
            if p in members and p not in seen:
                if p in others:
                    return True
                seen.add(p)
                todo.append(p)
    return False


def pallas_callable(spec: TileSpec, cfg: TileConfig, *, name: str, interpret: bool, two_d_grid: bool) -> Callable:
    """Wrap the kernel: reshape inputs to 2-D, launch over row (and column) blocks, reshape outputs back."""
    group = spec.group
    g = group.graph
    kernel = make_kernel(spec, cfg, two_d_grid=two_d_grid)
    grid = (-(-spec.R // cfg.block_rows),) + ((-(-spec.C // cfg.block_cols),) if two_d_grid else ())
    if two_d_grid and cfg.col_major:
        grid = grid[::-1]
    out_shape = [jax.ShapeDtypeStruct(spec.layout2d(v), g.avals[v].dtype) for v in group.outputs]
    call = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        interpret=interpret,
        name=name,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
    )

    def run(*ins):
        ins2 = [jnp.reshape(x, spec.layout2d(v)) for v, x in zip(group.inputs, ins)]
        outs = call(*ins2)
        return [jnp.reshape(o, g.avals[v].shape) for v, o in zip(group.outputs, outs)]

    return run


def build_template(name: str, params: Sequence[str], spec: TileSpec | None, group: Group, config: dict, *,
                   interpret: bool, two_d_grid: bool, defaults: dict | None = None) -> Callable:
    """A template's `build`: config to `TileConfig`, then the kernel (named after template and group)."""
    if spec is None:
        raise NoMatch(f"{name} does not match this group")
    defaults = defaults or {}
    cfg = TileConfig(**{k: int(config[k] if k in config else defaults[k]) for k in params})
    return pallas_callable(spec, cfg, name=f"autofuse_{name}_{group.signature[:8]}", interpret=interpret, two_d_grid=two_d_grid)
