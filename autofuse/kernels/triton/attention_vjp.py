"""Triton lowering of `attention_vjp`: the flash pair of the forward chain (`attention.flash_pair`), its outputs
laid out as the group's: the forward output and the cotangents of the chain's inputs."""
from __future__ import annotations

from collections.abc import Callable

from ...graph import Group
from .attention_bwd import flash_pair
from ..attention_vjp import AttentionVJPSpec


def lower(group: Group, spec: AttentionVJPSpec, config: dict, *, interpret: bool) -> Callable:
    g = group.graph
    fwd = spec.forward
    forward, backward = flash_pair(fwd, spec.attn, config, None, interpret=interpret)

    def run(*xs):
        env = dict(zip(group.inputs, xs))
        ins = [env[v] for v in fwd.inputs]
        out, lse = forward(ins)
        grads = backward(ins, out, lse, env[spec.dout])
        res = []
        for v in group.outputs:
            x = out if v == spec.out else grads[spec.grads[v]]
            res.append(x.astype(g.avals[v].dtype).reshape(g.avals[v].shape))
        return res

    return run
