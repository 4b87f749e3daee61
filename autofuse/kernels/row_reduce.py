"""Template `row_reduce`: reductions over the trailing axes with elementwise work around them.

Softmax (max, exp, sum, divide), layer and RMS norm, logsumexp: one program
per block of rows. A row that fits one column block is reduced in registers
in one pass; a longer row is reduced with in-kernel loops over column blocks
(one loop per reduction depth, then one that writes). A norm's backward also
sums over the rows of each column (dγ = Σ dy·x̂, dβ = Σ dy): such a sum
(`TileSpec.col_sums`) is written per block of rows as a partial, [row blocks,
C] in float32, and the partials are added after the kernel (a small XLA sum),
so dy and x̂ are read once for dx and the column sums together.
"""
from __future__ import annotations

from ..costmodel import H200, GPUModel
from ..spaces import DEFAULT_BACKEND
from ..graph import Group
from ..ops import OpClass, op_class
from .template import NoMatch, Template
from .tiling import TileSpec, analyze, cdiv, facts, tile_time_ms



class RowReduceTemplate(Template[TileSpec]):
    name = "row_reduce"
    offers_row_sums = True  # a norm's backward with its dγ, dβ
    defaults = {"row_steps": 1}  # plans stored before programs walked row blocks

    def match(self, group: Group) -> TileSpec | None:
        """A tiling of the group around its column reductions, or None."""
        nodes = group.nodes
        if any(op_class(n.name) in (OpClass.CONTRACTION, OpClass.OPAQUE) for n in nodes):
            return None
        reds = [n for n in nodes if op_class(n.name) is OpClass.REDUCTION]
        if not reds:
            return None
        g = group.graph
        trailing = [n for n in reds if sorted(n.params["axes"]) == list(range(min(n.params["axes"]), len(g.aval(n.inputs[0]).shape)))]
        if not trailing:
            return None
        S = g.aval(trailing[0].inputs[0]).shape
        if not S or min(S) == 0:
            return None
        split = min(trailing[0].params["axes"])
        try:
            return analyze(group, S, split, column_sums=True)
        except NoMatch:
            return None

    def space_of(self, group: Group, spec: TileSpec | None = None, backend: str = DEFAULT_BACKEND) -> dict:
        """The space of search_spaces/row_reduce.toml, with `row_steps` searched only where the group has column sums
        to walk rows for (elsewhere its one value, 1: a space six times the size, five of six configs infeasible,
        would spend the sampler's proposals and the model's enumeration on nothing)."""
        sp = super().space_of(group, spec, backend)
        spec = spec if spec is not None else self.match(group)
        if not spec.col_sums or spec.inner:
            sp["params"] = {**sp["params"], "row_steps": [1]}
        return sp

    def facts(self, group: Group, spec: TileSpec) -> dict:
        """What search_spaces/row_reduce.toml's constraints read: the tiling's (`tiling.facts`)."""
        return facts(spec)

    def model_time_ms(self, spec: TileSpec, config: dict, model: GPUModel = H200) -> float:
        """One program per block of rows; a row longer than a block reads its inputs once per reduction depth
        (an upper bound) and once more to write."""
        passes = 2 + len(spec.reductions) if cdiv(spec.C, int(config["block_cols"])) > 1 else 1
        return tile_time_ms(spec, config, model, passes=passes)


TEMPLATE = RowReduceTemplate()
match, default_config, space, model_time_ms, build = (TEMPLATE.match, TEMPLATE.default_config, TEMPLATE.space,
                                                      TEMPLATE.model_time_ms, TEMPLATE.build)
