"""Triton lowering of `matmul_reduce_vjp`: stage 1 is the `matmul_reduce` kernel of the forward, stage 2 the `matmul`
kernel that computes the product again under the backward's epilogue, each built by its own template for
`backend` (`mosaic_gpu/matmul_reduce_vjp.py` runs the same with Mosaic GPU's). `lower` runs both as one unit (a
convex group); `lower_stages` as two (a training step), stage 1's row values that only stage 2 reads handed on
privately (`two_stage.py`)."""
from __future__ import annotations

from collections.abc import Callable

from ...graph import Group
from .. import matmul, matmul_reduce
from ..matmul_reduce_vjp import BWD, MatmulReduceVJPSpec, stage_configs
from . import matmul as backward
from . import matmul_reduce as forward
from .two_stage import as_one, in_stages



PARAMS = forward.PARAMS + tuple(BWD + p for p in backward.PARAMS)


def default_config(spec: MatmulReduceVJPSpec) -> dict:
    return {**forward.default_config(spec.forward_spec), **{BWD + k: v for k, v in backward.default_config(spec.backward_spec).items()}}


def kernels(spec: MatmulReduceVJPSpec, config: dict, *, backend: str, interpret) -> tuple[Callable, Callable]:
    """(stage 1's kernel: the forward's inputs -> its outputs, stage 2's: the backward's inputs -> its outputs)."""
    fwd, bwd = stage_configs(config)
    fwd.pop("backend", None)
    bwd.pop("backend", None)
    first = matmul_reduce.TEMPLATE.build(spec.forward, fwd, backend=backend, interpret=interpret, spec=spec.forward_spec)
    second = matmul.TEMPLATE.build(spec.backward, bwd, backend=backend, interpret=interpret, spec=spec.backward_spec)
    return first, second


def lower(group: Group, spec: MatmulReduceVJPSpec, config: dict, *, interpret, backend: str = "triton") -> Callable:
    return as_one(group, spec, *kernels(spec, config, backend=backend, interpret=interpret))


def lower_stages(group: Group, spec: MatmulReduceVJPSpec, stages, config: dict, *, interpret, backend: str = "triton") -> list[Callable]:
    """Stage 1 hands stage 2 its row values and the operands of the product, which stage 2 computes again."""
    return in_stages(group, spec, stages, *kernels(spec, config, backend=backend, interpret=interpret))
