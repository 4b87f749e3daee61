"""What a run measures: its candidates (fusion groups) and their trials (configs timed), written by one tuning
process or claimed by many workers so that the run's budget is kept exactly and no config is measured twice."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from autofuse.store.base import Db, opt_float, require
from autofuse.store.models import Candidate, Run, Trial, utcnow

#: Trial statuses that spend no budget: decided without compiling, or lost with a dead worker (and retried).
UNCOUNTED_TRIAL_STATUSES = ("infeasible", "pruned", "lost")


def add_candidate(store: Db, run_id: int, signature: str, template: str, nodes: list[int]) -> int:
    """Id of the candidate (run, signature, template), created if new.

    Idempotent so that a resumed run finds its candidates again.
    """
    return add_candidates(store, run_id, [(signature, template, nodes)])[0]


def add_candidates(store: Db, run_id: int, cands: Sequence[tuple[str, str, list[int]]]) -> list[int]:
    """`add_candidate` of each (signature, template, nodes), in one transaction: a whole model's candidates
    (GPT-2 medium: 158) are one write, not one each while the run's workers start and read the store."""

    def fn(s: Session) -> list[int]:
        require(s, Run, run_id, "run")
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

    return store.write(fn, retry_integrity=True)


def update_candidate(store: Db, cand_id: int, *, best_config: dict[str, Any] | None = None, best_ms: float | None = None,
                     xla_ms: float | None = None, status: str | None = None, n_trials: int | None = None) -> None:
    """Set the given fields of a candidate (None: unchanged)."""
    values = {"best_config": None if best_config is None else dict(best_config), "best_ms": opt_float(best_ms),
              "xla_ms": opt_float(xla_ms), "status": status, "n_trials": None if n_trials is None else int(n_trials)}

    def fn(s: Session) -> None:
        c = require(s, Candidate, cand_id, "candidate")
        for field, value in values.items():
            if value is not None:
                setattr(c, field, value)

    store.write(fn)


def add_trial(store: Db, cand_id: int, number: int, config: dict[str, Any], status: str, *, median_ms: float | None = None,
              min_ms: float | None = None, max_ms: float | None = None, error: str | None = None,
              optuna_trial_id: int | None = None) -> int:
    """Record trial *number* of a candidate; returns its id.

    *status*: ok, infeasible, compile_error, resource_exhausted,
    wrong_result, nan, timeout, crashed, ... (and, for runs shared by
    workers, running and lost: see :meth:`claim_trial`). Recording the same number
    again replaces that trial's values (a resumed run re-running it).
    """
    values = dict(config=dict(config), status=status, median_ms=opt_float(median_ms), min_ms=opt_float(min_ms),
                  max_ms=opt_float(max_ms), error=error, optuna_trial_id=optuna_trial_id)

    def fn(s: Session) -> int:
        found = s.scalar(sa.select(Trial).where(Trial.candidate_id == cand_id, Trial.number == number))
        if found is not None:
            for k, v in values.items():
                setattr(found, k, v)
            return found.id
        require(s, Candidate, cand_id, "candidate")
        row = Trial(candidate_id=cand_id, number=int(number), created_at=utcnow(), **values)
        s.add(row)
        s.flush()
        return row.id

    return store.write(fn, retry_integrity=True)


def claim_trial(store: Db, run_id: int, cand_id: int, config: dict[str, Any], optuna_trial_id: int, *, limit: int | None,
                status: str = "running", error: str | None = None, worker: str | None = None) -> tuple[str, Any]:
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
        run = require(s, Run, run_id, "run", lock=True)
        if run.status != "running" or run.selected_by is not None:
            return "closed", None
        rows = s.execute(sa.select(Trial).where(Trial.candidate_id == cand_id)).scalars().all()
        for r in rows:
            if r.status != "lost" and r.config == cfg:
                return "duplicate", {"number": r.number, "status": r.status, "median_ms": r.median_ms, "error": r.error}
        if limit is not None and count_trials(s, run_id, Trial.status.not_in(UNCOUNTED_TRIAL_STATUSES)) >= limit:
            return "spent", None
        number = max((r.number for r in rows), default=-1) + 1
        s.add(Trial(candidate_id=cand_id, number=number, config=cfg, status=status, error=error,
                    optuna_trial_id=optuna_trial_id, created_at=utcnow(), worker=worker))
        return "ok", number

    return store.write(fn)


def count_trials(s: Session, run_id: int, where: Any) -> int:
    """How many trials of the run satisfy *where* (a condition on :class:`Trial`)."""
    q = sa.select(sa.func.count(Trial.id)).join(Candidate, Candidate.id == Trial.candidate_id).where(Candidate.run_id == run_id, where)
    return int(s.scalar(q) or 0)


def finish_trial(store: Db, cand_id: int, number: int, status: str, *, median_ms: float | None = None,
                 min_ms: float | None = None, max_ms: float | None = None, error: str | None = None,
                 device: str | None = None) -> bool:
    """Record the result of a claimed (``running``) trial, the device that measured it and when; False if it
    was meanwhile marked lost."""
    values = dict(status=status, median_ms=opt_float(median_ms), min_ms=opt_float(min_ms), max_ms=opt_float(max_ms),
                  error=error, device=device, finished_at=utcnow())
    return _update_running(store, cand_id, Trial.number == number, values) == 1


def mark_trial_lost(store: Db, cand_id: int, optuna_trial_id: int, error: str) -> bool:
    """A running trial whose worker died (its Optuna trial failed by heartbeat): ``lost``, no longer counted."""
    return _update_running(store, cand_id, Trial.optuna_trial_id == optuna_trial_id, {"status": "lost", "error": error}) > 0


def _update_running(store: Db, cand_id: int, which: Any, values: dict[str, Any]) -> int:
    """Set *values* on the candidate's trials that match *which* and are still ``running``; how many there were."""

    def fn(s: Session) -> int:
        res = s.execute(sa.update(Trial).where(Trial.candidate_id == cand_id, which, Trial.status == "running").values(**values))
        return res.rowcount

    return store.write(fn)
