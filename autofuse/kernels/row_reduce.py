"""Template `row_reduce`: reductions over the trailing axes with elementwise work around them.

Softmax (max, exp, sum, divide), layer and RMS norm, logsumexp: one program
per block of rows. A row that fits one column block is reduced in registers
in one pass; a longer row is reduced with in-kernel loops over column blocks
(one loop per reduction depth, then one that writes).
"""
from __future__ import annotations

from typing import Callable

from ..graph import Group
from ..ops import OpClass, op_class
from .tiling import NoMatch, TileSpec, analyze, build_template, next_pow2, template_space

NAME = "row_reduce"
PARAMS = ("block_rows", "block_cols", "num_warps", "num_stages")
MAX_BLOCK_COLS = 8192


def match(group: Group) -> TileSpec | None:
    """A tiling of the group around its column reductions, or None."""
    nodes = group.nodes
    if any(op_class(n.name) in (OpClass.CONTRACTION, OpClass.OPAQUE) for n in nodes):
        return None
    reds = [n for n in nodes if op_class(n.name) is OpClass.REDUCTION]
    if not reds:
        return None
    g = group.graph
    S = g.avals[reds[0].inputs[0]].shape
    if not S or min(S) == 0:
        return None
    axes = reds[0].params["axes"]
    split = min(axes)
    if sorted(axes) != list(range(split, len(S))):
        return None
    try:
        return analyze(group, S, split)
    except NoMatch:
        return None


def default_config(spec: TileSpec) -> dict:
    bn = min(next_pow2(spec.C), MAX_BLOCK_COLS)
    bm = max(1, min(next_pow2(spec.R), 4096 // bn))
    warps = 4 if bm * bn <= 2048 else 8 if bm * bn <= 8192 else 16
    return {"block_rows": bm, "block_cols": bn, "num_warps": warps, "num_stages": 1}


def space(group: Group, spec: TileSpec | None = None) -> dict:
    """Tunable parameters (search_spaces/row_reduce.yaml), the default config and the constraint facts."""
    spec = spec or match(group)
    return template_space(NAME, spec, default_config(spec))


def build(group: Group, config: dict, *, interpret: bool = False, spec: TileSpec | None = None) -> Callable:
    return build_template(NAME, PARAMS, spec or match(group), group, config, interpret=interpret, two_d_grid=False)
