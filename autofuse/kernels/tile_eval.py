"""The tile evaluator: a group's own equations re-run on register tiles, whatever the backend.

Given a `TileSpec`, each value is a [bm|1, bn|1] array (its span); the
evaluator runs the group's elementwise work, broadcasts, iotas and partial
column reductions on such arrays with plain `jnp`, so the same arithmetic
serves every backend and the host (attention's mask analysis). Low-precision
floats are held in float32 and rounded when stored or explicitly converted
(XLA's `xla_allow_excess_precision` default). Loads and stores are the
backend's (`triton/tiles.py`).
"""
from __future__ import annotations

import functools
import math
import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import ops
from ..graph import Lit, Node
from ..ops import OpClass
from .template import NoMatch
from .tiling import Span, TileSpec


def edge_mask(shape: tuple[int, ...], *masks) -> jax.Array | None:
    """The conjunction of `masks` (None: that side does not run past the edge) broadcast to `shape`, or None when
    no side needs a mask."""
    given = [m for m in masks if m is not None]
    if not given:
        return None
    return jnp.broadcast_to(functools.reduce(operator.and_, given), shape)


def product_tile(acc: jax.Array, spec: Any) -> jax.Array:
    """The float32 accumulator as the epilogue reads it: rounded to the dot's own dtype where the spec says so
    (`round_product`: two kernels that compute one product each must agree with the values one hands the other)."""
    if not getattr(spec, "round_product", False):
        return acc
    return acc.astype(spec.group.graph.avals[spec.dot.outputs[0]].dtype).astype(jnp.float32)


def partials_struct(spec: TileSpec, v: int, blocks: int) -> jax.ShapeDtypeStruct:
    """The kernel's array for a sum over the rows (`TileSpec.col_sums`): one float32 partial per block of rows."""
    return jax.ShapeDtypeStruct((blocks, spec.layout2d(v)[1]), jnp.float32)


def add_partials(spec: TileSpec, v: int, partials: jax.Array) -> jax.Array:
    """A sum over the rows from its partials (a few row blocks, in XLA), in the output's dtype and shape."""
    g = spec.group.graph
    kind = ops.reduction_kind(g.node_index[spec.col_sums[v]].name)
    return jnp.reshape(ops.reduce_tile(kind, partials, axis=0).astype(g.avals[v].dtype), g.avals[v].shape)


class TileEval:
    """Evaluates a group's equations on [bm, bn] tiles at rows r0.., columns c0.. of the [R, C] space."""

    def __init__(self, spec: TileSpec, bm: int, bn: int, row_steps: int = 1):
        self.spec, self.bm, self.bn = spec, bm, bn
        self.row_steps = row_steps  # row blocks a program walks (`walk_rows`): the grid covers R in bm x row_steps rows
        self.g = spec.group.graph

    # masks / indices -------------------------------------------------------
    def row_idx(self, r0):
        return r0 + jax.lax.broadcasted_iota(jnp.int32, (self.bm, 1), 0)

    def col_idx(self, c0):
        return c0 + jax.lax.broadcasted_iota(jnp.int32, (1, self.bn), 1)

    def mask(self, span: Span, r0, c0):
        """Where a tile of `span` at (r0, c0) lies inside [R, C] (None: all of it); with inner rows, inside the
        tile's `spec.inner` rows."""
        inner = self.spec.inner
        if inner:
            rows = jax.lax.broadcasted_iota(jnp.int32, (self.bm, 1), 0) < inner if span.rows and self.bm != inner else None
        else:
            rows = self.row_idx(r0) < self.spec.R if span.rows and self.spec.R % (self.bm * self.row_steps) else None
        cols = self.col_idx(c0) < self.spec.C if span.cols and self.spec.C % self.bn else None
        return edge_mask(self.tile_shape(span), rows, cols)

    def reduce_mask(self, r0, c0):
        """The mask of the side a reduction runs along: the columns, or the rows with inner rows (`spec.inner`)."""
        return self.mask(Span(True, False) if self.spec.inner else Span(False, True), r0, c0)

    def tile_shape(self, span: Span) -> tuple[int, int]:
        """The 2-D block a value of `span` is loaded or stored as."""
        return (self.bm if span.rows else 1, self.bn if span.cols else 1)

    def reg_shape(self, span: Span) -> tuple[int, ...]:
        """The register tile of a value of `span`: the 2-D block, or with segmented columns (`spec.seg`)
        [bm|1, bn / seg|1, seg|1] (a segment's statistic: [bm|1, bn / seg, 1])."""
        if not self.spec.seg:
            return self.tile_shape(span)
        seg = self.spec.seg
        return (self.bm if span.rows else 1, self.bn // seg if span.cols else 1, seg if span.cols and not span.per_segment else 1)

    def view(self, x, span: Span):
        """A 2-D block of `span` as its register tile (a reshape with segmented columns; else unchanged)."""
        return x if x is None or not self.spec.seg else jnp.reshape(x, self.reg_shape(span))

    # arithmetic --------------------------------------------------------------
    def atom(self, env: dict, a) -> Any:
        if isinstance(a, Lit):
            return jnp.asarray(np.array(a.value, ops.compute_dtype(a.aval.dtype)))
        return env[a]

    def eval_node(self, nd: Node, env: dict, r0, c0, colmask=None) -> None:
        cls = ops.op_class(nd.name)
        out = nd.outputs[0]
        odt = self.g.avals[out].dtype
        if cls in (OpClass.BROADCAST, OpClass.LAYOUT) or nd.id in self.spec.unit_reductions:
            env[out] = self.atom(env, nd.inputs[0])
        elif cls is OpClass.ELEMENTWISE:
            env[out] = ops.eval_elementwise(nd.primitive, nd.params, odt, [self.atom(env, a) for a in nd.inputs],
                                            [self.g.aval(a).dtype for a in nd.inputs])
        elif cls is OpClass.SOURCE:
            env[out] = self.iota(nd, r0, c0)
        elif cls is OpClass.REDUCTION:
            env[out] = self.reduce_partial(nd, env, colmask)
        else:  # pragma: no cover - analysis rejects these
            raise NoMatch(nd.name)

    def reduce_partial(self, nd: Node, env: dict, colmask):
        """A reduction over the tile's columns (segmented: over each segment, which a tile holds whole); with inner
        rows, over the tile's rows (`colmask` is then the rows' mask: `reduce_mask`)."""
        kind = ops.reduction_kind(nd.name)
        x = env[nd.inputs[0]]
        span = self.spec.span[nd.inputs[0]]
        if self.spec.inner:
            if not span.rows:
                return x * self.spec.inner if kind == "sum" else x
            if colmask is not None:
                x = jnp.where(colmask, x, ops.reduction_identity(kind, x.dtype))
            return ops.reduce_tile(kind, x, axis=0)
        seg = self.spec.seg
        if not span.cols or span.per_segment:  # constant along the row (segment)
            return x * (seg or self.spec.C) if kind == "sum" else x
        if colmask is not None:
            x = jnp.where(self.view(colmask, Span(False, True)) if colmask.ndim == 2 else colmask, x, ops.reduction_identity(kind, x.dtype))
        return ops.reduce_tile(kind, x, axis=2 if seg else 1)

    def iota(self, nd: Node, r0, c0):
        S, k, d = self.spec.shape, self.spec.split, self.spec.axes[nd.outputs[0]][nd.params["dimension"]]
        if d is None:  # along a unit axis: all zeros
            return jnp.zeros((1, 1), ops.compute_dtype(nd.params["dtype"]))
        if d >= k:
            idx, stride = self.view(self.col_idx(c0), Span(False, True)), math.prod(S[d + 1 :])
        else:
            idx, stride = self.view(self.row_idx(r0), Span(True, False)), math.prod(S[d + 1 : k])
        return ((idx // stride) % S[d]).astype(ops.compute_dtype(nd.params["dtype"]))
