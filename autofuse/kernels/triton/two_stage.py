"""Running a group of two kernels (`kernels/reread.py`'s split): as one unit, or as two stages with stage 1's row
values handed to stage 2 privately. Shared by the lowerings of `matmul_reduce_vjp` and `reduce_vjp`, whatever
kernels they build; `spec` has `forward`, `backward` (the two kernels' groups) and `private`."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...graph import Group, stage_groups


def as_one(group: Group, spec: Any, first: Callable, second: Callable) -> Callable:
    """The group's function (a convex group): stage 1's kernel, then stage 2's."""

    def run(*xs):
        env = dict(zip(group.inputs, xs))
        env.update(zip(spec.forward.outputs, first(*[env[v] for v in spec.forward.inputs])))
        env.update(zip(spec.backward.outputs, second(*[env[v] for v in spec.backward.inputs])))
        return [env[v] for v in group.outputs]

    return run


def in_stages(group: Group, spec: Any, stages, first: Callable, second: Callable) -> list[Callable]:
    """Stage 1: `(ins, None) -> (its outputs, what stage 2 reads from it: the row values, and the inputs of the
    values stage 2 evaluates again)`; stage 2: `(ins, private) -> (its outputs, None)`."""
    one, two = stage_groups(group, stages)

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
