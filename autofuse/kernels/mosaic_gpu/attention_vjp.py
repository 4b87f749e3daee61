"""Mosaic GPU lowering of `attention_vjp`: the flash pair with its forward on Mosaic GPU (`mosaic_gpu/attention.py`
emitting the row logsumexp: 1.00 vs 1.28 ms for Triton's forward at B8 H32 L2048 D128 on an H100) and its backward
on Mosaic GPU (`mosaic_gpu/attention_bwd.py`, `bwd_mosaic=1`; dQ fused into the dK/dV kernel with `bwd_fused=1`)
or Triton (`triton/attention_bwd.py`, `bwd_mosaic=0`: score work the Mosaic GPU backward declines, e.g. a bias).
The group's layout and stages are `triton/attention_vjp.py`'s. The config: the Mosaic GPU forward's parameters and
the backward's `bwd_` keys (`search_spaces/attention_vjp.mosaic_gpu.toml`)."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ...differentiate import VJPRule
from ...graph import Group
from ..attention import AttentionSpec
from ..attention_vjp import AttentionVJPSpec, backward_default_config
from ..triton import attention as triton_forward
from ..triton.attention_bwd import flash_vjp_rule
from ..triton import attention_vjp as pair
from . import attention as forward
from . import attention_bwd as backward

PARAMS = forward.PARAMS + ("bwd_mosaic", "bwd_held", "bwd_step", "bwd_warps", "bwd_stages", "bwd_fused", "bwd_overlap",
                           "bwd_persistent")


@dataclasses.dataclass(frozen=True)
class Config:
    forward: forward.Config
    backward: backward.Config | None  # None: the Triton backward (its tiles are checked by the space's constraints)

    @staticmethod
    def of(config: dict) -> "Config":
        return Config(forward.Config.of(config), backward.Config.of(config) if int(config.get("bwd_mosaic", 0)) else None)


def default_config(spec: AttentionVJPSpec) -> dict:
    """The Mosaic GPU forward's default with the Mosaic GPU backward's (`mosaic_backward_default`), or the Triton
    backward's default where the Mosaic GPU backward declines the group."""
    mosaic = mosaic_backward_default(spec.attn)
    bwd = mosaic if mosaic is not None else {"bwd_mosaic": 0, "bwd_fused": 0, "bwd_overlap": 0, "bwd_persistent": 0,
                                             **backward_default_config(spec.attn)}
    # the forward's own default: at D64 its three warpgroups make the pair 2.874 -> 2.803 ms, causal 1.666 -> 1.648
    # (results/attention_overlap_h200.md)
    return {**forward.default_config(spec.attn), **bwd}


def mosaic_backward_default(spec: AttentionSpec) -> dict | None:
    """The Mosaic GPU backward's first config that runs the group (an `AttentionSpec`), or None. Measured on an H200
    at B8 H32 L2048 bf16 (results/attention_bwd_fused_h200.md), fwd+bwd against cuDNN's: dQ fused into the dK/dV
    kernel with one product at a time, 64 queries a step at head dim 128 (0.99x, causal 1.01x; two kernels 1.08x)
    and 128 at 64 (0.96x, causal 0.95x; two kernels 1.08x); else the two kernels at 64 and 64."""
    base = {"bwd_mosaic": 1, "bwd_held": 64, "bwd_warps": 4, "bwd_stages": 2, "bwd_overlap": 0, "bwd_persistent": 0}
    tries = [{"bwd_step": 64, "bwd_fused": 1}, {"bwd_step": 64, "bwd_fused": 0}]
    if max(spec.D, spec.Dv) <= 64 and min(spec.Lq, spec.Lk) > 64:  # 128 queries a step: the rows split of dQ
        tries.insert(0, {"bwd_step": 128, "bwd_fused": 1})
    return next((c for c in ({**base, **t} for t in tries) if backward_runs(spec, c)), None)


def backward_runs(spec, config: dict) -> bool:
    """Whether the Mosaic GPU backward runs this attention group (an `AttentionSpec`) at `config`'s `bwd_` tiles."""
    try:
        backward.check_group(spec)
        backward.check_config(spec, backward.Config.of(config))
    except NotImplementedError:
        return False
    return True


def check_group(spec: AttentionVJPSpec) -> None:
    forward.check_group(spec.attn)


def check_config(spec: AttentionVJPSpec, cfg: Config) -> None:
    forward.check_config(spec.attn, cfg.forward, emit_lse=True)
    if cfg.backward is not None:
        backward.check_group(spec.attn)
        backward.check_config(spec.attn, cfg.backward)


def lower(group: Group, spec: AttentionVJPSpec, config: dict, *, interpret=False) -> Callable:
    """`interpret`: as the Mosaic GPU lowerings take it (True, or `plgpu.InterpretGPUParams`)."""
    return pair.lower(group, spec, config, interpret=bool(interpret), **lowerings(config, interpret))


def lower_stages(group: Group, spec: AttentionVJPSpec, stages, config: dict, *, interpret=False) -> list[Callable]:
    return pair.lower_stages(group, spec, stages, config, interpret=bool(interpret), **lowerings(config, interpret))


def vjp_rule(group: Group, spec: AttentionSpec, config: dict, *, interpret) -> VJPRule:
    """`attention`'s reverse-mode rule for a Mosaic GPU group: the flash pair with the Mosaic GPU forward emitting the
    row logsumexp, and the Mosaic GPU backward where it runs the group at the config's `bwd_` tiles (else Triton's);
    Triton's forward at its default where this forward cannot run the group or its config with the logsumexp."""
    cfg = backward_config(spec, config)
    try:
        return flash_vjp_rule(group, spec, cfg, cfg, interpret=bool(interpret), **lowerings(cfg, interpret))
    except NotImplementedError:  # e.g. the logsumexp's buffer does not fit the config's shared memory
        return flash_vjp_rule(group, spec, triton_forward.default_config(spec), None, interpret=bool(interpret))


def backward_config(spec: AttentionSpec, config: dict) -> dict:
    """`config` with the backward it will run: the `bwd_` keys it names over the Mosaic GPU backward's default
    (`{"bwd_overlap": 1}` is the default backward with its products in pairs, not the keys' own defaults: the two
    kernels unfused), as named where that does not run; `bwd_mosaic` 0 where the Mosaic GPU backward does not run
    it at all."""
    merged = {**(mosaic_backward_default(spec) or {}), **config}
    if backward_runs(spec, merged) or not any(k.startswith("bwd_") for k in config):
        config = merged
    return {"bwd_mosaic": 1, **config} if backward_runs(spec, config) else {**config, "bwd_mosaic": 0}


def lowerings(config: dict, params) -> dict[str, Callable | None]:
    """`flash_pair`'s `fwd_lower` and `bwd_lower` for `config`, run with `params` (True or `plgpu.InterpretGPUParams`
    in interpret mode): `flash_pair` hands each lowering the Triton backward's plain bool."""
    def fwd(group: Group, spec, cfg: dict, *, interpret: bool, emit_lse: bool) -> Callable:  # noqa: ARG001
        return forward.lower(group, spec, cfg, interpret=params, emit_lse=emit_lse)

    def bwd(group: Group, spec, cfg: dict | None, *, interpret: bool) -> Callable:  # noqa: ARG001
        return backward.lower(group, spec, cfg, interpret=params)

    return {"fwd_lower": fwd, "bwd_lower": bwd if int(config.get("bwd_mosaic", 0)) else None}
