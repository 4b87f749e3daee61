"""The end of a job: each candidate's checked best, the cheapest cover, and the whole plan against jax.jit.

On the GPU the chosen plan and the plans of its groups with the largest
savings (half, a quarter, ...) are each checked and timed against jax.jit on
the whole program; the chosen plan is kept unless a smaller one is faster
beyond the noise of both (groups measured alone do not always add up); with
the model, the first that passes. None passes: XLA's own plan, recorded as
such. The chosen plan is compiled and validated first, and the job may store
it as soon as it passes (`on_passed`): a first validated plan does not wait
for the smaller plans' compilation and timing.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from typing import Any, Callable

from .. import costmodel
from ..graph import Graph
from ..plan import Plan
from ..runner.protocol import (
    TrialRequest,
    ValidateRequest,
    ValidationResult,
    XlaRequest,
)
from ..status import TrialStatus
from ..tables import plural
from .ahead import compile_batch
from .ledger import CandidateState, Ledger
from .output import candidate_line
from .partition import Candidate
from .report import TuneReport
from .select import Cover, best_cover, contested_nodes, lone_contraction_costs, lone_contractions

log = logging.getLogger("autofuse")
MAX_FALLBACKS = 3  # smaller plans validated beside the chosen one (its groups with the largest savings)
MIN_NOISE = 0.005  # a plan must beat jax.jit by at least this fraction, whatever the measured spread


def finish_candidate(r: CandidateState, runner: Any, measure: str, ledger: Ledger) -> None:
    """Pick the candidate's best config; in model mode only a config that passed its correctness check
    (interpret mode; the three fastest are tried) may be the best. A resumed run whose earlier process
    checked the candidate with the same trials keeps that best (read back from the store)."""
    if measure == "model" and r.checked_trials is not None and r.checked_trials == len(r.trials):
        return
    r.update_best()
    if measure == "model":
        verified = None
        for k, t in sorted(((k, t) for k, t in enumerate(r.trials) if t.status is TrialStatus.OK), key=lambda kt: kt[1].median_ms)[:3]:
            res = runner.call(TrialRequest(tuple(r.nodes), r.template, t.config, check=True))
            if res.ok:
                verified = t
                break
            r.trials[k] = replace(t, status=res.status, error=res.error)
        r.best_ms, r.best_config = (verified.median_ms, verified.config) if verified else (None, None)
    r.status = "tuned" if r.best_ms is not None else "failed" if r.trials else "skipped"
    if r.candidate_id is not None:
        ledger.update_candidate(r)


def finalize(graph: Graph, by_sig: dict[str, list[Candidate]], cands: list[CandidateState], runner: Any, measure: str,
             model: costmodel.GPUModel, ledger: Ledger, name: str, n_trials: int, t_start: float,
             say: Callable[[str], None], phase: Callable[[str], None] | None = None, *, compile_workers: int = 1,
             timings: dict | None = None, on_passed: Callable[[TuneReport], None] | None = None) -> TuneReport:
    """Every candidate's checked best, the exact cover, and the whole plan validated against jax.jit.
    `phase` hears the selection phase's progress (which candidate is checked, which plan validated, k of n).
    `compile_workers` > 1 compiles on the GPU what is timed next on that many threads at once (the lone dots' XLA
    references; the plans to validate with the whole program's reference). `timings` receives where the time went
    (seconds: check, singles, cover, validate, and per plan validated its parts). `on_passed` hears the report of
    the first plan that passes on the GPU, before the others are validated (the job stores it at once)."""
    phase = phase or (lambda s: None)
    timings = {} if timings is None else timings
    t0 = time.perf_counter()
    phase(f"autofuse: selecting the plan from {sum(1 for r in cands if r.trials)} tuned candidates")
    _pause_for_tests()
    to_check = [r for r in cands if measure == "model" and any(t.status is TrialStatus.OK for t in r.trials)
                and not (r.checked_trials is not None and r.checked_trials == len(r.trials))]
    for r in cands:
        if r in to_check:
            phase(f"autofuse: checking the best config of candidate {to_check.index(r) + 1} of {len(to_check)} ({r.template}, interpret mode)")
        finish_candidate(r, runner, measure, ledger)
        if r.trials:
            say(candidate_line(r))
    t1 = time.perf_counter()
    singles = None
    if measure == "device":
        known = {r.signature: r.xla_ms for r in cands if r.xla_ms is not None}  # dots that are candidates alone: timed already
        contested = contested_nodes(by_sig, cands)  # elsewhere a lone dot costs every cover alike
        lone = lone_contractions(graph, known, contested)
        if compile_workers > 1 and len(lone) > 1:
            compile_batch(runner, [XlaRequest((n,)) for n in lone], compile_workers)
        singles = lone_contraction_costs(graph, runner, known, contested)
    t2 = time.perf_counter()
    cover = best_cover(graph, by_sig, cands, model, measure, singles)
    t3 = time.perf_counter()
    timings.update(check=round(t1 - t0, 3), singles=round(t2 - t1, 3), cover=round(t3 - t2, 3))
    report = validate(graph, cover, runner, measure, name, cands, n_trials, t_start, phase, compile_workers=compile_workers,
                      timings=timings, on_passed=on_passed)
    timings["validate"] = round(time.perf_counter() - t3, 3)
    return report


def validate(graph: Graph, cover: Cover, runner: Any, measure: str, name: str, cands: list[CandidateState], n_trials: int,
             t_start: float, phase: Callable[[str], None] | None = None, *, compile_workers: int = 1,
             timings: dict | None = None, on_passed: Callable[[TuneReport], None] | None = None) -> TuneReport:
    """The chosen plan and the smaller plans of `smaller_plans` against jax.jit on the whole program.

    A plan must be correct within tolerance and, on the GPU, faster than jax.jit
    beyond noise. On the GPU all are measured; the first that passes (the chosen
    plan, or the largest smaller one) is kept unless a later one's speedup beats
    it beyond the noise of both (groups measured alone do not add up: a smaller
    plan can be faster), and `on_passed` hears it at once; with the model, the
    first that passes. None passes: XLA's own plan. On the GPU with
    `compile_workers` > 1, the chosen plan and jax.jit's reference are compiled
    at once first, and the smaller plans together once it is validated.
    """
    plan = cover.plan
    validation = ValidationResult(TrialStatus.OK)
    base, tuned, noise = cover.baseline_ms, cover.tuned_ms, None
    notes, kept, best, first, first_passed = [], None, None, None, None  # best (GPU): (speedup, plan, validation, noise), kept so far
    restarted = False  # whether the trial process was restarted for a validation out of memory (once per job)
    tries = [(plan, 0.0)] + smaller_plans(plan, cands) if not plan.is_xla else []
    plans_t = [] if timings is None else timings.setdefault("plans", [])
    ahead = measure == "device" and compile_workers > 1
    for k, (cand, given_up) in enumerate(tries):
        if ahead and k < 2:  # the chosen plan (with jax.jit's reference) first, then every smaller plan at once
            batch = [cand] if k == 0 else [c for c, _ in tries[1:]]
            t0 = time.perf_counter()
            what = "the chosen plan and jax.jit's reference" if k == 0 else f"{len(batch)} smaller plans"
            phase is not None and phase(f"autofuse: compiling {what}, {compile_workers} at once")
            longest: dict = {}
            compile_batch(runner, [ValidateRequest(c.to_json()) for c in batch], compile_workers, timeout_s=None, longest=longest)
            if timings is not None:
                timings["compile_ahead"] = round(timings.get("compile_ahead", 0.0) + time.perf_counter() - t0, 3)
                timings.setdefault("compiled", []).append(longest)  # per batch: jax.jit's program and the slowest plan, s
        if phase is not None:
            phase(f"autofuse: validating plan {k + 1} of {len(tries)} ({describe(cand)}) against jax.jit")
        t0 = time.perf_counter()
        v = runner.call(ValidateRequest(cand.to_json()))
        if v.status is TrialStatus.RESOURCE_EXHAUSTED and not restarted:
            # A whole program near the card's size needs one contiguous block of the trial process's pool, which the
            # trials' buffers may have split: GPT-2 medium's training step (64.7 GiB of temporaries in a 71 GiB pool)
            # ran out of memory there. Once per job, the validation is made again in a fresh trial process.
            restarted = True
            log.warning("autofuse: validating a plan of %d fused groups ran out of GPU memory (%s); validating it again in a "
                        "fresh trial process", len(cand.groups), v.error)
            phase is not None and phase(f"autofuse: out of GPU memory; validating plan {k + 1} again in a fresh trial process")
            runner.restart()
            if ahead:  # the plan and jax.jit's reference compiled at once again, in the fresh process
                compile_batch(runner, [ValidateRequest(cand.to_json())], compile_workers, timeout_s=None)
            v = runner.call(ValidateRequest(cand.to_json()))
        plans_t.append({"groups": len(cand.groups), "status": v.status.value, "seconds": round(time.perf_counter() - t0, 3),
                        **{key: round(x, 3) for key, x in (v.seconds or {}).items()}})
        if not v.ok:
            log.warning("autofuse: a plan of %d fused groups failed end-to-end validation (%s)", len(cand.groups), v.error)
            notes.append(f"{plural(len(cand.groups), 'group')}: validation failed: {v.status}: {v.error}")
        elif measure == "device":
            b, p, r = v.baseline, v.plan, v.ratio
            nz = max(r.q3_ms - r.q1_ms, MIN_NOISE)  # the spread of plan/jax.jit over alternating repeats
            if r.q3_ms < 1.0 and r.median_ms < 1 - nz:
                notes.append(f"{plural(len(cand.groups), 'group')}: {p.median_ms:.4f} ms vs jax.jit {b.median_ms:.4f} ms")
                this = (b.median_ms / p.median_ms, cand, v, nz)
                if best is None:
                    best = first_passed = this
                    first = _report(graph, _with_reason(plan, cand, notes), name, measure, b.median_ms, p.median_ms, nz, cands, v,
                                    n_trials, t_start)
                    if on_passed is not None:
                        on_passed(first)
                elif this[0] > best[0] * (1 + max(nz, best[3])):
                    best = this
            else:
                base, noise, validation = b.median_ms, nz, v
                notes.append(f"{plural(len(cand.groups), 'group')}: plan {p.median_ms:.4f} ms is not faster than jax.jit {b.median_ms:.4f} ms beyond noise ±{nz:.1%}")
        elif cover.tuned_ms + given_up < base:
            kept, tuned, validation = cand, cover.tuned_ms + given_up, v
            break
        else:
            notes.append(f"{plural(len(cand.groups), 'group')}: modelled plan is not faster than XLA")
    if best is not None:
        _, kept, validation, noise = best
        if best is first_passed:  # the first plan that passed: the report the job may have stored already
            first.wall_s = time.time() - t_start
            return first
        base, tuned = validation.baseline.median_ms, validation.plan.median_ms
    if kept is None:
        plan = Plan(graph.fingerprint, (), {**plan.provenance, "reason": "; ".join(notes) or "no fused group is cheaper than XLA"})
        if measure == "device" and not tries:
            validation = runner.call(ValidateRequest(plan.to_json()))
        if measure == "device" and validation.baseline is not None:
            base = validation.baseline.median_ms
        tuned = base
    else:
        plan = _with_reason(plan, kept, notes)
    return _report(graph, plan, name, measure, base, tuned, noise, cands, validation, n_trials, t_start)


def _with_reason(chosen: Plan, kept: Plan, notes: list[str]) -> Plan:
    """`kept`, saying in its provenance why, when it is a smaller plan than the chosen one."""
    if kept is chosen:
        return kept
    return replace(kept, provenance={
        **kept.provenance, "reason": f"smaller plan kept ({len(kept.groups)} of {plural(len(chosen.groups), 'group')}): " + "; ".join(notes)})


def _report(graph: Graph, plan: Plan, name: str, measure: str, base: float | None, tuned: float | None, noise: float | None,
            cands: list[CandidateState], validation: ValidationResult, n_trials: int, t_start: float) -> TuneReport:
    """The job's report of `plan`, its times recorded in its provenance."""
    plan = replace(plan, provenance={**plan.provenance, "baseline_ms": base, "tuned_ms": tuned})
    speedup = base / tuned if base and tuned else None
    return TuneReport(name, graph.fingerprint, measure, plan, base, tuned, speedup, noise, cands, validation, time.time() - t_start, n_trials)


def describe(plan: Plan) -> str:
    """``3 fused groups: attention, row_reduce×2``."""
    counts: dict[str, int] = {}
    for g in plan.groups:
        counts[g.template] = counts.get(g.template, 0) + 1
    kinds = ", ".join(t if n == 1 else f"{t}×{n}" for t, n in counts.items())
    return f"{len(plan.groups)} fused group{'s' if len(plan.groups) != 1 else ''}: {kinds}"


def _pause_for_tests() -> None:
    """Test hook: $AUTOFUSE_TEST_PAUSE_IN_SELECTION seconds of sleep as the selection phase begins, so that a test
    can kill the job there (after every trial, before the plan is written)."""
    pause = os.environ.get("AUTOFUSE_TEST_PAUSE_IN_SELECTION")
    if pause:
        time.sleep(float(pause))


def smaller_plans(plan: Plan, cands: list[CandidateState]) -> list[tuple[Plan, float]]:
    """Plans of the chosen plan's groups with the largest measured savings: half its distinct groups, a quarter,
    ..., one (at most MAX_FALLBACKS plans), each with the saving it gives up (ms, measured alone).

    Groups measured alone do not always add up in the whole program (a fused group's
    output is written where XLA would have fused it into its consumers: GPT-2's
    gradient plan measured 73 ms against jax.jit's 66), and one group that fails
    the whole-program check should not cost the others their gain.
    """
    by_sig = {r.signature: r for r in cands}
    saving: dict[str, float] = {}
    for g in plan.groups:
        r = by_sig.get(g.signature)
        saving[g.signature] = saving.get(g.signature, 0.0) + ((r.xla_ms or 0.0) - (r.best_ms or 0.0) if r and r.best_ms else 0.0)
    order = sorted(saving, key=lambda sig: -saving[sig])
    out, k = [], len(order)
    while k > 1 and len(out) < MAX_FALLBACKS:
        k //= 2
        keep = set(order[:k])
        groups = tuple(g for g in plan.groups if g.signature in keep)
        out.append((Plan(plan.fingerprint, groups, dict(plan.provenance)), sum(saving[sig] for sig in order[k:])))
    return out
