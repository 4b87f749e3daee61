"""Evaluate a group's elementwise equations on register arrays inside a Mosaic GPU kernel.

The Triton backend holds every value of a group as a 2-D register tile that is
lazily broadcast ([bm, 1] / [1, bn]); Mosaic GPU register arrays carry a
*layout* instead (how the elements are spread over the 128 threads of a
warpgroup), and only some shapes and layouts combine. This module maps the
same analysis (`kernels.tiling.TileSpec`: what each value varies along) onto
Mosaic GPU layouts for a [bm, bn] tile of an accumulator:

=============  ==========  ====================================  ===========================
what it spans  shape       layout                                example
=============  ==========  ====================================  ===========================
rows and cols  [bm, bn]    ``plgpu.Layout.WGMMA``                the accumulator, a residual
rows only      [bm]        ``plgpu.Layout.WGMMA.reduce(1)``      a per-row scale [M, 1]
cols only      [bn]        ``plgpu.Layout.WGMMA.reduce(0)``      a bias [N]
neither        []          (a scalar, splat when it meets a tile) a literal, a scalar input
=============  ==========  ====================================  ===========================

A row or column vector stays a vector until an equation combines it with a
wider value; then it is broadcast with `lax.broadcast_in_dim` (the Mosaic GPU
lowering turns a reduced WGMMA layout broadcast along its missing axis back into
the WGMMA layout, with no data movement: each thread already holds the rows or
columns of its accumulator fragment). The arithmetic itself is the group's own
jaxpr, one equation at a time, through `autofuse.ops.eval_elementwise` (the
same function the Triton tile evaluator uses); low-precision floats are held in
float32 and rounded when stored or explicitly converted.

Which primitives the Mosaic GPU lowering implements is read from its own rule
table (`supported_primitives`), so a group using one it lacks (log1p, expm1,
pow, floor, ...) is declined up front with the primitive's name instead of
failing inside the lowering.
"""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from ... import ops
from ...graph import Lit, Node
from ...ops import OpClass
from ..tiling import Span, TileSpec

FULL, ROWS, COLS, NONE = Span(True, True), Span(True, False), Span(False, True), Span(False, False)

# Equations that `ops.eval_elementwise` runs without binding their primitive.
_PASS_THROUGH = {"stop_gradient", "copy", "copy_p", "convert_element_type", "square", "add_any"}


class Unsupported(NotImplementedError):
    """This lowering cannot implement the group or config (the message names what); the tuner treats it as infeasible."""


def supported_primitives() -> frozenset[str]:
    """Names of the primitives the Pallas Mosaic GPU lowering has a (warpgroup-thread, lane-semantics) rule for."""
    try:
        from jax._src.pallas.mosaic_gpu import core as gpu_core, lowering
        import jax._src.pallas.mosaic_gpu.primitives  # noqa: F401  (registers its rules)
        return frozenset(p.name for p in lowering.mosaic_lowering_rules[gpu_core.LANExWG_SEMANTICS])
    except (ImportError, AttributeError, KeyError):  # pragma: no cover - JAX moved it: fall back to what 0.11.2 has
        return frozenset({
            "abs", "add", "and", "atan2", "broadcast_in_dim", "clamp", "convert_element_type", "cos", "div", "eq", "erf",
            "exp", "exp2", "ge", "gt", "integer_pow", "iota", "le", "log", "logistic", "lt", "max", "min", "mul", "ne", "neg",
            "not", "or", "rem", "reshape", "round", "rsqrt", "select_n", "shift_left", "shift_right_arithmetic",
            "shift_right_logical", "sign", "sin", "sqrt", "square", "squeeze", "sub", "tanh", "xor",
        })


def check_nodes(nodes: list[Node], *, reductions: bool = False) -> None:
    """Raise `Unsupported` naming the first equation the Mosaic GPU lowering cannot run on register arrays
    (`reductions`: row reductions of a piece are allowed, as a segmented epilogue has them)."""
    have = supported_primitives()
    for nd in nodes:
        cls = ops.op_class(nd.name)
        if cls in (OpClass.BROADCAST, OpClass.LAYOUT):
            continue  # no code: spans say where a value varies
        if reductions and cls is OpClass.REDUCTION:
            if nd.name not in have:
                raise Unsupported(f"primitive {nd.name} has no Mosaic GPU lowering in jax {jax.__version__}")
            continue
        if cls is OpClass.SOURCE:
            continue  # iota: built from plgpu.broadcasted_iota
        if cls is not OpClass.ELEMENTWISE:
            raise Unsupported(f"{nd.name} in an epilogue ({cls.value}) is not supported by the Mosaic GPU lowering")
        rounding = nd.name == "reduce_precision" and ops.rounded_dtype(nd.params) is not None  # conversions there and back
        if nd.name not in _PASS_THROUGH and nd.name not in have and not rounding:
            raise Unsupported(f"primitive {nd.name} has no Mosaic GPU lowering in jax {jax.__version__}")
        if nd.name == "convert_element_type" and np.dtype(nd.params["new_dtype"]) == np.dtype(jnp.float64):
            raise Unsupported("float64 in a Mosaic GPU kernel")


def layout(span: Span):
    """The Mosaic GPU register layout of a value of this span in a [bm, bn] WGMMA tile (None: a scalar)."""
    if span == FULL:
        return plgpu.Layout.WGMMA
    if span == ROWS:
        return plgpu.Layout.WGMMA.reduce(1)
    if span == COLS:
        return plgpu.Layout.WGMMA.reduce(0)
    return None


class RegisterTiles:
    """Evaluates an epilogue's equations on the register arrays of one [bm, bn] tile of the accumulator.

    `spec` is the epilogue's `TileSpec` (rows = the product's rows, columns = N);
    `env` maps value ids to register arrays whose shape follows their span
    (`shape`). `r0` / `c0` (traced int32) are the tile's first row and column,
    used only by `iota`.
    """

    def __init__(self, spec: TileSpec, bm: int, bn: int):
        self.spec, self.bm, self.bn = spec, bm, bn
        self.g = spec.group.graph

    def piece(self, span: Span) -> Span:
        """What a value of `span` varies along within one piece. With segmented columns (`spec.seg`) a piece is
        one segment wide, so a segment's statistic (`per_segment`) is a row vector there (or a scalar)."""
        return Span(span.rows, False) if span.per_segment else span

    def shape(self, span: Span) -> tuple[int, ...]:
        span = self.piece(span)
        return (self.bm,) * span.rows + (self.bn,) * span.cols

    def span_of(self, a) -> Span:
        return NONE if isinstance(a, Lit) else self.piece(self.spec.span[a])

    def widen(self, x, have: Span, want: Span):
        """`x` (a value of span `have`) broadcast to span `want` (which contains it)."""
        if have == want:
            return x
        if (have.rows and not want.rows) or (have.cols and not want.cols):
            raise Unsupported(f"cannot narrow a {have} value to {want}")
        dims = () if have == NONE else ((0,) if have == ROWS else (len(self.shape(want)) - 1,))
        return lax.broadcast_in_dim(jnp.asarray(x), self.shape(want), dims)

    def atom(self, env: dict, a) -> Any:
        if isinstance(a, Lit):
            return jnp.asarray(np.array(a.value, ops.compute_dtype(a.aval.dtype)))
        return env[a]

    def eval_node(self, nd: Node, env: dict, r0=0, c0=0) -> None:
        cls = ops.op_class(nd.name)
        out = nd.outputs[0]
        want = self.piece(self.spec.span[out])
        if cls in (OpClass.BROADCAST, OpClass.LAYOUT):
            # no code where the span (what it varies along) is unchanged; a vector broadcast over the tile (a padding
            # mask's [B, 1, 1, Lk] to the scores' shape) is widened here, so that every value's shape follows its span
            # (left as a vector, numpy's broadcasting would align it with the last axis: wrong on a transposed tile)
            env[out] = self.widen(self.atom(env, nd.inputs[0]), self.span_of(nd.inputs[0]), want)
        elif cls is OpClass.REDUCTION and self.spec.seg and self.bn == self.spec.seg:
            # over one segment = over this piece's columns: a row reduction that stays within each warp
            kind = ops.reduction_kind(nd.name)
            x, have = self.atom(env, nd.inputs[0]), self.span_of(nd.inputs[0])
            if not have.cols:  # constant along the segment
                env[out] = x * self.spec.seg if kind == "sum" else x
            else:
                env[out] = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min}[kind](x, axis=1)
        elif cls is OpClass.ELEMENTWISE:
            ins = [self.widen(self.atom(env, a), self.span_of(a), want) for a in nd.inputs]
            env[out] = ops.eval_elementwise(nd.primitive, nd.params, self.g.avals[out].dtype, ins,
                                            [self.g.aval(a).dtype for a in nd.inputs])
        elif cls is OpClass.SOURCE:
            env[out] = self.iota(nd, r0, c0)
        else:
            raise Unsupported(f"{nd.name} in an epilogue")

    def iota(self, nd: Node, r0, c0):
        """An `iota` of the group as the index along its S-axis of each row / column of this tile.

        (Not reachable from `matmul`, whose match leaves iotas out of its groups; here for the templates that
        keep them, e.g. attention's masks, and untested until one of them is lowered.)"""
        S, k = self.spec.shape, self.spec.split
        d = self.spec.axes[nd.outputs[0]][nd.params["dimension"]]
        dt = ops.compute_dtype(nd.params["dtype"])
        if d is None:
            return jnp.zeros((), dt)
        along_cols = d >= k
        n = self.bn if along_cols else self.bm
        idx = plgpu.broadcasted_iota(jnp.int32, (n,), 0, layout=layout(COLS if along_cols else ROWS))
        idx = idx + (c0 if along_cols else r0)
        stride = math.prod(S[d + 1 :]) if along_cols else math.prod(S[d + 1 : k])
        return ((idx // stride) % S[d]).astype(dt)

    def column_partial(self, env: dict, v: int, r0, rows: int) -> jax.Array:
        """This tile's partial of a sum over every row (`TileSpec.col_sums`): a float32 [bn] column vector, the
        rows from `rows` on (past the array's edge, where TMA zero-filled the operands but the epilogue need not
        give zero) left out. A reduction across the tile's warps, through Mosaic GPU's reduction scratch: one
        warpgroup at a time may run it (the scratch is the kernel's, not the warpgroup's). It costs GPT-2's dgrad GEMM
        with GELU' about 0.08 ms of 0.28 on an H200, and a larger scratch (6 or 16 KiB against Mosaic GPU's 2: fewer
        warpgroup barriers per piece) changed nothing (results/sum_scratch_h200.md)."""
        nd = self.g.node_index[self.spec.col_sums[v]]
        kind = ops.reduction_kind(nd.name)
        a = nd.inputs[0]
        x = self.widen(self.atom(env, a), self.span_of(a), FULL).astype(jnp.float32)
        if rows % self.bm:
            idx = plgpu.broadcasted_iota(jnp.int32, (self.bm,), 0, layout=layout(ROWS)) + r0
            x = jnp.where(self.widen(idx < rows, ROWS, FULL), x, jnp.asarray(ops.reduction_identity(kind, jnp.float32)))
        return {"sum": jnp.sum, "max": jnp.max, "min": jnp.min}[kind](x, axis=0)

    def store_value(self, env: dict, v: int, dtype) -> jax.Array:
        """Output `v` as a full [bm, bn] tile in its own dtype (rounded from float32 where it is a low float)."""
        return self.widen(env[v], self.span_of(v), FULL).astype(dtype)
