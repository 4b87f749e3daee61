"""The small public surface: `jit` (with `tune` in `search` and `PlanStore` in `store`).

`autofuse.jit(fn)` is a drop-in for `jax.jit`, and is a `jax.jit` underneath:
calls dispatch through JAX's own fast path. When JAX traces a new input
signature, autofuse captures the program, finds its plan (given directly, or
looked up in the plan store for this device and software), checks that the
fused program builds (and re-verifies plans made with other versions), and
traces the fused program instead of `fn`. A shape that was not tuned exactly
may take the plan of a program of the same structure tuned at other sizes
(`autofuse.shapes`), checked once against `jax.jit` at that shape and
remembered in the store. Anything wrong with a plan (missing, failing
re-verification, malformed, no longer compiling) traces plain `fn` with one
logged warning, or raises with `on_miss="error"`.
"""
from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from .deploy.background import TuningJob
from .deploy.lookup import resolve
from .deploy.serve import serve
from .deploy.settings import Deployment
from .deploy.traces import Signatures
from .graph import Graph, capture, flatten_args
from .plan import Plan, preload_pallas_lowerings

log = logging.getLogger("autofuse")


def _setting(name: str) -> property:
    return property(lambda self: getattr(self.deployment, name), doc=f"`autofuse.jit`'s {name} (read-only: see `deployment`).")


class AutofuseFunction:
    """A `jax.jit`-ed function that traces a fused plan where it has one; what it runs is decided by
    `autofuse.deploy` (`deployment` holds its settings)."""

    fn = _setting("fn")
    plan = _setting("plan")
    store = _setting("store")
    static_argnums = _setting("static_argnums")
    static_argnames = _setting("static_argnames")
    on_miss = _setting("on_miss")
    on_version_mismatch = _setting("on_version_mismatch")
    on_other_shape = _setting("on_other_shape")
    interpret = _setting("interpret")
    tune_budget = _setting("tune_budget")
    name = _setting("name")  # ``module:qualname`` of the wrapped function, as misses and `explain` name it

    def __init__(self, fn: Callable, *, plan: Plan | None = None, store: Any = None, static_argnums: Sequence[int] = (),
                 static_argnames: Sequence[str] = (), donate_argnums: Sequence[int] = (), on_miss: str = "xla",
                 on_version_mismatch: str = "verify", on_other_shape: str = "check", interpret: bool | None = None,
                 tune_budget: Any = None) -> None:
        self.deployment = Deployment.of(fn, plan=plan, store=store, static_argnums=static_argnums, static_argnames=static_argnames,
                                        on_miss=on_miss, on_version_mismatch=on_version_mismatch, on_other_shape=on_other_shape,
                                        interpret=interpret, tune_budget=tune_budget)
        # Background tuning jobs this function started (on_miss="tune") and not yet seen finish; while there are any,
        # a call checks at most once a second whether one finished, and then traces again to pick its plan up.
        self.tuning_jobs: list[TuningJob] = []
        self._next_poll = 0.0
        # What the most recent call ran (see `Resolution.status`): "plan: 2 fused groups (...), run R, plan P",
        # "plan-reverified: ...", "xla-plan: nothing beat jax.jit (...)" or "xla: <why>".
        self.last_status: str = ""
        self._traced_status: dict[str, str] = {}  # by program fingerprint: what each traced signature runs
        self._signatures = Signatures(self.static_argnums, self.static_argnames)  # the same, by jax.jit's cache key
        self._donate_argnums = donate_argnums
        self._call = threading.local()  # this thread's call's own arguments while it traces (for a check at them)
        preload_pallas_lowerings(interpret)  # else the second call of each signature traces again (see plan.py)
        self._jitted = self._new_jit()
        functools.update_wrapper(self, fn)

    def _new_jit(self) -> Any:
        """A `jax.jit` of a new function object: JAX caches traces by function, so a new one traces every signature
        again (after a background tuning job stored a plan)."""
        @functools.wraps(self.fn)  # named after the user's function in HLO dumps and profiles (jit_<name>, not jit__traced)
        def traced(*args: Any, **kwargs: Any) -> Any:
            return self._traced(*args, **kwargs)

        return jax.jit(traced, static_argnums=self.static_argnums, static_argnames=self.static_argnames,
                       donate_argnums=self._donate_argnums)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.tuning_jobs:
            self._poll_jobs()
        self._call.args = (args, kwargs)
        try:
            out = self._jitted(*args, **kwargs)
        finally:
            self._call.args = None
        if self._signatures.several():  # a call that did not trace says what its signature runs, not the last traced one's
            self.last_status = self._signatures.status(args, kwargs) or self.last_status
        return out

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """As `jax.jit(...).lower`: the program each signature traces (a fused plan where there is one)."""
        return self._jitted.lower(*args, **kwargs)

    def _poll_jobs(self) -> None:
        """At most once a second: if a background tuning job ended, forget the traces made so far, so that the
        next call traces again and finds its plan (the other signatures find theirs again)."""
        now = time.monotonic()
        if now < self._next_poll:
            return
        self._next_poll = now + 1.0
        ended = [j for j in self.tuning_jobs if j.done()]
        if ended:
            self.tuning_jobs = [j for j in self.tuning_jobs if not j.done()]
            for j in ended:  # a job that succeeded removed its log; a failed one's is kept
                rc = j.process.returncode
                log.warning("autofuse: %s: the background tuning job for %s ended (exit status %s%s): tracing again to pick up its plan",
                            self.name, ", ".join(j.inputs), rc, f", log {j.log}" if rc else "")
            self._jitted = self._new_jit()
            self._traced_status.clear()
            self._signatures.clear()

    def capture(self, *args: Any, **kwargs: Any) -> Graph:
        """The program these arguments trace, as `autofuse.capture` sees it (static arguments as given to jit)."""
        return capture(self.fn, *args, static_argnums=self.static_argnums, static_argnames=self.static_argnames, **kwargs)

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
        return resolve(graph, self.deployment).explain(head, self.on_miss, graph.fingerprint)

    def _traced(self, *args: Any, **kwargs: Any) -> Any:
        """What jax.jit traces for a new signature: the fused plan `autofuse.deploy` serves, or plain `fn`."""
        graph = self.capture(*args, **kwargs)
        served = serve(graph, self.deployment, (args, kwargs), getattr(self._call, "args", None))
        if served.job is not None:
            self.tuning_jobs.append(served.job)
        self.last_status = served.status
        self._traced_status[graph.fingerprint] = self.last_status
        self._signatures.add(args, kwargs, self.last_status)
        if served.run is None:
            return self.fn(*args, **kwargs)
        leaves = flatten_args(graph, self.fn, args, kwargs, self.static_argnums, self.static_argnames)
        return jax.tree_util.tree_unflatten(graph.out_tree, served.run(leaves))


def jit(fn: Callable | None = None, *, plan: Plan | None = None, store: Any = None, static_argnums: Sequence[int] = (),
        static_argnames: Sequence[str] = (), donate_argnums: Sequence[int] = (), on_miss: str = "xla",
        on_version_mismatch: str = "verify", on_other_shape: str = "check", interpret: bool | None = None,
        tune_budget: Any = None) -> Any:
    """Like `jax.jit`, but runs the tuned plan for the program where there is one.

    The plan is `plan` if given, else the current plan in `store` (a `PlanStore`
    or URL; default `$AUTOFUSE_DB` or the per-user file) for this program, device
    and software. A plan made with other jax/jaxlib/autofuse versions is
    re-verified once against `jax.jit` (`on_version_mismatch="verify"`) or not
    used (`"refuse"`). Input shapes not tuned exactly may take the plan of the
    same program (its structure) tuned at other sizes, where every group still
    matches and every config still fits, after one check against `jax.jit` at
    that shape remembered in the store (`on_other_shape="check"`), or never
    (`"refuse"`). Without a usable plan: plain `jax.jit` and one logged
    warning (`on_miss="xla"`), `PlanError` (`on_miss="error"`), or plain `jax.jit`
    at once and the missed shapes queued for a background tuning job
    (`on_miss="tune"`: a separate low-priority process, `tune_budget` trials or an
    `autofuse.background.BackgroundTune`, one job per program at a time; the
    function must be importable by name); a later trace of those shapes, in this
    process once the job ends or in the next, picks its plan up.
    Usable as `autofuse.jit(f, ...)` or as a decorator `@autofuse.jit(...)`.
    """
    def wrap(f: Callable) -> AutofuseFunction:
        return AutofuseFunction(f, plan=plan, store=store, static_argnums=static_argnums, static_argnames=static_argnames,
                                donate_argnums=donate_argnums, on_miss=on_miss, on_version_mismatch=on_version_mismatch,
                                on_other_shape=on_other_shape, interpret=interpret, tune_budget=tune_budget)

    return wrap if fn is None else wrap(fn)
