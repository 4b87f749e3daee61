"""Triton lowering of `reduce_vjp`: two `row_reduce` kernels over tiles holding the reduced axis whole, run as
one unit or as two stages (`two_stage.py`)."""
from __future__ import annotations

from collections.abc import Callable

from ...graph import Group
from .. import row_reduce
from ..reduce_vjp import BWD, ReduceVJPSpec, row_config, stage_configs
from ..tiling import TileSpec, next_pow2
from .two_stage import as_one, in_stages



PARAMS = ("block_cols", "num_warps", BWD + "block_cols", BWD + "num_warps")


def default_config(spec: ReduceVJPSpec) -> dict:
    return {**_stage_config(spec.forward_spec, 32), **{BWD + k: v for k, v in _stage_config(spec.backward_spec, 32).items()}}


def _stage_config(spec: TileSpec, per_thread: int) -> dict:
    """A good stage config: rows of 64 columns (128 bytes of bf16) where the tile allows, and warps for about
    `per_thread` of its elements per thread (on an H100 at SPLADE's [256, 64] tiles: stage 1 at 32 per thread
    0.26 ms; stage 2 at 32 per thread 0.73 ms, 16 per thread (1024 threads, 64 registers each, spilling) 0.75 ms,
    128 per thread 2.3 ms: its live values fill the registers; at 32 it runs ~60 instructions per element, bound
    by the issue rate, not memory)."""
    rows = next_pow2(spec.inner)
    bn = max(16, min(64, 32768 // rows, next_pow2(spec.C)))
    return {"block_cols": bn, "num_warps": max(2, min(32, rows * bn // (32 * per_thread)))}


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
