"""The small public surface: `jit` (with `tune` in `search` and `PlanStore` in `store`).

`autofuse.jit(fn)` is a drop-in for `jax.jit`, and is a `jax.jit` underneath:
calls dispatch through JAX's own fast path. When JAX traces a new input
signature, autofuse captures the program, finds its plan (given directly, or
looked up in the plan store for this device and software), checks that the
fused program builds (and re-verifies plans made with other versions), and
traces the fused program instead of `fn`. Anything wrong with a plan
(missing, failing re-verification, malformed, no longer compiling) traces
plain `fn` with one logged warning, or raises with `on_miss="error"`.
"""
from __future__ import annotations

import functools
import logging
import os
from typing import Any, Callable, Sequence

import jax

from .graph import Graph, capture, flatten_args
from .plan import Plan, PlanError, executor

log = logging.getLogger("autofuse")


class AutofuseFunction:
    """A `jax.jit`-ed function that traces a fused plan where it has one."""

    def __init__(self, fn: Callable, *, plan: Plan | None = None, store: Any = None, static_argnums: Sequence[int] = (),
                 static_argnames: Sequence[str] = (), donate_argnums: Sequence[int] = (), on_miss: str = "xla",
                 on_version_mismatch: str = "verify", interpret: bool | None = None):
        if on_miss not in ("xla", "error"):
            raise ValueError(f"on_miss must be 'xla' or 'error', got {on_miss!r}")
        if on_version_mismatch not in ("verify", "refuse"):
            raise ValueError(f"on_version_mismatch must be 'verify' or 'refuse', got {on_version_mismatch!r}")
        self.fn = fn
        self.plan = plan
        self.store = store
        self.static_argnums = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
        self.static_argnames = (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames)
        self.on_miss, self.on_version_mismatch = on_miss, on_version_mismatch
        self.interpret = interpret
        self.last_status: str = ""  # what the most recently traced signature runs: "plan", "plan-reverified" or "xla: <why>"
        @functools.wraps(fn)  # named after the user's function in HLO dumps and profiles (jit_<name>, not jit__traced)
        def traced(*args: Any, **kwargs: Any) -> Any:
            return self._traced(*args, **kwargs)

        self._jitted = jax.jit(traced, static_argnums=self.static_argnums, static_argnames=self.static_argnames, donate_argnums=donate_argnums)
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._jitted(*args, **kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        return self._jitted.lower(*args, **kwargs)

    # tracing a new signature ---------------------------------------------------
    def capture(self, *args: Any, **kwargs: Any) -> Graph:
        return capture(self.fn, *args, static_argnums=self.static_argnums, static_argnames=self.static_argnames, **kwargs)

    def _traced(self, *args: Any, **kwargs: Any) -> Any:
        graph = self.capture(*args, **kwargs)
        run, self.last_status = self._build(graph)
        if run is None:
            return self.fn(*args, **kwargs)
        leaves = flatten_args(graph, self.fn, args, kwargs, self.static_argnums, self.static_argnames)
        return jax.tree_util.tree_unflatten(graph.out_tree, run(leaves))

    def _build(self, graph: Graph) -> tuple[Callable | None, str]:
        plan, status = self._find_plan(graph)
        if plan is None or plan.is_xla:
            return None, status
        specs = [jax.ShapeDtypeStruct(graph.avals[v].shape, graph.avals[v].dtype) for v in graph.inputs]
        try:
            run = executor(graph, plan, interpret=self.interpret)
            compiled = jax.jit(lambda *leaves: run(leaves)).lower(*specs).compile()
        except Exception as e:  # a plan that no longer builds or compiles never breaks the program
            return None, self._miss(graph, f"its plan does not build here ({type(e).__name__}: {str(e)[:300]})")
        if status == "plan-version":
            if not self._reverify(graph, compiled):
                return None, self._miss(graph, "its plan, made with other software versions, failed re-verification")
            status = "plan-reverified"
        return run, status

    def _miss(self, graph: Graph, why: str) -> str:
        msg = f"autofuse: program {graph.fingerprint}: {why}"
        if self.on_miss == "error":
            raise PlanError(msg)
        log.warning("%s; running plain jax.jit", msg)
        return f"xla: {why}"

    def _find_plan(self, graph: Graph) -> tuple[Plan | None, str]:
        if self.plan is not None:
            if self.plan.fingerprint == graph.fingerprint:
                return self.plan, "plan"
            return None, self._miss(graph, f"the given plan is for program {self.plan.fingerprint}")
        found = self._lookup(graph)
        if isinstance(found, str):
            return None, self._miss(graph, found)
        return found

    def _lookup(self, graph: Graph) -> tuple[Plan, str] | str:
        """The stored plan for this program, device and software, or why there is none."""
        store = _open_store(self.store)
        if store is None:
            return "no plan store (pass store= or set AUTOFUSE_DB)"
        from .device import device_info, software

        try:
            hit = store.lookup(graph.fingerprint, device_info()["name"], software())
        except Exception as e:
            return f"the plan store cannot be read ({type(e).__name__}: {e})"
        if hit is None:
            return f"no stored plan for this program on {device_info()['name']}"
        try:
            plan = Plan.from_dict(hit.plan_json)
        except PlanError as e:
            return f"stored plan {hit.plan_id} is invalid: {e}"
        if hit.match == "exact":
            return plan, "plan"
        if self.on_version_mismatch == "refuse":
            return f"stored plan {hit.plan_id} was made with other software ({hit.software}) and on_version_mismatch='refuse'"
        log.warning("autofuse: program %s: stored plan %s was made with other software (%s); re-verifying it once",
                    graph.fingerprint, hit.plan_id, hit.software)
        return plan, "plan-version"

    def _reverify(self, graph: Graph, fused: Callable) -> bool:
        """Check the fused program against jax.jit on fresh inputs, eagerly (this runs while JAX traces)."""
        from .runner.measure import check, cone_tolerances

        ref = jax.jit(lambda *a: graph.evaluate(a))
        with jax.ensure_compile_time_eval():
            res = check(fused, ref, [graph.avals[v] for v in graph.inputs], (11, 12),
                        cone_tolerances(graph, [n.id for n in graph.nodes], graph.outputs))
        return res.ok


def _open_store(store: Any) -> Any:
    """A PlanStore from a store, a URL, or (None) $AUTOFUSE_DB / the default file if it exists."""
    from .store import PlanStore
    from .store.db import default_url

    if isinstance(store, PlanStore):
        return store
    if store is None:
        url = os.environ.get("AUTOFUSE_DB") or default_url()
        if url.startswith("sqlite:///") and not os.path.exists(url[len("sqlite:///"):]):
            return None  # deploy time never creates a database
        store = url
    try:
        return _store_cache(store)
    except Exception as e:
        log.warning("autofuse: cannot open plan store %s: %s", store, e)
        return None


@functools.lru_cache(maxsize=8)
def _store_cache(url: str) -> Any:
    from .store import PlanStore

    return PlanStore(url)


def jit(fn: Callable | None = None, *, plan: Plan | None = None, store: Any = None, static_argnums: Sequence[int] = (),
        static_argnames: Sequence[str] = (), donate_argnums: Sequence[int] = (), on_miss: str = "xla",
        on_version_mismatch: str = "verify", interpret: bool | None = None) -> Any:
    """Like `jax.jit`, but runs the tuned plan for the program where there is one.

    The plan is `plan` if given, else the current plan in `store` (a `PlanStore`
    or URL; default `$AUTOFUSE_DB` or the per-user file) for this program, device
    and software. A plan made with other jax/jaxlib/autofuse versions is
    re-verified once against `jax.jit` (`on_version_mismatch="verify"`) or not
    used (`"refuse"`). Without a usable plan: plain `jax.jit` and one logged
    warning (`on_miss="xla"`), or `PlanError` (`on_miss="error"`).
    Usable as `autofuse.jit(f, ...)` or as a decorator `@autofuse.jit(...)`.
    """
    def wrap(f: Callable) -> AutofuseFunction:
        return AutofuseFunction(f, plan=plan, store=store, static_argnums=static_argnums, static_argnames=static_argnames,
                                donate_argnums=donate_argnums, on_miss=on_miss, on_version_mismatch=on_version_mismatch,
                                interpret=interpret)

    return wrap if fn is None else wrap(fn)
