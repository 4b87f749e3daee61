"""Mosaic GPU lowering of `matmul_reduce_vjp`: both kernels on Mosaic GPU (`mosaic_gpu/matmul_reduce.py` for the
forward, `mosaic_gpu/matmul.py` for the backward that computes the product again), laid out and staged as
`triton/matmul_reduce_vjp.py` does. The config: the forward kernel's parameters and the backward's under `bwd_`
(`search_spaces/matmul_reduce_vjp.mosaic_gpu.toml`)."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ...graph import Group
from ..matmul_reduce_vjp import BWD, MatmulReduceVJPSpec, stage_configs
from ..triton import matmul_reduce_vjp as pair
from . import matmul as backward
from . import matmul_reduce as forward

PARAMS = forward.PARAMS + tuple(BWD + p for p in backward.PARAMS)


@dataclasses.dataclass(frozen=True)
class Config:
    forward: forward.Config
    backward: backward.Config

    @staticmethod
    def of(config: dict) -> "Config":
        fwd, bwd = stage_configs(config)
        return Config(forward.Config.of(fwd), backward.Config.of(bwd))


def default_config(spec: MatmulReduceVJPSpec) -> dict:
    return {**forward.default_config(spec.forward_spec), **{BWD + k: v for k, v in backward.default_config(spec.backward_spec).items()}}


def check_group(spec: MatmulReduceVJPSpec) -> None:
    forward.check_group(spec.forward_spec)
    backward.check_group(spec.backward_spec)


def check_config(spec: MatmulReduceVJPSpec, cfg: Config) -> None:
    forward.check_config(spec.forward_spec, cfg.forward)
    backward.check_config(spec.backward_spec, cfg.backward)


def lower(group: Group, spec: MatmulReduceVJPSpec, config: dict, *, interpret=False) -> Callable:
    """`interpret`: as the Mosaic GPU lowerings take it (True, or `plgpu.InterpretGPUParams`)."""
    return pair.lower(group, spec, config, interpret=interpret, backend="mosaic_gpu")


def lower_stages(group: Group, spec: MatmulReduceVJPSpec, stages, config: dict, *, interpret=False) -> list[Callable]:
    return pair.lower_stages(group, spec, stages, config, interpret=interpret, backend="mosaic_gpu")
