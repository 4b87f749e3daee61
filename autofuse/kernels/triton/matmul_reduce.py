"""Triton lowering of `matmul_reduce`: each program loops over the reduced axis, one [block_m, block_n] product
tile per step (`dot_tile`), evaluates the epilogue on it and folds it into running reductions (rescaling dependent
sums online); with `split` > 1 the ranges of N are merged outside (`merge_ranges`)."""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ... import ops
from ...graph import Group
from ..matmul_reduce import MatmulReduceSpec, merge_ranges, rescale_factor
from ..template import NoMatch
from ..tile_eval import TileEval, edge_mask, product_tile
from ..tiling import cdiv, next_pow2
from .matmul import dot_tile
from .tiles import bool_as_int8, kernel_name, load_tile, pallas_call



PARAMS = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "split")


def default_config(spec: MatmulReduceSpec) -> dict:
    """Large tiles where the shapes allow (the best of a few configs timed on the H200, results/matmul_reduce_h200.md);
    over N, enough ranges of N that the programs fill the SMs."""
    if not spec.over_n:
        bm = min(256, max(16, next_pow2(spec.L)))
        return {"block_m": bm, "block_n": 128, "block_k": 64, "num_warps": 8 if bm >= 128 else 4, "num_stages": 3, "split": 1}
    bm = 128 if spec.M >= 4096 else 64
    bn = 256 if spec.N >= 4096 and bm == 128 else 128
    n_m, n_n = cdiv(spec.M, bm), cdiv(spec.N, bn)
    split = 1
    while n_m * split * 2 <= 132 and split < 8 and split * 2 <= n_n:
        split *= 2
    return {"block_m": bm, "block_n": bn, "block_k": 32 if spec.K < 64 else 64, "num_warps": 8 if bm == 128 else 4,
            "num_stages": 3, "split": split}


def lower(group: Group, spec: MatmulReduceSpec, config: dict, *, interpret: bool) -> Callable:
    bm, bn, bk, split = (int(config[k]) for k in ("block_m", "block_n", "block_k", "split"))
    if split > 1 and not spec.over_n:
        raise NoMatch("split applies to reductions over N only")
    g = spec.tile.group.graph  # the group's graph, with gathers folded into one-hot sums
    body = TileEval(spec.tile, bm, bn)
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
    n_m, n_n, n_l = cdiv(M, bm), cdiv(N, bn), cdiv(L, bm)
    per = cdiv(n_n, split)
    carry_shape = (bm, 1) if spec.over_n else (1, bn)
    red_axis = 1 if spec.over_n else 0
    outs_final = list(group.outputs) if split == 1 else []

    def place(v, r0, p, c0, row_ok, col_ok):
        """Value v's tile in its 2-D layout: (index, tile shape, edge mask)."""
        rows, cols = spec.layout[v]
        shape = (bm if rows == "M" else 1, bn if cols else 1)
        idx = (pl.ds(r0, bm) if rows == "M" else pl.ds(p, 1) if rows == "P" else pl.ds(0, 1), pl.ds(c0, bn) if cols else pl.ds(0, 1))
        return idx, shape, edge_mask(shape, row_ok if rows == "M" else None, col_ok if cols else None)

    def load(ref, v, *at):
        idx, _, mask = place(v, *at)
        x = load_tile(ref.at[idx], mask)
        if g.avals[v].dtype == np.bool_:  # passed as int8 (`bool_as_int8`)
            return x != 0
        return x.astype(ops.compute_dtype(x.dtype))

    def store(ref, v, x, *at):
        idx, shape, mask = place(v, *at)
        plgpu.store(ref.at[idx], jnp.broadcast_to(x, shape).astype(g.avals[v].dtype), mask=mask)

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
            local[out_v] = product_tile(dot_tile(ins[spec.a], ins[spec.b], r0, c0, r_ok, c_ok, bm=bm, bn=bn, bk=bk, K=spec.K,
                                                 a_km=spec.a_km, b_nk=spec.b_nk), spec)
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
                        f = jnp.broadcast_to(rescale_factor(spec.scale[nd.id], old, local), carry_shape)
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
    call = pallas_call(kernel, out_shape=out_shape, grid=(n_m, split) if spec.over_n and split > 1 else (n_m,) if spec.over_n else (P, n_n),
                       name=kernel_name("matmul_reduce", group), interpret=interpret, num_warps=int(config["num_warps"]),
                       num_stages=int(config["num_stages"]))

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
                args.append(jnp.reshape(bool_as_int8(x), spec.layout2d(v)))
        res = call(*args)
        if split > 1:
            return merge_ranges(spec, [jnp.reshape(r, (split, M)) for r in res], env)
        return [jnp.reshape(o, g.avals[v].shape) for v, o in zip(group.outputs, res)]

    return run
