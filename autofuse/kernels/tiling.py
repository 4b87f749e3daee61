"""Map a group onto a 2-D tile space (backend-independent analysis).

A group's iteration shape S (rank n) is split at axis k into rows (S[:k],
flattened to R) and columns (S[k:], flattened to C). Every value of the group
is then a register tile that varies along rows, columns, both, or neither:
broadcasts stay lazy (a bias is a [1, bn] tile until it meets a full tile),
and a reduction over the columns leaves a [bm, 1] tile. The arithmetic is the
group's own jaxpr, re-run equation by equation on tiles (`tile_eval.py`);
each backend writes the loads, stores and loops around it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from .. import ops
from ..costmodel import H200, GPUModel, group_bytes
from ..graph import Group, Node
from ..ops import OpClass



class NoMatch(Exception):
    """The group cannot be tiled this way (the reason is the message)."""


@dataclass(frozen=True)
class Span:
    rows: bool
    cols: bool
    per_segment: bool = False  # (segmented tilings) varies along the columns only from one segment to the next


@dataclass
class TileSpec:
    """How a group maps onto [R, C] tiles."""

    group: Group
    shape: tuple[int, ...]
    split: int
    axes: dict[int, tuple]  # value -> S-axis of each of its dims (None: unit dim)
    span: dict[int, Span]  # value -> what its register tile varies along
    reductions: list[int]  # node ids of column reductions
    seg: int = 0  # segmented tiling (`analyze_segments`): the columns are S[split:] = [C / seg, seg]; 0: not segmented
    col_sums: dict[int, int] = field(default_factory=dict)  # (`analyze(column_sums=True)`) a group output that is a sum
    # over every row axis (a norm's dγ/dβ), maybe reshaped -> the reduction's node id: written per block of rows as a partial
    col_sum_nodes: frozenset[int] = frozenset()  # those reductions and the reshapes after them (not evaluated on tiles)
    unit_reductions: frozenset[int] = frozenset()  # reductions over unit axes only (a gradient's [R, 1] sums): identities
    outer: dict[int, int] = field(default_factory=dict)  # (`analyze(outer=True)`) an input that covers only the leading
    # row axes (SPLADE's per-sequence max [B, 1, V] beside the [B, S, V] product) -> the rows per index of those
    # axes; a tile whose rows lie in one such index reads it as one row (`Span(False, ...)`); with `inner`, also an
    # output (a reduction over the inner rows, written as one row per tile)
    inner: int = 0  # (`analyze(inner=k)`) the rows a tile holds whole: S-axes k.. of the rows, which the group's
    # reductions reduce over (SPLADE's max over the sequence of [B, S, V]); tiles of `inner` rows, one per outer index

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

    @property
    def outer_rows(self) -> int:
        """The rows per outer index a tile must stay within (0: no value covers only the leading row axes)."""
        return math.gcd(*self.outer.values()) if self.outer else 0

    def layout2d(self, v: int) -> tuple[int, int]:
        """The 2-D shape a group input/output is reshaped to outside the kernel."""
        sp = self.layout_span(v)
        return (self.R // self.outer.get(v, 1) if sp.rows else 1, self.C if sp.cols else 1)


def next_pow2(x: int) -> int:
    return 1 << max(0, int(x - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    """Blocks of `b` needed to cover `a`."""
    return -(-a // b)


def facts(spec: TileSpec) -> dict:
    """What search-space constraints on a [R, C] tiling may refer to besides the parameters."""
    g = spec.group
    avals = g.input_avals() + g.output_avals()
    return {
        "R": spec.R,
        "C": spec.C,
        "itemsize": max(np.dtype(a.dtype).itemsize for a in avals),
        "n_inputs": len(g.inputs),
        "n_outputs": len(g.outputs),
        "n_reductions": len(spec.reductions),
        "smem_bytes": H200.smem_bytes,
        "outer_rows": spec.outer_rows,
        "n_col_sums": len(spec.col_sums),
        "inner": spec.inner,
    }


def template_space(template: str, default: dict, group_facts: dict, space=None) -> dict:
    """A template's `space()`: its search space (its TOML file, or `space` given), the default config snapped
    to the choices, and the facts about the group."""
    from ..spaces import load_spaces

    space = space or load_spaces()[template]
    snapped = {k: _snap(v, space.params[k]) if k in space.params else v for k, v in default.items()}
    return {"params": space.params, "default": snapped, "facts": group_facts, "space": space}


def _snap(value: int, choices: list) -> int:
    """The nearest choice at or above `value` (else the largest)."""
    above = [c for c in sorted(choices) if c >= value]
    return above[0] if above else max(choices)


# How far from the floor a generated [R, C] tile kernel runs: 1.1, and it pays for its config below.
_PALLAS_FACTOR = 1.1
_SMS = 132
_RESIDENT_PROGRAMS = _SMS * 4  # SMs x programs resident per SM, roughly
_PROGRAM_OVERHEAD_S = 0.2e-6  # fitted to the default-config layer norm in results/core_default_h200.md


def tile_time_ms(spec: TileSpec, config: dict, model: GPUModel, *, passes: int = 1, two_d_grid: bool = False) -> float:
    """Modelled time of a [R, C] tile kernel with `config`: floor x efficiency x config penalties. `passes`: reads
    of the inputs; `two_d_grid`: one program per tile (else one per row block)."""
    group = spec.group
    bm, bn, warps = int(config["block_rows"]), int(config["block_cols"]), int(config["num_warps"])
    R, C = spec.R, spec.C
    col_blocks = cdiv(C, bn)
    row_programs = cdiv(R, bm * int(config.get("row_steps", 1)))
    programs = row_programs * (col_blocks if two_d_grid else 1)
    partial_bytes = 2 * 4 * row_programs * C * len(spec.col_sums)  # column sums' float32 partials: a row each, written, then added
    t_bytes = (group_bytes(group, passes) + partial_bytes) / model.bandwidth_Bps
    padded = (cdiv(R, bm) * bm / R) * (col_blocks * bn / C)
    per_thread = bm * bn / (32 * warps)
    penalty = 1.0
    if per_thread > 64:
        penalty += (per_thread - 64) / 64 * 0.5  # register pressure, spills
    elif per_thread < 4:
        penalty += 0.2  # too little work per thread to hide latency
    occupancy = min(1.0, programs / _SMS)  # fewer programs than SMs cannot use the whole bandwidth
    t = t_bytes / occupancy * _PALLAS_FACTOR * penalty * min(padded, 2.0) + programs * _PROGRAM_OVERHEAD_S / _RESIDENT_PROGRAMS
    return 1e3 * (t + model.launch_s)


# ---------------------------------------------------------------------------
# Analysis.

def _placed_in_order(group: Group, values: list[int], S: tuple[int, ...]) -> dict[int, tuple]:
    """Each value's axes in the iteration space `S` (`place_axes`); NoMatch where a value has no place, or is a
    transpose of the space (its axes out of order): a tile reads and writes every value in the space's order."""
    g = group.graph
    axes = place_axes(g, group.nodes, values, S)
    for v in values:
        if v not in axes:
            raise NoMatch(f"cannot place value %{v} of shape {g.avals[v].shape} in {S}")
        ax = [a for a in axes[v] if a is not None]
        if ax != sorted(ax) or len(set(ax)) != len(ax):
            raise NoMatch(f"value %{v} is a transpose of the iteration space")
    return axes

def analyze(group: Group, shape: Sequence[int], split: int, *, reduce_axes: Sequence[int] | None = None,
            outer: bool = False, column_sums: bool = False, inner: int | None = None) -> TileSpec:
    """Assign every value of `group` its S-axes and tile span, or raise NoMatch.

    Reductions must cover the trailing axes from `split`, or exactly the S-axes
    `reduce_axes` when given; then inputs and outputs need not be 2-D views
    (the caller lays them out itself). With `outer`, an input may cover only the
    leading row axes (`TileSpec.outer`: the caller's tiles lie within one index of them).
    With `column_sums` (a norm's backward), a reduction over every row axis is allowed where the
    group returns it, maybe reshaped (or reduced over unit axes), and reads it no further
    (`TileSpec.col_sums`); and a reduction over unit axes only is the value itself
    (`TileSpec.unit_reductions`: a gradient's sums of [R, 1] values).
    With `inner` = k < split, the reductions are over the row S-axes k..split-1 instead, which a tile holds
    whole (`TileSpec.inner`); a value covering only row axes before k (a reduced one) is one row per tile, in
    and out (`TileSpec.outer`).
    """
    S = tuple(shape)
    n = len(S)
    values = list(group.inputs) + [v for nd in group.nodes for v in nd.outputs]
    axes = _placed_in_order(group, values, S)
    if inner is not None and (reduce_axes is not None or not 0 <= inner < split):
        raise NoMatch("inner-row reductions are over trailing row axes")

    per_outer: dict[int, int] = {}
    if reduce_axes is None:
        for v in list(group.inputs) + list(group.outputs):
            rows = _outer_rows(axes[v], S, split) if (outer and v in group.inputs) or inner is not None else None
            if rows is not None:
                per_outer[v] = rows
            else:
                _check_2d(v, axes[v], S, split)
    if inner is not None:
        want = {d for d in range(inner, split) if S[d] != 1}
    else:
        want = {d for d in (range(split, n) if reduce_axes is None else reduce_axes) if S[d] != 1}

    span: dict[int, Span] = {}
    for v in group.inputs:
        ax = [a for a in axes[v] if a is not None]
        span[v] = Span(any(a < split for a in ax) and v not in per_outer, any(a >= split for a in ax))
    reductions = []
    summed: dict[int, int] = {}  # a sum over the rows (or a reshape of one) -> the reduction's node id
    skipped: set[int] = set()
    unit: set[int] = set()
    converted: set[int] = set()  # sums over the rows already converted once after the adding
    rows_all = {d for d in range(split) if S[d] != 1}
    for nd in group.nodes:
        cls = ops.op_class(nd.name)
        ins = [span[a] for a in nd.inputs if isinstance(a, int)]
        src = [summed[a] for a in nd.inputs if isinstance(a, int) and a in summed]
        if src:  # only a reshape (or a reduction over unit axes, or one conversion) of a sum over the rows may read it
            over_units = cls is OpClass.REDUCTION and not ({axes[nd.inputs[0]][d] for d in nd.params["axes"]} - {None})
            cast = nd.name == "convert_element_type" and src[0] not in converted
            if cast:
                converted.add(src[0])  # applied to the added partials (one cast: rounding once, as the program does)
            if not (cls is OpClass.LAYOUT or over_units or cast):
                raise NoMatch(f"{nd.name} reads a sum over the rows inside the group")
            summed[nd.outputs[0]], span[nd.outputs[0]] = src[0], Span(False, True)
            skipped.add(nd.id)
            continue
        if cls is OpClass.REDUCTION:
            red = {axes[nd.inputs[0]][d] for d in nd.params["axes"]} - {None}
            if column_sums and not red:  # over unit axes only: the value itself
                span[nd.outputs[0]] = ins[0]
                unit.add(nd.id)
                continue
            if column_sums and red and red == rows_all and reduce_axes is None and ins[0].cols:
                summed[nd.outputs[0]], span[nd.outputs[0]] = nd.id, Span(False, True)
                skipped.add(nd.id)
                continue
            if red != want:
                raise NoMatch(f"{nd.name} over S-axes {sorted(red)} is not a reduction over the S-axes {sorted(want)}")
            if inner is not None:
                span[nd.outputs[0]] = Span(False, ins[0].cols)  # constant over the tile's rows (one outer index)
            elif reduce_axes is None:
                span[nd.outputs[0]] = Span(ins[0].rows, False)
            else:
                span[nd.outputs[0]] = Span(ins[0].rows and not any(d < split for d in want), ins[0].cols and not any(d >= split for d in want))
            reductions.append(nd.id)
        elif cls is OpClass.SOURCE:
            d = axes[nd.outputs[0]][nd.params["dimension"]]  # the S-axis it counts along (an iota may have fewer dims than S)
            span[nd.outputs[0]] = Span(False, False) if d is None else Span(d < split, d >= split)
        else:
            span[nd.outputs[0]] = Span(any(s.rows for s in ins), any(s.cols for s in ins))
    col_sums = {v: summed[v] for v in group.outputs if v in summed}
    if inner is not None:
        if not reductions:
            raise NoMatch("no reduction over the inner rows")
        rows_inner = math.prod(S[inner:split])
        for v in group.outputs:
            if span[v].rows and v in per_outer:
                raise NoMatch(f"output %{v} covers some row axes: neither a tile nor one row per tile")
        for v, rows in per_outer.items():  # one row per tile: constant over the tile's rows
            if rows % rows_inner:
                raise NoMatch(f"value %{v} varies within a tile's rows")
    return TileSpec(group, S, split, axes, span, reductions, col_sums=col_sums, col_sum_nodes=frozenset(skipped),
                    unit_reductions=frozenset(unit), outer=per_outer,
                    inner=math.prod(S[inner:split]) if inner is not None else 0)


def _outer_rows(ax: tuple, S: tuple, split: int) -> int | None:
    """For a value covering only some leading row axes of S (and any columns), the rows per index of them; else None."""
    rows = sorted({a for a in ax if a is not None and a < split})
    full = [d for d in range(split) if S[d] != 1]
    if not rows or rows == full or rows != full[: len(rows)]:
        return None
    return math.prod(S[d] for d in full[len(rows):])


def analyze_segments(group: Group, shape: Sequence[int], split: int) -> TileSpec:
    """`analyze` for a group whose columns are segments: S = (*rows, G, seg) with split = len(rows), every input
    and output spanning all of the columns or none of them, and every reduction over the last S-axis (the
    segment). A value varying along G but not within a segment (a segment's mean) has the span
    `Span(rows, True, per_segment=True)`; one varying within segments but not across them is a NoMatch.
    The group comes from `passes.split_columns` (its values already have the [G, seg] axes)."""
    S = tuple(shape)
    n = len(S)
    if n != split + 2:
        raise NoMatch("a segmented tiling has two column axes")
    values = list(group.inputs) + [v for nd in group.nodes for v in nd.outputs]
    axes = _placed_in_order(group, values, S)
    for v in list(group.inputs) + list(group.outputs):
        _check_2d(v, axes[v], S, split)
    vary: dict[int, frozenset] = {v: frozenset(a for a in axes[v] if a is not None) for v in group.inputs}
    reductions = []
    for nd in group.nodes:
        ins = frozenset().union(*[vary[a] for a in nd.inputs if isinstance(a, int)])
        cls = ops.op_class(nd.name)
        if cls is OpClass.REDUCTION:
            red = {axes[nd.inputs[0]][d] for d in nd.params["axes"]} - {None}
            if red - {n - 1} or not red:
                raise NoMatch(f"{nd.name} over S-axes {sorted(red)} is not a reduction over segments (S-axis {n - 1})")
            vary[nd.outputs[0]] = ins - red
            reductions.append(nd.id)
        elif cls is OpClass.SOURCE:
            d = axes[nd.outputs[0]][nd.params["dimension"]]
            vary[nd.outputs[0]] = frozenset() if d is None else frozenset({d})
        else:
            vary[nd.outputs[0]] = ins
    span = {}
    for v, a in vary.items():
        if n - 1 in a and split not in a:
            raise NoMatch(f"value %{v} varies within segments but not across them")
        span[v] = Span(any(x < split for x in a), bool(a & {split, n - 1}), split in a and n - 1 not in a)
    return TileSpec(group, S, split, axes, span, reductions, seg=S[-1])


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

    def propagate() -> None:
        changed = True
        while changed:
            changed = False
            for nd in nodes:
                changed |= _propagate(nd, g.avals, axes, put)

    if not strict and seed:  # what the seed reaches first: a transposed value whose sizes happen to match S's
        propagate()          # (a bias [1, H, 1, L, L] beside scores [1, B, H, L, L], B == H) must not align dim by dim
    for v in values:
        av = g.avals[v]
        if v in axes and not strict:
            continue
        if av.size == 1:
            put(v, (None,) * len(av.shape))
        elif len(av.shape) == n:
            if all(s in (1, S[d]) for d, s in enumerate(av.shape)):
                put(v, tuple(d if s != 1 else None for d, s in enumerate(av.shape)))
            elif strict:
                raise NoMatch(f"value %{v} of shape {av.shape} does not align with {S}")
    propagate()
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
                ax = tuple(merged[d] if sh[d] != 1 else None for d in range(len(sh)))
                if all(a is not None or s == 1 for a, s in zip(ax, sh)):  # else another reader places it
                    changed |= put(v, ax)
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
            if not any(ax[j] is None and oshape[j] != 1 for j in range(len(oshape))):
                changed |= put(out, tuple(ax))
            # else: the broadcast makes a new axis (a scalar broadcast to a row): its readers place it
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
# Dependencies inside a group.
def needed(nodes: list[Node], targets: set[int], stop: set[int], through: dict[int, int] | None = None) -> list[Node]:
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


def depends_on(group: Group, node_id: int, others: set[int]) -> bool:
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
