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
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import getpass
import json
import os
import socket
from collections.abc import Callable
from typing import Any, Literal, Sequence, TypeVar

import sqlalchemy as sa
from sqlalchemy import exc
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from autofuse.processes import pid_alive
from autofuse.store import db, queries
from autofuse.store.models import (
    MEASURES,
    RUN_STATUSES,
    SHAPE_VERDICTS,
    Candidate,
    Device,
    Plan,
    PlanEvent,
    PlanShape,
    Program,
    Run,
    Software,
    Trial,
    XlaAutotune,
    utcnow,
)
from autofuse.store.promotion import PlanFigures, decide

T = TypeVar("T")

SOFTWARE_KEYS = ("jax", "jaxlib", "autofuse", "backend")
UNFINISHED_STATUSES = ("running", "interrupted")
#: Trial statuses that spend no budget: decided without compiling, or lost with a dead worker (and retried).
UNCOUNTED_TRIAL_STATUSES = ("infeasible", "pruned", "lost")


@dataclasses.dataclass(frozen=True)
class LookupResult:
    """A plan found by :meth:`PlanStore.lookup`.

    ``match`` is ``"exact"`` (same jax, jaxlib, autofuse and backend) or
    ``"version"`` (same backend, other versions: the caller should re-verify
    the plan against ``tolerance`` before trusting it).
    """

    plan_id: int
    plan_json: dict[str, Any]
    match: Literal["exact", "version"]
    speedup: float
    measured_ms: float
    software: dict[str, str]
    measure: str = "device"
    tolerance: dict[str, Any] = dataclasses.field(default_factory=dict)
    run_id: int | None = None


@dataclasses.dataclass(frozen=True)
class SameStructure:
    """A current plan of another program of the same structure (the same computation at other sizes), found by
    :meth:`PlanStore.same_structure`: the plan, and the fingerprint and input signature of the program it was tuned
    for (``["bfloat16[8, 128]", ...]``)."""

    plan: LookupResult
    fingerprint: str
    inputs: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class ShapeVerdict:
    """A remembered check of a plan at a shape it was not tuned for: ``ok`` (it serves that shape) or ``failed``
    (``detail`` says why), when and by whom."""

    plan_id: int
    fingerprint: str
    verdict: str
    detail: str
    checked_at: _dt.datetime
    actor: str


@dataclasses.dataclass(frozen=True)
class SavedPlan:
    """A plan a tuning job stored: its id, whether it became current, and why (or why not)."""

    plan_id: int
    current: bool
    reason: str
    previous: int | None = None  # the current plan of its key before it was stored


@dataclasses.dataclass(frozen=True)
class PlanChange:
    """What a promote, pin, unpin or rm did: the plan, the one it replaced as current (if any), in words."""

    plan_id: int
    action: str
    replaced: int | None
    message: str


@dataclasses.dataclass(frozen=True)
class MissReason:
    """Why the store has no plan for a program on this device, for a person: ``kind`` is one of
    ``no_plan`` (never tuned), ``other_inputs`` (the function was tuned for other shapes, dtypes or
    static values), ``other_device``, ``other_backend``, ``no_current`` (plans exist, none current),
    ``changed`` (same function and inputs, another program: its code or constants changed)."""

    kind: str
    text: str


def whoami() -> str:
    """``user@host``, recorded with every change to a plan."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry in some containers
        user = f"uid{os.getuid()}"
    return f"{user}@{socket.gethostname()}"


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
        self.url: str = db.resolve_url(url)
        self._timeout = timeout
        self.readonly = readonly
        if readonly:
            self._engine, self.revision = db.open_readonly(url, timeout=timeout)
        else:
            self._engine, self.revision = db.open_engine(self.url, timeout=timeout), db.HEAD_REVISION
        self._pid = os.getpid()

    @property
    def _v3(self) -> bool:
        """Whether the schema has migration 0003's columns (a read-only store may be older)."""
        return (self.revision or "") >= "0003"

    @property
    def _v6(self) -> bool:
        """Whether the schema has migration 0006's run phases."""
        return (self.revision or "") >= "0006"

    @property
    def _v5(self) -> bool:
        """Whether the schema has migration 0005's program structures and shape checks."""
        return (self.revision or "") >= "0005"

    @property
    def _v7(self) -> bool:
        """Whether the schema has migration 0007's XLA autotune entries."""
        return (self.revision or "") >= "0007"

    # ------------------------------------------------------------ plumbing

    def __repr__(self) -> str:
        return f"PlanStore({db.display_url(self.url)!r}{', readonly=True' if self.readonly else ''})"

    def __enter__(self) -> PlanStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Release pooled connections (the store can still be used after)."""
        self._engine.dispose()

    @property
    def engine(self) -> Engine:
        """The SQLAlchemy engine (after a fork, a fresh pool for this process)."""
        if os.getpid() != self._pid:
            # Never share pooled connections across fork().
            self._engine.dispose(close=False)
            self._pid = os.getpid()
        return self._engine

    def _guard(self, fn: Callable[[], T], *, retry_integrity: bool = False) -> T:
        try:
            return db.with_retry(fn, url=self.url, retry_integrity=retry_integrity)
        except (exc.SQLAlchemyError, OSError) as e:
            err = db.translate_error(e, self.url)
            if err is not None:
                raise err from None
            raise

    def _write(self, fn: Callable[[Session], T], *, retry_integrity: bool = False) -> T:
        """Run ``fn(session)`` in one write transaction, retried on lock conflicts."""

        if self.readonly:
            raise db.ReadOnlyStoreError(f"the plan store {db.display_url(self.url)} was opened read-only; a write was asked for")

        def attempt() -> T:
            with self.engine.connect() as conn:
                conn.execution_options(autofuse_write=True)
                with Session(bind=conn, expire_on_commit=False, autoflush=True) as s, s.begin():
                    return fn(s)

        return self._guard(attempt, retry_integrity=retry_integrity)

    def _read(self, stmt: Any) -> list[dict[str, Any]]:
        def attempt() -> list[dict[str, Any]]:
            with db.transaction(self.engine, write=False) as conn:
                return [dict(r._mapping) for r in conn.execute(stmt)]

        return self._guard(attempt)

    @staticmethod
    def _require(s: Session, model: type, ident: int, what: str, *, lock: bool = False) -> Any:
        """The row *ident* of *model*; KeyError if absent.

        *lock*: also row-lock it until the transaction ends (``SELECT ... FOR NO KEY
        UPDATE`` on PostgreSQL, which does not block other writers' foreign-key checks
        against the row; SQLite ignores it, its writers are serialised already).
        """
        obj = s.get(model, ident, with_for_update={"key_share": True} if lock else None)
        if obj is None:
            raise KeyError(f"no {what} with id {ident}")
        return obj

    # ------------------------------------------------------- dimension rows

    def program(self, fingerprint: str, name: str, signature: dict[str, Any], size: int, function: str | None = None,
                structure: str | None = None) -> int:
        """Id of the program with *fingerprint*, created if new.

        An existing program keeps its first name, signature and size; *function*
        (``module:qualname``) and *structure* (``Graph.structure``: the program with
        its sizes abstracted) are filled in where they were not known.
        """
        if not fingerprint:
            raise ValueError("program fingerprint must be a non-empty string")

        def fn(s: Session) -> int:
            found = s.scalar(sa.select(Program).where(Program.fingerprint == fingerprint))
            if found is not None:
                if function and not found.function:
                    found.function = function
                if structure and not found.structure:
                    found.structure = structure
                return found.id
            row = Program(fingerprint=fingerprint, name=name, signature=signature, size=int(size), function=function,
                          structure=structure)
            s.add(row)
            s.flush()
            return row.id

        return self._write(fn, retry_integrity=True)

    def device(
        self,
        name: str,
        compute_capability: str | None = None,
        sm_count: int | None = None,
        memory_bytes: int | None = None,
    ) -> int:
        """Id of the device row with exactly these fields (NULLs included), created if new."""
        return self._dimension(Device, name=name, compute_capability=compute_capability, sm_count=sm_count, memory_bytes=memory_bytes)

    def software(self, jax: str, jaxlib: str, autofuse: str, backend: str) -> int:
        """Id of the software row (jax, jaxlib, autofuse versions + backend), created if new."""
        return self._dimension(Software, jax=jax, jaxlib=jaxlib, autofuse=autofuse, backend=backend)

    def _dimension(self, model: type, **fields: Any) -> int:
        """Id of the `model` row with exactly these field values (NULLs included), created if new."""

        def fn(s: Session) -> int:
            found = s.scalar(sa.select(model.id).where(*(getattr(model, k).is_not_distinct_from(v) for k, v in fields.items())))
            if found is not None:
                return found
            row = model(**fields)
            s.add(row)
            s.flush()
            return row.id

        return self._write(fn, retry_integrity=True)

    # ------------------------------------------------------------------ runs

    def start_run(
        self,
        program_id: int,
        device_id: int,
        software_id: int,
        *,
        budget: dict[str, Any],
        seed: int,
        sampler: str,
        measure: str,
        host: str | None = None,
        pid: int | None = None,
        optuna_storage: str | None = None,
    ) -> int:
        """Record a new run in status ``running``; returns its id.

        *host* and *pid* default to this process (so that
        :meth:`mark_interrupted` can tell when it died). The run's
        ``optuna_study_prefix`` is ``autofuse-run<id>-``.
        """
        _check_measure(measure)
        if host is None and pid is None:
            host, pid = socket.gethostname(), os.getpid()

        def fn(s: Session) -> int:
            self._require(s, Program, program_id, "program")
            self._require(s, Device, device_id, "device")
            self._require(s, Software, software_id, "software")
            run = Run(
                program_id=program_id,
                device_id=device_id,
                software_id=software_id,
                budget=dict(budget),
                seed=int(seed),
                sampler=sampler,
                status="running",
                measure=measure,
                started_at=utcnow(),
                host=host,
                pid=pid,
                optuna_storage=optuna_storage,
                optuna_study_prefix="",
            )
            s.add(run)
            s.flush()
            run.optuna_study_prefix = f"autofuse-run{run.id}-"
            return run.id

        return self._write(fn)

    def finish_run(
        self,
        run_id: int,
        status: str,
        *,
        baseline_ms: float | None = None,
        best_ms: float | None = None,
        speedup: float | None = None,
        error: str | None = None,
    ) -> None:
        """Close a run with *status* (finished, interrupted or failed) and its results.

        Fields left as None keep their stored value.
        """
        if status not in RUN_STATUSES or status == "running":
            raise ValueError(f"invalid final run status {status!r}: expected finished, interrupted or failed")

        def fn(s: Session) -> None:
            run = self._require(s, Run, run_id, "run")
            run.status = status
            run.ended_at = utcnow()
            for field, value in (("baseline_ms", baseline_ms), ("best_ms", best_ms), ("speedup", speedup)):
                if value is not None:
                    setattr(run, field, float(value))
            if error is not None:
                run.error = error

        self._write(fn)

    def resume_run(self, run_id: int, *, host: str | None = None, pid: int | None = None) -> dict[str, Any]:
        """Mark an unfinished run ``running`` again, owned by this process; returns :meth:`get_run`.

        For ``autofuse tune --resume RUN``: budget, seed, sampler, measure,
        optuna_storage and optuna_study_prefix are in the returned dict.
        Refuses (ValueError) a run that is finished or still running
        elsewhere.
        """
        if host is None and pid is None:
            host, pid = socket.gethostname(), os.getpid()

        def fn(s: Session) -> None:
            run = self._require(s, Run, run_id, "run")
            if run.status == "finished":
                raise ValueError(f"run {run_id} is finished; nothing to resume")
            if run.status == "running" and not (run.host == host and run.pid == pid):
                if run.host == socket.gethostname() and run.pid is not None and not pid_alive(
                    run.pid, run.started_at
                ):
                    pass  # its process is gone: take it over
                else:
                    raise ValueError(f"run {run_id} is still running (host {run.host}, pid {run.pid})")
            run.status = "running"
            run.ended_at = None
            run.error = None  # why it stopped last time no longer holds
            run.host, run.pid = host, pid
            run.selected_by = None  # a worker that died while selecting: this process selects now

        self._write(fn)
        return self.get_run(run_id)

    def mark_interrupted(self) -> list[int]:
        """Mark ``running`` runs of this host whose process is gone as ``interrupted``.

        Call at the start of every tuning job. Runs of other hosts (whose
        processes cannot be checked) are left alone. A pid reused by a newer
        process counts as gone (Linux: process start time after the run's).
        Returns the ids marked.
        """
        host = socket.gethostname()

        def fn(s: Session) -> list[int]:
            rows = s.execute(
                sa.select(Run.id, Run.pid, Run.started_at).where(
                    Run.status == "running", Run.host == host, Run.pid.is_not(None)
                )
            ).all()
            dead = [r.id for r in rows if not pid_alive(r.pid, r.started_at)]
            if dead:
                s.execute(
                    sa.update(Run)
                    .where(Run.id.in_(dead), Run.status == "running")
                    .values(status="interrupted", ended_at=utcnow(), error="process died (marked by mark_interrupted)")
                )
            return dead

        return self._write(fn)

    # ------------------------------------------------------ candidates/trials

    def add_candidate(self, run_id: int, signature: str, template: str, nodes: list[int]) -> int:
        """Id of the candidate (run, signature, template), created if new.

        Idempotent so that a resumed run finds its candidates again.
        """
        return self.add_candidates(run_id, [(signature, template, nodes)])[0]

    def add_candidates(self, run_id: int, cands: Sequence[tuple[str, str, list[int]]]) -> list[int]:
        """`add_candidate` of each (signature, template, nodes), in one transaction: a whole model's candidates
        (GPT-2 medium: 158) are one write, not one each while the run's workers start and read the store."""

        def fn(s: Session) -> list[int]:
            self._require(s, Run, run_id, "run")
            known = {(sig, tmpl): cid for cid, sig, tmpl in s.execute(
                sa.select(Candidate.id, Candidate.signature, Candidate.template).where(Candidate.run_id == run_id))}
            ids = []
            for signature, template, nodes in cands:
                if (signature, template) not in known:
                    row = Candidate(run_id=run_id, signature=signature, template=template, nodes=[int(n) for n in nodes],
                                    status="pending", n_trials=0)
                    s.add(row)
                    s.flush()
                    known[(signature, template)] = row.id
                ids.append(known[(signature, template)])
            return ids

        return self._write(fn, retry_integrity=True)

    def update_candidate(
        self,
        cand_id: int,
        *,
        best_config: dict[str, Any] | None = None,
        best_ms: float | None = None,
        xla_ms: float | None = None,
        status: str | None = None,
        n_trials: int | None = None,
    ) -> None:
        """Set the given fields of a candidate (None: unchanged)."""

        def fn(s: Session) -> None:
            c = self._require(s, Candidate, cand_id, "candidate")
            if best_config is not None:
                c.best_config = dict(best_config)
            if best_ms is not None:
                c.best_ms = float(best_ms)
            if xla_ms is not None:
                c.xla_ms = float(xla_ms)
            if status is not None:
                c.status = status
            if n_trials is not None:
                c.n_trials = int(n_trials)

        self._write(fn)

    def add_trial(
        self,
        cand_id: int,
        number: int,
        config: dict[str, Any],
        status: str,
        *,
        median_ms: float | None = None,
        min_ms: float | None = None,
        max_ms: float | None = None,
        error: str | None = None,
        optuna_trial_id: int | None = None,
    ) -> int:
        """Record trial *number* of a candidate; returns its id.

        *status*: ok, infeasible, compile_error, resource_exhausted,
        wrong_result, nan, timeout, crashed, ... (and, for runs shared by
        workers, running and lost: see :meth:`claim_trial`). Recording the same number
        again replaces that trial's values (a resumed run re-running it).
        """
        values = dict(
            config=dict(config),
            status=status,
            median_ms=_float(median_ms),
            min_ms=_float(min_ms),
            max_ms=_float(max_ms),
            error=error,
            optuna_trial_id=optuna_trial_id,
        )

        def fn(s: Session) -> int:
            found = s.scalar(sa.select(Trial).where(Trial.candidate_id == cand_id, Trial.number == number))
            if found is not None:
                for k, v in values.items():
                    setattr(found, k, v)
                return found.id
            self._require(s, Candidate, cand_id, "candidate")
            row = Trial(candidate_id=cand_id, number=int(number), created_at=utcnow(), **values)
            s.add(row)
            s.flush()
            return row.id

        return self._write(fn, retry_integrity=True)

    # ------------------------------------------------- runs shared by workers

    def set_run_job(self, run_id: int, job: dict[str, Any]) -> None:
        """Publish what workers need to join the run (set once its candidates and studies exist)."""

        def fn(s: Session) -> None:
            self._require(s, Run, run_id, "run").job = dict(job)

        self._write(fn)

    def claim_trial(
        self,
        run_id: int,
        cand_id: int,
        config: dict[str, Any],
        optuna_trial_id: int,
        *,
        limit: int | None,
        status: str = "running",
        error: str | None = None,
        worker: str | None = None,
    ) -> tuple[str, Any]:
        """Record that a worker is about to measure *config* of a candidate, if the run allows it.

        One transaction, serialised per run (the run row's lock), so that
        workers on any number of hosts keep the budget exactly and never
        measure one config twice. Returns ``("ok", number)`` (a new trial row
        in *status*, ``running`` by default), ``("duplicate", row)`` (the
        config has a row that is not ``lost``), ``("spent", None)`` (the run's
        *limit* of counted trials is reached: every trial except infeasible,
        pruned and lost ones counts, those running included) or
        ``("closed", None)`` (the run is no longer running, or its final
        selection has begun). Give *limit* None for a trial that spends no
        budget (infeasible, pruned). *worker* (host:pid) is recorded on the row.
        """
        cfg = dict(config)

        def fn(s: Session) -> tuple[str, Any]:
            run = self._require(s, Run, run_id, "run", lock=True)
            if run.status != "running" or run.selected_by is not None:
                return "closed", None
            rows = s.execute(sa.select(Trial).where(Trial.candidate_id == cand_id)).scalars().all()
            for r in rows:
                if r.status != "lost" and r.config == cfg:
                    return "duplicate", {"number": r.number, "status": r.status, "median_ms": r.median_ms, "error": r.error}
            if limit is not None and self._counted_trials(s, run_id) >= limit:
                return "spent", None
            number = max((r.number for r in rows), default=-1) + 1
            s.add(Trial(candidate_id=cand_id, number=number, config=cfg, status=status, error=error,
                        optuna_trial_id=optuna_trial_id, created_at=utcnow(), worker=worker))
            return "ok", number

        return self._write(fn)

    @staticmethod
    def _counted_trials(s: Session, run_id: int) -> int:
        q = (
            sa.select(sa.func.count(Trial.id))
            .join(Candidate, Candidate.id == Trial.candidate_id)
            .where(Candidate.run_id == run_id, Trial.status.not_in(UNCOUNTED_TRIAL_STATUSES))
        )
        return int(s.scalar(q) or 0)

    def finish_trial(
        self,
        cand_id: int,
        number: int,
        status: str,
        *,
        median_ms: float | None = None,
        min_ms: float | None = None,
        max_ms: float | None = None,
        error: str | None = None,
        device: str | None = None,
    ) -> bool:
        """Record the result of a claimed (``running``) trial, the device that measured it and when; False if it
        was meanwhile marked lost."""
        values = dict(status=status, median_ms=_float(median_ms), min_ms=_float(min_ms), max_ms=_float(max_ms), error=error,
                      device=device, finished_at=utcnow())

        def fn(s: Session) -> bool:
            res = s.execute(
                sa.update(Trial)
                .where(Trial.candidate_id == cand_id, Trial.number == number, Trial.status == "running")
                .values(**values)
            )
            return res.rowcount == 1

        return self._write(fn)

    def claim_xla(self, run_id: int, worker: str, n: int, *, stale_s: float, among: Sequence[int] | None = None) -> list[int]:
        """Up to *n* candidates of the run (of *among*, candidate ids, where given) whose XLA timing nobody has done
        or is doing, now claimed by *worker* (host:pid); their ids. A claim older than *stale_s* seconds, or of a
        dead process of this host, is taken over. One transaction serialised on the run row: each candidate is
        timed once."""

        def fn(s: Session) -> list[int]:
            self._require(s, Run, run_id, "run", lock=True)
            now = utcnow()
            query = sa.select(Candidate).where(Candidate.run_id == run_id, Candidate.xla_ms.is_(None),
                                               sa.or_(Candidate.xla_status.is_(None), Candidate.xla_status == "running"))
            if among is not None:
                query = query.where(Candidate.id.in_(list(among)))
            rows = s.execute(query.order_by(Candidate.id)).scalars().all()
            got = []
            for c in rows:
                if len(got) >= n:
                    break
                if c.xla_status == "running" and not _claim_stale(c.xla_worker, c.xla_claimed_at, now, stale_s):
                    continue
                c.xla_status, c.xla_worker, c.xla_claimed_at = "running", worker, now
                got.append(c.id)
            return got

        return self._write(fn)

    def finish_xla(self, cand_id: int, worker: str, status: str, xla_ms: float | None, device: str | None) -> bool:
        """Record a claimed XLA timing (*status* ok, or why it failed); False if another worker took the claim over."""
        return self.finish_xla_many(worker, [(cand_id, status, xla_ms, device)]) == [True]

    def finish_xla_many(self, worker: str, results: Sequence[tuple[int, str, float | None, str | None]]) -> list[bool]:
        """`finish_xla` of a chunk's (candidate id, status, ms, device), in one transaction: a worker's chunk is one
        write, not one per candidate (four workers' per-candidate writes on one SQLite file waited on each other's
        locks for seconds of every worker's XLA phase). Per result, False where another worker took the claim over."""

        def fn(s: Session) -> list[bool]:
            done = []
            for cand_id, status, xla_ms, device in results:
                res = s.execute(
                    sa.update(Candidate)
                    .where(Candidate.id == cand_id, Candidate.xla_status == "running", Candidate.xla_worker == worker)
                    .values(xla_status=status, xla_ms=_float(xla_ms), xla_device=device)
                )
                done.append(res.rowcount == 1)
            return done

        return self._write(fn)

    def record_xla(self, cand_id: int, worker: str, status: str, xla_ms: float | None, device: str | None) -> bool:
        """XLA's time of a candidate measured without a claim (at its first trial: `scheduler.timed_first`); False
        if the candidate has one already (another worker timed it first, which stays)."""

        def fn(s: Session) -> bool:
            res = s.execute(
                sa.update(Candidate)
                .where(Candidate.id == cand_id, Candidate.xla_ms.is_(None), sa.or_(Candidate.xla_status.is_(None), Candidate.xla_status != "ok"))
                .values(xla_status=status, xla_ms=_float(xla_ms), xla_device=device, xla_worker=worker, xla_claimed_at=utcnow())
            )
            return res.rowcount == 1

        return self._write(fn)

    def mark_trial_lost(self, cand_id: int, optuna_trial_id: int, error: str) -> bool:
        """A running trial whose worker died (its Optuna trial failed by heartbeat): ``lost``, no longer counted."""

        def fn(s: Session) -> bool:
            res = s.execute(
                sa.update(Trial)
                .where(Trial.candidate_id == cand_id, Trial.optuna_trial_id == optuna_trial_id, Trial.status == "running")
                .values(status="lost", error=error)
            )
            return res.rowcount > 0

        return self._write(fn)

    def mark_phase(self, run_id: int, name: str, *, worker: str | None = None, at: float | None = None, value: Any = None,
                   keep_first: bool = True) -> None:
        """Record in the run's ``phases`` that phase *name* ended now (or at the epoch time *at*), as seconds from the
        run's start (negative before it); with *value*, that JSON value instead (a phase's parts). *worker*
        (host:pid): under that worker's marks. *keep_first*: a mark already recorded (by another worker) stays."""

        def fn(s: Session) -> None:
            run = self._require(s, Run, run_id, "run", lock=True)
            phases = dict(run.phases or {})
            workers = dict(phases.get("workers") or {})
            marks = dict(workers.get(worker) or {}) if worker is not None else phases
            if keep_first and name in marks:
                return
            if value is None:
                now = _dt.datetime.now(_dt.UTC).timestamp() if at is None else at
                started = run.started_at if run.started_at.tzinfo else run.started_at.replace(tzinfo=_dt.UTC)
                marks[name] = round(now - started.timestamp(), 3)
            else:
                marks[name] = value
            if worker is not None:
                workers[worker] = marks
                phases["workers"] = workers
            run.phases = phases

        self._write(fn)

    def begin_selection(self, run_id: int, worker: str) -> bool:
        """Compare-and-set: *worker* becomes the one that selects and saves the run's plan.

        True for exactly one caller, and only while the run is running, its
        selection not yet taken, and none of its trials is still running.
        """

        def fn(s: Session) -> bool:
            run = self._require(s, Run, run_id, "run", lock=True)
            if run.status != "running" or run.selected_by is not None:
                return False
            running = s.scalar(
                sa.select(sa.func.count(Trial.id))
                .join(Candidate, Candidate.id == Trial.candidate_id)
                .where(Candidate.run_id == run_id, Trial.status == "running")
            )
            if running:
                return False
            res = s.execute(
                sa.update(Run).where(Run.id == run_id, Run.status == "running", Run.selected_by.is_(None)).values(selected_by=worker)
            )
            return res.rowcount == 1

        return self._write(fn)

    # ----------------------------------------------------------------- plans

    def save_plan(self, program_id: int, device_id: int, software_id: int, plan_json: dict[str, Any] | str, **fields: Any) -> int:
        """Store a plan (a JSON-able dict, or JSON text); returns its id. The keyword fields are :meth:`add_plan`'s."""
        return self.add_plan(program_id, device_id, software_id, plan_json, **fields).plan_id

    def add_plan(
        self,
        program_id: int,
        device_id: int,
        software_id: int,
        plan_json: dict[str, Any] | str,
        *,
        run_id: int | None = None,
        measured_ms: float,
        baseline_ms: float,
        speedup: float,
        measure: str,
        tolerance: dict[str, Any],
        max_error: float,
        current: bool | None = None,
        noise: float | None = None,
        actor: str | None = None,
    ) -> SavedPlan:
        """Store a plan and decide, in the same transaction, whether it becomes the current plan of its
        (program, device, software) key; the decision is recorded as a ``saved`` event.

        *current*: None applies :func:`autofuse.store.promotion.decide` (the first
        plan of a key is current; a later one only if measured and faster than the
        current one beyond *noise*, the spread of its plan/jax.jit ratio; never
        over a pinned plan); True promotes it (the user asked; still not over a
        pinned plan); False stores it beside the current one.
        """
        _check_measure(measure)
        if isinstance(plan_json, str):
            text = plan_json
            if not isinstance(json.loads(text), dict):
                raise ValueError("plan_json must be a JSON object")
        else:
            text = json.dumps(plan_json)
        who = actor or whoami()

        def fn(s: Session) -> SavedPlan:
            # Writers of one program's plans take turns (the program row's lock): on
            # PostgreSQL (READ COMMITTED) two concurrent writers would otherwise each clear
            # the old current flag, each insert a current plan, and one would fail the
            # partial unique index; now the second waits, then sees and clears the first's.
            self._require(s, Program, program_id, "program", lock=True)
            self._require(s, Device, device_id, "device")
            self._require(s, Software, software_id, "software")
            if run_id is not None:
                self._require(s, Run, run_id, "run")
            old = self._current(s, program_id, device_id, software_id)
            decision = decide(PlanFigures(None, measure, float(speedup), _float(noise)), _figures(old), force=current)
            if decision.current and old is not None:
                old.is_current = False
                s.flush()
            row = Plan(
                program_id=program_id,
                device_id=device_id,
                software_id=software_id,
                run_id=run_id,
                plan_json=text,
                measured_ms=float(measured_ms),
                baseline_ms=float(baseline_ms),
                speedup=float(speedup),
                measure=measure,
                tolerance=dict(tolerance),
                max_error=float(max_error),
                is_current=decision.current,
                noise=_float(noise),
                pinned=False,
                created_at=utcnow(),
            )
            s.add(row)
            s.flush()
            state = "current" if decision.current else "not current"
            self._event(s, row, "saved", who, f"{state}: {decision.reason}", run_id=run_id)
            return SavedPlan(row.id, decision.current, decision.reason, old.id if old is not None else None)

        # IntegrityError: should not happen with the lock above; retried as a last resort.
        return self._write(fn, retry_integrity=True)

    @staticmethod
    def _current(s: Session, program_id: int, device_id: int, software_id: int) -> Plan | None:
        return s.scalar(sa.select(Plan).where(Plan.program_id == program_id, Plan.device_id == device_id,
                                              Plan.software_id == software_id, Plan.is_current == sa.true()))

    @staticmethod
    def _event(s: Session, plan: Plan, action: str, actor: str, detail: str, run_id: int | None = None) -> None:
        s.add(PlanEvent(plan_id=plan.id, program_id=plan.program_id, run_id=run_id if run_id is not None else plan.run_id,
                        action=action, actor=actor[:255], at=utcnow(), detail=detail))

    # ------------------------------------------------------ plan management

    def promote_plan(self, plan_id: int, *, actor: str | None = None) -> PlanChange:
        """Make plan *plan_id* the current plan of its key (a person's decision, recorded).

        Refused (ValueError) where another plan of the key is pinned: unpin it first.
        """
        return self._change(plan_id, "promote", actor)

    def pin_plan(self, plan_id: int, *, actor: str | None = None) -> PlanChange:
        """Make plan *plan_id* current and pinned: no tuning job replaces it until it is unpinned."""
        return self._change(plan_id, "pin", actor)

    def unpin_plan(self, plan_id: int, *, actor: str | None = None) -> PlanChange:
        """Let tuning jobs replace plan *plan_id* again (it stays current until one beats it)."""
        return self._change(plan_id, "unpin", actor)

    def remove_plan(self, plan_id: int, *, actor: str | None = None) -> PlanChange:
        """Delete plan *plan_id* (recorded). Refused for a pinned plan; removing the current plan leaves its
        key without one (lookups miss) until another is promoted or tuned."""
        return self._change(plan_id, "rm", actor)

    def _change(self, plan_id: int, action: str, actor: str | None) -> PlanChange:
        who = actor or whoami()

        def fn(s: Session) -> PlanChange:
            plan = self._require(s, Plan, plan_id, "plan")
            self._require(s, Program, plan.program_id, "program", lock=True)
            old = self._current(s, plan.program_id, plan.device_id, plan.software_id)
            replaced = old.id if old is not None and old.id != plan.id else None
            if action in ("promote", "pin") and old is not None and old.pinned and old.id != plan.id:
                raise ValueError(f"plan {old.id} is pinned as the current plan of this program, device and software: "
                                 f"unpin it first (autofuse plans unpin {old.id})")
            if action == "rm" and plan.pinned:
                raise ValueError(f"plan {plan_id} is pinned: unpin it first (autofuse plans unpin {plan_id})")
            if action in ("promote", "pin"):
                if old is not None and old.id != plan.id:
                    old.is_current = False
                    s.flush()
                plan.is_current = True
                plan.pinned = plan.pinned or action == "pin"
                verb = "pinned" if action == "pin" else "promoted"
                message = f"plan {plan_id} {verb}: current" + (f" in place of plan {replaced}" if replaced else
                                                                 "" if old is not None else " (the key had no current plan)")
            elif action == "unpin":
                plan.pinned = False
                message = f"plan {plan_id} unpinned: tuning jobs may replace it when they beat it" + (
                    "" if plan.is_current else " (it is not current)")
            else:
                was_current = plan.is_current
                self._event(s, plan, action, who, _plan_summary(plan) + ("; was current" if was_current else ""))
                s.delete(plan)
                message = f"plan {plan_id} removed" + (
                    ": its program now has no current plan on this device and software (autofuse plans promote ID)" if was_current else "")
                return PlanChange(plan_id, action, None, message)
            self._event(s, plan, action, who, message)
            return PlanChange(plan_id, action, replaced, message)

        return self._write(fn)

    def plan_events(self, plan_id: int | None = None, program: str | None = None) -> list[dict[str, Any]]:
        """The record of plan changes, newest first: who (``user@host``), when, what (``saved``: a tuning
        job's decision; ``promote``, ``pin``, ``unpin``, ``rm``: a person's), and the detail in words."""
        if not self._v3:
            return []
        return self._read(queries.plan_events(plan_id, program))

    def lookup(self, fingerprint: str, device_name: str, software: dict[str, str]) -> LookupResult | None:
        """The current plan for this program on this device, graded.

        * ``match="exact"``: same fingerprint, device name, jax, jaxlib,
          autofuse and backend;
        * ``match="version"``: same fingerprint, device and backend, other
          versions (newest such plan; the caller re-verifies it);
        * None otherwise.

        One indexed query.
        """
        missing = [k for k in SOFTWARE_KEYS if k not in software]
        if missing:
            raise ValueError(f"software dict lacks {', '.join(missing)} (needs {', '.join(SOFTWARE_KEYS)})")
        rows = self._read(queries.lookup(fingerprint, device_name, software))
        if not rows:
            return None
        r = rows[0]
        return LookupResult(
            plan_id=r["id"],
            plan_json=json.loads(r["plan_json"]),
            match="exact" if r["exact"] else "version",
            speedup=r["speedup"],
            measured_ms=r["measured_ms"],
            software={k: r[k] for k in SOFTWARE_KEYS},
            measure=r["measure"],
            tolerance=r["tolerance"] or {},
            run_id=r["run_id"],
        )

    def explain_miss(self, fingerprint: str, device_name: str, software: dict[str, str], *, function: str | None = None,
                     signature: dict[str, Any] | None = None) -> MissReason:
        """Why :meth:`lookup` found no plan, in words: this program was never tuned, or only on other
        devices or for another code generator, or it has plans but none current; or, by *function*
        (``module:qualname``), the function was tuned for other input shapes, dtypes or static values
        (which ones differ from *signature*, this call's ``{"inputs": [...], "static": ...}``), or for the
        same inputs but as another program (its code changed). Reads only."""
        legacy = tuple(dict.fromkeys(x for x in (function, (function or "").rpartition(":")[2]) if x))
        progs = self._read(queries.programs_of(fingerprint, function, legacy, self._v3))
        plans = self._read(queries.plans_of_programs([r["id"] for r in progs])) if progs else []
        where = f"in {db.display_url(self.url)}"
        this = next((r for r in progs if r["fingerprint"] == fingerprint), None)
        if this is not None:
            mine = [p for p in plans if p["program_id"] == this["id"]]
            here = [p for p in mine if p["device"] == device_name]
            same = [p for p in here if p["backend"] == software.get("backend")]
            if not mine:
                return MissReason("no_plan", f"this program was tuned but no plan was stored {where} (its run did not finish: autofuse runs)")
            if not here:
                devs = ", ".join(sorted({p["device"] for p in mine}))
                return MissReason("other_device", f"this program has plans only for another device ({devs}), not {device_name}")
            if not same:
                other = ", ".join(sorted({p["backend"] for p in here}))
                return MissReason("other_backend", f"this program's plans on {device_name} are for code generator {other}, "
                                                   f"not {software.get('backend')} (made by an older autofuse: tune it again)")
            ids = ", ".join(str(p["id"]) for p in same[:5])
            return MissReason("no_current", f"plan(s) {ids} of this program on {device_name} are stored but none is current "
                                            "(autofuse plans promote ID)")
        others = [r for r in progs if r["fingerprint"] != fingerprint]
        if function and others:
            current = {p["program_id"] for p in plans if p["is_current"] and p["device"] == device_name}
            near = [r for r in others if r["id"] in current] or [r for r in others if any(p["program_id"] == r["id"] for p in plans)]
            if near:
                diff = _signature_diff(near[0]["signature"] or {}, signature or {})
                more = f" (and {len(near) - 1} other input signature(s))" if len(near) > 1 else ""
                if diff:
                    return MissReason("other_inputs", f"{function} was tuned for other inputs: {diff}{more}")
                return MissReason("changed", f"{function} has plans for the same inputs but as another program "
                                             f"{near[0]['fingerprint'][:12]} (its code or constants changed since it was tuned)")
        return MissReason("no_plan", f"no plan for this program at all {where} (never tuned: autofuse tune)")

    # ---------------------------------------------------- shape-generic plans

    def same_structure(self, structure: str, device_name: str, software: dict[str, str], *, exclude: str) -> list[SameStructure]:
        """The current plans, on this device and backend, of the programs of *structure* other than *exclude* (the
        fingerprint that missed): plans tuned at other sizes that may serve it. Exact versions first, newest first.
        Empty for a schema older than 0005. Reads only."""
        if not self._v5:
            return []
        out = []
        for r in self._read(queries.same_structure(structure, device_name, software, exclude)):
            hit = LookupResult(plan_id=r["id"], plan_json=json.loads(r["plan_json"]), match="exact" if r["exact"] else "version",
                               speedup=r["speedup"], measured_ms=r["measured_ms"], software={k: r[k] for k in SOFTWARE_KEYS},
                               measure=r["measure"], tolerance=r["tolerance"] or {}, run_id=r["run_id"])
            out.append(SameStructure(hit, r["fingerprint"], tuple((r["signature"] or {}).get("inputs") or ())))
        return out

    def unstructured_programs(self, function: str, limit: int = 8) -> list[dict[str, Any]]:
        """Programs of *function* whose structure is not recorded (stored before migration 0005): id, fingerprint,
        signature. Empty for an older schema."""
        return self._read(queries.unstructured_programs(function, limit)) if self._v5 else []

    def set_structure(self, fingerprint: str, structure: str) -> bool:
        """Record the structure of a program stored without one; False if it had one or is not stored."""

        def fn(s: Session) -> bool:
            res = s.execute(sa.update(Program).where(Program.fingerprint == fingerprint, Program.structure.is_(None))
                            .values(structure=structure))
            return res.rowcount == 1

        return self._write(fn)

    def shape_verdict(self, plan_id: int, fingerprint: str, software: dict[str, str]) -> ShapeVerdict | None:
        """The remembered check of plan *plan_id* at the program *fingerprint* made with exactly this *software*
        (jax, jaxlib, autofuse, backend), or None (never checked so, or a schema older than 0005)."""
        if not self._v5:
            return None
        for r in self._read(queries.shape_checks([plan_id], fingerprint)):
            if all(r[k] == software.get(k) for k in SOFTWARE_KEYS):
                return ShapeVerdict(plan_id, fingerprint, r["verdict"], r["detail"] or "", r["checked_at"], r["actor"])
        return None

    def record_shape(self, plan_id: int, fingerprint: str, inputs: list[str], software: dict[str, str], verdict: str,
                     detail: str = "", *, actor: str | None = None) -> None:
        """Remember the verdict (``ok`` or ``failed``) of checking plan *plan_id* at the program *fingerprint*
        (inputs as ``Graph.signature()["inputs"]``) with *software*; a later check with the same software replaces it."""
        if verdict not in SHAPE_VERDICTS:
            raise ValueError(f"invalid shape verdict {verdict!r}: expected one of {', '.join(SHAPE_VERDICTS)}")
        missing = [k for k in SOFTWARE_KEYS if k not in software]
        if missing:
            raise ValueError(f"software dict lacks {', '.join(missing)}")
        sw_id = self.software(**{k: software[k] for k in SOFTWARE_KEYS})
        who = (actor or f"{whoami()}:{os.getpid()}")[:255]

        def fn(s: Session) -> None:
            self._require(s, Plan, plan_id, "plan")
            row = s.scalar(sa.select(PlanShape).where(PlanShape.plan_id == plan_id, PlanShape.fingerprint == fingerprint,
                                                      PlanShape.software_id == sw_id))
            if row is None:
                row = PlanShape(plan_id=plan_id, fingerprint=fingerprint, software_id=sw_id)
                s.add(row)
            row.inputs, row.verdict, row.detail, row.actor, row.checked_at = list(inputs), verdict, detail, who, utcnow()

        self._write(fn, retry_integrity=True)

    def plan_shapes(self, plan_ids: list[int]) -> dict[int, dict[str, Any]]:
        """Per plan: ``structure`` (None: not recorded), ``inputs`` (the shapes it was tuned at) and ``checks`` (its
        checks at other shapes, newest first: inputs, verdict, detail, checked_at, actor, versions)."""
        if not plan_ids:
            return {}
        progs = self._read(queries.plan_programs(plan_ids)) if self._v5 else []
        out: dict[int, dict[str, Any]] = {
            r["plan_id"]: {"structure": r["structure"], "inputs": list((r["signature"] or {}).get("inputs") or []), "checks": []}
            for r in progs}
        for r in self._read(queries.shape_checks(plan_ids)) if self._v5 else []:
            out.setdefault(r["plan_id"], {"structure": None, "inputs": [], "checks": []})["checks"].append(r)
        return out

    # ------------------------------------------------- XLA autotune entries

    def save_autotune(self, jaxlib: str, device: str, entries: dict[str, str]) -> int:
        """Keep XLA's per-fusion autotune `entries` (file name -> content, `xla_autotune.read_entries`) made under
        *jaxlib* on *device*, so that the store alone carries the GEMM kernels its plans were measured with. An entry
        already stored under its key stays as it is (the kernels the first plans were measured with); returns how many
        were added."""
        if not entries:
            return 0

        def fn(s: Session) -> int:
            known = set(s.scalars(sa.select(XlaAutotune.name).where(XlaAutotune.jaxlib == jaxlib, XlaAutotune.device == device)))
            new = [XlaAutotune(jaxlib=jaxlib, device=device, name=n, content=c) for n, c in entries.items() if n not in known]
            s.add_all(new)
            return len(new)

        return self._write(fn, retry_integrity=True)

    def autotune_entries(self, jaxlib: str, device: str) -> dict[str, str]:
        """The autotune entries stored for *jaxlib* and *device* (file name -> content), for a deploy to write into
        its XLA cache directory before compiling a plan; empty for a schema older than 0007. Reads only."""
        if not self._v7:
            return {}
        stmt = sa.select(XlaAutotune.name, XlaAutotune.content).where(XlaAutotune.jaxlib == jaxlib, XlaAutotune.device == device)
        return {r["name"]: r["content"] for r in self._read(stmt)}

    # --------------------------------------------------------------- listings

    def runs(
        self,
        program: str | None = None,
        device: str | None = None,
        since: str | _dt.date | None = None,
        min_speedup: float | None = None,
    ) -> list[dict[str, Any]]:
        """Runs, newest first. *program*: name or fingerprint (prefix);
        *device*: case-insensitive part of the name; *since*: ``YYYY-MM-DD``
        or a date/datetime (UTC); *min_speedup*: runs with speedup >= it."""
        return _live(self._read(queries.runs(program, device, queries.parse_since(since), min_speedup)))

    def unfinished_runs(self, program: str | None = None, device: str | None = None) -> list[dict[str, Any]]:
        """Runs in status running or interrupted (candidates for ``tune --resume``), newest first."""
        return _live(self._read(queries.runs(program, device, statuses=UNFINISHED_STATUSES)))

    def plans(
        self,
        program: str | None = None,
        device: str | None = None,
        since: str | _dt.date | None = None,
        min_speedup: float | None = None,
        current_only: bool = False,
    ) -> list[dict[str, Any]]:
        """Plans (without their JSON), newest first; filters as in :meth:`runs`."""
        return self._read(queries.plans(program, device, queries.parse_since(since), min_speedup, current_only, self._v3))

    def candidates(self, run_id: int) -> list[dict[str, Any]]:
        """Candidates of a run, with ``speedup`` = xla_ms / best_ms where both are known."""
        rows = self._read(queries.candidates(run_id))
        for r in rows:
            r["speedup"] = _ratio(r["xla_ms"], r["best_ms"])
        return rows

    def trials(self, run_id: int, status: str | None = None) -> list[dict[str, Any]]:
        """Trials of a run (optionally of one status), joined with candidate signature and template."""
        return self._read(queries.trials(run_id, status))

    def get_run(self, run_id: int) -> dict[str, Any]:
        """One run with program, device and software details; KeyError if absent."""
        rows = self._read(queries.run(run_id, self._v6))
        if not rows:
            raise KeyError(f"no run with id {run_id} in {db.display_url(self.url)}")
        return _live(rows)[0]

    def get_plan(self, plan_id: int) -> dict[str, Any]:
        """One plan; ``plan`` holds the parsed plan JSON, ``plan_json`` the text; KeyError if absent."""
        rows = self._read(queries.plan(plan_id, self._v3))
        if not rows:
            raise KeyError(f"no plan with id {plan_id} in {db.display_url(self.url)}")
        r = rows[0]
        r["plan"] = json.loads(r["plan_json"])
        return r

    def compare(
        self,
        program: str | None = None,
        device: str | None = None,
        since: str | _dt.date | None = None,
        min_speedup: float | None = None,
    ) -> list[dict[str, Any]]:
        """One row per program x device x software that has a current plan:
        its speedup, the best speedup ever saved for the key, and the number of plans."""
        return self._read(queries.compare(program, device, queries.parse_since(since), min_speedup))

    # ---------------------------------------------------------------- schema

    def schema_revision(self) -> str | None:
        """The autofuse schema revision of the database."""
        revs = self._guard(lambda: db.current(self.engine))
        return ",".join(sorted(revs)) or None


# ---------------------------------------------------------------- helpers


def _signature_diff(stored: dict[str, Any], this: dict[str, Any]) -> str:
    """Which inputs (shape and dtype) and static values differ between a stored program's signature and this call's."""
    parts = []
    a, b = list(stored.get("inputs") or []), list(this.get("inputs") or [])
    if len(a) != len(b):
        parts.append(f"{len(a)} input arrays ({', '.join(map(str, a[:4]))}{', ...' if len(a) > 4 else ''}), this call {len(b)}")
    else:
        d = [f"input {i} {x} (this call {y})" for i, (x, y) in enumerate(zip(a, b)) if x != y]
        if d:
            parts.append("; ".join(d[:3]) + (f"; and {len(d) - 3} more" if len(d) > 3 else ""))
    if "static" in stored or "static" in this:
        sa_, sb = stored.get("static"), this.get("static")
        if "static" in stored and sa_ != sb:
            parts.append(f"static values {sa_ or 'none'} (this call {sb or 'none'})")
    return "; ".join(parts)


def _figures(plan: Plan | None) -> PlanFigures | None:
    return None if plan is None else PlanFigures(plan.id, plan.measure, plan.speedup, plan.noise, bool(plan.pinned))


def _plan_summary(plan: Plan) -> str:
    return f"{plan.measure} plan, speedup {plan.speedup:.2f}x, run {plan.run_id}"


def _check_measure(measure: str) -> None:
    if measure not in MEASURES:
        raise ValueError(f"invalid measure {measure!r}: expected one of {', '.join(MEASURES)}")


def _float(x: float | None) -> float | None:
    return None if x is None else float(x)


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den <= 0:
        return None
    return num / den


def _claim_stale(worker: str | None, claimed_at: _dt.datetime | None, now: _dt.datetime, stale_s: float) -> bool:
    """Whether a claim may be taken over: older than *stale_s*, or made by a process of this host that is gone."""
    if claimed_at is None or (now - claimed_at).total_seconds() > stale_s:
        return True
    host, _, pid = (worker or "").rpartition(":")
    return host == socket.gethostname() and pid.isdigit() and not pid_alive(int(pid), claimed_at)


def _live(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Runs as they stand now: one still marked ``running`` whose process on this host is gone is shown
    ``interrupted`` (with why) at once, by any reader, read-only stores included; the next tuning job's
    :meth:`PlanStore.mark_interrupted` writes it. Runs of other hosts cannot be checked and are left as stored."""
    host = socket.gethostname()
    for r in runs:
        if r.get("status") == "running" and r.get("host") == host and r.get("pid") is not None and not pid_alive(r["pid"], r.get("started_at")):
            r["status"] = "interrupted"
            r["error"] = r.get("error") or f"its process ({host}, pid {r['pid']}) is gone"
    return runs
