"""``PlanStore``: the public API of the autofuse plan store.

Example::

    from autofuse.store import PlanStore

    store = PlanStore()                      # $AUTOFUSE_DB or ~/.local/share/autofuse/autofuse.db
    store.mark_interrupted()                 # at the start of every tuning job
    prog = store.program("9f3a...", "mlp", {"inputs": [["f32", [128, 512]]]}, size=12)
    dev = store.device("NVIDIA H200", "9.0", 132, 150_000_000_000)
    sw = store.software("0.10.2", "0.10.2", "0.1.0", "triton")
    run = store.start_run(prog, dev, sw, budget={"trials": 64}, seed=0, sampler="tpe", measure="device")
    cand = store.add_candidate(run, "c81e...", "row_reduce", [3, 4, 5])
    store.add_trial(cand, 0, {"block_rows": 8}, "ok", median_ms=0.12, min_ms=0.11, max_ms=0.14)
    store.update_candidate(cand, best_config={"block_rows": 8}, best_ms=0.12, xla_ms=0.2, status="done", n_trials=1)
    store.save_plan(prog, dev, sw, plan.to_json_dict(), run_id=run, measured_ms=1.0, baseline_ms=1.3,
                    speedup=1.3, measure="device", tolerance={"rtol": 1e-3, "atol": 1e-3}, max_error=2e-4)
    store.finish_run(run, "finished", baseline_ms=1.3, best_ms=1.0, speedup=1.3)

    hit = store.lookup("9f3a...", "NVIDIA H200",
                       {"jax": "0.10.2", "jaxlib": "0.10.2", "autofuse": "0.1.0", "backend": "triton"})
    if hit is not None and hit.match == "exact":
        ...

Every write is one short transaction (on SQLite: ``BEGIN IMMEDIATE`` with a
busy timeout, retried on "database is locked"), so several tuning processes
can share one SQLite file on one host. Imports nothing from JAX.

``PlanStore`` is a facade: each method is a function of one part of the store (a module of this package, named
beside it below), called with the store's :class:`~autofuse.store.base.Db`, where the schema check lives.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Concatenate, ParamSpec, TypeVar

from sqlalchemy.engine import Engine

from autofuse.store import (
    autotune,
    baselines,
    db,
    dimensions,
    lifecycle,
    listings,
    lookups,
    measurements,
    plan_changes,
    shapes,
)
from autofuse.store.base import Db

R = TypeVar("R")
P = ParamSpec("P")


def _part(fn: Callable[Concatenate[Db, P], R]) -> Callable[Concatenate[PlanStore, P], R]:
    """*fn* of a part as a method of :class:`PlanStore`, called with the store's :class:`Db`; its docstring, and
    its signature with ``self`` for the Db, are the method's."""

    @functools.wraps(fn)
    def method(self: PlanStore, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return fn(self._db, *args, **kwargs)

    sig = inspect.signature(fn)
    first, *rest = sig.parameters.values()
    method.__signature__ = sig.replace(parameters=[first.replace(name="self", annotation="PlanStore"), *rest])  # type: ignore[attr-defined]
    return method


class PlanStore:
    """Runs, candidates, trials and plans in one SQL database.

    ``url``: any SQLAlchemy URL (``sqlite:////abs/path.db``,
    ``postgresql+psycopg://user@host/db``) or a bare file path; None means
    ``$AUTOFUSE_DB``, else ``autofuse/autofuse.db`` in ``$XDG_DATA_HOME`` (or
    ``~/.local/share``). The schema is created or upgraded on first use; a new
    SQLite file is made only in an existing directory (or the default store's,
    made then). Raises :class:`StoreError` for a file that is not a database, a
    directory, a schema from a newer autofuse, or an unreachable server.

    ``readonly=True`` (lookups at deploy time, listings) never creates,
    migrates or writes, and leaves no file beside a SQLite store: a missing
    database is a :class:`StoreError`, and a write raises
    :class:`ReadOnlyStoreError`. A store that is read-only itself (a
    ``?mode=ro`` URL, a file or directory nobody may write, even as root: see
    ``db.readonly_reason``) opens only so; opened read-write, it raises
    :class:`ReadOnlyStoreError` at once.
    """

    def __init__(self, url: str | None = None, *, timeout: float = db.DEFAULT_TIMEOUT_S, readonly: bool = False) -> None:
        self._db = Db(url, timeout=timeout, readonly=readonly)
        self.url: str = self._db.url
        self.readonly: bool = readonly
        self.revision: str | None = self._db.revision

    def __repr__(self) -> str:
        return f"PlanStore({self._db.shown!r}{', readonly=True' if self.readonly else ''})"

    def __enter__(self) -> PlanStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Release pooled connections (the store can still be used after)."""
        self._db.close()

    @property
    def engine(self) -> Engine:
        """The SQLAlchemy engine (after a fork, a fresh pool for this process)."""
        return self._db.engine

    def schema_revision(self) -> str | None:
        """The autofuse schema revision of the database."""
        revs = self._db.guard(lambda: db.current(self.engine))
        return ",".join(sorted(revs)) or None

    _read = _part(Db.read)  # a statement's rows as dicts (tests read with queries' statements)

    # the rows runs and plans point at (dimensions)
    program = _part(dimensions.program)
    device = _part(dimensions.device)
    software = _part(dimensions.software)

    # a run's life (lifecycle)
    start_run = _part(lifecycle.start_run)
    finish_run = _part(lifecycle.finish_run)
    resume_run = _part(lifecycle.resume_run)
    mark_interrupted = _part(lifecycle.mark_interrupted)
    set_run_job = _part(lifecycle.set_run_job)
    mark_phase = _part(lifecycle.mark_phase)
    begin_selection = _part(lifecycle.begin_selection)

    # candidates and trials (measurements)
    add_candidate = _part(measurements.add_candidate)
    add_candidates = _part(measurements.add_candidates)
    update_candidate = _part(measurements.update_candidate)
    add_trial = _part(measurements.add_trial)
    claim_trial = _part(measurements.claim_trial)
    finish_trial = _part(measurements.finish_trial)
    mark_trial_lost = _part(measurements.mark_trial_lost)

    # XLA's time of each candidate (baselines)
    claim_xla = _part(baselines.claim_xla)
    finish_xla = _part(baselines.finish_xla)
    finish_xla_many = _part(baselines.finish_xla_many)
    record_xla = _part(baselines.record_xla)

    # plans and which is current (plan_changes)
    save_plan = _part(plan_changes.save_plan)
    add_plan = _part(plan_changes.add_plan)
    promote_plan = _part(plan_changes.promote_plan)
    pin_plan = _part(plan_changes.pin_plan)
    unpin_plan = _part(plan_changes.unpin_plan)
    remove_plan = _part(plan_changes.remove_plan)
    plan_events = _part(plan_changes.plan_events)

    # deploy-time lookups (lookups)
    lookup = _part(lookups.lookup)
    explain_miss = _part(lookups.explain_miss)

    # shape-generic plans (shapes)
    same_structure = _part(shapes.same_structure)
    unstructured_programs = _part(shapes.unstructured_programs)
    set_structure = _part(shapes.set_structure)
    shape_verdict = _part(shapes.shape_verdict)
    record_shape = _part(shapes.record_shape)
    plan_shapes = _part(shapes.plan_shapes)

    # XLA autotune entries (autotune)
    save_autotune = _part(autotune.save_autotune)
    autotune_entries = _part(autotune.autotune_entries)

    # listings
    runs = _part(listings.runs)
    unfinished_runs = _part(listings.unfinished_runs)
    plans = _part(listings.plans)
    candidates = _part(listings.candidates)
    trials = _part(listings.trials)
    get_run = _part(listings.get_run)
    get_plan = _part(listings.get_plan)
    compare = _part(listings.compare)
