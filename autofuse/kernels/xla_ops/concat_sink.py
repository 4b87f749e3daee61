"""`concat_sink` through XLA: the group's readers of a concatenation run on its parts (`concat_sink` says how), so
that the concatenation is never written."""
from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
import numpy as np
from jax import lax

from ...graph import Group, Node, bind_node, read_atom
from ..concat_sink import SINKS, ConcatSinkSpec, reduces_the_axis

XLA_KERNELS = True  # XLA's own operations, no Pallas kernel
PARAMS = ("accumulate", "contracted", "kept")


def default_config(spec: ConcatSinkSpec) -> dict:
    """Every dot on the concatenation, written once, the sums on the parts: GPT-2 medium's QKV backward on an H200
    ran 0.878x XLA's time so, 0.957x with the weight's gradient on the parts, 0.979x with dx split along K too
    (results/concat_once_h200.md)."""
    return {"accumulate": 0, "contracted": 0, "kept": 1}


def check_config(spec: ConcatSinkSpec, cfg: dict) -> None:
    if cfg["accumulate"] not in (0, 1):
        raise NotImplementedError(f"accumulate={cfg['accumulate']} must be 0 (the result's dtype) or 1 (float32)")
    if cfg["contracted"] not in (0, 1):
        raise NotImplementedError(f"contracted={cfg['contracted']} must be 0 (read the concatenation) or 1 (the parts)")
    if cfg.get("kept", 0) not in (0, 1):
        raise NotImplementedError(f"kept={cfg['kept']} must be 0 (the parts) or 1 (read the concatenation)")


class Parts(list):
    """A value held as its parts along the concatenated axis (never concatenated)."""


def lower(group: Group, spec: ConcatSinkSpec, config: dict, *, interpret=False) -> Callable:
    """`interpret` is unused: XLA's operations run wherever XLA does. `accumulate` = 1 adds the partial results of a
    sum over the concatenated axis in float32 (partial dots with float32 products), 0 in the result's own dtype
    (XLA folds each addition into the next GEMM's output). `contracted` = 0 leaves a dot that contracts the
    concatenated axis reading the concatenation: K-split GEMMs and their additions may cost more than the copy.
    `kept` = 1 leaves a dot that keeps the axis reading it too: the parts' products are GEMMs of a third the size,
    which fill a third of the card. The concatenation such dots read is written once for all of them, behind an
    optimisation barrier: XLA otherwise writes it again for each GEMM (GPT-2's step: two identical copies)."""
    axis, sizes = spec.axis, spec.sizes
    starts = np.cumsum((0,) + sizes[:-1]).tolist()
    wide, split_k, split_n = bool(config["accumulate"]), bool(config.get("contracted", 1)), not config.get("kept", 0)

    def whole_reader(nd: Node) -> bool:
        """A dot that reads the concatenation rather than its parts."""
        return nd.name == "dot_general" and not (split_k if reduces_the_axis(nd, spec) else split_n)

    def kernel(*ins):
        env = dict(zip(group.inputs, ins))
        whole: dict[int, object] = {}  # a piece-wise value concatenated, for the dots that read it whole
        for nd in group.nodes:
            args = [read_atom(env, a) for a in nd.inputs]
            if nd.id == spec.concat.id:
                out = Parts(args)
            elif any(isinstance(x, Parts) for x in args) and nd.name not in SINKS:  # an elementwise op of the parts
                (parts,) = [x for x in args if isinstance(x, Parts)]
                out = Parts(bind_node(nd, [p if isinstance(x, Parts) else x for x in args])[0] for p in parts)
            elif whole_reader(nd):
                v = next(a for a in nd.inputs if isinstance(a, int) and a in spec.pieces)
                if v not in whole:
                    whole[v] = lax.optimization_barrier(jnp.concatenate(env[v], axis=axis))
                out = bind_node(nd, [whole[v] if a == v else x for a, x in zip(nd.inputs, args)])[0]
            elif nd.name == "dot_general":
                out = _dot(nd, args, axis, starts, sizes, wide)
            else:
                out = _sum(nd, args[0], axis, wide)
            env[nd.outputs[0]] = out
        return [env[v] for v in group.outputs]

    return kernel


def _dot(nd: Node, args: list, axis: int, starts: list[int], sizes: tuple[int, ...], wide: bool):
    """A dot of one operand held in parts: the sum of the parts' dots with the other operand's slices along the
    paired contracted axis, or the concatenation of the parts' products along the kept axis's output position."""
    side = 0 if isinstance(args[0], Parts) else 1
    parts, other = args[side], args[1 - side]
    (contract, batch) = nd.params["dimension_numbers"]
    dtype = nd.params.get("preferred_element_type") or np.result_type(*(p.dtype for p in (parts[0], other)))
    if axis in contract[side]:
        paired = contract[1 - side][list(contract[side]).index(axis)]
        total = None
        for p, s, n in zip(parts, starts, sizes):
            o = lax.slice_in_dim(other, s, s + n, axis=paired)
            ops_ = (p, o) if side == 0 else (o, p)
            prod = lax.dot_general(*ops_, nd.params["dimension_numbers"], precision=nd.params.get("precision"),
                                   preferred_element_type=jnp.float32 if wide else dtype)
            total = prod if total is None else total + prod
        return total.astype(dtype)
    ndim = parts[0].ndim
    kept = [d for d in range(ndim) if d not in contract[side] and d not in batch[side]]
    n_batch = len(batch[0])
    other_free = other.ndim - len(contract[1 - side]) - n_batch
    out_axis = n_batch + kept.index(axis) + (0 if side == 0 else other_free)
    prods = [bind_node(nd, [p, other] if side == 0 else [other, p])[0] for p in parts]
    return jnp.concatenate(prods, axis=out_axis)


def _sum(nd: Node, parts: Parts, axis: int, wide: bool):
    """A sum of a value held in parts: the parts' sums added (over the axis) or concatenated (keeping it)."""
    axes = tuple(nd.params["axes"])
    if axis in axes:
        dtype = parts[0].dtype
        acc = jnp.float32 if wide and jnp.issubdtype(dtype, jnp.floating) else dtype
        total = None
        for p in parts:
            s = jnp.sum(p.astype(acc), axis=axes)
            total = s if total is None else total + s
        return total.astype(dtype)
    sums = [bind_node(nd, [p])[0] for p in parts]
    return jnp.concatenate(sums, axis=axis - sum(1 for a in axes if a < axis))
