"""Triton lowering of `matmul_reduce_vjp`: stage 1 is the `matmul_reduce` kernel of the forward, stage 2 the `matmul`
kernel that computes the product again under the backward's epilogue, each built by its own template for
`backend` (`mosaic_gpu/matmul_reduce_vjp.py` runs the same with Mosaic GPU's). `lower` runs both as one unit (a
convex group); `lower_stages` as two (a training step), stage 1's row values that only stage 2 reads handed on
privately."""
from __future__ import annotations

from collections.abc import Callable

from ...graph import Group, stage_groups
from .. import matmul, matmul_reduce
from ..matmul_reduce_vjp import MatmulReduceVJPSpec, stage_configs


def kernels(spec: MatmulReduceVJPSpec, config: dict, *, backend: str, interpret) -> tuple[Callable, Callable]:
    """(stage 1's kernel: the forward's inputs -> its outputs, stage 2's: the backward's inputs -> its outputs)."""
    fwd, bwd = stage_configs(config)
    fwd.pop("backend", None)
    bwd.pop("backend", None)
    first = matmul_reduce.TEMPLATE.build(spec.forward, fwd, backend=backend, interpret=interpret, spec=spec.forward_spec)
    second = matmul.TEMPLATE.build(spec.backward, bwd, backend=backend, interpret=interpret, spec=spec.backward_spec)
    return first, second


def lower(group: Group, spec: MatmulReduceVJPSpec, config: dict, *, interpret, backend: str = "triton") -> Callable:
    first, second = kernels(spec, config, backend=backend, interpret=interpret)

    def run(*xs):
        env = dict(zip(group.inputs, xs))
        env.update(zip(spec.forward.outputs, first(*[env[v] for v in spec.forward.inputs])))
        env.update(zip(spec.backward.outputs, second(*[env[v] for v in spec.backward.inputs])))
        return [env[v] for v in group.outputs]

    return run


def lower_stages(group: Group, spec: MatmulReduceVJPSpec, stages, config: dict, *, interpret, backend: str = "triton") -> list[Callable]:
    """Stage 1: `(ins, None) -> (its outputs, what stage 2 reads from it: the row values, and the operands of the
    product, which stage 2 computes again)`; stage 2: `(ins, private) -> (its outputs, None)`."""
    one, two = stage_groups(group, stages)
    first, second = kernels(spec, config, backend=backend, interpret=interpret)

    def stage1(xs, _):
        env = dict(zip(one.inputs, xs))
        env.update(zip(spec.forward.outputs, first(*[env[v] for v in spec.forward.inputs])))
        handed = [v for v in spec.backward.inputs if v in spec.private or (v in env and v not in two.inputs)]
        return [env[v] for v in one.outputs], {v: env[v] for v in handed}

    def stage2(xs, private):
        env = {**dict(zip(two.inputs, xs)), **private}
        env.update(zip(spec.backward.outputs, second(*[env[v] for v in spec.backward.inputs])))
        return [env[v] for v in two.outputs], None

    return [stage1, stage2]
