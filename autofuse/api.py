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
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax

from .graph import Graph, capture, flatten_args, qualified_name
from .plan import Plan, PlanError, executor

log = logging.getLogger("autofuse")


@dataclass(frozen=True)
class Resolution:
    """What a signature runs, as decided before anything is built: ``kind`` is ``plan`` (a fused plan for this
    program, device and software), ``plan-version`` (one made with other versions: re-verified before use),
    ``xla-plan`` (a stored plan whose tuning found nothing that beat jax.jit) or ``miss`` (no usable plan:
    `why`)."""

    kind: str
    plan: Plan | None = None
    plan_id: int | None = None
    run_id: int | None = None
    software: dict = field(default_factory=dict)
    why: str = ""

    def where(self) -> str:
        """Which stored plan, e.g. ``run 7, plan 12`` (``given plan``: passed as plan=)."""
        if self.plan_id is None:
            return "given plan"
        return ", ".join(x for x in (f"run {self.run_id}" if self.run_id is not None else "", f"plan {self.plan_id}") if x)

    def status(self) -> str:
        """The `last_status` line: ``plan: 3 fused groups (attention, row_reduce×2), run 7, plan 12``,
        ``plan-reverified: ...``, ``xla-plan: nothing beat jax.jit (run 7, plan 12)`` or ``xla: <why>``."""
        if self.kind == "miss":
            return f"xla: {self.why}"
        if self.kind == "xla-plan":
            return f"xla-plan: nothing beat jax.jit when it was tuned ({self.where()})"
        head = "plan-reverified" if self.kind == "plan-version" else "plan"
        made = f", made with jax {self.software.get('jax')} (re-verified here)" if self.kind == "plan-version" else ""
        return f"{head}: {describe_groups(self.plan)}, {self.where()}{made}"


def describe_groups(plan: Plan | None) -> str:
    """``3 fused groups (attention, row_reduce×2)``: how many groups of which templates a plan runs."""
    groups = plan.groups if plan is not None else ()
    counts = Counter(g.template for g in groups)
    kinds = ", ".join(t if n == 1 else f"{t}×{n}" for t, n in counts.items())
    return f"{len(groups)} fused group{'s' if len(groups) != 1 else ''} ({kinds})"


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
        # What the most recently traced signature runs (see `Resolution.status`): "plan: 2 fused groups (...), run R, plan P",
        # "plan-reverified: ...", "xla-plan: nothing beat jax.jit (...)" or "xla: <why>".
        self.last_status: str = ""
        self._traced_status: dict[str, str] = {}  # by program fingerprint: what each traced signature runs
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

    @property
    def name(self) -> str:
        """``module:qualname`` of the wrapped function, as misses and `explain` name it."""
        return qualified_name(self.fn)

    def __repr__(self) -> str:
        store = self.store if isinstance(self.store, str) or self.store is None else repr(self.store)
        src = "plan=<given>" if self.plan is not None else f"store={store or '$AUTOFUSE_DB'}"
        last = f"last traced: {self.last_status}" if self.last_status else "not traced yet: the plan is looked up at the first call"
        return f"<autofuse.jit {self.name} {src} on_miss={self.on_miss!r}; {last}>"

    def explain(self, *args: Any, **kwargs: Any) -> str:
        """What a call with these arguments runs, without running (or compiling) anything: the plan it
        would use and where it comes from, or why it runs plain jax.jit. A signature already traced says
        what it runs; otherwise the store is looked up as the first call would (the plan is then built
        and, if made with other versions, re-verified at that call)."""
        graph = self.capture(*args, **kwargs)
        head = f"{self.name}({', '.join(graph.signature()['inputs'])})"
        if graph.fingerprint in self._traced_status:
            return f"{head} runs {self._traced_status[graph.fingerprint]}"
        res = self._resolve(graph)
        if res.kind == "miss":
            act = "raises PlanError" if self.on_miss == "error" else "runs plain jax.jit"
            return f"{head} {act} at the first call: {res.why} (program {graph.fingerprint})"
        if res.kind == "xla-plan":
            return f"{head} runs plain jax.jit: {res.status()}"
        if res.kind == "plan-version":
            return (f"{head} re-verifies against jax.jit at the first call, then runs {describe_groups(res.plan)}, {res.where()} "
                    f"(made with jax {res.software.get('jax')}, autofuse {res.software.get('autofuse')})")
        return f"{head} runs plan: {describe_groups(res.plan)}, {res.where()} (built at the first call)"

    def _traced(self, *args: Any, **kwargs: Any) -> Any:
        graph = self.capture(*args, **kwargs)
        run, self.last_status = self._build(graph)
        self._traced_status[graph.fingerprint] = self.last_status
        if run is None:
            return self.fn(*args, **kwargs)
        leaves = flatten_args(graph, self.fn, args, kwargs, self.static_argnums, self.static_argnames)
        return jax.tree_util.tree_unflatten(graph.out_tree, run(leaves))

    def _build(self, graph: Graph) -> tuple[Callable | None, str]:
        res = self._resolve(graph)
        if res.kind == "miss":
            return None, self._miss(graph, res.why)
        if res.kind == "plan-version":
            log.warning("autofuse: %s: program %s: stored plan %s was made with other software (%s); re-verifying it once",
                        self.name, graph.fingerprint, res.plan_id, res.software)
        if res.kind == "xla-plan":
            return None, res.status()
        plan = res.plan
        specs = [jax.ShapeDtypeStruct(graph.avals[v].shape, graph.avals[v].dtype) for v in graph.inputs]
        try:
            run = executor(graph, plan, interpret=self.interpret)
            compiled = jax.jit(lambda *leaves: run(leaves)).lower(*specs).compile()
        except Exception as e:  # a plan that no longer builds or compiles never breaks the program
            return None, self._miss(graph, f"its plan does not build here ({type(e).__name__}: {str(e)[:300]})")
        if res.kind == "plan-version" and not self._reverify(graph, compiled):
            return None, self._miss(graph, f"stored plan {res.plan_id}, made with other software versions, failed re-verification")
        return run, res.status()

    def _miss(self, graph: Graph, why: str) -> str:
        msg = f"autofuse: {self.name}: program {graph.fingerprint}: {why}"
        if self.on_miss == "error":
            raise PlanError(msg)
        log.warning("%s; running plain jax.jit", msg)
        return f"xla: {why}"

    def _resolve(self, graph: Graph) -> Resolution:
        """The plan for this program (given, or the store's current one for this device and software), or why
        there is none. Reads only: never logs, raises or writes."""
        if self.plan is not None:
            if self.plan.fingerprint != graph.fingerprint:
                return Resolution("miss", why=f"the given plan is for program {self.plan.fingerprint}, not this one "
                                              f"(inputs {', '.join(graph.signature()['inputs'])})")
            return Resolution("xla-plan" if self.plan.is_xla else "plan", self.plan)
        store, why = _open_store(self.store)
        if store is None:
            return Resolution("miss", why=why)
        from .device import device_info, software

        device, sw = device_info()["name"], software()
        try:
            hit = store.lookup(graph.fingerprint, device, sw)
        except Exception as e:
            return Resolution("miss", why=f"the plan store cannot be read ({type(e).__name__}: {e})")
        if hit is None:
            return Resolution("miss", why=self._why_missing(store, graph, device, sw))
        try:
            plan = Plan.from_dict(hit.plan_json)
        except PlanError as e:
            return Resolution("miss", why=f"stored plan {hit.plan_id} is invalid: {e}")
        if hit.match != "exact" and self.on_version_mismatch == "refuse":
            return Resolution("miss", why=f"stored plan {hit.plan_id} was made with other software ({_versions(hit.software)}; "
                                          f"here {_versions(sw)}) and on_version_mismatch='refuse'")
        kind = "xla-plan" if plan.is_xla else "plan" if hit.match == "exact" else "plan-version"
        return Resolution(kind, plan, hit.plan_id, hit.run_id, dict(hit.software))

    def _why_missing(self, store: Any, graph: Graph, device: str, sw: dict) -> str:
        """The store's account of a miss (never tuned; other shapes, dtypes or static values; another device)."""
        try:
            return store.explain_miss(graph.fingerprint, device, sw, function=self.name, signature=graph.signature()).text
        except Exception:  # noqa: BLE001 -- an explanation must never break the program
            return f"no stored plan for this program on {device}"

    def _reverify(self, graph: Graph, fused: Callable) -> bool:
        """Check the fused program against jax.jit on fresh inputs, eagerly (this runs while JAX traces)."""
        from .runner.measure import check, cone_tolerances

        ref = jax.jit(lambda *a: graph.evaluate(a))
        with jax.ensure_compile_time_eval():
            res = check(fused, ref, [graph.avals[v] for v in graph.inputs], (11, 12),
                        cone_tolerances(graph, [n.id for n in graph.nodes], graph.outputs))
        return res.ok


def _open_store(store: Any) -> tuple[Any, str]:
    """A `PlanStore` (opened read-only: a lookup never creates, migrates or writes a database) from a store,
    a URL, or (None) $AUTOFUSE_DB / the default file; or None and why not."""
    from .store import PlanStore
    from .store.db import default_url, display_url

    if isinstance(store, PlanStore):
        return store, ""
    if store is None:
        url = os.environ.get("AUTOFUSE_DB") or default_url()
        if url.startswith("sqlite:///") and not os.path.exists(url[len("sqlite:///"):]):
            return None, "no plan store (pass store= or set AUTOFUSE_DB)"
        store = url
    try:
        return _store_cache(store), ""
    except Exception as e:
        return None, f"the plan store {display_url(str(store))} cannot be opened ({e})"


@functools.lru_cache(maxsize=8)
def _store_cache(url: str) -> Any:
    from .store import PlanStore

    return PlanStore(url, readonly=True)


def _versions(sw: dict) -> str:
    return ", ".join(f"{k} {sw[k]}" for k in ("jax", "jaxlib", "autofuse") if k in sw)


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
