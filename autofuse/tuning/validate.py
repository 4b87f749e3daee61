"""The end of a job: each candidate's checked best, the cheapest cover, and the whole plan against jax.jit.

On the GPU the plan is judged in the program, not group by group: the chosen plan, then the other plans
`composition` draws (each distinct group on its own, the groups that saved time together, ...), each checked and
timed against jax.jit on the whole program; the fastest is kept, the savings alone and realised of each recorded
(`composition` in the run's selection timings). The chosen plan is
compiled and validated first, and the job may store it as soon as it passes (`on_passed`). With the model, the
chosen plan or the first smaller plan that passes. None passes: XLA's own plan, recorded as such.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from typing import Any, Callable

from .. import costmodel
from ..graph import Graph
from ..kernels import TEMPLATES
from ..plan import Plan, bind_plan, describe_groups
from ..runner.protocol import (
    CompareRequest,
    TrialRequest,
    ValidateRequest,
    ValidationResult,
    XlaRequest,
)
from ..status import TrialStatus
from ..tables import plural
from .ahead import compile_batch
from .helpers import Helpers
from .composition import (
    MAX_COMPARISONS,
    REALISED_ENOUGH,
    Measured,
    comparison_record,
    extend,
    extras_beside,
    failure,
    group_plans,
    measurable_ms,
    plan_saving_ms,
    probe,
    replace_losers,
    same_groups,
    swap_rivals,
)
from .ledger import CandidateState, Ledger
from .output import candidate_line
from .partition import Candidate
from .report import TuneReport
from .program_costs import ProgramCosts, take_profile
from .select import Cover, Savings, alone_savings, best_cover, contested_nodes, group_savings, lone_contraction_costs, lone_contractions

log = logging.getLogger("autofuse")
MAX_FALLBACKS = 3  # model mode: smaller plans validated after the chosen one (its groups with the largest savings)


def finish_candidate(r: CandidateState, runner: Any, measure: str, ledger: Ledger, check: bool = True) -> None:
    """Pick the candidate's best config; in model mode only a config that passed its correctness check
    (interpret mode; the three fastest are tried) may be the best, unless `check` is False (a best no faster than
    XLA's own fusion of the group, which no cover chooses: `_could_be_chosen`). A resumed run whose earlier process
    checked the candidate with the same trials keeps that best (read back from the store)."""
    if _already_checked(r, measure):
        return
    r.update_best()
    if measure == "model" and check:
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
             timings: dict | None = None, on_passed: Callable[[TuneReport], None] | None = None,
             max_memory_bytes: int | None = None, helpers: Helpers | None = None,
             on_timings: Callable[[dict], None] | None = None, costs: ProgramCosts | None = None,
             profiled: dict | None = None) -> TuneReport:
    """Every candidate's checked best, the exact cover, and the whole plan validated against jax.jit.
    `phase` hears the selection phase's progress (which candidate is checked, which plan validated, k of n).
    `compile_workers` > 1 compiles on the GPU what is timed next on that many threads at once (the lone dots' XLA
    references; the plans to validate with the whole program's reference). `timings` receives where the time went
    (seconds: check, singles, cover, validate, and per plan validated its parts). `on_passed` hears the report of
    the first plan that passes on the GPU, before the others are validated (the job stores it at once). `helpers`:
    trial processes on this host's other GPUs that validate the plans judged after the chosen one (`Helpers`).
    `on_timings` hears `timings` as they grow (after the cover, each plan validated, each close call, and whole at
    the end): the job records them as they come, so that a job killed in its selection keeps what it learned.
    On the GPU the cover is priced by XLA's kernels in jax.jit's program (`costs`: the job's profile, whose record
    `profiled` is, or None where it failed; taken here where the job took none), else by the groups' times alone."""
    phase = phase or (lambda s: None)
    timings = {} if timings is None else timings
    t0 = time.perf_counter()
    to_check = [r for r in cands if measure == "model" and not _already_checked(r, measure) and _could_be_chosen(r, by_sig, model)]
    tuned = sum(1 for r in cands if r.trials)
    phase(f"autofuse: selecting the plan from {plural(tuned, 'tuned candidate')}" +
          (f" ({len(to_check)} of them to check in interpret mode)" if measure == "model" else ""))
    _pause_for_tests()
    for r in cands:
        if r in to_check:
            phase(f"autofuse: checking the best config of candidate {to_check.index(r) + 1} of {len(to_check)} ({r.template}, interpret mode)")
        finish_candidate(r, runner, measure, ledger, check=r in to_check)
        if r.trials:
            say(candidate_line(r))
    t1 = time.perf_counter()
    singles = None
    if measure == "device":
        if costs is None and profiled is None:
            phase("autofuse: profiling jax.jit's program (what XLA's kernels there cost each group's nodes)")
            costs = take_profile(runner, timings, graph, model)
        else:
            timings["profile"] = profiled if profiled is not None else costs.summary()
        if costs is None:
            known = {r.signature: r.xla_ms for r in cands if r.xla_ms is not None}  # dots that are candidates alone: timed already
            contested = contested_nodes(by_sig, cands)  # elsewhere a lone dot costs every cover alike
            lone = lone_contractions(graph, known, contested)
            if compile_workers > 1 and len(lone) > 1:
                compile_batch(runner, [XlaRequest((n,)) for n in lone], compile_workers)
            singles = lone_contraction_costs(graph, runner, known, contested)
    if costs is not None:  # priced again (XLA's times alone bound them); `show run` lists them beside the times alone
        costs.price(cands, by_sig)
        timings["in_program_xla_ms"] = {r.signature: round(r.program_xla_ms, 4) for r in cands if r.trials}
    t2 = time.perf_counter()
    cover = best_cover(graph, by_sig, cands, model, measure, singles, costs)
    savings = Savings(graph, by_sig, cands, model, costs) if measure == "device" else None
    t3 = time.perf_counter()
    timings.update(check=round(t1 - t0, 3), singles=round(t2 - t1, 3), cover=round(t3 - t2, 3))
    if on_timings is not None:
        on_timings(timings)
    report = validate(graph, cover, runner, measure, name, cands, n_trials, t_start, phase, compile_workers=compile_workers,
                      timings=timings, on_passed=on_passed, alternative=savings.plan() if savings else None,
                      max_memory_bytes=max_memory_bytes, savings=savings, helpers=helpers, on_timings=on_timings,
                      expected=group_savings(cands, by_sig, costs) if costs is not None else None)
    timings["validate"] = round(time.perf_counter() - t3, 3)
    if on_timings is not None:
        on_timings(timings)
    return report


def _already_checked(r: CandidateState, measure: str) -> bool:
    """Model mode: a resumed run's candidate whose best its earlier process checked with these same trials."""
    return measure == "model" and r.checked_trials is not None and r.checked_trials == len(r.trials)


def _could_be_chosen(r: CandidateState, by_sig: dict[str, list[Candidate]], model: costmodel.GPUModel) -> bool:
    """Whether some measured config of `r` is faster than XLA's own fusion of its group (its XLA option in every
    cover, by the model where XLA was not asked: `best_cover`). One that is not is never chosen, so checking it in
    interpret mode (seconds each: half of a small job's time once) decides nothing."""
    ok = [t.median_ms for t in r.trials if t.status is TrialStatus.OK and t.median_ms is not None]
    if not ok:
        return False
    xla_ms = r.xla_ms if r.xla_ms is not None else costmodel.xla_group_time_ms(by_sig[r.signature][0].group, model)
    return min(ok) < xla_ms


def validate(graph: Graph, cover: Cover, runner: Any, measure: str, name: str, cands: list[CandidateState], n_trials: int,
             t_start: float, phase: Callable[[str], None] | None = None, *, compile_workers: int = 1,
             timings: dict | None = None, on_passed: Callable[[TuneReport], None] | None = None,
             alternative: Plan | None = None, max_memory_bytes: int | None = None,
             savings: Savings | None = None, helpers: Helpers | None = None,
             on_timings: Callable[[dict], None] | None = None, expected: dict[str, float] | None = None) -> TuneReport:
    """The chosen plan against jax.jit on the whole program, and on the GPU its groups in the program's context.

    A plan must be correct within tolerance and, on the GPU, faster than jax.jit beyond noise. On the GPU
    (`_in_context`) the chosen plan is validated first (`on_passed` hears it at once if it passes). If it kept
    REALISED_ENOUGH of its groups' savings alone, only groups it lacks are tried beside it (`extend`, `extras_beside`):
    those of `alternative` (the plan of the largest savings alone: `select.savings_plan`), then those of the plan
    of the largest savings alone unpriced by the profile (`Savings.alone_plan`); else each of its distinct groups
    and of `alternative`'s, the largest savings alone first, as a plan of its own, and then the plan of the groups
    that saved time in the program (`probe`); where some of those lost time there, the plan of the largest savings
    alone without them (`savings.plan`) gives the groups to try in their stead (`replace_losers`), and last the
    fastest plan so far with one group swapped for a fusion of its nodes that nearly tied it alone (`savings.rivals`,
    `swap_rivals`). The fastest is kept (a later one where faster beyond the noise of both, or faster within it and
    in a head-to-head timing of the two: `closer_look`). With the model, the chosen plan or the first smaller plan
    (`smaller_plans`) that passes. None passes: XLA's own plan. On the GPU a plan whose peak device memory is above `max_memory_bytes` fails its validation.
    `expected`: per distinct group, what one instance saves in the program by a profile of jax.jit's program
    (`select.group_savings`), in place of its saving alone wherever the validation ranks groups or plans.
    """
    if measure == "device":
        return _in_context(graph, cover, runner, name, cands, n_trials, t_start, phase, compile_workers=compile_workers,
                           timings=timings, on_passed=on_passed, alternative=alternative, max_memory_bytes=max_memory_bytes,
                           savings=savings, helpers=helpers, on_timings=on_timings, expected=expected)
    plan = cover.plan
    validation = ValidationResult(TrialStatus.OK)
    base, tuned = cover.baseline_ms, cover.tuned_ms
    notes, kept = [], None
    tries = [(plan, 0.0)] + smaller_plans(plan, cands) if not plan.is_xla else []
    plans_t = [] if timings is None else timings.setdefault("plans", [])
    for k, (cand, given_up) in enumerate(tries):
        if phase is not None:
            phase(f"autofuse: validating plan {k + 1} of {len(tries)} ({describe_groups(cand)}) against jax.jit")
        t0 = time.perf_counter()
        v = runner.call(ValidateRequest(cand.to_json()))
        plans_t.append(_plan_timing(cand, v, t0))
        if v.status is TrialStatus.OVER_MEMORY and m.saving_ms is not None:
            notes.append(f"{what}, {plural(len(cand.groups), 'group')}: {v.error}; saved {m.saving_ms:.3f} ms in the program, "
                         "which counts only toward a plan composed with others")
        elif not v.ok:
            log.warning("autofuse: a plan of %d fused groups failed end-to-end validation (%s)", len(cand.groups), v.error)
            notes.append(f"{plural(len(cand.groups), 'group')}: validation failed: {v.status}: {v.error}")
        elif cover.tuned_ms + given_up < base:
            kept, tuned, validation = cand, cover.tuned_ms + given_up, v
            break
        else:
            notes.append(f"{plural(len(cand.groups), 'group')}: modelled plan is not faster than XLA")
    if kept is None:
        plan, tuned = Plan(graph.fingerprint, (), {**plan.provenance, "reason": "; ".join(notes) or "no fused group is cheaper than XLA"}), base
    else:
        plan = _with_reason(plan, kept, notes)
    return _report(graph, plan, name, measure, base, tuned, None, cands, validation, n_trials, t_start)


def _in_context(graph: Graph, cover: Cover, runner: Any, name: str, cands: list[CandidateState], n_trials: int, t_start: float,
                phase: Callable[[str], None] | None, *, compile_workers: int, timings: dict | None,
                on_passed: Callable[[TuneReport], None] | None, alternative: Plan | None,
                max_memory_bytes: int | None, savings: Savings | None = None, helpers: Helpers | None = None,
                on_timings: Callable[[dict], None] | None = None, expected: dict[str, float] | None = None) -> TuneReport:
    """`validate` on the GPU: the chosen plan, its distinct groups each in the program, then the groups that saved
    time in the program together (see `validate`).

    Groups measured alone do not add up in the program (results/composition_h100.md): GPT-2 medium's forward with
    cuDNN attention kept its GEMM+GELU groups' 1.4 ms in the program, but half a layer norm that saved 0.77 ms alone
    lost 1.86 ms there, and in its training step every group that saved time alone lost it in the program. Where the
    cover chose XLA's own plan, the plan of the largest savings alone is judged in its stead. With `helpers`, each
    distinct group's plan is queued on them before the chosen plan is validated (whichever way the chosen plan's
    result goes, `extend` or `probe` judges some of them), and so is every later batch of plans but its first, which
    this process validates."""
    say = phase or (lambda s: None)
    plan = cover.plan if not cover.plan.is_xla or alternative is None or alternative.is_xla else alternative
    alone = alone_savings(cands)
    saving = alone if expected is None else expected  # what ranks groups and plans: in the program where profiled
    measured: list[Measured] = []
    notes: list[str] = []
    best: Measured | None = None
    first: TuneReport | None = None
    state = {"restarted": False, "compared": 0}
    plans_t = [] if timings is None else timings.setdefault("plans", [])

    def recorded() -> None:
        if on_timings is not None and timings is not None:
            on_timings(timings)

    def closer_look(best: Measured, m: Measured, k: int, n: int) -> Measured:
        """`m` beat the fastest plan so far, but within the noise of their timings against jax.jit (8 pairs of a 100
        ms step: ±1.4%, where GPT-2's step rejected a plan that saved 0.9 ms more): the two timed against each
        other, here, over more pairs; `m` is kept where its median ratio is below 1 (`second_faster`)."""
        state["compared"] += 1
        say(f"autofuse: plan {k} of {n} beat the fastest plan so far within noise: timing the two against each other")
        c = runner.call(CompareRequest(best.plan.to_json(), m.plan.to_json()))
        if timings is not None:
            timings.setdefault("comparisons", []).append(comparison_record(best.plan, m.plan, c))
            recorded()
        if c.second_faster:
            notes.append(f"{m.what}: faster than the plan before it in {c.ratio.repeats} alternating pairs "
                         f"(ratio {c.ratio.median_ms:.4f}, quartiles {c.ratio.q1_ms:.4f}..{c.ratio.q3_ms:.4f})")
            return m
        return best

    def judge_here(cand: Plan, what: str, k: int, n: int, ahead: list[Plan]) -> ValidationResult:
        """`cand` validated on this process's GPU, the plans of `ahead` compiled at once first."""
        if compile_workers > 1 and ahead:
            t0 = time.perf_counter()
            batch = plural(len(ahead), "plan") if measured else "the chosen plan and jax.jit's reference"
            say(f"autofuse: compiling {batch}, {compile_workers} at once")
            longest: dict = {}
            compile_batch(runner, [ValidateRequest(c.to_json()) for c in ahead], compile_workers, timeout_s=None, longest=longest)
            if timings is not None:
                timings["compile_ahead"] = round(timings.get("compile_ahead", 0.0) + time.perf_counter() - t0, 3)
                timings.setdefault("compiled", []).append(longest)
        say(f"autofuse: validating plan {k} of {n} ({what}: {describe_groups(cand)}) against jax.jit")
        return over_memory(_validate_once(runner, cand, state, say, compile_workers), max_memory_bytes)

    def judge(cand: Plan, what: str, k: int, n: int, ahead: list[Plan]) -> Measured:
        nonlocal best, first
        if helpers and len(ahead) > 1:  # the others on the helpers' GPUs, this one here
            helpers.submit([p for p in ahead if p is not cand])
            ahead = [p for p in ahead if p is cand]
        t0 = time.perf_counter()
        v = helpers.take(cand) if helpers else None
        gpu = helpers.validated.get(cand.to_json()) if v is not None else None  # the helper's GPU that validated it
        if v is not None:
            say(f"autofuse: plan {k} of {n} ({what}: {describe_groups(cand)}) validated on GPU {gpu}")
            v = over_memory(v, max_memory_bytes)
        else:
            v = judge_here(cand, what, k, n, ahead)
        lean = leaner_plan(graph, cand) if v.status is TrialStatus.OVER_MEMORY else None
        if lean is not None:  # over the cap: its groups' leaner configs before any smaller plan
            notes.append(f"{what}, {plural(len(cand.groups), 'group')}: {v.error}; again with its groups' leaner configs")
            cand, what = lean, f"{what}, leaner configs"
            v = judge_here(cand, what, k, n, [cand])
        plans_t.append({**_plan_timing(cand, v, t0), **({"gpu": gpu} if gpu else {})})
        m = Measured(cand, v, plan_saving_ms(cand, alone), what, None if expected is None else plan_saving_ms(cand, expected))
        measured.append(m)
        if timings is not None:
            timings.setdefault("composition", []).append(m.record())
            recorded()
        if v.status is TrialStatus.OVER_MEMORY and m.saving_ms is not None:
            notes.append(f"{what}, {plural(len(cand.groups), 'group')}: {v.error}; saved {m.saving_ms:.3f} ms in the program, "
                         "which counts only toward a plan composed with others")
        elif not v.ok:
            log.warning("autofuse: a plan of %d fused groups failed end-to-end validation (%s)", len(cand.groups), v.error)
            notes.append(f"{what}, {plural(len(cand.groups), 'group')}: validation failed: {v.status}: {v.error}")
        elif m.passed:
            notes.append(f"{what}, {plural(len(cand.groups), 'group')}: {v.plan.median_ms:.4f} ms vs jax.jit {v.baseline.median_ms:.4f} ms")
            if best is None:
                best = m
                first = _measured_report(graph, m, plan, notes, name, cands, n_trials, t_start)
                if on_passed is not None:
                    on_passed(first)
            elif m.speedup > best.speedup * (1 + max(m.noise, best.noise)):
                best = m
            elif m.speedup > best.speedup and state["compared"] < MAX_COMPARISONS:
                best = closer_look(best, m, k, n)
        else:
            notes.append(f"{what}, {plural(len(cand.groups), 'group')}: plan {v.plan.median_ms:.4f} ms is not faster than jax.jit "
                         f"{v.baseline.median_ms:.4f} ms beyond noise ±{m.noise:.1%}")
        return m

    if plan.is_xla:
        m = Measured(plan, runner.call(ValidateRequest(plan.to_json())), 0.0)
        return _xla_report(graph, m, plan, [plan.provenance.get("reason", "no fused group is cheaper than XLA")], name, cands,
                           n_trials, t_start)
    if helpers:  # whichever way the chosen plan goes, some of these are judged next (`extend`, `probe`)
        helpers.submit([p for p in group_plans(plan, alternative, saving) if not same_groups(p, plan)])
    chosen = judge(plan, "the chosen plan", 1, 1, [plan])
    if chosen.passed and 0 < REALISED_ENOUGH * chosen.predicted_ms <= chosen.saving_ms:
        unpriced = savings.alone_plan() if savings is not None else None
        extend(plan, extras_beside(plan, [(alternative, saving), (unpriced, alone)]), judge)
    else:
        small = probe(plan, chosen, group_plans(plan, alternative, saving), judge, measured, saving)
        if small and timings is not None:  # `show run` says which groups were too small to judge alone
            timings["not_judged"] = {"floor_ms": round(measurable_ms(chosen), 4), **({"profiled": True} if expected is not None else {}),
                                     "groups": [{"instances": len(p.groups), "alone_ms": round(plan_saving_ms(p, saving), 4)} for p in small]}
            recorded()
        if savings is not None:
            replace_losers(plan, measured, savings.plan, saving, judge)
            if best is not None:
                swap_rivals(best, savings.rivals, measured, judge)
    if best is None:
        timed = next((m for m in measured if m.validation.baseline is not None), None)
        m = timed or Measured(plan, runner.call(ValidateRequest(Plan(graph.fingerprint, ()).to_json())), 0.0)
        return _xla_report(graph, m, plan, notes, name, cands, n_trials, t_start)
    if first is not None and first.plan.groups == best.plan.groups:  # the report the job may have stored already
        first.wall_s = time.time() - t_start
        return first
    return _measured_report(graph, best, plan, notes, name, cands, n_trials, t_start)


def leaner_plan(graph: Graph, plan: Plan) -> Plan | None:
    """`plan` with each group whose template has a config holding less memory (`Template.leaner_config`) in that
    config; None where no group has one."""
    groups, changed = [], False
    for group, fg in bind_plan(graph, plan):
        template = TEMPLATES[fg.template]
        spec = template.match(group)
        config = template.leaner_config(spec, fg.config) if spec is not None else None
        changed |= config is not None
        groups.append(replace(fg, config=config) if config is not None else fg)
    return replace(plan, groups=tuple(groups)) if changed else None


def over_memory(v: ValidationResult, max_memory_bytes: int | None) -> ValidationResult:
    """`v`, failed, where its plan's peak device memory is above the job's cap (`tune(max_memory_bytes=)`)."""
    if max_memory_bytes is None or v.peak_bytes is None or v.peak_bytes <= max_memory_bytes or not v.ok:
        return v
    return replace(v, status=TrialStatus.OVER_MEMORY,
                   error=f"peak device memory {v.peak_bytes / 2**30:.2f} GiB is over the cap of {max_memory_bytes / 2**30:.2f} GiB")


def _validate_once(runner: Any, cand: Plan, state: dict, say: Callable[[str], None], compile_workers: int) -> ValidationResult:
    """One plan's validation; out of GPU memory, once per job, again in a fresh trial process: a whole program near the
    card's size needs one contiguous block of the trial process's pool, which the trials' buffers may have split
    (GPT-2 medium's training step: 64.7 GiB of temporaries in a 71 GiB pool)."""
    v = runner.call(ValidateRequest(cand.to_json()))
    if v.status is TrialStatus.RESOURCE_EXHAUSTED and not state["restarted"]:
        state["restarted"] = True
        log.warning("autofuse: validating a plan of %d fused groups ran out of GPU memory (%s); validating it again in a "
                    "fresh trial process", len(cand.groups), v.error)
        say("autofuse: out of GPU memory; validating the plan again in a fresh trial process")
        runner.restart()
        if compile_workers > 1:  # the plan and jax.jit's reference compiled at once again, in the fresh process
            compile_batch(runner, [ValidateRequest(cand.to_json())], compile_workers, timeout_s=None)
        v = runner.call(ValidateRequest(cand.to_json()))
    return v


def _plan_timing(cand: Plan, v: ValidationResult, t0: float) -> dict:
    return {"groups": len(cand.groups), "status": v.status.value, "seconds": round(time.perf_counter() - t0, 3),
            **{key: round(x, 3) for key, x in (v.seconds or {}).items()}, **failure(v)}


def _measured_report(graph: Graph, m: Measured, chosen: Plan, notes: list[str], name: str, cands: list[CandidateState], n_trials: int,
                     t_start: float) -> TuneReport:
    """The report of measured plan `m`, with its groups' savings alone and realised in its provenance."""
    kept = _with_reason(chosen, m.plan, notes)
    kept = replace(kept, provenance={**kept.provenance, "alone_ms": round(m.alone_ms, 4), "realised_ms": round(m.saving_ms, 4),
                                     **({} if m.expected_ms is None else {"expected_ms": round(m.expected_ms, 4)})})
    v = m.validation
    return _report(graph, kept, name, "device", v.baseline.median_ms, v.plan.median_ms, m.noise, cands, v, n_trials, t_start)


def _xla_report(graph: Graph, m: Measured, chosen: Plan, notes: list[str], name: str, cands: list[CandidateState], n_trials: int,
                t_start: float) -> TuneReport:
    """XLA's own plan, its baseline jax.jit measured on the whole program (never the cover's sum of parts)."""
    base = m.validation.baseline.median_ms if m.validation.baseline is not None else None
    xla = Plan(graph.fingerprint, (), {**chosen.provenance, "reason": "; ".join(notes) or "no fused group is cheaper than XLA"})
    noise = m.noise if m.validation.ratio is not None else None
    return _report(graph, xla, name, "device", base, base, noise, cands, m.validation, n_trials, t_start)


def _with_reason(chosen: Plan, kept: Plan, notes: list[str]) -> Plan:
    """`kept`, saying in its provenance why, when it is another plan than the chosen one."""
    if kept is chosen:
        return kept
    if {g.nodes for g in kept.groups} <= {g.nodes for g in chosen.groups}:
        what = f"smaller plan kept ({len(kept.groups)} of {plural(len(chosen.groups), 'group')})"
    else:
        what = f"plan of the groups that saved time in context kept ({plural(len(kept.groups), 'group')}; the cover chose {len(chosen.groups)})"
    return replace(kept, provenance={**kept.provenance, "reason": f"{what}: " + "; ".join(notes)})


def _report(graph: Graph, plan: Plan, name: str, measure: str, base: float | None, tuned: float | None, noise: float | None,
            cands: list[CandidateState], validation: ValidationResult, n_trials: int, t_start: float) -> TuneReport:
    """The job's report of `plan`, its times and, measured on a GPU, its peak device memory and jax.jit's recorded in
    its provenance (XLA's own plan: jax.jit's for both)."""
    base_peak = validation.baseline_peak_bytes if measure == "device" else None
    peak = base_peak if plan.is_xla else validation.peak_bytes
    plan = replace(plan, provenance={**plan.provenance, "baseline_ms": base, "tuned_ms": tuned,
                                     **({"peak_bytes": peak, "baseline_peak_bytes": base_peak} if peak and base_peak else {})})
    speedup = base / tuned if base and tuned else None
    return TuneReport(name, graph.fingerprint, measure, plan, base, tuned, speedup, noise, cands, validation, time.time() - t_start, n_trials)


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
