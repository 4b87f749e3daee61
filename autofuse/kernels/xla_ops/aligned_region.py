"""`aligned_region` through XLA: the region's own equations re-bound on arrays padded along their tied axis
(`aligned_region.AlignedRegionSpec.axes`) to a multiple of `align`; reductions over it read their identity at
the padding, contractions over it read zeros there, and the region's outputs are sliced back. With `chunks` > 1
(a region `chunking` allows) the equations run in a `lax.scan` over that many chunks of the product's rows: one
chunk's logits and dlogits at a time, the sums over the rows (dW) added up in float32."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from ... import ops
from ...graph import Group, Node, bind_node, read_atom, stage_groups
from ...ops import OpClass
from ..aligned_region import AlignedRegionSpec

XLA_KERNELS = True  # XLA's own operations, no Pallas kernel
PARAMS = ("align", "chunks")


def default_config(spec: AlignedRegionSpec) -> dict:
    return {"align": 64, "chunks": 1}


def check_config(spec: AlignedRegionSpec, cfg: dict) -> None:
    if cfg["align"] <= 0 or cfg["align"] % 8:
        raise NotImplementedError(f"align={cfg['align']} must be a positive multiple of 8")
    chunks = cfg.get("chunks", 1)
    if chunks != 1 and not (spec.rows and spec.rows % chunks == 0):
        raise NotImplementedError(f"chunks={chunks}: the region does not run in chunks of its {spec.rows or 'unsplittable'} rows")


class _Padded:
    """Evaluates the region's nodes on padded arrays (of one chunk's rows, where the region runs in chunks)."""

    def __init__(self, spec: AlignedRegionSpec, align: int, chunks: int = 1):
        self.spec, self.g = spec, spec.group.graph
        self.padded = -(-spec.extent // align) * align
        self.chunk = spec.rows // chunks if chunks > 1 else None  # rows per chunk, where the region runs in chunks
        # values a dot reads, zeroed at their padding where they are made: a contraction over the padded axis must
        # read zeros there, and one over other axes (dW's over the rows) then reads the same array, one value
        # for both dots (masked at each dot, XLA wrote dlogits twice: masked and not, 1.5 GiB each at GPT-2's head)
        g = self.g
        self.contracted = {a for i in spec.group.node_ids if ops.op_class(g.node_index[i].name) is OpClass.CONTRACTION
                           for a in g.node_index[i].inputs if isinstance(a, int) and a in spec.axes and a not in spec.group.inputs}

    def shape(self, v: int) -> tuple[int, ...]:
        """`v`'s shape as evaluated: padded, and one chunk's rows where the region runs in chunks."""
        shape = list(self.g.aval(v).shape)
        if v in self.spec.axes:
            shape[self.spec.axes[v]] = self.padded
        if self.chunk and v in self.spec.row_axes:
            shape[self.spec.row_axes[v]] = self.chunk
        return tuple(shape)

    def pad(self, v: int, x: jax.Array) -> jax.Array:
        """A value from outside the region, padded with zeros along its tied axis."""
        axis = self.spec.axes.get(v)
        if axis is None:
            return x
        return jnp.pad(x, [(0, self.padded - self.spec.extent if k == axis else 0) for k in range(x.ndim)])

    def unpad(self, v: int, x: jax.Array) -> jax.Array:
        axis = self.spec.axes.get(v)
        return x if axis is None else jax.lax.slice_in_dim(x, 0, self.spec.extent, axis=axis)

    def masked(self, v: int, x: jax.Array, fill: Any) -> jax.Array:
        """`x` with `fill` at its padding."""
        axis = self.spec.axes.get(v)
        if axis is None:
            return x
        inside = jax.lax.broadcasted_iota(jnp.int32, x.shape, axis) < self.spec.extent
        return jnp.where(inside, x, jnp.asarray(fill, x.dtype))

    def node(self, nd: Node, env: dict, partial: bool = False) -> None:
        """One equation on `env`'s padded (or chunked) values; `partial`: a sink's sum over one chunk's rows, in
        float32 (the chunks' partials are added)."""
        ins = [read_atom(env, a) for a in nd.inputs]
        cls = ops.op_class(nd.name)
        changes: dict[str, Any] = {}
        if partial and jnp.issubdtype(self.g.avals[nd.outputs[0]].dtype, jnp.floating):
            if cls is OpClass.CONTRACTION:
                changes["preferred_element_type"] = jnp.dtype(jnp.float32)
            else:
                ins[0] = ins[0].astype(jnp.float32)
        if nd.name == "broadcast_in_dim":
            changes["shape"] = self.shape(nd.outputs[0])
        elif nd.name == "reshape":
            changes["new_sizes"] = self.shape(nd.outputs[0])
        elif cls is OpClass.SOURCE:
            changes["shape"] = self.shape(nd.outputs[0])
        elif cls is OpClass.REDUCTION:
            v = nd.inputs[0]
            if self.spec.axes.get(v) in set(int(a) for a in nd.params["axes"]):
                kind = ops.reduction_kind(nd.name)
                ins[0] = self.masked(v, ins[0], ops.reduction_identity(kind, self.g.aval(v).dtype))
        if changes:
            params = dict(nd.params, **changes)
            if "sharding" in params:
                params["sharding"] = None
            nd = dataclasses.replace(nd, params=params)
        for v, x in zip(nd.outputs, bind_node(nd, ins)):
            env[v] = self.masked(v, x, 0) if v in self.contracted else x

    def run(self, group: Group, ins, private: dict | None) -> tuple[list, dict]:
        """The nodes of `group` (the region or one stage of it) on its inputs and what the stage before handed
        on; returns its outputs and its padded values, for the next stage."""
        env = dict(private or {})
        env.update((v, self.pad(v, x)) for v, x in zip(group.inputs, ins))
        for i in group.node_ids:
            self.node(self.g.node_index[i], env)
        return [self.unpad(v, read_atom(env, v)) for v in group.outputs], env


def lower(group: Group, spec: AlignedRegionSpec, config: dict, *, interpret=False) -> Callable:
    """`interpret` is unused: XLA's operations run wherever XLA does."""
    chunks = config.get("chunks", 1)
    ev = _Padded(spec, config["align"], chunks)
    if chunks == 1:
        def kernel(*ins):
            return ev.run(group, ins, None)[0]
        return kernel
    return _in_chunks(group, spec, ev, chunks)


def _in_chunks(group: Group, spec: AlignedRegionSpec, ev: _Padded, chunks: int) -> Callable:
    """The region as a scan over `chunks` chunks of its rows: the work that reads no rows first, once; then per
    chunk the rest, the sinks' partial sums carried."""
    g, rows = group.graph, spec.row_axes
    per_chunk = [i for i in group.node_ids if any(v in rows for v in g.node_index[i].outputs)
                 or any(isinstance(a, int) and a in rows for a in g.node_index[i].inputs)]
    once = [i for i in group.node_ids if i not in set(per_chunk)]
    sunk = {v: i for i in spec.sinks for v in g.node_index[i].outputs}

    def split(v: int, x: jax.Array) -> jax.Array:  # [.., rows, ..] -> [chunks, .., rows / chunks, ..]
        a = rows[v]
        return jnp.moveaxis(x.reshape(x.shape[:a] + (chunks, ev.chunk) + x.shape[a + 1:]), a, 0)

    def join(v: int, y: jax.Array) -> jax.Array:
        a = rows[v]
        y = jnp.moveaxis(y, 0, a)
        return y.reshape(y.shape[:a] + (chunks * ev.chunk,) + y.shape[a + 2:])

    def kernel(*ins):
        env, xs = {}, {}
        for v, x in zip(group.inputs, ins):
            if v in rows:
                xs[v] = split(v, ev.pad(v, x))
            else:
                env[v] = ev.pad(v, x)
        for i in once:
            ev.node(g.node_index[i], env)
        sums = {v: jnp.zeros(ev.shape(v), jnp.float32 if jnp.issubdtype(g.avals[v].dtype, jnp.floating) else g.avals[v].dtype)
                for v in sunk}

        def body(sums, xc):
            e = dict(env)
            e.update(xc)
            for i in per_chunk:
                ev.node(g.node_index[i], e, partial=i in spec.sinks)
            return {v: sums[v] + e[v] for v in sums}, {v: e[v] for v in group.outputs if v in rows}

        sums, ys = jax.lax.scan(body, sums, xs)
        outs = []
        for v in group.outputs:
            x = join(v, ys[v]) if v in rows else sums[v].astype(g.avals[v].dtype) if v in sunk else read_atom(env, v)
            outs.append(ev.unpad(v, x))
        return outs

    return kernel


def lower_stages(group: Group, spec: AlignedRegionSpec, stages, config: dict, *, interpret=False) -> list[Callable]:
    """Stage 1 hands stage 2 the dot's padded product and the smaller values stage 2 reads; stage 2 evaluates
    again the padded values it reads that stage 1 made from the product (the float32 logits, their exponentials).
    A stage's results are materialised (it is a call of its own): handing those on would hold [rows, vocabulary]
    float32 arrays between the stages, where jax.jit holds only the product."""
    ev = _Padded(spec, config["align"])
    first, second = stage_groups(group, stages)
    g = group.graph
    product = g.node_index[spec.dot].outputs[0]
    made1 = {v: i for i in first.node_ids for v in g.node_index[i].outputs}
    again: set[int] = set()  # stage 1's nodes stage 2 evaluates again
    stack = [a for i in second.node_ids for a in g.node_index[i].inputs if isinstance(a, int) and a in made1]
    while stack:
        v = stack.pop()
        if v != product and v in spec.axes and made1[v] not in again:
            again.add(made1[v])
            stack.extend(a for a in g.node_index[made1[v]].inputs if isinstance(a, int) and a in made1)
    reads = {a for i in again | set(second.node_ids) for a in g.node_index[i].inputs if isinstance(a, int)}
    # what stage 2 cannot make: the product and row values stage 1 made, and the (padded) group inputs of the nodes
    # it evaluates again that are not its own inputs (a bias added to the logits)
    handed = sorted(v for v in reads if (v in made1 and (v == product or v not in spec.axes))
                    or (v in first.inputs and v not in second.inputs))

    def stage1(ins, private):
        outs, env = ev.run(first, ins, private)
        return outs, {v: env[v] for v in handed}

    def stage2(ins, private):
        env = dict(private)
        for i in sorted(again):
            ev.node(g.node_index[i], env)
        return ev.run(second, ins, env)[0], None

    return [stage1, stage2]
