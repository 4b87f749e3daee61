"""Triton lowering of `elementwise`: one program per [block_rows, block_cols] tile on a 2-D grid."""
from __future__ import annotations

from typing import Callable

from jax.experimental import pallas as pl

from ...graph import Group
from ..tiling import TileSpec, cdiv, next_pow2
from .tiles import TileBody, group_refs, kernel_name, single_pass, tile_call



PARAMS = ("block_rows", "block_cols", "num_warps", "num_stages", "col_major")


def default_config(spec: TileSpec) -> dict:
    bn = min(max(32, next_pow2(spec.C)), 1024)  # the space's narrowest block (masked past C) for a few columns
    bm = max(1, min(next_pow2(spec.R), 2048 // bn))
    return {"block_rows": bm, "block_cols": bn, "num_warps": min(4, bm * bn // 32), "num_stages": 1, "col_major": 0}


def lower(group: Group, spec: TileSpec, config: dict, *, interpret: bool) -> Callable:
    bm, bn, col_major = int(config["block_rows"]), int(config["block_cols"]), int(config["col_major"])
    body = TileBody(spec, bm, bn)
    rows_axis, cols_axis = (1, 0) if col_major else (0, 1)  # col_major walks the column blocks of a row block first

    def kernel(*refs):
        in_refs, out_refs = group_refs(group, refs)
        single_pass(body, in_refs, out_refs, pl.program_id(rows_axis) * bm, pl.program_id(cols_axis) * bn)

    grid = (cdiv(spec.R, bm), cdiv(spec.C, bn))
    return tile_call(spec, kernel, grid=grid[::-1] if col_major else grid, name=kernel_name("elementwise", group),
                     interpret=interpret, num_warps=int(config["num_warps"]), num_stages=int(config["num_stages"]))
