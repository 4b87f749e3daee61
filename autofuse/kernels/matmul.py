"""Template `matmul`: a 2-D `dot_general` with its elementwise epilogue, in one kernel.

Each program computes one [block_m, block_n] output tile: a loop over K in
block_k steps accumulates in float32 (`jnp.dot`, so bf16/f16 operands use the
tensor cores and float32 runs at the default TF32 precision, as XLA's own
float32 matmul does), then the group's epilogue (bias, scale, residual,
activations: whatever elementwise work the jaxpr applies to the product) is
evaluated on the accumulator tile by the same tile evaluator as the other
templates, and only the epilogue's results are written. Operands may come in
either layout the jaxpr gives ([M, K] or [K, M]; [K, N] or [N, K]). Programs
walk the output tiles in groups of `group_m` row blocks for L2 reuse. A
batched dot (one leading batch dimension on both operands, as
`einsum('bij,bjk->bik')` gives) runs its batch entries on a second grid axis;
an A of shape [..., K] (h @ W with h [B, S, D]) is a matrix of its flattened rows.
A prologue (elementwise work on an operand before the dot: a scale, a cast)
runs on each operand tile as it is loaded. `precision=HIGHEST` stays in XLA.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .. import costmodel
from ..graph import Group, Node
from ..ops import OpClass, op_class
from .tiling import NoMatch, Span, TileConfig, TileSpec, _Body, analyze, template_space

NAME = "matmul"
PARAMS = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "group_m")
_DTYPES = {np.dtype("float32"), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)}


@dataclass
class MatmulSpec:
    group: Group
    dot: Node
    a: int
    b: int
    M: int
    N: int
    K: int
    a_km: bool  # A is stored [K, M]
    b_nk: bool  # B is stored [N, K]
    epi: TileSpec  # the epilogue on [M, N] (batched: [batch, M, N]) tiles (its group excludes the dot)
    batch: int = 1  # batch entries (a leading batch dimension of both operands), 1 when not batched
    pro: dict = field(default_factory=dict)  # operand (a or b) -> (its prologue's nodes, their TileSpec on the operand's shape)


def match(group: Group) -> MatmulSpec | None:
    """A matmul spec when the group is one plain (2-D or batched) dot plus an elementwise epilogue of it."""
    g = group.graph
    dots = [n for n in group.nodes if op_class(n.name) is OpClass.CONTRACTION]
    if len(dots) != 1 or any(op_class(n.name) in (OpClass.REDUCTION, OpClass.OPAQUE, OpClass.SOURCE) for n in group.nodes):
        return None
    dot = dots[0]
    a, b = dot.inputs
    if not (isinstance(a, int) and isinstance(b, int)):
        return None
    (lc, rc), (lb, rb) = dot.params["dimension_numbers"]
    av, bv = g.avals[a], g.avals[b]
    nb = len(lb)
    if tuple(lb) != tuple(range(nb)) or tuple(rb) != tuple(range(nb)) or nb > 1 or len(lc) != 1 or len(rc) != 1:
        return None
    flat_a = nb == 0 and len(av.shape) > 2 and lc[0] == len(av.shape) - 1  # A [..., K]: its free axes are the rows
    if (len(av.shape) != 2 + nb and not flat_a) or len(bv.shape) != 2 + nb or av.shape[:nb] != bv.shape[:nb]:
        return None
    if not default_precision(dot):
        return None  # HIGHEST / HIGH precision: leave it to XLA
    if av.dtype != bv.dtype or np.dtype(av.dtype) not in _DTYPES:
        return None
    a_km, b_nk = lc[0] == nb, rc[0] == nb + 1
    M, K = (av.shape[nb + 1], av.shape[nb]) if a_km else (math.prod(av.shape[nb:-1]), av.shape[-1])
    N = bv.shape[nb] if b_nk else bv.shape[nb + 1]
    if min(M, N, K) < 16:
        return None
    batch = av.shape[0] if nb else 1
    try:
        pro = {v: _prologue(group, dot, v) for v in (a, b) if v not in group.inputs}
        if pro and nb:
            raise NoMatch("a prologue on a batched dot")
        in_pro = {nd.id for nodes, _ in pro.values() for nd in nodes}
        rest = [n.id for n in group.nodes if n.id != dot.id and n.id not in in_pro]
        epi = _epilogue_spec(group, dot, rest, g.avals[dot.outputs[0]].shape)
        for v in set(group.inputs) - {a, b}:  # an input read by two parts must have one 2-D layout
            shapes = {sp.layout2d(v) for sp in [epi] + [t for _, t in pro.values()] if v in sp.group.inputs}
            if len(shapes) > 1:
                raise NoMatch(f"input %{v} is read with two layouts")
    except NoMatch:
        return None
    return MatmulSpec(group, dot, a, b, M, N, K, a_km, b_nk, epi, batch, pro)


def _prologue(group: Group, dot: Node, operand: int) -> tuple[list[Node], TileSpec]:
    """The elementwise work inside the group that produces a dot operand, tiled on the operand's shape."""
    g = group.graph
    members = set(group.node_ids)
    ids, todo = set(), [operand]
    while todo:
        nid = g.producer.get(todo.pop())
        if nid is None or nid not in members or nid in ids:
            continue
        ids.add(nid)
        todo.extend(x for x in g.node_index[nid].inputs if isinstance(x, int))
    nodes = [nd for nd in group.nodes if nd.id in ids]
    if any(op_class(nd.name) not in (OpClass.ELEMENTWISE, OpClass.BROADCAST, OpClass.LAYOUT) for nd in nodes):
        raise NoMatch("a prologue does more than elementwise work")
    sub = Group.of(g, [nd.id for nd in nodes])
    if list(sub.outputs) != [operand] or any(c != dot.id for c in g.consumers.get(operand, ())):
        raise NoMatch("a prologue value is also used elsewhere")
    shape = g.avals[operand].shape
    return nodes, analyze(sub, shape, len(shape) - 1)


def default_precision(dot: Node) -> bool:
    """Whether the dot runs at default precision (what a Triton dot does: TF32 for float32, as XLA's own)."""
    prec = dot.params.get("precision")
    return prec is None or all(p is None or "DEFAULT" in str(p) for p in (prec if isinstance(prec, tuple) else (prec,)))


def _epilogue_spec(group: Group, dot: Node, rest: list[int], S: tuple[int, ...]) -> TileSpec:
    """The epilogue tiled with rows = all but the last axis of the product (batch entries stacked), columns = N."""
    out, n = dot.outputs[0], len(S)
    sub = Group.of(group.graph, rest) if rest else None
    if sub is None:
        return TileSpec(Group.of(group.graph, [dot.id]), S, n - 1, {out: tuple(range(n))}, {out: Span(True, True)}, [])
    if {dot.inputs[0], dot.inputs[1]} & set(sub.inputs):
        raise NoMatch("an operand of the dot is also read by the epilogue")
    spec = analyze(sub, S, n - 1)
    if spec.reductions:
        raise NoMatch("reductions belong to matmul_reduce")
    spec.axes[out], spec.span[out] = tuple(range(n)), Span(True, True)
    return spec


def default_config(spec: MatmulSpec) -> dict:
    small = min(spec.M, spec.N) < 128
    return {"block_m": 64 if small else 128, "block_n": 64 if small else 128, "block_k": 32 if spec.K < 64 else 64,
            "num_warps": 4 if small else 8, "num_stages": 3, "group_m": 8}


def space(group: Group, spec: MatmulSpec | None = None) -> dict:
    """Tunable parameters (search_spaces/matmul.yaml), the default config and the constraint facts."""
    spec = spec or match(group)
    out = template_space(NAME, spec.epi, default_config(spec))
    itemsize = np.dtype(group.graph.avals[spec.a].dtype).itemsize
    out["facts"] = {"M": spec.M, "N": spec.N, "K": spec.K, "itemsize": itemsize, "smem_bytes": out["facts"]["smem_bytes"]}
    return out


def model_time_ms(spec: MatmulSpec, config: dict, model: costmodel.GPUModel = costmodel.H200) -> float:
    """Roofline with a tile-efficiency factor: small tiles reuse operands less and issue smaller MMAs."""
    bm, bn, bk = int(config["block_m"]), int(config["block_n"]), int(config["block_k"])
    low = np.dtype(spec.group.graph.avals[spec.a].dtype) != np.dtype("float32")
    flops = 2.0 * spec.batch * spec.M * spec.N * spec.K
    eff = min(1.0, (bm * bn) / (128 * 256)) ** 0.5 * min(1.0, bk / 64) ** 0.25
    tiles_m, tiles_n = spec.batch * -(-spec.M // bm), -(-spec.N // bn)
    a_bytes = spec.batch * spec.M * spec.K * np.dtype(spec.group.graph.avals[spec.a].dtype).itemsize
    bytes_moved = a_bytes * tiles_n / max(1, int(config["group_m"])) ** 0.5 + sum(a.nbytes for a in spec.group.output_avals())
    return costmodel.kernel_time_ms(bytes_moved, flops / max(eff, 0.05), model, low) * max(1.0, 132 / max(1, tiles_m * tiles_n)) ** 0.5


def build(group: Group, config: dict, *, interpret: bool = False, spec: MatmulSpec | None = None) -> Callable:
    spec = spec or match(group)
    if spec is None:
        raise NoMatch("matmul does not match this group")
    bm, bn, bk = (int(config[k]) for k in ("block_m", "block_n", "block_k"))
    gm = int(config["group_m"])
    g = group.graph
    cfg = TileConfig(bm, bn, int(config["num_warps"]), int(config["num_stages"]))
    body = _BatchBody(spec.epi, cfg, spec.M)
    out_v = spec.dot.outputs[0]
    in_pro = {nd.id for nodes, _ in spec.pro.values() for nd in nodes}
    epi_nodes = [n for n in group.nodes if n.id != spec.dot.id and n.id not in in_pro]
    epi_inputs = [v for v in spec.epi.group.inputs if v != out_v] if epi_nodes else []
    n_m, n_n = -(-spec.M // bm), -(-spec.N // bn)
    in_order = list(group.inputs)

    def kernel(*refs):
        ins = dict(zip(in_order, refs[: len(in_order)]))
        outs = dict(zip(group.outputs, refs[len(in_order):]))
        pid = pl.program_id(0)
        per_group = gm * n_n
        first_m = (pid // per_group) * gm
        size_m = jnp.minimum(n_m - first_m, gm)
        pid_m = first_m + (pid % per_group) % size_m
        pid_n = (pid % per_group) // size_m
        r0, c0 = pid_m * bm, pid_n * bn
        rows = r0 + jax.lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
        cols = c0 + jax.lax.broadcasted_iota(jnp.int32, (1, bn), 1)
        bi = pl.program_id(1) if spec.batch > 1 else 0
        a_off = bi * (spec.K if spec.a_km else spec.M)  # the batch entry's first row of the stacked operands
        b_off = bi * (spec.N if spec.b_nk else spec.K)

        m_ok = rows < spec.M if spec.M % bm else None  # masks only where a block runs past the edge
        n_ok = cols < spec.N if spec.N % bn else None
        tiles = {}
        for v, (nodes, pspec) in spec.pro.items():
            # the operand's tile in memory order: [rows, K] / [K, rows] for A, [K, N] / [N, K] for B
            major_is_k = spec.a_km if v == spec.a else not spec.b_nk
            other0, other_n = (r0, bm) if v == spec.a else (c0, bn)
            tiles[v] = _prologue_tile(ins, nodes, pspec, v, v == spec.a, major_is_k, other0, other_n, bk, spec.K, g.avals[v].dtype, cfg)
        acc = dot_tile(ins.get(spec.a), ins.get(spec.b), r0, c0, m_ok, n_ok, bm=bm, bn=bn, bk=bk, K=spec.K, a_km=spec.a_km, b_nk=spec.b_nk,
                       a_off=a_off, b_off=b_off, a_tile=tiles.get(spec.a), b_tile=tiles.get(spec.b))
        env = {out_v: acc}
        body.base = bi * spec.M
        rg = body.base + r0  # the tile's first row among all batch entries' rows
        for v in epi_inputs:
            env[v] = body.load(ins[v], v, rg, c0)
        colmask = body.mask(Span(False, True), rg, c0)
        for nd in epi_nodes:
            body.eval_node(nd, env, rg, c0, colmask)
        for v in group.outputs:
            body.store(outs[v], v, env[v], rg, c0)

    out_shape = [jax.ShapeDtypeStruct(spec.epi.layout2d(v), g.avals[v].dtype) for v in group.outputs]
    call = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(n_m * n_n, spec.batch) if spec.batch > 1 else (n_m * n_n,),
        interpret=interpret,
        name=f"autofuse_matmul_{group.signature[:8]}",
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
    )

    def run(*xs):
        env = dict(zip(group.inputs, xs))
        layouts = [spec.epi] + [t for _, t in spec.pro.values()]
        args = [_stacked(env[v]) if v in (spec.a, spec.b) else
                jnp.reshape(env[v], next(sp.layout2d(v) for sp in layouts if v in sp.group.inputs)) for v in in_order]
        res = call(*args)
        return [jnp.reshape(o, g.avals[v].shape) for v, o in zip(group.outputs, res)]

    return run


def dot_tile(a_ref, b_ref, r0, c0, row_ok, col_ok, *, bm: int, bn: int, bk: int, K: int, a_km: bool, b_nk: bool, a_off=0, b_off=0,
             a_tile: Callable | None = None, b_tile: Callable | None = None):
    """The float32 [bm, bn] product tile at rows r0.., columns c0..: a loop over K in bk steps.

    `row_ok` ([bm, 1]) / `col_ok` ([1, bn]) mask rows / columns past the edge (None: no mask needed).
    `a_off` / `b_off` offset the leading index of each operand (a batch entry of stacked operands).
    `a_tile(k0)` / `b_tile(k0)`, when given, make an operand's tile ([bm, bk] / [bk, bn]) instead of loading it (a prologue).
    """
    def step(kk, acc):
        k0 = kk * bk
        ks_r = k0 + jax.lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
        ks_c = k0 + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)
        kr_ok, kc_ok = (ks_r < K, ks_c < K) if K % bk else (None, None)
        if a_tile is not None:
            a = a_tile(k0)
        elif a_km:
            a = _load(a_ref.at[pl.ds(a_off + k0, bk), pl.ds(r0, bm)], kr_ok, None if row_ok is None else row_ok.T, (bk, bm)).T
        else:
            a = _load(a_ref.at[pl.ds(a_off + r0, bm), pl.ds(k0, bk)], row_ok, kc_ok, (bm, bk))
        if b_tile is not None:
            b = b_tile(k0)
        elif b_nk:
            b = _load(b_ref.at[pl.ds(b_off + c0, bn), pl.ds(k0, bk)], None if col_ok is None else col_ok.T, kc_ok, (bn, bk)).T
        else:
            b = _load(b_ref.at[pl.ds(b_off + k0, bk), pl.ds(c0, bn)], kr_ok, col_ok, (bk, bn))
        return acc + jnp.dot(a, b, preferred_element_type=jnp.float32)

    return jax.lax.fori_loop(0, -(-K // bk), step, jnp.zeros((bm, bn), jnp.float32))


def _prologue_tile(ins: dict, nodes: list, pspec: TileSpec, operand: int, is_a: bool, major_is_k: bool, other0, other_n: int, bk: int,
                   K: int, dtype, cfg: TileConfig) -> Callable:
    """A function of k0 that loads the prologue's inputs, runs its work and returns the operand tile in dot orientation
    (zero where k runs past K, so nothing the prologue computes there reaches the product)."""
    rows, cols = (bk, other_n) if major_is_k else (other_n, bk)
    body = _Body(pspec, TileConfig(rows, cols, cfg.num_warps, cfg.num_stages), 0)

    def tile(k0):
        r0, c0 = (k0, other0) if major_is_k else (other0, k0)
        env = {v: body.load(ins[v], v, r0, c0) for v in pspec.group.inputs}
        for nd in nodes:
            body.eval_node(nd, env, r0, c0)
        x = jnp.broadcast_to(env[operand], (rows, cols))
        if K % bk:
            kk = body.row_idx(r0) if major_is_k else body.col_idx(c0)
            x = jnp.where(kk < K, x, 0)
        x = x.astype(dtype)
        return x.T if major_is_k == is_a else x  # the dot takes A as [bm, bk] and B as [bk, bn]

    return tile


def _stacked(x):
    """A batched operand [batch, p, q] as [batch * p, q] (batch entries one after another); 2-D ones as they are."""
    return x if x.ndim == 2 else jnp.reshape(x, (-1, x.shape[-1]))


class _BatchBody(_Body):
    """The epilogue of one batch entry: its rows are [base, base + rows) of the stacked rows, masked by that range."""

    def __init__(self, spec: TileSpec, cfg: TileConfig, rows: int):
        super().__init__(spec, cfg, 0)
        self.rows, self.base = rows, 0

    def mask(self, span: Span, r0, c0):
        m = None
        if span.rows and self.rows % self.bm:
            m = self.row_idx(r0) - self.base < self.rows
        if span.cols and self.spec.C % self.bn:
            cm = self.col_idx(c0) < self.spec.C
            m = cm if m is None else m & cm
        return None if m is None else jnp.broadcast_to(m, self.tile_shape(span))


def _load(ref, row_ok, col_ok, shape):
    """A masked tile load (no mask where neither side runs past the edge)."""
    masks = [m for m in (row_ok, col_ok) if m is not None]
    if not masks:
        return plgpu.load(ref)
    mask = masks[0] if len(masks) == 1 else masks[0] & masks[1]
    return plgpu.load(ref, mask=jnp.broadcast_to(mask, shape), other=0)
