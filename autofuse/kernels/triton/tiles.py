"""Pieces every Triton lowering uses: masked tile loads/stores, the evaluator with them, the launch.

Rows and columns that run past an array are masked (GPU_NOTES: no automatic
edge masking on the GPU); every tile has power-of-two sides.
"""
from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ... import ops
from ...graph import Group
from ..tile_eval import TileEval, add_partials, partials_struct
from ..tiling import Span, TileSpec


def load_tile(ref, mask: jax.Array | None) -> jax.Array:
    """A tile load that reads 0 where `mask` is False (no mask: a plain load)."""
    return plgpu.load(ref, mask=mask, other=0 if mask is not None else None)


def bool_as_int8(x: jax.Array) -> jax.Array:
    """Triton refs hold no bools: a bool array goes in as int8 (the kernel reads it back with `!= 0`)."""
    return x.astype(jnp.int8) if x.dtype == jnp.bool_ else x


class TileBody(TileEval):
    """The tile evaluator with masked loads and stores of group inputs/outputs laid out as [R|1, C|1]."""

    def _index(self, span: Span, r0, c0):
        return (pl.ds(r0, self.bm) if span.rows else pl.ds(0, 1), pl.ds(c0, self.bn) if span.cols else pl.ds(0, 1))

    def load(self, ref, v: int, r0, c0):
        span = self.spec.span[v]
        index = self._index(span, r0, c0)
        if v in self.spec.outer:  # one row per outer index: the tile's (its rows lie within one)
            index = (pl.ds(r0 // self.spec.outer[v], 1), index[1])
        x = load_tile(ref.at[index], self.mask(span, r0, c0))
        return self.view(x.astype(ops.compute_dtype(x.dtype)), span)

    def col_partial(self, v: int, env: dict, r0, c0) -> jax.Array:
        """A group output that is a sum over every row (`TileSpec.col_sums`): this tile's partial, [1, bn] float32,
        rows past the edge left out."""
        nd = self.g.node_index[self.spec.col_sums[v]]
        kind, x = ops.reduction_kind(nd.name), env[nd.inputs[0]]
        x = jnp.broadcast_to(x, (self.bm, self.bn))
        rows = self.mask(Span(True, False), r0, c0)
        if rows is not None:
            x = jnp.where(rows, x, ops.reduction_identity(kind, x.dtype))
        return ops.reduce_tile(kind, x, axis=0).astype(jnp.float32)

    def store_partial(self, ref, part: jax.Array, block, c0) -> None:
        """A column sum's partial at row `block` of its [blocks, C] float32 array."""
        plgpu.store(ref.at[pl.ds(block, 1), pl.ds(c0, self.bn)], part, mask=self.mask(Span(False, True), 0, c0))

    def store_col_sum(self, ref, v: int, env: dict, r0, c0) -> None:
        """This block of rows' partial of a column sum, at its row of `ref` ([row blocks, C], float32; with inner
        rows a block is one outer index)."""
        self.store_partial(ref, self.col_partial(v, env, r0, c0), r0 // (self.spec.inner or self.bm), c0)

    def store(self, ref, v: int, x, r0, c0):
        if v in self.spec.outer:  # (inner rows) one row per tile, at its outer index
            span = Span(False, self.spec.span[v].cols)
            x = jnp.broadcast_to(x, self.tile_shape(span)).astype(self.g.avals[v].dtype)
            index = (pl.ds(r0 // self.spec.outer[v], 1), self._index(span, r0, c0)[1])
            plgpu.store(ref.at[index], x, mask=self.mask(span, r0, c0))
            return
        span = self.spec.layout_span(v)
        x = jnp.reshape(jnp.broadcast_to(x, self.reg_shape(span)), self.tile_shape(span)).astype(self.g.avals[v].dtype)
        plgpu.store(ref.at[self._index(span, r0, c0)], x, mask=self.mask(span, r0, c0))


def group_refs(group: Group, refs: Sequence) -> tuple[dict, dict]:
    """A kernel's refs as (group input -> ref, group output -> ref)."""
    n_in = len(group.inputs)
    return dict(zip(group.inputs, refs[:n_in])), dict(zip(group.outputs, refs[n_in:]))


def single_pass(body: TileBody, in_refs: dict, out_refs: dict, r0, c0) -> None:
    """The whole group on one tile: load every input, evaluate, store every output."""
    env = _evaluate(body, in_refs, r0, c0)
    for v in body.spec.group.outputs:
        if v in body.spec.col_sums:
            body.store_col_sum(out_refs[v], v, env, r0, c0)
        else:
            body.store(out_refs[v], v, env[v], r0, c0)


def walk_rows(body: TileBody, in_refs: dict, out_refs: dict, program, steps: int) -> None:
    """`single_pass` over `steps` consecutive blocks of rows (program `program`'s), the column sums' partials
    combined in registers and stored once, at row `program`: `steps` times fewer partials to write and add."""
    spec = body.spec
    sums = [v for v in spec.group.outputs if v in spec.col_sums]
    kinds = [ops.reduction_kind(body.g.node_index[spec.col_sums[v]].name) for v in sums]

    def step(i, acc):
        r0 = (program * steps + i) * body.bm
        env = _evaluate(body, in_refs, r0, 0)
        for v in spec.group.outputs:
            if v not in spec.col_sums:
                body.store(out_refs[v], v, env[v], r0, 0)
        return tuple(ops.combine(k, a, body.col_partial(v, env, r0, 0)) for k, a, v in zip(kinds, acc, sums))

    init = tuple(jnp.full((1, body.bn), ops.reduction_identity(k, jnp.float32), jnp.float32) for k in kinds)
    acc = jax.lax.fori_loop(0, steps, step, init)
    for v, a in zip(sums, acc):
        body.store_partial(out_refs[v], a, program, 0)


def _evaluate(body: TileBody, in_refs: dict, r0, c0) -> dict:
    """The group's values on the tile at (r0, c0): its inputs loaded, its nodes evaluated (column sums left out)."""
    spec = body.spec
    env = {v: body.load(in_refs[v], v, r0, c0) for v in spec.group.inputs}
    redmask = body.reduce_mask(r0, c0)
    for nd in spec.group.nodes:
        if nd.id not in spec.col_sum_nodes:
            body.eval_node(nd, env, r0, c0, redmask)
    return env


def kernel_name(template: str, group: Group) -> str:
    """The CUDA kernel's name: template and group, so profiles can be read."""
    return f"autofuse_{template}_{group.signature[:8]}"


def pallas_call(kernel: Callable, *, out_shape, grid: tuple[int, ...], name: str, interpret: bool, num_warps: int,
                num_stages: int) -> Callable:
    """`pl.pallas_call` on the Triton backend (without compiler params JAX lowers through Mosaic GPU)."""
    return pl.pallas_call(kernel, out_shape=out_shape, grid=grid, interpret=interpret, name=name,
                          compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages))


def tile_call(spec: TileSpec, kernel: Callable, *, grid: tuple[int, ...], name: str, interpret: bool, num_warps: int,
              num_stages: int) -> Callable:
    """Launch `kernel` over `grid` with the group's inputs and outputs reshaped to their 2-D layouts (and back)."""
    group = spec.group
    g = group.graph
    blocks = grid[0]  # programs along the rows: one partial each per column sum
    out_shape = [partials_struct(spec, v, blocks) if v in spec.col_sums else
                 jax.ShapeDtypeStruct(spec.layout2d(v), g.avals[v].dtype) for v in group.outputs]
    call = pallas_call(kernel, out_shape=out_shape, grid=grid, name=name, interpret=interpret, num_warps=num_warps,
                       num_stages=num_stages)

    def run(*ins):
        ins2 = [jnp.reshape(x, spec.layout2d(v)) for v, x in zip(group.inputs, ins)]
        outs = call(*ins2)
        return [add_partials(spec, v, o) if v in spec.col_sums else jnp.reshape(o, g.avals[v].shape)
                for v, o in zip(group.outputs, outs)]

    return run
