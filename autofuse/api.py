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
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax

from .graph import Graph, capture, flatten_args, qualified_name
from .plan import Plan, PlanError, describe_groups, executor, preload_pallas_lowerings

log = logging.getLogger("autofuse")


@dataclass(frozen=True)
class Resolution:
    """What a signature runs, as decided before anything is built: ``kind`` is ``plan`` (a fused plan for this
    program, device and software), ``plan-version`` (one made with other versions: re-verified before use),
    ``plan-shape`` (the plan of a program of the same structure tuned at other sizes, `tuned_at`, adapted to
    these, `serving`: checked against jax.jit unless a check is `remembered`), ``xla-plan`` (a stored plan whose
    tuning found nothing that beat jax.jit) or ``miss`` (no usable plan: `why`). `learned`: structures of stored
    programs computed on the way ((fingerprint, structure) pairs the store did not have), to record."""

    kind: str
    plan: Plan | None = None
    plan_id: int | None = None
    run_id: int | None = None
    software: dict = field(default_factory=dict)
    why: str = ""
    tuned_at: str = ""
    serving: str = ""
    remembered: Any = None  # store.ShapeVerdict of an earlier check at this shape (plan-shape)
    learned: tuple[tuple[str, str], ...] = ()

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
        if self.kind == "plan-shape":
            return f"plan (tuned at {self.tuned_at}, serving {self.serving}): {describe_groups(self.plan)}, {self.where()}, {self.checked()}"
        head = "plan-reverified" if self.kind == "plan-version" else "plan"
        made = f", made with jax {self.software.get('jax')} (re-verified here)" if self.kind == "plan-version" else ""
        return f"{head}: {describe_groups(self.plan)}, {self.where()}{made}"


    def checked(self) -> str:
        """How a plan-shape resolution was checked at its shape: ``checked against jax.jit here`` or
        ``checked against jax.jit 2026-11-28 10:02 (remembered)``."""
        when = getattr(self.remembered, "checked_at", None)
        return f"checked against jax.jit {when:%Y-%m-%d %H:%M} (remembered)" if when is not None else "checked against jax.jit here"


class _Signatures:
    """What each signature an `AutofuseFunction` traced runs, by what jax.jit's cache tells calls apart (the arguments'
    tree structure, static values, each array's shape, dtype and weak type), so that a call that did not trace (its
    signature traced before) says what it ran. Only the parts in which the traced signatures differ are looked at (a
    batch size among a model's hundreds of weights), so a call pays for a few leaves, and nothing with one signature."""

    def __init__(self, static_argnums: Sequence[int], static_argnames: Sequence[str]):
        self.static_argnums, self.static_argnames = static_argnums, frozenset(static_argnames)
        self.status_by_key: dict[tuple, str] = {}
        self.parts: tuple[int, ...] | None = None  # the key's parts that tell the traced signatures apart (None: all)
        self.by_parts: dict[tuple, str] = {}

    def several(self) -> bool:
        return len(self.status_by_key) > 1

    def clear(self) -> None:
        self.status_by_key, self.parts, self.by_parts = {}, None, {}

    def add(self, args: tuple, kwargs: dict, status: str) -> None:
        """Record what a signature runs (from the arguments `_traced` received: tracers where the call has arrays)."""
        tree, leaves = self._split(args, kwargs)
        self.status_by_key[(tree, *map(_leaf_key, leaves))] = status
        keys = list(self.status_by_key)
        if len({len(k) for k in keys}) == 1:
            self.parts = tuple(i for i in range(len(keys[0])) if len({k[i] for k in keys}) > 1)
            self.by_parts = {tuple(k[i] for i in self.parts): s for k, s in self.status_by_key.items()}
        else:
            self.parts, self.by_parts = None, dict(self.status_by_key)

    def status(self, args: tuple, kwargs: dict) -> str | None:
        """What a call with these arguments ran; None for a signature never traced."""
        tree, leaves = self._split(args, kwargs)
        if self.parts is None:
            return self.by_parts.get((tree, *map(_leaf_key, leaves)))
        if len(leaves) + 1 != len(next(iter(self.status_by_key))):
            return None
        return self.by_parts.get(tuple(tree if i == 0 else _leaf_key(leaves[i - 1]) for i in self.parts))

    def _split(self, args: tuple, kwargs: dict) -> tuple[Any, list]:
        """The tree structure of the dynamic arguments with the static values, and the dynamic leaves."""
        n = len(args)
        static = {i % n for i in self.static_argnums if -n <= i < n}
        fixed = (tuple(args[i] for i in sorted(static)), tuple(sorted((k, v) for k, v in kwargs.items() if k in self.static_argnames)))
        leaves, tree = jax.tree_util.tree_flatten(([a for i, a in enumerate(args) if i not in static],
                                                   {k: v for k, v in kwargs.items() if k not in self.static_argnames}))
        return (tree, fixed), leaves


def _leaf_key(x: Any) -> tuple:
    """A dynamic argument as jax.jit tells calls apart: shape, dtype and weak type (a Python scalar by its type alone)."""
    if isinstance(x, (bool, int, float, complex)):
        x = jax.typeof(x)
    return tuple(x.shape), x.dtype, bool(getattr(x, "weak_type", False))


class AutofuseFunction:
    """A `jax.jit`-ed function that traces a fused plan where it has one."""

    def __init__(self, fn: Callable, *, plan: Plan | None = None, store: Any = None, static_argnums: Sequence[int] = (),
                 static_argnames: Sequence[str] = (), donate_argnums: Sequence[int] = (), on_miss: str = "xla",
                 on_version_mismatch: str = "verify", on_other_shape: str = "check", interpret: bool | None = None,
                 tune_budget: Any = None):
        if on_miss not in ("xla", "error", "tune"):
            raise ValueError(f"on_miss must be 'xla', 'error' or 'tune', got {on_miss!r}")
        if on_version_mismatch not in ("verify", "refuse"):
            raise ValueError(f"on_version_mismatch must be 'verify' or 'refuse', got {on_version_mismatch!r}")
        if on_other_shape not in ("check", "refuse"):
            raise ValueError(f"on_other_shape must be 'check' or 'refuse', got {on_other_shape!r}")
        self.fn = fn
        self.plan = plan
        self.store = store
        self.static_argnums = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
        self.static_argnames = (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames)
        self.on_miss, self.on_version_mismatch, self.on_other_shape = on_miss, on_version_mismatch, on_other_shape
        self.interpret = interpret
        self.tune_budget: Any = None
        if on_miss == "tune":
            from .background import BackgroundTune

            self.tune_budget = BackgroundTune.of(tune_budget)
        # Background tuning jobs this function started (on_miss="tune") and not yet seen finish; while there are any,
        # a call checks at most once a second whether one finished, and then traces again to pick its plan up.
        self.tuning_jobs: list[Any] = []
        self._next_poll = 0.0
        # What the most recent call ran (see `Resolution.status`): "plan: 2 fused groups (...), run R, plan P",
        # "plan-reverified: ...", "xla-plan: nothing beat jax.jit (...)" or "xla: <why>".
        self.last_status: str = ""
        self._traced_status: dict[str, str] = {}  # by program fingerprint: what each traced signature runs
        self._signatures = _Signatures(self.static_argnums, self.static_argnames)  # the same, by jax.jit's cache key
        self._donate_argnums = donate_argnums
        self._call = threading.local()  # this thread's call's own arguments while it traces (`_caller_leaves`)
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
        if res.kind == "plan-shape":
            first = (f"{res.checked()}, " if res.remembered is not None else
                     "is checked against jax.jit at the first call (once per store, or per process where it cannot remember), then ")
            return (f"{head} runs plan (tuned at {res.tuned_at}, serving {res.serving}): {first}{describe_groups(res.plan)}, "
                    f"{res.where()}")
        return f"{head} runs plan: {describe_groups(res.plan)}, {res.where()} (built at the first call)"

    def _traced(self, *args: Any, **kwargs: Any) -> Any:
        graph = self.capture(*args, **kwargs)
        run, self.last_status = self._build(graph, (args, kwargs))
        self._traced_status[graph.fingerprint] = self.last_status
        self._signatures.add(args, kwargs, self.last_status)
        if run is None:
            return self.fn(*args, **kwargs)
        leaves = flatten_args(graph, self.fn, args, kwargs, self.static_argnums, self.static_argnames)
        return jax.tree_util.tree_unflatten(graph.out_tree, run(leaves))

    def _build(self, graph: Graph, call: tuple[tuple, dict] | None = None) -> tuple[Callable | None, str]:
        res = self._resolve(graph)
        if res.learned:
            self._remember(res, graph, None)
        if res.kind == "miss":
            status = self._miss(graph, res.why)
            return None, status + self._queue_tuning(graph, call) if self.on_miss == "tune" else status
        if res.kind == "plan-version":
            log.warning("autofuse: %s: program %s: stored plan %s was made with other software (%s); re-verifying it once",
                        self.name, graph.fingerprint, res.plan_id, res.software)
        if res.plan_id is not None:  # a plan from the store: its GEMMs compiled as its tuning job measured them
            _restore_autotune(self.store)
        checking = res.kind == "plan-shape" and res.remembered is None
        if checking:
            log.warning("autofuse: %s: program %s: no plan for these shapes; plan %s, tuned at %s, fits %s: checking it once "
                        "against jax.jit", self.name, graph.fingerprint, res.plan_id, res.tuned_at, res.serving)
        if res.kind == "xla-plan":
            return None, res.status()
        plan = res.plan
        specs = [jax.ShapeDtypeStruct(graph.avals[v].shape, graph.avals[v].dtype) for v in graph.inputs]
        try:
            run = executor(graph, plan, interpret=self.interpret)
            compiled = jax.jit(lambda *leaves: run(leaves)).lower(*specs).compile()
        except Exception as e:  # a plan that no longer builds or compiles never breaks the program
            why = f"its plan does not build here ({type(e).__name__}: {str(e)[:300]})"
            if checking:
                why = f"plan {res.plan_id} (tuned at {res.tuned_at}) does not build at {res.serving} ({type(e).__name__}: {str(e)[:300]})"
                self._remember(res, graph, ("failed", why))
            return None, self._miss(graph, why)
        if res.kind == "plan-version":
            ok, detail = self._reverify(graph, compiled)
            if not ok:
                return None, self._miss(graph, f"stored plan {res.plan_id}, made with other software versions, failed re-verification ({detail})")
        if checking:
            ok, detail = self._reverify(graph, compiled)
            if not ok:
                why = f"plan {res.plan_id} (tuned at {res.tuned_at}) failed its check against jax.jit at {res.serving} ({detail})"
                if not detail.startswith("undecided"):  # an undecided check is made again at the next trace
                    self._remember(res, graph, ("failed", why))
                return None, self._miss(graph, why)
            self._remember(res, graph, ("ok", ""))
            log.warning("autofuse: %s: program %s: plan %s (tuned at %s) passed its check against jax.jit at %s: serving it",
                        self.name, graph.fingerprint, res.plan_id, res.tuned_at, res.serving)
        return run, res.status()

    def _queue_tuning(self, graph: Graph, call: tuple[tuple, dict] | None) -> str:
        """Start a background job tuning this missed program (`autofuse.background`); what the status adds, or why
        not (logged once). Never waits for the job."""
        from .background import NotQueued, queue
        from .store import PlanStore
        from .store.db import readonly_reason, resolve_url

        store = self.store
        url = store.url if isinstance(store, PlanStore) else resolve_url(store)
        readonly = "it was opened read-only" if isinstance(store, PlanStore) and store.readonly else readonly_reason(url)
        if readonly is not None:
            why = f"the plan store is read-only: {readonly}"
        else:
            try:
                args, kwargs = call if call is not None else ((), {})
                job = queue(self.fn, graph.fingerprint, graph.signature()["inputs"], args, kwargs, self.static_argnums, self.static_argnames,
                            str(url), self.tune_budget)
            except (NotQueued, OSError) as e:
                why = str(e)
            else:
                self.tuning_jobs.append(job)
                log.warning("autofuse: %s: program %s: queued a background tuning job (pid %s, log %s)", self.name,
                            graph.fingerprint, job.process.pid, job.log)
                return f"; tuning these shapes in the background (pid {job.process.pid})"
        log.warning("autofuse: %s: program %s: not tuned in the background: %s", self.name, graph.fingerprint, why)
        return f"; not tuned in the background: {why}"

    def _remember(self, res: Resolution, graph: Graph, verdict: tuple[str, str] | None) -> None:
        """Record what this trace learned: the `verdict` ((``ok``|``failed``, detail)) of checking a plan at a shape
        it was not tuned for (in this process always; in the store where it can be written, so the next process
        skips the check), and the structures of stored programs computed on the way. A store that cannot be written
        is said so once per process; a failed write is one warning, never an error."""
        if verdict is not None:
            _CHECKED[(_store_key(self.store), res.plan_id, graph.fingerprint)] = verdict
        writer, why = _writer(self.store)
        if writer is None:
            if verdict is not None:
                _say_once(_store_key(self.store), why)
            return
        from .device import software

        try:
            for fp, structure in res.learned:
                writer.set_structure(fp, structure)
            if verdict is not None:
                writer.record_shape(res.plan_id, graph.fingerprint, graph.signature()["inputs"], software(), verdict[0], verdict[1])
        except Exception as e:  # noqa: BLE001 -- remembering is an optimisation: never break the program
            log.warning("autofuse: %s: could not record a shape check in the plan store (%s: %s)", self.name, type(e).__name__,
                        str(e)[:200])

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
            served, refusals, learned = self._other_shapes(store, graph, device, sw) if self.on_other_shape == "check" else (None, [], ())
            if served is not None:
                return served
            why = self._why_missing(store, graph, device, sw)
            if refusals:
                more = f"; and {len(refusals) - 2} other plan(s) of the same structure" if len(refusals) > 2 else ""
                why = f"{why}; {'; '.join(refusals[:2])}{more}"
            return Resolution("miss", why=why, learned=learned)
        try:
            plan = Plan.from_dict(hit.plan_json)
        except PlanError as e:
            return Resolution("miss", why=f"stored plan {hit.plan_id} is invalid: {e}")
        if hit.match != "exact" and self.on_version_mismatch == "refuse":
            return Resolution("miss", why=f"stored plan {hit.plan_id} was made with other software ({_versions(hit.software)}; "
                                          f"here {_versions(sw)}) and on_version_mismatch='refuse'")
        kind = "xla-plan" if plan.is_xla else "plan" if hit.match == "exact" else "plan-version"
        return Resolution(kind, plan, hit.plan_id, hit.run_id, dict(hit.software))

    def _other_shapes(self, store: Any, graph: Graph, device: str, sw: dict) -> tuple[Resolution | None, list[str], tuple]:
        """A plan of the same structure tuned at other sizes that serves this program (the nearest shapes first, exact
        versions first), as a ``plan-shape`` resolution; else None. Also why each one found refuses (a config that
        no longer fits, the template no longer matching, a failed check remembered) and the structures computed
        for stored programs that had none. Reads only."""
        from .shapes import adapt, nearest_first
        from .signatures import shape_change

        serving = graph.signature()["inputs"]
        try:
            found = [(sib, ()) for sib in store.same_structure(graph.structure, device, sw, exclude=graph.fingerprint)]
            found += self._unstructured(store, graph, device, sw)
        except Exception as e:  # noqa: BLE001 -- a store that cannot answer is a miss, said why
            return None, [f"plans of the same structure cannot be read ({type(e).__name__}: {str(e)[:200]})"], ()
        learned = tuple(x for _, x in found if x)
        found = nearest_first(found, serving, inputs=lambda f: f[0].inputs, exact=lambda f: f[0].plan.match == "exact")
        refusals = []
        for sib, _ in found:
            tuned, serves = shape_change(sib.inputs, serving)
            head = f"plan {sib.plan.plan_id} (tuned at {tuned})"
            try:
                plan = Plan.from_dict(sib.plan.plan_json)
            except PlanError as e:
                refusals.append(f"{head} is invalid: {e}")
                continue
            if plan.is_xla:
                continue  # nothing was fused at its shape: it says nothing of this one
            if sib.plan.match != "exact" and self.on_version_mismatch == "refuse":
                refusals.append(f"{head} was made with other software and on_version_mismatch='refuse'")
                continue
            try:
                adapted = adapt(plan, graph)
            except PlanError as e:
                refusals.append(f"{head} does not serve {serves}: {e}")
                continue
            remembered = _remembered(store, sib.plan.plan_id, graph.fingerprint, sw, self.store)
            if remembered is not None and remembered.verdict != "ok":
                refusals.append(remembered.detail or f"{head} failed its check against jax.jit at {serves}")
                continue
            return (Resolution("plan-shape", adapted, sib.plan.plan_id, sib.plan.run_id, dict(sib.plan.software), tuned_at=tuned,
                               serving=serves, remembered=remembered, learned=learned), refusals, learned)
        return None, refusals, learned

    def _unstructured(self, store: Any, graph: Graph, device: str, sw: dict) -> list[tuple[Any, tuple[str, str]]]:
        """Stored programs of this function whose structure was not recorded (tuned before it was): traced again at
        their stored input shapes (nothing is compiled); those of this program's structure with a current plan
        here, each with its (fingerprint, structure) to record. Not for functions with static arguments."""
        if self.static_argnums or self.static_argnames:
            return []
        from .shapes import specs_of
        from .store.results import SameStructure

        out = []
        for row in store.unstructured_programs(self.name):
            inputs = list((row["signature"] or {}).get("inputs") or [])
            specs = specs_of(inputs)
            if row["fingerprint"] == graph.fingerprint or specs is None or len(specs) != len(graph.inputs):
                continue
            try:
                d_args, d_kwargs = jax.tree_util.tree_unflatten(graph.in_tree, specs)
                other = capture(self.fn, *d_args, **d_kwargs)
            except Exception:  # noqa: BLE001, S112 -- the function no longer traces at those shapes: not a sibling
                continue
            if other.fingerprint != row["fingerprint"] or other.structure != graph.structure:
                continue
            hit = store.lookup(row["fingerprint"], device, sw)
            if hit is not None:
                out.append((SameStructure(hit, row["fingerprint"], tuple(inputs)), (row["fingerprint"], other.structure)))
        return out

    def _why_missing(self, store: Any, graph: Graph, device: str, sw: dict) -> str:
        """The store's account of a miss (never tuned; other shapes, dtypes or static values; another device)."""
        try:
            return store.explain_miss(graph.fingerprint, device, sw, function=self.name, signature=graph.signature()).text
        except Exception:  # noqa: BLE001 -- an explanation must never break the program
            return f"no stored plan for this program on {device}"

    def _reverify(self, graph: Graph, fused: Callable) -> tuple[bool, str]:
        """Check the fused program against jax.jit, eagerly (this runs while JAX traces), by the rule the tuning job's
        validation holds a whole plan to (`ProgramCheck`): fresh random inputs, and this call's own arguments where
        they are arrays (not tracers of an enclosing transformation). A bf16 training step on N(0, 1) inputs is
        chaotic: jax.jit's own result moves by more than the bound when its inputs move by one rounding step, so a
        right plan can be told from a wrong one only at the caller's inputs. Returns whether it passed and, if not,
        why; a failure on such outputs without the caller's arrays says "undecided" (not to be remembered)."""
        from .runner.program_check import ProgramCheck

        ref = jax.jit(lambda *a: graph.evaluate(a))
        leaves = self._caller_leaves(graph)
        with jax.ensure_compile_time_eval():
            verdict = ProgramCheck(graph, ref, (11, 12), leaves).judge(fused)
        if verdict.ok:
            return True, ""
        if verdict.chaotic() and leaves is None:
            return False, (f"undecided: on random inputs jax.jit's own result moves by up to {max(verdict.sensitivity):.2g} when they move "
                           "by one rounding step, and this call's arguments were tracers (call it with arrays to check it there)")
        return False, verdict.reason[:300]

    def _caller_leaves(self, graph: Graph) -> list | None:
        """The arguments of the call now tracing, as `graph`'s input leaves, where they are concrete arrays; None when
        traced otherwise (under `jax.grad`, an enclosing `jax.jit`, `lower`)."""
        call = getattr(self._call, "args", None)
        if call is None:
            return None
        try:
            leaves = flatten_args(graph, self.fn, call[0], call[1], self.static_argnums, self.static_argnames)
        except ValueError:
            return None
        return None if any(isinstance(x, jax.core.Tracer) for x in leaves) else leaves


def _open_store(store: Any) -> tuple[Any, str]:
    """A `PlanStore` (opened read-only: a lookup never creates, migrates or writes a database) from a store,
    a URL, or (None) $AUTOFUSE_DB / the default file; or None and why not."""
    from .store import PlanStore
    from .store.db import data_dir, default_url, display_url

    if isinstance(store, PlanStore):
        return store, ""
    if store is None:
        if not os.environ.get("AUTOFUSE_DB") and not (data_dir() / "autofuse.db").exists():
            return None, "no plan store (pass store= or set AUTOFUSE_DB)"
        store = default_url()
    try:
        return _store_cache(store), ""
    except Exception as e:
        return None, f"the plan store {display_url(str(store))} cannot be opened ({e})"


@functools.lru_cache(maxsize=8)
def _store_cache(url: str) -> Any:
    from .store import PlanStore

    return PlanStore(url, readonly=True)


# Shape checks made by this process: (store, plan id, program fingerprint) -> (verdict, detail). A store that cannot
# be written cannot remember them for the next process; this process still checks each shape once.
_CHECKED: dict[tuple[str, int | None, str], tuple[str, str]] = {}
_SAID: set[str] = set()


@dataclass(frozen=True)
class _Checked:
    """A check made earlier by this process (the store could not remember it), read as a `store.ShapeVerdict`."""

    verdict: str
    detail: str
    checked_at: Any = None


def _store_key(store: Any) -> str:
    return getattr(store, "url", None) or str(store or os.environ.get("AUTOFUSE_DB") or "")


def _remembered(store: Any, plan_id: int, fingerprint: str, sw: dict, given: Any) -> Any:
    """The verdict of an earlier check of plan `plan_id` at program `fingerprint` with this software: the store's,
    else this process's; None if never checked."""
    try:
        hit = store.shape_verdict(plan_id, fingerprint, sw)
    except Exception:  # noqa: BLE001 -- not readable: check again
        hit = None
    if hit is not None:
        return hit
    here = _CHECKED.get((_store_key(given), plan_id, fingerprint))
    return _Checked(*here) if here is not None else None


# (store, autotune directory, jaxlib, device) whose entries this process wrote: once is enough.
_RESTORED: set[tuple[str, str, str, str]] = set()


def _restore_autotune(store: Any) -> None:
    """Write the store's XLA autotune entries for this jaxlib and device that this process's autotune directory lacks,
    before a plan from it compiles: XLA reads a cache file for each fusion it has no result for in memory, so the
    plan's GEMMs get the kernels its tuning job measured, even on a machine that never tuned. Silent where there is
    no directory, it cannot be written, or the store cannot be read: XLA then autotunes as it would."""
    from . import xla_autotune
    from .device import device_info, software

    if xla_autotune.DIR is None:
        return
    opened, _ = _open_store(store)
    if opened is None:
        return
    jaxlib, device = software()["jaxlib"], device_info()["name"]
    key = (_store_key(opened), xla_autotune.DIR, jaxlib, device)
    if key in _RESTORED:
        return
    _RESTORED.add(key)
    try:
        written = xla_autotune.write_entries(xla_autotune.DIR, opened.autotune_entries(jaxlib, device))
    except Exception as e:  # noqa: BLE001 -- the kernels' choice is XLA's again: never a reason to break the program
        log.debug("autofuse: XLA autotune entries not restored into %s: %s: %s", xla_autotune.DIR, type(e).__name__, e)
        return
    if written:
        log.debug("autofuse: wrote %d XLA autotune entries of %s into %s", len(written), _store_key(opened), xla_autotune.DIR)


def _writer(store: Any) -> tuple[Any, str]:
    """A store that can record shape checks (the given read-write `PlanStore`, or the URL's database opened for
    writing without migrating it), or None and why not."""
    from .store import PlanStore

    if isinstance(store, PlanStore):
        return (None, "it was opened read-only") if store.readonly else (store, "")
    opened, why = _open_store(store)
    if opened is None:
        return None, why
    return _writable_store(opened.url, opened.revision)


@functools.lru_cache(maxsize=8)
def _writable_store(url: str, revision: str | None) -> tuple[Any, str]:
    from .store import PlanStore
    from .store.db import HEAD_REVISION, readonly_reason

    readonly = readonly_reason(url)
    if readonly is not None:
        return None, f"it is read-only: {readonly}"
    if (revision or "") < "0005":
        return None, f"its schema revision {revision} predates shape checks (autofuse db upgrade --db URL)"
    if revision != HEAD_REVISION:
        return None, f"its schema revision {revision} is not this autofuse's {HEAD_REVISION}"
    try:
        return PlanStore(url), ""
    except Exception as e:  # noqa: BLE001 -- an unreachable server: remembered per process only
        return None, str(e).split("\n")[0][:200]


def _say_once(key: str, why: str) -> None:
    if key in _SAID:
        return
    _SAID.add(key)
    log.warning("autofuse: the plan store %s cannot remember which shapes its plans serve (%s): plans serving shapes they "
                "were not tuned for are checked against jax.jit again in every process", key or "(default)", why)


def _versions(sw: dict) -> str:
    return ", ".join(f"{k} {sw[k]}" for k in ("jax", "jaxlib", "autofuse") if k in sw)


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
