"""Mosaic GPU lowering of `attention_vjp`: the flash pair with its forward on Mosaic GPU (`mosaic_gpu/attention.py`
emitting the row logsumexp: TMA, wgmma, warp specialisation; 1.00 vs 1.28 ms for Triton's forward at
B8 H32 L2048 D128 on an H100) and its backward kernels on Triton (`triton/attention_bwd.py`: no Mosaic GPU backward
is built). The group's layout and stages are `triton/attention_vjp.py`'s. The config: the Mosaic GPU forward's
parameters and the backward's `bwd_` keys (`search_spaces/attention_vjp.mosaic_gpu.toml`)."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ...graph import Group
from ..attention_vjp import AttentionVJPSpec
from ..triton import attention_bwd
from ..triton import attention_vjp as pair
from . import attention as forward

PARAMS = forward.PARAMS + ("bwd_held", "bwd_step", "bwd_warps", "bwd_stages")


@dataclasses.dataclass(frozen=True)
class Config:
    forward: forward.Config  # the backward's `bwd_` keys are checked by the space's constraints

    @staticmethod
    def of(config: dict) -> "Config":
        return Config(forward.Config.of(config))


def default_config(spec: AttentionVJPSpec) -> dict:
    return {**forward.default_config(spec.attn), **attention_bwd.default_config(spec.attn)}


def check_group(spec: AttentionVJPSpec) -> None:
    forward.check_group(spec.attn)


def check_config(spec: AttentionVJPSpec, cfg: Config) -> None:
    forward.check_config(spec.attn, cfg.forward, emit_lse=True)


def lower(group: Group, spec: AttentionVJPSpec, config: dict, *, interpret=False) -> Callable:
    """`interpret`: as `mosaic_gpu.attention.lower` takes it (True, or `plgpu.InterpretGPUParams`)."""
    return pair.lower(group, spec, config, interpret=bool(interpret), fwd_lower=_forward(interpret))


def lower_stages(group: Group, spec: AttentionVJPSpec, stages, config: dict, *, interpret=False) -> list[Callable]:
    return pair.lower_stages(group, spec, stages, config, interpret=bool(interpret), fwd_lower=_forward(interpret))


def _forward(params) -> Callable:
    """The Mosaic GPU forward's lowering run with `params` (True or `plgpu.InterpretGPUParams` for interpret mode):
    `flash_pair` hands each lowering the Triton backward's plain bool."""
    def lower(group: Group, spec, config: dict, *, interpret: bool, emit_lse: bool) -> Callable:  # noqa: ARG001
        return forward.lower(group, spec, config, interpret=params, emit_lse=emit_lse)

    return lower
