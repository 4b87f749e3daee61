"""The trial ledger: every candidate of a job and its trials, kept one way whichever driver runs the job.

A trial is claimed before it is measured and finished after: the claim is
where the budget is kept (a trial that would pass it is refused) and where a
config already tried is caught (no config of a candidate is measured twice).
`MemoryLedger` keeps the books in this process (a job without a store);
`StoreLedger` keeps them in the plan store, one transaction per claim
serialised on the run row, so workers on any number of hosts share one budget.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Protocol

from ..status import TrialStatus
from ..runner.protocol import TrialResult


@dataclass(frozen=True)
class TrialRecord:
    """One trial of a candidate: a config and what became of it."""

    number: int
    config: dict
    status: TrialStatus
    median_ms: float | None = None
    min_ms: float | None = None
    max_ms: float | None = None
    error: str | None = None
    max_error: float | None = None
    optuna_trial_id: int | None = None

    @staticmethod
    def from_row(row: dict) -> "TrialRecord":
        return TrialRecord(row["number"], dict(row["config"]), TrialStatus(row["status"]), row.get("median_ms"), row.get("min_ms"),
                           row.get("max_ms"), row.get("error"), row.get("max_error"), row.get("optuna_trial_id"))


@dataclass
class CandidateState:
    """A distinct candidate of a job (instances that compute the same thing are tuned once) and what is known of it."""

    signature: str
    template: str
    nodes: list[int]
    instances: int
    xla_ms: float | None = None
    best_ms: float | None = None
    best_config: dict | None = None
    status: str = "pending"
    trials: list[TrialRecord] = field(default_factory=list)
    candidate_id: int | None = None  # its row in the store
    checked_trials: int | None = None  # a resumed run: its best was checked (model mode) when it had this many trials
    ops: tuple[str, ...] = ()  # its nodes' primitives, in program order (what the job's output names it by)
    program_xla_ms: float | None = None  # XLA's time in the program one instance saves, by a profile (`ProgramCosts.price`)

    @property
    def speedup(self) -> float | None:
        return self.xla_ms / self.best_ms if self.xla_ms and self.best_ms else None

    @property
    def measured(self) -> bool:
        """Whether any of its configs was built and run (infeasible and pruned ones never are)."""
        return any(t.status.compiled and t.status not in (TrialStatus.RUNNING, TrialStatus.LOST) for t in self.trials)

    def spent(self) -> list[TrialRecord]:
        """Its trials that count against the budget."""
        return [t for t in self.trials if t.status.spends_budget]

    def update_best(self) -> None:
        """The best config is the fastest trial still marked ok (none: no fused option)."""
        ok = [t for t in self.trials if t.status is TrialStatus.OK]
        b = min(ok, key=lambda t: t.median_ms) if ok else None
        self.best_ms, self.best_config = (b.median_ms, b.config) if b else (None, None)


@dataclass(frozen=True)
class Claim:
    """The ledger's answer to a claim: "ok" (trial `number` is yours), "duplicate" (`known` has that config
    already), "spent" (the budget is), "closed" (the run no longer takes trials)."""

    kind: str
    number: int | None = None
    known: TrialRecord | None = None


class Ledger(Protocol):
    def claim(self, cand: CandidateState, config: dict, optuna_trial_id: int, *, limit: int | None,
              status: TrialStatus = TrialStatus.RUNNING, error: str | None = None) -> Claim:
        """Record that `config` of `cand` is about to be measured (or, with another status, was decided unmeasured)."""

    def finish(self, cand: CandidateState, number: int, result: TrialResult) -> bool:
        """Record a claimed trial's result; False if it was meanwhile marked lost."""

    def refresh(self, cands: list[CandidateState]) -> None:
        """Bring every candidate's trials up to date (other workers write too)."""

    def mark_lost(self, cand: CandidateState, optuna_trial_id: int, error: str) -> bool:
        """A running trial whose worker died: it stops counting, its config may be retried."""

    def update_candidate(self, cand: CandidateState) -> None:
        """Record the candidate's best config and status."""

    def time_xla(self, cand: CandidateState, measure: Callable[[], TrialResult]) -> None:
        """Set XLA's time of a candidate at its first trial (one not timed first: `scheduler.timed_first`): the
        run's where another worker recorded one, else `measure`d here (None where that failed) and recorded."""


def _counted(cands: list[CandidateState]) -> int:
    return sum(len(c.spent()) for c in cands)


def _duplicate(cand: CandidateState, config: dict) -> TrialRecord | None:
    return next((t for t in cand.trials if t.status is not TrialStatus.LOST and t.config == config), None)


def _record(cand: CandidateState, number: int, result: TrialResult) -> bool:
    """Write a result into the candidate's copy of its running trial `number`."""
    for k, t in enumerate(cand.trials):
        if t.number == number and t.status is TrialStatus.RUNNING:
            cand.trials[k] = replace(t, status=result.status, median_ms=result.median_ms, min_ms=result.min_ms, max_ms=result.max_ms,
                                     error=result.error, max_error=result.max_error)
            return True
    return False


class MemoryLedger:
    """The books of a job without a store, in this process (one driver)."""

    def __init__(self, cands: list[CandidateState]):
        self.cands = cands

    def claim(self, cand: CandidateState, config: dict, optuna_trial_id: int, *, limit: int | None,
              status: TrialStatus = TrialStatus.RUNNING, error: str | None = None) -> Claim:
        known = _duplicate(cand, config)
        if known is not None:
            return Claim("duplicate", known=known)
        if limit is not None and _counted(self.cands) >= limit:
            return Claim("spent")
        number = max((t.number for t in cand.trials), default=-1) + 1
        cand.trials.append(TrialRecord(number, dict(config), status, error=error, optuna_trial_id=optuna_trial_id))
        return Claim("ok", number)

    def finish(self, cand: CandidateState, number: int, result: TrialResult) -> bool:
        return _record(cand, number, result)

    def refresh(self, cands: list[CandidateState]) -> None:
        pass

    def mark_lost(self, cand: CandidateState, optuna_trial_id: int, error: str) -> bool:
        for k, t in enumerate(cand.trials):
            if t.optuna_trial_id == optuna_trial_id and t.status is TrialStatus.RUNNING:
                cand.trials[k] = replace(t, status=TrialStatus.LOST, error=error)
                return True
        return False

    def update_candidate(self, cand: CandidateState) -> None:
        pass

    def time_xla(self, cand: CandidateState, measure: Callable[[], TrialResult]) -> None:
        res = measure()
        cand.xla_ms = res.median_ms if res.ok else None


class StoreLedger:
    """The books of a run in the plan store, shared by every worker of the run."""

    def __init__(self, store: Any, run_id: int, worker: str | None = None):
        self.store, self.run_id, self.worker = store, run_id, worker  # worker: host:pid, recorded on the trials it claims
        self._xla_read: set[int] = set()  # candidates whose XLA time (or its failure) was read after their first trial

    def claim(self, cand: CandidateState, config: dict, optuna_trial_id: int, *, limit: int | None,
              status: TrialStatus = TrialStatus.RUNNING, error: str | None = None) -> Claim:
        kind, got = self.store.claim_trial(self.run_id, cand.candidate_id, config, optuna_trial_id, limit=limit, status=status.value,
                                           error=error, worker=self.worker)
        if kind == "ok":
            cand.trials.append(TrialRecord(got, dict(config), status, error=error, optuna_trial_id=optuna_trial_id))
            return Claim("ok", got)
        if kind == "duplicate":
            return Claim("duplicate", known=TrialRecord(got["number"], dict(config), TrialStatus(got["status"]), got["median_ms"],
                                                        error=got["error"]))
        return Claim(kind)

    def finish(self, cand: CandidateState, number: int, result: TrialResult) -> bool:
        done = self.store.finish_trial(cand.candidate_id, number, result.status.value, median_ms=result.median_ms, min_ms=result.min_ms,
                                       max_ms=result.max_ms, error=result.error, device=result.device)
        return done and _record(cand, number, result)

    def refresh(self, cands: list[CandidateState]) -> None:
        """Every candidate's trials, and XLA's time of those with trials that this worker did not time itself."""
        rows = self.store.trials(self.run_id)
        for c in cands:
            c.trials = [TrialRecord.from_row(r) for r in rows if r["candidate_id"] == c.candidate_id]
        # a candidate's XLA time is recorded before its first trial is claimed: read once it has one (a failed
        # timing stays None, and is not read again at every step)
        missing = [c for c in cands if c.xla_ms is None and c.trials and c.candidate_id not in self._xla_read]
        if missing:
            xla = {row["id"]: row["xla_ms"] for row in self.store.candidates(self.run_id)}
            for c in missing:
                c.xla_ms = xla.get(c.candidate_id)
                self._xla_read.add(c.candidate_id)

    def mark_lost(self, cand: CandidateState, optuna_trial_id: int, error: str) -> bool:
        return self.store.mark_trial_lost(cand.candidate_id, optuna_trial_id, error)

    def time_xla(self, cand: CandidateState, measure: Callable[[], TrialResult]) -> None:
        cand.xla_ms = self._stored_xla(cand)
        if cand.xla_ms is not None:
            return
        res = measure()
        ms = res.median_ms if res.ok else None
        recorded = self.store.record_xla(cand.candidate_id, self.worker or "", res.status.value, ms, res.device)
        cand.xla_ms = ms if recorded else self._stored_xla(cand)  # another worker's, recorded meanwhile, stays

    def _stored_xla(self, cand: CandidateState) -> float | None:
        return next((row["xla_ms"] for row in self.store.candidates(self.run_id) if row["id"] == cand.candidate_id), None)

    def update_candidate(self, cand: CandidateState) -> None:
        self.store.update_candidate(cand.candidate_id, best_config=cand.best_config, best_ms=cand.best_ms, xla_ms=cand.xla_ms,
                                    status=cand.status, n_trials=len(cand.trials))
