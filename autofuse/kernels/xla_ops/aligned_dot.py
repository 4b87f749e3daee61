"""`aligned_dot` through XLA: the group's dot on its operands padded with zeros (`aligned_dot.padded_shapes`), its
product sliced back to the program's shape."""
from __future__ import annotations

from typing import Callable

import jax.numpy as jnp

from ...graph import Group, bind_node, read_atom
from ..aligned_dot import AlignedDotSpec, padded_shapes

PARAMS = ("align",)


def default_config(spec: AlignedDotSpec) -> dict:
    return {"align": 64}


def check_config(spec: AlignedDotSpec, cfg: dict) -> None:
    if cfg["align"] <= 0 or cfg["align"] % 8:
        raise NotImplementedError(f"align={cfg['align']} must be a positive multiple of 8")


def lower(group: Group, spec: AlignedDotSpec, config: dict, *, interpret=False) -> Callable:
    """`interpret` is unused: XLA's dot runs wherever XLA does."""
    nd = spec.dot
    shapes = padded_shapes(spec, config["align"])
    out_shape = tuple(group.graph.avals[nd.outputs[0]].shape)

    def kernel(*ins):
        env = dict(zip(group.inputs, ins))
        operands = [read_atom(env, a) for a in nd.inputs]
        padded = [jnp.pad(x, [(0, n - m) for n, m in zip(shape, x.shape)]) for x, shape in zip(operands, shapes)]
        (out,) = bind_node(nd, padded)
        return [out[tuple(slice(0, n) for n in out_shape)]]

    return kernel
