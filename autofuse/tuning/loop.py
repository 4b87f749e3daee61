"""The trial loop both drivers run: read the ledger, let the scheduler name a candidate, run one trial of it."""
from __future__ import annotations

import sys
import time
from typing import Any

from ..runner.protocol import XlaRequest
from ..spent import add_since
from .job import create_study, load_study
from .ledger import CandidateState, Ledger
from .output import best_postfix, trial_line
from .scheduler import Scheduler
from .space import CandidateSpace
from .trial import TrialContext, run_trial


SHOW_EVERY_S = 1.0


class TrialLoop:
    """One driver's trials of a job. `worker_seed` keeps several workers' samplers apart (0 for the first)."""

    def __init__(self, cands: list[CandidateState], spaces: dict[str, CandidateSpace], scheduler: Scheduler, ctx: TrialContext,
                 storage: Any, run_id: int | None, seed: int, worker_seed: int = 0, bar: Any = None, verbose: bool = False):
        self.cands, self.spaces, self.scheduler, self.ctx = cands, spaces, scheduler, ctx
        self.storage, self.run_id, self.seed, self.worker_seed, self.bar = storage, run_id, seed, worker_seed, bar
        self.verbose = verbose  # a line per trial
        self._show_next = -float("inf")
        self.studies: dict[int, Any] = {}
        self.measured = 0
        self.order: list[tuple[int, str]] = []  # each trial run: its candidate and what became of it
        self.ahead: Any = None  # an `ahead.CompileAhead`: phase 1's next configs compiled ahead, concurrently
        self.creates_studies = False  # whether a candidate's study is created here, at its first trial (one driver alone)
        self.seeds: dict[str, list[dict]] = {}  # by signature: configs a new study tries before its defaults (`buckets`)
        self.xla_tried: set[int] = set()  # candidates this driver timed in XLA at their first trial
        # Where the trials' time went (seconds): reading the ledger, the scheduler's pick, compiling ahead, XLA
        # timings at a first trial, and the trials (`run_trial`'s own parts: the measurement, the ledger's claim and
        # finish; the rest of a trial is the sampler and its storage).
        self.spent: dict[str, float] = {}
    @property
    def ledger(self) -> Ledger:
        return self.ctx.ledger

    def study(self, i: int) -> Any:
        if i not in self.studies:
            if self.creates_studies:
                r = self.cands[i]
                create_study(self.storage, self.run_id, self.spaces[r.signature], r.signature, self.seeds.get(r.signature, ()))
            self.studies[i] = load_study(self.storage, self.run_id, self.cands[i].signature, self.seed + i + 7919 * self.worker_seed)
        return self.studies[i]

    def step(self) -> str | None:
        """One trial of the candidate the budget rule names; None when it names none. Returns what became of the trial."""
        t = time.perf_counter()
        self.ledger.refresh(self.cands)
        for c in self.cands:
            c.update_best()
        t = add_since(self.spent, "ledger", t)
        i = self.scheduler.pick()
        t = add_since(self.spent, "pick", t)
        if i is None:
            return None
        if self.ahead is not None:
            self.ahead.before(i)
            t = add_since(self.spent, "compile_ahead", t)
        r = self.cands[i]
        if r.xla_ms is None and i not in self.xla_tried:  # not among those timed first (`scheduler.timed_first`)
            self.time_xla(i)
            t = add_since(self.spent, "xla", t)
        study = self.study(i)
        t = add_since(self.spent, "study", t)
        if self.ahead is not None and r.trials:  # phase 2's next configs, this one's and the other contenders'
            others = [(j, n) for j, n in sorted(self.scheduler.planned.items(), key=lambda kv: -kv[1]) if j != i and n > 0 and self.cands[j].trials]
            self.ahead.ask([(i, self.scheduler.due(i))] + others, self.study, self.spent)
            t = time.perf_counter()
        kind = run_trial(study, r, self.spaces[r.signature], self.ctx, self.spent)
        add_since(self.spent, "trials", t)
        self.scheduler.note(i, kind)
        self.order.append((i, kind))
        if kind == "measured":
            self.measured += 1
            r.update_best()
            if self.bar is not None:
                self.bar.update(1)
                self.show_best()
        if self.verbose and kind in ("measured", "unmeasured") and r.trials:
            if self.bar is not None:
                self.bar.write(trial_line(r), file=sys.stderr)
            else:
                print(trial_line(r), file=sys.stderr, flush=True)
        return kind

    def time_xla(self, i: int) -> None:
        """XLA's time of candidate i at its first trial (`Ledger.time_xla`), once per driver: a failed timing leaves the
        candidate without an XLA option, as a failure before the trials would; priced again in the program where the
        job profiled it."""
        self.xla_tried.add(i)
        r = self.cands[i]
        self.ledger.time_xla(r, lambda: self.ctx.runner.call(XlaRequest(tuple(r.nodes))))
        if self.scheduler.costs is not None:  # its time alone bounds what the profile credits it (`ProgramCosts.credit_ms`)
            self.scheduler.costs.price([r], self.scheduler.by_sig, self.scheduler.spaces)

    def show_best(self, force: bool = False) -> None:
        """The job's best plan so far on the bar (its cover's speedup, not one candidate's). A whole model's cover is
        a MILP over thousands of options (seconds): it is solved for the bar at most once a second and at most a
        tenth of the time, so the display never costs the job more than 10%."""
        now = time.monotonic()
        if self.bar is None or getattr(self.bar, "disable", False) or (not force and now < self._show_next):
            return
        cover = self.scheduler.cover()
        took = time.monotonic() - now
        self._show_next = now + max(SHOW_EVERY_S, 10 * took)
        self.bar.set_postfix_str(best_postfix(cover.baseline_ms, cover.tuned_ms))

    def run(self) -> None:
        """Trials until the budget rule names no candidate or the run is closed."""
        try:
            while True:
                kind = self.step()
                if kind is None or kind == "closed":
                    return
        finally:
            if self.measured:
                self.show_best(force=True)
