"""One trial, end to end: ask Optuna for a config -> decide whether it is worth compiling -> claim it in the
ledger -> build, check and time it in the trial process -> record -> tell Optuna. Written once, for every driver.

The trial runs inside `study.optimize(n_trials=1)`, so Optuna's heartbeats
(where the storage has them) cover it while it runs. A config that breaks a
constraint, or that the roofline puts far behind the default on the GPU, is
told to Optuna as infeasible and never compiled; a config the ledger already
has is told its known value and spends nothing. A candidate with a working config takes the untried neighbours of its
best before its sampler's proposals (`space.queue_neighbours`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ..runner.protocol import TrialRequest, TrialResult
from ..spent import add_parts, add_since
from ..status import TrialStatus
from .job import enqueue_model_best
from .ledger import CandidateState, Ledger
from .space import CandidateSpace, queue_neighbours

INFEASIBLE_VALUE = 1e9  # what Optuna is told for a config that was never measured


class _NoResult(Exception):
    """Ends an Optuna trial as failed: a failed build or check, a config running elsewhere, or no budget left."""


@dataclass
class TrialContext:
    """What every trial of a job needs besides its candidate."""

    ledger: Ledger
    runner: Any  # runner.protocol.Runner
    measure: str
    limit: int  # the job's trial budget (counted trials)
    worker: str  # who runs it, recorded on the Optuna trial


def measure_config(runner: Any, cand: CandidateState, config: dict) -> TrialResult:
    """Build, check and time one config of a candidate in the trial process."""
    return runner.call(TrialRequest(tuple(cand.nodes), cand.template, dict(config)))


def run_trial(study: Any, cand: CandidateState, space: CandidateSpace, ctx: TrialContext, spent: dict | None = None) -> str:
    """One Optuna trial of `cand`; returns what became of it: "measured", "unmeasured" (infeasible or pruned),
    "duplicate" (a config already done), "exhausted" (a config already done, and every config worth timing has
    been tried), "spent" (no budget left), "closed" (the run takes no more trials) or
    "stale" (taken for dead meanwhile; its retry measures it again). `spent` adds up the seconds of the measurement
    ("measure"; its parts in the trial process as "measure_build", "measure_check", ...: `TrialResult.seconds`) and
    of the ledger's claims and finishes ("claim")."""
    spent = {} if spent is None else spent
    for t in cand.trials:  # any worker's shared-memory failure corrects this group's budget here too
        space.learn_shared_memory(t.status, t.config, t.error)
    outcome = {"kind": "closed"}

    def objective(trial: Any) -> float:
        cfg = space.suggest(trial)
        if trial.number == 0:  # the study's first enqueued default: the model's best queued behind the defaults
            enqueue_model_best(study, space)
        trial.set_user_attr("worker", ctx.worker)
        unmeasured = space.unmeasured_reason(cfg, ctx.measure)
        t0 = time.perf_counter()
        if unmeasured:
            claim = ctx.ledger.claim(cand, cfg, trial.number, limit=None, status=unmeasured[0], error=unmeasured[1])
        else:
            claim = ctx.ledger.claim(cand, cfg, trial.number, limit=ctx.limit)
        add_since(spent, "claim", t0)
        outcome["kind"] = claim.kind
        if claim.kind == "duplicate":  # the sampler proposed a config done (or running) already: nothing spent
            known = claim.known
            if space.explored([t.config for t in cand.trials if t.status is not TrialStatus.LOST], ctx.measure):
                outcome["kind"] = "exhausted"
            if known.status is TrialStatus.OK or not known.status.compiled:
                trial.set_constraint("violations", 1.0 if known.status is TrialStatus.INFEASIBLE else 0.0)
                return float(known.median_ms) if known.status is TrialStatus.OK else INFEASIBLE_VALUE
            raise _NoResult(f"config already tried: {known.status}")
        if claim.kind != "ok":
            raise _NoResult(f"no trial started: {claim.kind}")
        record = {"config": cfg, "number": claim.number}  # the ledger's trial, also on Optuna's (read by optuna-dashboard)
        if unmeasured:
            trial.set_constraint("violations", float(unmeasured[2]))
            trial.set_user_attr("result", {**record, "status": unmeasured[0].value, "error": unmeasured[1]})
            outcome["kind"] = "unmeasured"
            return INFEASIBLE_VALUE
        t0 = time.perf_counter()
        res = measure_config(ctx.runner, cand, cfg)
        add_since(spent, "measure", t0)
        add_parts(spent, res.seconds, "measure_")
        t0 = time.perf_counter()
        finished = ctx.ledger.finish(cand, claim.number, res)
        add_since(spent, "claim", t0)
        if not finished:
            outcome["kind"] = "stale"
            raise _NoResult("marked lost while running")
        trial.set_constraint("violations", 0.0)
        trial.set_user_attr("result", {**record, "status": res.status.value, "median_ms": res.median_ms, "error": res.error})
        outcome["kind"] = "measured"
        if space.learn_shared_memory(res.status, cfg, res.error):  # the next try: the model's best config that fits the corrected budget
            best = space.model_best()
            if best is not None and all(t.config != best for t in cand.trials):
                study.enqueue_trial(space.optuna_params(best))
        if not res.ok:
            raise _NoResult(f"{res.status}: {res.error}")
        return float(res.median_ms)

    from optuna.exceptions import UpdateFinishedTrialError
    from optuna.trial import TrialState

    if cand.best_config is not None and not study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
        queue_neighbours(study, space, cand, 1, ctx.measure)  # compiling ahead queues them where it runs (`ahead._queue`)
    try:
        study.optimize(objective, n_trials=1, catch=(_NoResult,))
    except UpdateFinishedTrialError:  # another worker failed this trial for a late heartbeat; the ledger has its fate
        if outcome["kind"] != "measured":
            outcome["kind"] = "stale"
    return outcome["kind"]
