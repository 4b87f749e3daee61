"""`aligned_dot` through XLA: the group's dot on its operands padded with zeros (`aligned_dot.padded_shapes`), its
product sliced back to the program's shape."""
from __future__ import annotations

from typing import Callable

import jax.numpy as jnp

from ...graph import Group, bind_node, read_atom
from ..aligned_dot import AlignedDotSpec, padded_shapes

XLA_KERNELS = True  # XLA's own operations, no Pallas kernel
PARAMS = ("align",)


def default_config(spec: AlignedDotSpec) -> dict:
    return {"align": 64}


def check_config(spec: AlignedDotSpec, cfg: dict) -> None:
    if cfg["align"] <= 0 or cfg["align"] % 8:
        raise NotImplementedError(f"align={cfg['align']} must be a positive multiple of 8")


def lower(group: Group, spec: AlignedDotSpec, config: dict, *, interpret=False) -> Callable:
    """`interpret` is unused: XLA's dot runs wherever XLA does."""
    return _padded_dot(group, spec, config, sliced=True)


def lower_alone(group: Group, spec: AlignedDotSpec, config: dict, *, interpret=False) -> Callable:
    """The padded dot as timed alone: its product left padded where only the program's own kernels read it. There
    XLA fuses the slice into the readers (the logits' padded columns are never copied out: the cross-entropy reads
    the product's first 50257 of each row); sliced alone it would be a copy of the whole product (1.65 GB for GPT-2's
    logits, ~0.7 ms) that the program never makes. The product the program returns is sliced, as there."""
    return _padded_dot(group, spec, config, sliced=spec.dot.outputs[0] in group.graph.output_values)


def _padded_dot(group: Group, spec: AlignedDotSpec, config: dict, *, sliced: bool) -> Callable:
    nd = spec.dot
    shapes = padded_shapes(spec, config["align"])
    out_shape = tuple(group.graph.avals[nd.outputs[0]].shape)

    def kernel(*ins):
        env = dict(zip(group.inputs, ins))
        operands = [read_atom(env, a) for a in nd.inputs]
        padded = [jnp.pad(x, [(0, n - m) for n, m in zip(shape, x.shape)]) for x, shape in zip(operands, shapes)]
        (out,) = bind_node(nd, padded)
        return [out[tuple(slice(0, n) for n in out_shape)] if sliced else out]

    return kernel
