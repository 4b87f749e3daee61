"""Triton lowering of `reduce_vjp`: two `row_reduce` kernels over tiles holding the reduced axis whole, run as
one unit or as two stages (`two_stage.py`)."""
from __future__ import annotations

from collections.abc import Callable

from ...graph import Group
from .. import row_reduce
from ..reduce_vjp import ReduceVJPSpec, row_config, stage_configs
from .two_stage import as_one, in_stages


def kernels(spec: ReduceVJPSpec, config: dict, *, interpret) -> tuple[Callable, Callable]:
    """(stage 1's kernel: the forward's inputs -> its outputs, stage 2's: the backward's inputs -> its outputs)."""
    fwd, bwd = stage_configs(config)
    first = row_reduce.TEMPLATE.build(spec.forward, row_config(spec.forward_spec, fwd), interpret=interpret,
                                      spec=spec.forward_spec)
    second = row_reduce.TEMPLATE.build(spec.backward, row_config(spec.backward_spec, bwd), interpret=interpret,
                                       spec=spec.backward_spec)
    return first, second


def lower(group: Group, spec: ReduceVJPSpec, config: dict, *, interpret) -> Callable:
    return as_one(group, spec, *kernels(spec, config, interpret=interpret))


def lower_stages(group: Group, spec: ReduceVJPSpec, stages, config: dict, *, interpret) -> list[Callable]:
    """Stage 1 writes what the program reads of the forward; stage 2 reads the stored value again."""
    return in_stages(group, spec, stages, *kernels(spec, config, interpret=interpret))
