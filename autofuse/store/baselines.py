"""XLA's own time of each candidate, the baseline its trials are compared with: claimed by one worker at a time, so
that the workers of a run share the timings out and each candidate is timed once."""

from __future__ import annotations

import datetime as _dt
import socket
from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.orm import Session

from autofuse.processes import pid_alive
from autofuse.store.base import Db, opt_float, require
from autofuse.store.models import Candidate, Run, utcnow


def claim_xla(store: Db, run_id: int, worker: str, n: int, *, stale_s: float, among: Sequence[int] | None = None) -> list[int]:
    """Up to *n* candidates of the run (of *among*, candidate ids, where given) whose XLA timing nobody has done
    or is doing, now claimed by *worker* (host:pid); their ids. A claim older than *stale_s* seconds, or of a
    dead process of this host, is taken over. One transaction serialised on the run row: each candidate is
    timed once."""

    def fn(s: Session) -> list[int]:
        require(s, Run, run_id, "run", lock=True)
        now = utcnow()
        query = sa.select(Candidate).where(Candidate.run_id == run_id, Candidate.xla_ms.is_(None),
                                           sa.or_(Candidate.xla_status.is_(None), Candidate.xla_status == "running"))
        if among is not None:
            query = query.where(Candidate.id.in_(list(among)))
        got = []
        for c in s.execute(query.order_by(Candidate.id)).scalars().all():
            if len(got) >= n:
                break
            if c.xla_status == "running" and not _claim_stale(c.xla_worker, c.xla_claimed_at, now, stale_s):
                continue
            c.xla_status, c.xla_worker, c.xla_claimed_at = "running", worker, now
            got.append(c.id)
        return got

    return store.write(fn)


def finish_xla(store: Db, cand_id: int, worker: str, status: str, xla_ms: float | None, device: str | None) -> bool:
    """Record a claimed XLA timing (*status* ok, or why it failed); False if another worker took the claim over."""
    return finish_xla_many(store, worker, [(cand_id, status, xla_ms, device)]) == [True]


def finish_xla_many(store: Db, worker: str, results: Sequence[tuple[int, str, float | None, str | None]]) -> list[bool]:
    """`finish_xla` of a chunk's (candidate id, status, ms, device), in one transaction: a worker's chunk is one
    write, not one per candidate (four workers' per-candidate writes on one SQLite file waited on each other's
    locks for seconds of every worker's XLA phase). Per result, False where another worker took the claim over."""

    def fn(s: Session) -> list[bool]:
        done = []
        for cand_id, status, xla_ms, device in results:
            res = s.execute(sa.update(Candidate)
                            .where(Candidate.id == cand_id, Candidate.xla_status == "running", Candidate.xla_worker == worker)
                            .values(xla_status=status, xla_ms=opt_float(xla_ms), xla_device=device))
            done.append(res.rowcount == 1)
        return done

    return store.write(fn)


def record_xla(store: Db, cand_id: int, worker: str, status: str, xla_ms: float | None, device: str | None) -> bool:
    """XLA's time of a candidate measured without a claim (at its first trial: `scheduler.timed_first`); False
    if the candidate has one already (another worker timed it first, which stays)."""

    def fn(s: Session) -> bool:
        untimed = sa.and_(Candidate.xla_ms.is_(None), sa.or_(Candidate.xla_status.is_(None), Candidate.xla_status != "ok"))
        res = s.execute(sa.update(Candidate).where(Candidate.id == cand_id, untimed)
                        .values(xla_status=status, xla_ms=opt_float(xla_ms), xla_device=device, xla_worker=worker,
                                xla_claimed_at=utcnow()))
        return res.rowcount == 1

    return store.write(fn)


def _claim_stale(worker: str | None, claimed_at: _dt.datetime | None, now: _dt.datetime, stale_s: float) -> bool:
    """Whether a claim may be taken over: older than *stale_s*, or made by a process of this host that is gone."""
    if claimed_at is None or (now - claimed_at).total_seconds() > stale_s:
        return True
    host, _, pid = (worker or "").rpartition(":")
    return host == socket.gethostname() and pid.isdigit() and not pid_alive(int(pid), claimed_at)
