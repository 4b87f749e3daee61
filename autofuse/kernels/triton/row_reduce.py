"""Triton lowering of `row_reduce`: one program per block of rows.

A row that fits one column block is reduced in registers in one pass; a longer
row is reduced with in-kernel loops over column blocks (`_staged`).
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ... import ops
from ...graph import Group
from ..tiling import Span, TileSpec, cdiv, depends_on, needed, next_pow2
from .tiles import TileBody, group_refs, kernel_name, single_pass, tile_call, walk_rows


PARAMS = ("block_rows", "block_cols", "num_warps", "num_stages", "row_steps")
MAX_BLOCK_COLS = 8192
PROGRAMS_WITH_SUMS = 512  # a norm's backward: about this many programs (~4 an H200 SM), each walking its row blocks
# (results/norm_backward_h200.md: GPT-2's layer norm backward 0.078 -> 0.063 ms at 512 programs, 0.067 at 1024)
WALKED_BLOCK = 1024  # elements of a block that such a program walks (`default_config`)


def row_steps_of(config: dict) -> int:
    """The row blocks each program walks (1 where the config predates `row_steps`)."""
    return int(config.get("row_steps", 1))


def walks_rows(spec: TileSpec, block_cols: int) -> bool:
    """Whether programs may walk several row blocks (`walk_rows`): where column sums are what it saves, on rows that
    fit one column block, with no inner rows."""
    return bool(spec.col_sums) and not spec.inner and block_cols >= spec.C


def check_config(spec: TileSpec, config: dict) -> None:
    if row_steps_of(config) > 1 and not walks_rows(spec, int(config["block_cols"])):
        raise NotImplementedError("row_steps > 1 needs column sums and rows that fit one column block")


def default_config(spec: TileSpec) -> dict:
    """Blocks of about 4096 elements; where programs walk row blocks for their column sums, blocks of about
    `WALKED_BLOCK` elements (one row from 1024 columns up) in up to 8 warps, walked until about `PROGRAMS_WITH_SUMS`
    programs remain. Why: on an H200 (results/row_reduce_sums_h200.md, device-timed) GPT-2's step's norm backward
    groups with 1-4 column sums (1024 wide) ran 0.060-0.083 ms at 1 row x 32 steps in 8 warps against 0.075-0.136 at 4
    rows x 8 steps (the same 512 programs; XLA 0.092-0.125), and Llama's RMS norm's (2048 wide) as fast or 8% faster at
    1 x 16 than at 2 x 8; 64 steps (256 programs) lost everywhere. Narrower rows keep ~1024 elements a block (not
    measured: one row of 64 would make 64 times the programs and partials)."""
    bn = min(max(32, next_pow2(spec.C)), MAX_BLOCK_COLS)  # the space's narrowest block (masked past C) for a few columns
    bm = max(1, min(next_pow2(spec.R), 4096 // bn))
    warps = min(4 if bm * bn <= 2048 else 8 if bm * bn <= 8192 else 16, bm * bn // 32)  # a thread per element at least
    steps = 1
    if walks_rows(spec, bn):  # fewer partials of the column sums to write and add
        bm = max(1, min(next_pow2(spec.R), WALKED_BLOCK // bn))
        warps = max(1, min(8, bm * bn // 32))
        steps = min(32, next_pow2(max(1, cdiv(cdiv(spec.R, bm), PROGRAMS_WITH_SUMS))))
    return {"block_rows": bm, "block_cols": bn, "num_warps": warps, "num_stages": 1, "row_steps": steps}


def lower(group: Group, spec: TileSpec, config: dict, *, interpret: bool) -> Callable:
    if spec.inner:
        return _lower_inner(group, spec, config, interpret=interpret)
    bm, bn, steps = int(config["block_rows"]), int(config["block_cols"]), row_steps_of(config)
    check_config(spec, config)
    body = TileBody(spec, bm, bn, steps)
    nchunks = cdiv(spec.C, bn)

    def kernel(*refs):
        in_refs, out_refs = group_refs(group, refs)
        if steps > 1:
            walk_rows(body, in_refs, out_refs, pl.program_id(0), steps)
        elif nchunks == 1:
            single_pass(body, in_refs, out_refs, pl.program_id(0) * bm, 0)
        else:
            _staged(body, in_refs, out_refs, pl.program_id(0) * bm, nchunks)

    return tile_call(spec, kernel, grid=(cdiv(spec.R, bm * steps),), name=kernel_name("row_reduce", group), interpret=interpret,
                     num_warps=int(config["num_warps"]), num_stages=int(config["num_stages"]))


def _lower_inner(group: Group, spec: TileSpec, config: dict, *, interpret: bool) -> Callable:
    """Reductions over the inner rows (`TileSpec.inner`): one program per outer index and block of columns, its
    tile holding the inner rows whole (their count rounded up to a power of two, `block_rows` not used)."""
    bm, bn = next_pow2(spec.inner), int(config["block_cols"])
    body = TileBody(spec, bm, bn)

    def kernel(*refs):
        in_refs, out_refs = group_refs(group, refs)
        single_pass(body, in_refs, out_refs, pl.program_id(0) * spec.inner, pl.program_id(1) * bn)

    return tile_call(spec, kernel, grid=(spec.R // spec.inner, cdiv(spec.C, bn)), name=kernel_name("row_reduce", group),
                     interpret=interpret, num_warps=int(config["num_warps"]), num_stages=int(config["num_stages"]))


def _staged(body: TileBody, in_refs: dict, out_refs: dict, r0, nchunks: int) -> None:
    """Rows longer than one block: one loop over column blocks per reduction depth, then one to write."""
    spec = body.spec
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
        sl = needed([nd for nd in nodes if nd.id not in done], targets, stop)
        need_in = {a for nd in sl for a in nd.inputs if isinstance(a, int)} | targets
        loads = [v for v in col_inputs if v in need_in]

        def step(c, carry):
            c0 = c * bn
            local = dict(env)
            local.update({v: body.load(in_refs[v], v, r0, c0) for v in loads})
            colmask = body.mask(Span(False, True), r0, c0)
            for nd in sl:
                if nd.id in spec.reductions or nd.id in spec.col_sum_nodes:
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
        this = [rid for rid in pending if not depends_on(group, rid, {p for p in pending if p != rid})]
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
                if v in spec.col_sums:
                    body.store_col_sum(out_refs[v], v, local, r0, c0)
                else:
                    body.store(out_refs[v], v, local[v], r0, c0)
            return carry

        col_loop(set(col_outs), write, 0)
    for v in group.outputs:
        if not span[v].cols:
            body.store(out_refs[v], v, env[v], r0, 0)
