"""The small public surface: `jit` (and, with the search and store, `tune` and `PlanStore`)."""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Sequence

import jax
import numpy as np

from .graph import Graph, _split_static, capture, flatten_args
from .plan import Plan, PlanError, executor

log = logging.getLogger("autofuse")


class AutofuseFunction:
    """A drop-in for a `jax.jit`-ed function that runs a fused plan where it has one."""

    def __init__(self, fn: Callable, *, plan: Plan | None = None, static_argnums: Sequence[int] = (), static_argnames: Sequence[str] = (),
                 donate_argnums: Sequence[int] = (), on_miss: str = "xla", interpret: bool | None = None):
        if on_miss not in ("xla", "error"):
            raise ValueError(f"on_miss must be 'xla' or 'error', got {on_miss!r}")
        self.fn = fn
        self.plan = plan
        self.static_argnums = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
        self.static_argnames = (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames)
        self.donate_argnums = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
        self.on_miss = on_miss
        self.interpret = interpret
        self._cache: dict[Any, Callable] = {}
        self.last_status: str = ""
        functools.update_wrapper(self, fn)

    def _key(self, args: tuple, kwargs: dict) -> Any:
        # Static arguments by value (as capture sees them), dynamic leaves by shape and dtype.
        dyn_args, dyn_kwargs, _, static_repr = _split_static(self.fn, args, kwargs, self.static_argnums, self.static_argnames)
        leaves, tree = jax.tree_util.tree_flatten((dyn_args, dyn_kwargs))
        return tree, static_repr, tuple((np.shape(x), str(getattr(x, "dtype", type(x)))) if hasattr(x, "shape") or isinstance(x, (int, float, complex, bool)) else ("static", repr(x)) for x in leaves)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key = self._key(args, kwargs)
        fn = self._cache.get(key)
        if fn is None:
            fn = self._cache[key] = self._build(args, kwargs)
        return fn(*args, **kwargs)

    def capture(self, *args: Any, **kwargs: Any) -> Graph:
        return capture(self.fn, *args, static_argnums=self.static_argnums, static_argnames=self.static_argnames, **kwargs)

    def _xla(self) -> Callable:
        return jax.jit(self.fn, static_argnums=self.static_argnums, static_argnames=self.static_argnames, donate_argnums=self.donate_argnums)

    def _build(self, args: tuple, kwargs: dict) -> Callable:
        graph = self.capture(*args, **kwargs)
        plan = self._find_plan(graph)
        if plan is None or plan.is_xla:
            return self._xla()
        run = executor(graph, plan, interpret=self.interpret)
        donate = self._donated_leaves(args)
        flat = jax.jit(lambda *leaves: run(leaves), donate_argnums=donate)

        def call(*a: Any, **k: Any) -> Any:
            leaves = flatten_args(graph, self.fn, a, k, self.static_argnums, self.static_argnames)
            return jax.tree_util.tree_unflatten(graph.out_tree, flat(*leaves))

        return call

    def _find_plan(self, graph: Graph) -> Plan | None:
        if self.plan is not None:
            if self.plan.fingerprint == graph.fingerprint:
                self.last_status = "plan"
                return self.plan
            msg = f"autofuse: the given plan is for program {self.plan.fingerprint}, this call is program {graph.fingerprint}"
            if self.on_miss == "error":
                raise PlanError(msg)
            log.warning("%s; running plain jax.jit", msg)
        elif self.on_miss == "error":
            raise PlanError(f"autofuse: no plan for program {graph.fingerprint}")
        self.last_status = "xla"
        return None

    def _donated_leaves(self, args: tuple) -> tuple[int, ...]:
        if not self.donate_argnums:
            return ()
        out, pos = [], 0
        for i, a in enumerate(args):
            if i in self.static_argnums:
                continue
            n = len(jax.tree_util.tree_leaves(a))
            if i in self.donate_argnums:
                out.extend(range(pos, pos + n))
            pos += n
        return tuple(out)


def jit(fn: Callable | None = None, *, plan: Plan | None = None, static_argnums: Sequence[int] = (), static_argnames: Sequence[str] = (),
        donate_argnums: Sequence[int] = (), on_miss: str = "xla", interpret: bool | None = None) -> Any:
    """Like `jax.jit`, but runs the tuned plan for the program where there is one.

    Usable as `autofuse.jit(f, plan=...)` or as a decorator `@autofuse.jit`.
    Without a plan for the call's program it runs plain `jax.jit`
    (`on_miss="xla"`) or raises (`on_miss="error"`).
    """
    def wrap(f: Callable) -> AutofuseFunction:
        return AutofuseFunction(f, plan=plan, static_argnums=static_argnums, static_argnames=static_argnames,
                                donate_argnums=donate_argnums, on_miss=on_miss, interpret=interpret)

    return wrap if fn is None else wrap(fn)
