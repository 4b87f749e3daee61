"""Triton lowering of `matmul`: one program per output tile (walked in groups of `group_m` row blocks), a K loop
of `jnp.dot` into a float32 accumulator (`dot_tile`), then the epilogue on the accumulator tile."""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ...graph import Group
from ..matmul import MatmulSpec
from ..tile_eval import add_partials, edge_mask, partials_struct, product_tile
from ..tiling import Span, TileSpec, cdiv, next_pow2
from .tiles import TileBody, kernel_name, load_tile, pallas_call



PARAMS = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "group_m")


def default_config(spec: MatmulSpec) -> dict:
    """128x128x64 tiles, 64x64 where a side is short; no block longer than its dimension (the space's rule)."""
    small = min(spec.M, spec.N) < 128
    fit = lambda block, length: min(block, max(16, next_pow2(length)))  # noqa: E731
    bn = fit(64 if small else 128, spec.N)
    if spec.seg:  # a tile holds whole segments
        bn = max(bn, spec.seg) // spec.seg * spec.seg
    bm = fit(64 if small else 128, spec.M)
    while spec.outer_rows and spec.outer_rows % bm and bm > 16:  # a tile's rows within one outer index
        bm //= 2
    return {"block_m": bm, "block_n": bn, "block_k": fit(32 if spec.K < 64 else 64, spec.K),
            "num_warps": 4 if small else 8, "num_stages": 3, "group_m": 8}


def check_group(spec: MatmulSpec) -> None:
    """Raise NotImplementedError for what this lowering cannot run: a product split into parts along N (its tiles
    write one array per output; the Mosaic GPU lowering writes the parts), a dual GEMM (two accumulators at once
    are the Mosaic GPU lowering's)."""
    if spec.windows:
        raise NotImplementedError("a product split into parts along N (split): Mosaic GPU only")
    if spec.dot2 is not None:
        raise NotImplementedError("two dots of one A (a dual GEMM): Mosaic GPU only")


def lower(group: Group, spec: MatmulSpec, config: dict, *, interpret: bool) -> Callable:
    bm, bn, bk = (int(config[k]) for k in ("block_m", "block_n", "block_k"))
    gm = int(config["group_m"])
    if spec.seg and (bn % spec.seg or spec.seg & (spec.seg - 1)):
        raise NotImplementedError(f"block_n={bn} must be a multiple of the segment length {spec.seg}, a power of two")
    if any(inner % bm for inner in spec.epi.outer.values()):
        raise NotImplementedError(f"block_m={bm} must divide the rows per index of an input over the leading row axes "
                                  f"({sorted(set(spec.epi.outer.values()))})")
    if spec.epi.col_sums and spec.batch > 1:
        raise NotImplementedError("sums over the rows of a batched dot's epilogue")
    g = group.graph
    body = _BatchBody(spec.epi, bm, bn, spec.M)
    out_v = spec.dot.outputs[0]
    epi_nodes = spec.epi_nodes
    epi_inputs = [v for v in spec.epi.group.inputs if v != out_v] if epi_nodes else []
    n_m, n_n = cdiv(spec.M, bm), cdiv(spec.N, bn)
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
            tiles[v] = _prologue_tile(ins, nodes, pspec, v, v == spec.a, major_is_k, other0, other_n, bk, spec.K, g.avals[v].dtype)
        acc = dot_tile(ins.get(spec.a), ins.get(spec.b), r0, c0, m_ok, n_ok, bm=bm, bn=bn, bk=bk, K=spec.K, a_km=spec.a_km, b_nk=spec.b_nk,
                       a_off=a_off, b_off=b_off, a_tile=tiles.get(spec.a), b_tile=tiles.get(spec.b),
                       precision=dot_algorithm(spec, interpret))
        env = {out_v: body.view(product_tile(acc, spec), Span(True, True))}  # segmented columns: [bm, bn / seg, seg]
        body.base = bi * spec.M
        rg = body.base + r0  # the tile's first row among all batch entries' rows
        for v in epi_inputs:
            env[v] = body.load(ins[v], v, rg, c0)
        colmask = body.mask(Span(False, True), rg, c0)
        for nd in epi_nodes:
            if nd.id not in spec.epi.col_sum_nodes:
                body.eval_node(nd, env, rg, c0, colmask)
        for v in group.outputs:
            if v in spec.epi.col_sums:  # this tile's rows' partial sums (`tiling.TileSpec.col_sums`)
                body.store_col_sum(outs[v], v, env, rg, c0)
            else:
                body.store(outs[v], v, env[v], rg, c0)

    out_shape = [partials_struct(spec.epi, v, n_m) if v in spec.epi.col_sums else
                 jax.ShapeDtypeStruct(spec.epi.layout2d(v), g.avals[v].dtype) for v in group.outputs]
    call = pallas_call(kernel, out_shape=out_shape, grid=(n_m * n_n, spec.batch) if spec.batch > 1 else (n_m * n_n,),
                       name=kernel_name("matmul", group), interpret=interpret, num_warps=int(config["num_warps"]),
                       num_stages=int(config["num_stages"]))

    def run(*xs):
        env = dict(zip(group.inputs, xs))
        layouts = [spec.epi] + [t for _, t in spec.pro.values()]
        args = [_stacked(env[v]) if v in (spec.a, spec.b) else
                jnp.reshape(env[v], next(sp.layout2d(v) for sp in layouts if v in sp.group.inputs)) for v in in_order]
        res = call(*args)
        return [add_partials(spec.epi, v, o) if v in spec.epi.col_sums else jnp.reshape(o, g.avals[v].shape)
                for v, o in zip(group.outputs, res)]

    return run


def dot_algorithm(spec: MatmulSpec, interpret: bool):
    """The in-kernel dot's precision: three-pass TF32 for a float32 dot the program asks to be exact (on the CPU, in
    interpret mode, the exact float32 dot itself), else the default (TF32 for float32, as XLA's)."""
    if not spec.exact_f32:
        return None
    return jax.lax.Precision.HIGHEST if interpret else jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def dot_tile(a_ref, b_ref, r0, c0, row_ok, col_ok, *, bm: int, bn: int, bk: int, K: int, a_km: bool, b_nk: bool, a_off=0, b_off=0,
             a_tile: Callable | None = None, b_tile: Callable | None = None, precision=None):
    """The float32 [bm, bn] product tile at rows r0.., columns c0..: a loop over K in bk steps.

    `row_ok` ([bm, 1]) / `col_ok` ([1, bn]) mask rows / columns past the edge (None: no mask needed).
    `a_off` / `b_off` offset the leading index of each operand (a batch entry of stacked operands).
    `a_tile(k0)` / `b_tile(k0)`, when given, make an operand's tile ([bm, bk] / [bk, bn]) instead of loading it (a prologue).
    `precision`: the dot's (`dot_algorithm`); None is the default.
    """
    def step(kk, acc):
        k0 = kk * bk
        ks_r = k0 + jax.lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
        ks_c = k0 + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)
        kr_ok, kc_ok = (ks_r < K, ks_c < K) if K % bk else (None, None)
        if a_tile is not None:
            a = a_tile(k0)
        elif a_km:
            a = load_tile(a_ref.at[pl.ds(a_off + k0, bk), pl.ds(r0, bm)], edge_mask((bk, bm), kr_ok, None if row_ok is None else row_ok.T)).T
        else:
            a = load_tile(a_ref.at[pl.ds(a_off + r0, bm), pl.ds(k0, bk)], edge_mask((bm, bk), row_ok, kc_ok))
        if b_tile is not None:
            b = b_tile(k0)
        elif b_nk:
            b = load_tile(b_ref.at[pl.ds(b_off + c0, bn), pl.ds(k0, bk)], edge_mask((bn, bk), None if col_ok is None else col_ok.T, kc_ok)).T
        else:
            b = load_tile(b_ref.at[pl.ds(b_off + k0, bk), pl.ds(c0, bn)], edge_mask((bk, bn), kr_ok, col_ok))
        return acc + jnp.dot(a, b, precision=precision, preferred_element_type=jnp.float32)

    return jax.lax.fori_loop(0, cdiv(K, bk), step, jnp.zeros((bm, bn), jnp.float32))


def _prologue_tile(ins: dict, nodes: list, pspec: TileSpec, operand: int, is_a: bool, major_is_k: bool, other0, other_n: int, bk: int,
                   K: int, dtype) -> Callable:
    """A function of k0 that loads the prologue's inputs, runs its work and returns the operand tile in dot orientation
    (zero where k runs past K, so nothing the prologue computes there reaches the product)."""
    rows, cols = (bk, other_n) if major_is_k else (other_n, bk)
    body = TileBody(pspec, rows, cols)

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


class _BatchBody(TileBody):
    """The epilogue of one batch entry: its rows are [base, base + rows) of the stacked rows, masked by that range."""

    def __init__(self, spec: TileSpec, bm: int, bn: int, rows: int):
        super().__init__(spec, bm, bn)
        self.rows, self.base = rows, 0

    def mask(self, span: Span, r0, c0):
        rows = self.row_idx(r0) - self.base < self.rows if span.rows and self.rows % self.bm else None
        cols = self.col_idx(c0) < self.spec.C if span.cols and self.spec.C % self.bn else None
        return edge_mask(self.tile_shape(span), rows, cols)
