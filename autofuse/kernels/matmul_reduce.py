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
`triton.matmul.dot_tile`), runs the group's own elementwise work on it (the shared
tile evaluator) and folds it into running reductions. A reduction that
depends on an earlier one (`sum(exp(x - max))`) is rescaled online: the
template reads from the jaxpr how its summand scales when the earlier
results change (`exp(a - c)`: by exp(c_old - c_new); `x * c`, `x / c`: by the
ratio) and rejects the group otherwise. The work after the reductions runs
once, on the final values; a max or min over a monotone elementwise chain
(`max(log1p(relu(x + b)) * mask)`) reduces the chain's base and runs the
chain after the loop too (`passes.hoist_monotone`). Batched dots, prologues and
`precision=HIGHEST` stay in XLA.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from .. import ops
from ..costmodel import H200, GPUModel
from ..graph import Group, Lit, Node, bind_node, read_atom
from ..ops import OpClass, op_class
from .matmul import DOT_DTYPES, default_precision
from .passes import PASS_THROUGH, fold_gathers, foldable_gather, hoist_monotone
from .template import NoMatch, Template
from .tiling import Span, TileSpec, analyze, cdiv


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
    scale: dict  # dependent reduction id -> [(kind "exp" | "mul" | "eq", value, sign)]: how its summand rescales
    round_product: bool = False  # the epilogue reads the product rounded to the dot's dtype (not the float32 accumulator)

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


class MatmulReduceTemplate(Template[MatmulReduceSpec]):
    name = "matmul_reduce"
    backends = ("triton", "mosaic_gpu")

    def match(self, group: Group) -> MatmulReduceSpec | None:
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
        if lb or rb or len(bv.shape) != 2 or len(lc) != 1 or len(rc) != 1 or not default_precision(dot, av.dtype):
            return None
        if av.dtype != bv.dtype or np.dtype(av.dtype) not in DOT_DTYPES:
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
        sub = group.part([n.id for n in group.nodes if n.id != dot.id])
        if {a, b} & set(sub.inputs):
            return None  # an operand of the dot also read by the epilogue
        sub = fold_gathers(sub)
        hoisted = hoist_monotone(sub)
        n = len(S)
        for epilogue in [hoisted, sub] if hoisted is not sub else [sub]:  # the rewrite first; as written where it fails
            for axis in [n - 1] + list(range(n - 2, -1, -1)):
                try:
                    return _spec(group, epilogue, dot, a, b, S, axis, K, N, a_km, b_nk)
                except NoMatch:
                    continue
        return None

    def facts(self, group: Group, spec: MatmulReduceSpec) -> dict:
        """What search_spaces/matmul_reduce[.<backend>].toml's constraints read."""
        itemsize = np.dtype(group.graph.avals[spec.a].dtype).itemsize
        return {"M": spec.M, "N": spec.N, "K": spec.K, "L": spec.L, "over_n": int(spec.over_n), "itemsize": itemsize,
                "smem_bytes": H200.smem_bytes}

    def model_time_ms(self, spec: MatmulReduceSpec, config: dict, model: GPUModel = H200) -> float:
        """Roofline: the product's flops at a tile efficiency, the epilogue's elementwise work, operand traffic,
        and the share of SMs the programs can fill."""
        bm, bn, bk, split = (int(config[k]) for k in ("block_m", "block_n", "block_k", "split"))
        g = spec.group.graph
        low = np.dtype(g.avals[spec.a].dtype) != np.dtype("float32")
        n_m, n_n, n_l = cdiv(spec.M, bm), cdiv(spec.N, bn), cdiv(spec.L, bm)
        padded_m, padded_n = (n_m * bm if spec.over_n else spec.P * n_l * bm), n_n * bn
        flops = 2.0 * padded_m * padded_n * spec.K
        eff = min(1.0, (bm * bn) / (128 * 256)) ** 0.5 * min(1.0, bk / 64) ** 0.25
        if config.get("backend") == "mosaic_gpu":  # wgmma on two warpgroups: the Mosaic matmul's measured edge over Triton's
            eff *= 1.15
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
    if name in PASS_THROUGH:
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
        if name == "eq" and not additive:
            found = _count_of_extreme(x, spec, prod, vlevel)
            if found is not None:
                return [("eq", found, 1)]
        if name == "select_n" and vlevel.get(x[0], -1) < 0:
            cases = [t(c) for c in x[1:] if not _is_zero(c, prod)]
            if all(c == cases[0] for c in cases):
                return cases[0] if cases else []
    raise NoMatch(f"cannot rescale through {name}")


def _count_of_extreme(x, spec: MatmulReduceSpec, prod: dict, vlevel: dict) -> int | None:
    """For `eq(y, c)` (either order), the value c when it is the running max or min of y itself (a max's location
    indicator: `jax.grad` of `max` counts the positions that reach it), else None. When c moves, every earlier
    y was at most the old c, so none equals the new one: the running count is kept while c stays and is reset
    to 0 when it moves (`rescale_factor`'s "eq")."""
    for y, c in ((x[0], x[1]), (x[1], x[0])):
        if not (isinstance(y, int) and isinstance(c, int)) or vlevel.get(y, -1) >= 0 or not spec.loop(y) or spec.loop(c):
            continue
        nd = prod.get(c)
        while nd is not None and nd.name in ("reshape", "broadcast_in_dim", "squeeze", "expand_dims"):
            nd = prod.get(nd.inputs[0])
        if nd is not None and nd.name in ("reduce_max", "reduce_min") and nd.inputs[0] == y:
            return c
    return None


def _is_zero(atom, prod: dict) -> bool:
    if isinstance(atom, Lit):
        return bool(np.all(np.asarray(atom.value) == 0))
    nd = prod.get(atom)
    return nd is not None and nd.name in ("broadcast_in_dim", "convert_element_type") and _is_zero(nd.inputs[0], prod)


def rescale_factor(terms: list, old: dict, new: dict):
    """The factor by which a rescalable sum changes from the `old` to the `new` values of its terms."""
    expo, ratio = None, None
    for kind, v, sign in terms:
        o, n_ = old[v].astype(jnp.float32), new[v].astype(jnp.float32)
        if kind == "exp":
            d = (n_ - o) if sign > 0 else (o - n_)
            expo = d if expo is None else expo + d
        elif kind == "eq":  # a count of the positions at a running extreme: reset when the extreme moves
            r = (n_ == o).astype(jnp.float32)
            ratio = r if ratio is None else ratio * r
        else:
            r = (n_ / o) if sign > 0 else (o / n_)
            ratio = r if ratio is None else ratio * r
    f = jnp.exp(expo) if expo is not None else None
    return ratio if f is None else f if ratio is None else f * ratio


def merge_ranges(spec: MatmulReduceSpec, parts: list, inputs: dict) -> list:
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
                    f = jnp.reshape(rescale_factor(spec.scale[nd.id], ranges[i], now), (-1,))
                    total = total + jnp.where(p[i] == 0, 0.0, p[i] * f)
                merged[nd.outputs[0]] = total
    env = state(merged)
    return [jnp.reshape(env[v], g.avals[v].shape) for v in spec.group.outputs]


TEMPLATE = MatmulReduceTemplate()
match, default_config, space, model_time_ms, build = (TEMPLATE.match, TEMPLATE.default_config, TEMPLATE.space,
                                                      TEMPLATE.model_time_ms, TEMPLATE.build)
