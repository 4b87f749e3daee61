"""Triton lowering of `attention_vjp`: the flash pair of the forward chain (`attention_bwd.flash_pair`), its outputs
laid out as the group's: the forward output and the cotangents of the chain's inputs. `lower` runs both as one
unit (a convex group); `lower_stages` as two (a training step: see `plan.py`, two-stage groups), the forward's
inputs, output and row logsumexp handed from the first to the second privately. `fwd_lower` and `bwd_lower` pick
another backend's forward (`attention.lower` with `emit_lse`) and backward (`attention_bwd.lower`):
`mosaic_gpu/attention_vjp.py`; by default both are Triton's."""
from __future__ import annotations

from collections.abc import Callable

from ...differentiate import VJPRule
from ...graph import Group, stage_groups
from ..attention import AttentionSpec
from ..attention_vjp import AttentionVJPSpec, backward_default_config
from . import attention as fwd_lowering
from .attention_bwd import flash_pair, flash_vjp_rule



PARAMS = fwd_lowering.PARAMS  # the backward's `bwd_` keys take their defaults where a config lacks them


def default_config(spec: AttentionVJPSpec) -> dict:
    """The forward kernel's config and the backward kernels' (`bwd_` keys: `attention_vjp.backward_default_config`)."""
    return {**fwd_lowering.default_config(spec.attn), **backward_default_config(spec.attn)}


def vjp_rule(group: Group, spec: AttentionSpec, config: dict, *, interpret) -> VJPRule:
    """`attention`'s reverse-mode rule on Triton: the flash pair, the forward and the backward tiled by `config`."""
    return flash_vjp_rule(group, spec, config, config, interpret=interpret)


def lower(group: Group, spec: AttentionVJPSpec, config: dict, *, interpret, fwd_lower: Callable = fwd_lowering.lower,
          bwd_lower: Callable | None = None) -> Callable:
    g = group.graph
    fwd = spec.forward
    forward, backward = flash_pair(fwd, spec.attn, config, config, interpret=interpret, fwd_lower=fwd_lower, bwd_lower=bwd_lower)

    def run(*xs):
        env = dict(zip(group.inputs, xs))
        ins = [env[v] for v in spec.forward_values()]
        out, lse = forward(ins)
        grads = backward(ins, out, lse, env[spec.dout])
        res = []
        for v in group.outputs:
            x = out if v == spec.out else grads[spec.grads[v]]
            res.append(x.astype(g.avals[v].dtype).reshape(g.avals[v].shape))
        return res

    return run


def lower_stages(group: Group, spec: AttentionVJPSpec, stages, config: dict, *, interpret,
                 fwd_lower: Callable = fwd_lowering.lower, bwd_lower: Callable | None = None) -> list[Callable]:
    """Stage 1 (the forward chain): `(ins, None) -> ([O], (forward inputs, O, lse))`; stage 2 (the backward):
    `(ins, private) -> (cotangents, None)`, reading dO from the program and the rest from stage 1."""
    g = group.graph
    fwd = spec.forward
    first, second = stage_groups(group, stages)
    if set(first.outputs) - {spec.out}:
        raise ValueError(f"attention_vjp stage 1 of group {list(group.node_ids)} would have to return more than the output")
    if spec.dout not in second.inputs or any(v not in spec.grads for v in second.outputs):
        raise ValueError(f"attention_vjp stage 2 of group {list(group.node_ids)} does not read dO or returns more than cotangents")
    forward, backward = flash_pair(fwd, spec.attn, config, config, interpret=interpret, fwd_lower=fwd_lower, bwd_lower=bwd_lower)

    def stage1(xs, _):
        env = dict(zip(first.inputs, xs))
        ins = [env[v] for v in spec.forward_values()]
        out, lse = forward(ins)
        return [out.astype(g.avals[v].dtype).reshape(g.avals[v].shape) for v in first.outputs], (ins, out, lse)

    def stage2(xs, private):
        ins, out, lse = private
        env = dict(zip(second.inputs, xs))
        grads = backward(ins, out, lse, env[spec.dout])
        return [grads[spec.grads[v]].astype(g.avals[v].dtype).reshape(g.avals[v].shape) for v in second.outputs], None

    return [stage1, stage2]
