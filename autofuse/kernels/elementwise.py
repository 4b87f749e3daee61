"""Template `elementwise`: elementwise work and broadcasts over a 2-D grid of tiles.

All outputs share one shape S; inputs may be full, row or column vectors, or
scalars. Multi-output groups are fine.
"""
from __future__ import annotations

from ..costmodel import H200, GPUModel
from ..graph import Group
from ..ops import OpClass, op_class
from .template import NoMatch, Template
from .tiling import TileSpec, analyze, facts, tile_time_ms


class ElementwiseTemplate(Template[TileSpec]):
    name = "elementwise"
    defaults = {"col_major": 0}  # plans stored before the parameter existed

    def match(self, group: Group) -> TileSpec | None:
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

    def facts(self, group: Group, spec: TileSpec) -> dict:
        """What search_spaces/elementwise.toml's constraints read: the tiling's (`tiling.facts`)."""
        return facts(spec)

    def model_time_ms(self, spec: TileSpec, config: dict, model: GPUModel = H200) -> float:
        """One program per tile, one read of each input."""
        return tile_time_ms(spec, config, model, two_d_grid=True)


TEMPLATE = ElementwiseTemplate()
match, default_config, space, model_time_ms, build = (TEMPLATE.match, TEMPLATE.default_config, TEMPLATE.space,
                                                      TEMPLATE.model_time_ms, TEMPLATE.build)
