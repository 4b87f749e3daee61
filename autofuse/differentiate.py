"""Reverse-mode autodiff through fused groups: every kernel of a plan gets a `jax.custom_vjp`.

A `pallas_call` has no VJP, so without this `jax.grad` of a function run
through `autofuse.jit` fails on its first fused group. Each group's kernel is
wrapped so that differentiating the plan gives the same gradient as
differentiating the plain program:

- the forward pass runs the fused kernel (or a variant of it that also emits
  the residuals a template's own backward wants);
- the backward pass is the template's `VJPRule` where it has one (attention's:
  the output and row logsumexp saved, the probabilities recomputed per tile),
  else the **recompute rule**: the group's inputs are saved and its own
  sub-jaxpr is differentiated (`jax.vjp` of the reference computation) and run
  by XLA. Residuals are then only values the program holds anyway (the group's
  inputs); no intermediate of the group is kept alive.

Second-order reverse mode (`jax.grad(jax.grad(f))`) works for groups under the
recompute rule: its forward calls the wrapped kernel itself and its backward is
plain JAX. A template's own rule runs kernels that are not differentiable again
(`first_order_only`): going through one a second time raises a clear error. Forward mode (`jax.jvp`, `jax.jacfwd`, `jax.hessian`,
`jax.linearize`) is refused by JAX for any `custom_vjp` function with
"can't apply forward-mode autodiff (jvp) to a custom_vjp function"; run
`jax.jit(fn)` for forward-mode work.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from .graph import Group

__all__ = ["VJPRule", "differentiable", "first_order_only", "is_differentiable", "recompute_rule"]


@dataclass(frozen=True)
class VJPRule:
    """How a fused group is differentiated.

    `forward(kernel, ins)` returns `(outs, residuals)`: the group's outputs (by calling `kernel`, the wrapped
    fused kernel, or a variant that also yields residuals) and a tuple of arrays the backward needs.
    `backward(residuals, cts)` returns one cotangent per group input (None for an input that is not a float,
    or that the outputs do not depend on). `name` says which rule ran, for people reading a plan's behaviour.
    """

    forward: Callable[[Callable, Sequence[Any]], tuple[list, tuple]]
    backward: Callable[[tuple, list], list]
    name: str = "custom"


def is_differentiable(dtype: Any) -> bool:
    """Whether values of `dtype` carry cotangents (floats and complex; integers and bools do not)."""
    return bool(jnp.issubdtype(dtype, jnp.inexact))


def recompute_rule(group: Group) -> VJPRule:
    """Save the group's inputs; in the backward, differentiate its own sub-jaxpr (run by XLA)."""
    in_diff = [is_differentiable(a.dtype) for a in group.input_avals()]
    out_diff = [is_differentiable(a.dtype) for a in group.output_avals()]

    def forward(kernel: Callable, ins: Sequence[Any]) -> tuple[list, tuple]:
        return kernel(*ins), tuple(ins)

    def backward(res: tuple, cts: list) -> list:
        fixed = list(res)

        def ref(*diff_ins: Any) -> list:
            it = iter(diff_ins)
            full = [next(it) if d else x for x, d in zip(fixed, in_diff)]
            return [o for o, d in zip(group.evaluate(full), out_diff) if d]

        _, pullback = jax.vjp(ref, *[x for x, d in zip(fixed, in_diff) if d])
        grads = iter(pullback([c for c, d in zip(cts, out_diff) if d]))
        return [next(grads) if d else None for d in in_diff]

    return VJPRule(forward, backward, "recompute")


def differentiable(group: Group, kernel: Callable, rule: VJPRule | None = None) -> Callable:
    """`kernel` (a function of the group's inputs returning its outputs) with a `jax.custom_vjp` from `rule`
    (default: `recompute_rule(group)`)."""
    rule = rule if rule is not None else recompute_rule(group)
    in_avals = group.input_avals()
    in_diff = [is_differentiable(a.dtype) for a in in_avals]

    @jax.custom_vjp
    def fused(*ins: Any) -> list:
        return list(kernel(*ins))

    def fwd(*ins: Any) -> tuple[list, tuple]:
        outs, res = rule.forward(fused, ins)
        return list(outs), tuple(res)

    def bwd(res: tuple, cts: list) -> tuple:
        grads = rule.backward(res, list(cts))
        if len(grads) != len(in_avals):
            raise ValueError(f"autofuse: the {rule.name} VJP of group {list(group.node_ids)} returned {len(grads)} "
                             f"cotangents for {len(in_avals)} inputs")
        out = []
        for g, d, av in zip(grads, in_diff, in_avals):
            if not d or g is None:
                out.append(None)  # custom_vjp: a zero cotangent (float0 for integer inputs)
            else:
                out.append(jnp.asarray(g).astype(av.dtype).reshape(av.shape))
        return tuple(out)

    fused.defvjp(fwd, bwd)
    return fused


def first_order_only(fn: Callable, what: str) -> Callable:
    """`fn` (kernels a template's VJP rule runs) with a VJP that refuses clearly: differentiating them again
    would otherwise fail deep inside Pallas."""
    @jax.custom_vjp
    def once(*args: Any) -> Any:
        return fn(*args)

    def fwd(*args: Any) -> tuple[Any, None]:
        return fn(*args), None

    def bwd(_: None, __: Any) -> tuple:
        raise NotImplementedError(f"autofuse: {what} cannot be differentiated again (second-order reverse mode "
                                  "through a template's own VJP rule); use jax.jit(fn) for higher-order derivatives")

    once.defvjp(fwd, bwd)
    return once
