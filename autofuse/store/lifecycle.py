"""A run's life in the store: started, shared with workers, its phases marked, its selection taken by one worker,
finished, or found interrupted and resumed. The run row is the lock that keeps workers on many hosts in step."""

from __future__ import annotations

import datetime as _dt
import socket
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from autofuse.processes import pid_alive
from autofuse.store import listings
from autofuse.store.base import Db, check_measure, require, this_process
from autofuse.store.measurements import count_trials
from autofuse.store.models import RUN_STATUSES, Device, Program, Run, Software, Trial, utcnow


def start_run(store: Db, program_id: int, device_id: int, software_id: int, *, budget: dict[str, Any], seed: int,
              sampler: str, measure: str, host: str | None = None, pid: int | None = None,
              optuna_storage: str | None = None) -> int:
    """Record a new run in status ``running``; returns its id.

    *host* and *pid* default to this process (so that
    :meth:`mark_interrupted` can tell when it died). The run's
    ``optuna_study_prefix`` is ``autofuse-run<id>-``.
    """
    check_measure(measure)
    host, pid = this_process(host, pid)

    def fn(s: Session) -> int:
        require(s, Program, program_id, "program")
        require(s, Device, device_id, "device")
        require(s, Software, software_id, "software")
        run = Run(program_id=program_id, device_id=device_id, software_id=software_id, budget=dict(budget), seed=int(seed),
                  sampler=sampler, status="running", measure=measure, started_at=utcnow(), host=host, pid=pid,
                  optuna_storage=optuna_storage, optuna_study_prefix="")
        s.add(run)
        s.flush()
        run.optuna_study_prefix = f"autofuse-run{run.id}-"
        return run.id

    return store.write(fn)


def finish_run(store: Db, run_id: int, status: str, *, baseline_ms: float | None = None, best_ms: float | None = None,
               speedup: float | None = None, error: str | None = None) -> None:
    """Close a run with *status* (finished, interrupted or failed) and its results.

    Fields left as None keep their stored value.
    """
    if status not in RUN_STATUSES or status == "running":
        raise ValueError(f"invalid final run status {status!r}: expected finished, interrupted or failed")

    def fn(s: Session) -> None:
        run = require(s, Run, run_id, "run")
        run.status = status
        run.ended_at = utcnow()
        for field, value in (("baseline_ms", baseline_ms), ("best_ms", best_ms), ("speedup", speedup)):
            if value is not None:
                setattr(run, field, float(value))
        if error is not None:
            run.error = error

    store.write(fn)


def resume_run(store: Db, run_id: int, *, host: str | None = None, pid: int | None = None) -> dict[str, Any]:
    """Mark an unfinished run ``running`` again, owned by this process; returns :meth:`get_run`.

    For ``autofuse tune --resume RUN``: budget, seed, sampler, measure,
    optuna_storage and optuna_study_prefix are in the returned dict.
    Refuses (ValueError) a run that is finished or still running
    elsewhere.
    """
    host, pid = this_process(host, pid)

    def fn(s: Session) -> None:
        run = require(s, Run, run_id, "run")
        if run.status == "finished":
            raise ValueError(f"run {run_id} is finished; nothing to resume")
        if run.status == "running" and not (run.host == host and run.pid == pid):
            gone = run.host == socket.gethostname() and run.pid is not None and not pid_alive(run.pid, run.started_at)
            if not gone:  # a run whose process is gone is taken over
                raise ValueError(f"run {run_id} is still running (host {run.host}, pid {run.pid})")
        run.status = "running"
        run.ended_at = None
        run.error = None  # why it stopped last time no longer holds
        run.host, run.pid = host, pid
        run.selected_by = None  # a worker that died while selecting: this process selects now

    store.write(fn)
    return listings.get_run(store, run_id)


def mark_interrupted(store: Db) -> list[int]:
    """Mark ``running`` runs of this host whose process is gone as ``interrupted``.

    Call at the start of every tuning job. Runs of other hosts (whose
    processes cannot be checked) are left alone. A pid reused by a newer
    process counts as gone (Linux: process start time after the run's).
    Returns the ids marked.
    """
    host = socket.gethostname()

    def fn(s: Session) -> list[int]:
        rows = s.execute(sa.select(Run.id, Run.pid, Run.started_at)
                         .where(Run.status == "running", Run.host == host, Run.pid.is_not(None))).all()
        dead = [r.id for r in rows if not pid_alive(r.pid, r.started_at)]
        if dead:
            s.execute(sa.update(Run).where(Run.id.in_(dead), Run.status == "running")
                      .values(status="interrupted", ended_at=utcnow(), error="process died (marked by mark_interrupted)"))
        return dead

    return store.write(fn)


def set_run_job(store: Db, run_id: int, job: dict[str, Any]) -> None:
    """Publish what workers need to join the run (set once its candidates and studies exist)."""

    def fn(s: Session) -> None:
        require(s, Run, run_id, "run").job = dict(job)

    store.write(fn)


def mark_phase(store: Db, run_id: int, name: str, *, worker: str | None = None, at: float | None = None, value: Any = None,
               keep_first: bool = True) -> None:
    """Record in the run's ``phases`` that phase *name* ended now (or at the epoch time *at*), as seconds from the
    run's start (negative before it); with *value*, that JSON value instead (a phase's parts). *worker*
    (host:pid): under that worker's marks. *keep_first*: a mark already recorded (by another worker) stays."""

    def fn(s: Session) -> None:
        run = require(s, Run, run_id, "run", lock=True)
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

    store.write(fn)


def begin_selection(store: Db, run_id: int, worker: str) -> bool:
    """Compare-and-set: *worker* becomes the one that selects and saves the run's plan.

    True for exactly one caller, and only while the run is running, its
    selection not yet taken, and none of its trials is still running.
    """

    def fn(s: Session) -> bool:
        run = require(s, Run, run_id, "run", lock=True)
        if run.status != "running" or run.selected_by is not None:
            return False
        if count_trials(s, run_id, Trial.status == "running"):
            return False
        res = s.execute(sa.update(Run).where(Run.id == run_id, Run.status == "running", Run.selected_by.is_(None))
                        .values(selected_by=worker))
        return res.rowcount == 1

    return store.write(fn)
