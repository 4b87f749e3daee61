"""The trial loop both drivers run: read the ledger, let the scheduler name a candidate, run one trial of it."""
from __future__ import annotations

from typing import Any

from .job import load_study
from .ledger import CandidateState, Ledger
from .scheduler import Scheduler
from .space import CandidateSpace
from .trial import TrialContext, run_trial


class TrialLoop:
    """One driver's trials of a job. `worker_seed` keeps several workers' samplers apart (0 for the first)."""

    def __init__(self, cands: list[CandidateState], spaces: dict[str, CandidateSpace], scheduler: Scheduler, ctx: TrialContext,
                 storage: Any, run_id: int | None, seed: int, worker_seed: int = 0, bar: Any = None):
        self.cands, self.spaces, self.scheduler, self.ctx = cands, spaces, scheduler, ctx
        self.storage, self.run_id, self.seed, self.worker_seed, self.bar = storage, run_id, seed, worker_seed, bar
        self.studies: dict[int, Any] = {}
        self.measured = 0
        self.order: list[tuple[int, str]] = []  # each trial run: its candidate and what became of it

    @property
    def ledger(self) -> Ledger:
        return self.ctx.ledger

    def study(self, i: int) -> Any:
        if i not in self.studies:
            self.studies[i] = load_study(self.storage, self.run_id, self.cands[i].signature, self.seed + i + 7919 * self.worker_seed)
        return self.studies[i]

    def step(self) -> str | None:
        """One trial of the candidate the budget rule names; None when it names none. Returns what became of the trial."""
        self.ledger.refresh(self.cands)
        for c in self.cands:
            c.update_best()
        i = self.scheduler.pick()
        if i is None:
            return None
        r = self.cands[i]
        kind = run_trial(self.study(i), r, self.spaces[r.signature], self.ctx)
        self.scheduler.note(i, kind)
        self.order.append((i, kind))
        if kind == "measured":
            self.measured += 1
            r.update_best()
            if self.bar is not None:
                self.bar.update(1)
                best = max((c.speedup for c in self.cands if c.speedup), default=None)
                if best:
                    self.bar.set_postfix_str(f"best candidate {best:.2f}x")
        return kind

    def run(self) -> None:
        """Trials until the budget rule names no candidate or the run is closed."""
        while True:
            kind = self.step()
            if kind is None or kind == "closed":
                return
