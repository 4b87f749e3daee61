"""Template `elementwise`: elementwise work and broadcasts over a 2-D grid of tiles.

All outputs share one shape S; inputs may be full, row or column vectors, or
scalars. Multi-output groups are fine.
"""
from __future__ import annotations

from typing import Callable

from ..graph import Group
from ..ops import OpClass, op_class
from .tiling import NoMatch, TileSpec, analyze, build_template, next_pow2, template_space

NAME = "elementwise"
PARAMS = ("block_rows", "block_cols", "num_warps", "num_stages", "col_major")
DEFAULTS = {"col_major": 0}  # plans stored before the parameter existed


def match(group: Group) -> TileSpec | None:
    """A tiling of the group, or None if this template cannot run it."""
    if any(op_class(n.name) in (OpClass.REDUCTION, OpClass.CONTRACTION, OpClass.OPAQUE) for n in group.nodes):
        return None
    shapes = {group.graph.avals[v].shape for v in group.outputs}
    if len(shapes) != 1:
        return None
    (S,) = shapes
    if not S or min(S) == 0:
        return None
    for split in range(len(S) - 1, -1, -1):
        try:
            return analyze(group, S, split)
        except NoMatch:
            continue
    return None


def default_config(spec: TileSpec) -> dict:
    bn = min(next_pow2(spec.C), 1024)
    bm = max(1, min(next_pow2(spec.R), 2048 // bn))
    return {"block_rows": bm, "block_cols": bn, "num_warps": 4, "num_stages": 1, "col_major": 0}


def space(group: Group, spec: TileSpec | None = None) -> dict:
    """Tunable parameters (search_spaces/elementwise.yaml), the default config and the constraint facts."""
    spec = spec or match(group)
    return template_space(NAME, spec, default_config(spec))


def build(group: Group, config: dict, *, interpret: bool = False, spec: TileSpec | None = None) -> Callable:
    return build_template(NAME, PARAMS, spec or match(group), group, config, interpret=interpret, two_d_grid=True, defaults=DEFAULTS)
