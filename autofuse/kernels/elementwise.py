"""Template `elementwise`: elementwise work and broadcasts over a 2-D grid of tiles.

All outputs share one shape S; inputs may be full, row or column vectors, or
scalars. Multi-output groups are fine.
"""
from __future__ import annotations

from ..costmodel import H200, GPUModel
from ..graph import Group
from ..ops import OpClass, op_class
from .template import NoMatch, Template
from .tiling import TileSpec, analyze, facts, next_pow2, template_space, tile_time_ms


class ElementwiseTemplate(Template[TileSpec]):
    name = "elementwise"
    params = ("block_rows", "block_cols", "num_warps", "num_stages", "col_major")
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

    def default_config(self, spec: TileSpec) -> dict:
        bn = min(max(32, next_pow2(spec.C)), 1024)  # the space's narrowest block (masked past C) for a few columns
        bm = max(1, min(next_pow2(spec.R), 2048 // bn))
        return {"block_rows": bm, "block_cols": bn, "num_warps": min(4, bm * bn // 32), "num_stages": 1, "col_major": 0}

    def space(self, group: Group, spec: TileSpec | None = None) -> dict:
        """Tunable parameters (search_spaces/elementwise.toml), the default config and the constraint facts."""
        spec = spec or self.match(group)
        return template_space(self.name, self.default_config(spec), facts(spec))

    def model_time_ms(self, spec: TileSpec, config: dict, model: GPUModel = H200) -> float:
        """One program per tile, one read of each input."""
        return tile_time_ms(spec, config, model, two_d_grid=True)


TEMPLATE = ElementwiseTemplate()
match, default_config, space, model_time_ms, build = (TEMPLATE.match, TEMPLATE.default_config, TEMPLATE.space,
                                                      TEMPLATE.model_time_ms, TEMPLATE.build)
