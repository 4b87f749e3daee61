"""Which plans the GPU validation judges in the program, and what a judged plan measured.

Groups measured alone do not add up in the program (results/composition_h100.md, results/models_cudnn_h200.md):
a group can cut through what XLA fuses, or share with its neighbours what it paid for alone. So after the chosen
plan (`validate._in_context`) the validation judges, in the program against jax.jit: each distinct group on its
own (`probe`, `group_plans`), the groups that saved time there together (`compose`), other fusions of the nodes of
groups that lost (`replace_losers`), and the fastest plan with a group swapped for a near-tie rival (`swap_rivals`);
or, where the chosen plan kept its savings, only more groups beside it (`extend`, `extras_beside`). `Measured` is one such judgement.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from ..plan import Plan
from ..runner.protocol import ComparisonResult, ValidationResult
from ..status import TrialStatus
from .select import disjoint_savings


MIN_NOISE = 0.005  # a plan must beat jax.jit by at least this fraction, whatever the measured spread
MAX_COMPARISONS = 2  # close calls between a later plan and the fastest so far, decided by timing the two against each other
REALISED_ENOUGH = 0.8  # a chosen plan that keeps this share of its savings alone is not taken apart again (`extend`)
MAX_IN_CONTEXT = 5  # distinct groups, the largest savings alone first, each validated as a plan of its own on the GPU
MEASURABLE = 0.5  # of a whole-program timing's noise (ms): a group saving less alone is not judged alone in the program


@dataclass
class Measured:
    """A plan validated on the GPU: its result, its saving in the program (jax.jit - plan, ms) and the noise of that
    comparison (a fraction of jax.jit's time), the saving its groups showed alone, and where the job profiled
    jax.jit's program, the saving that profile expected of them there (`program_costs`)."""

    plan: Plan
    validation: ValidationResult
    alone_ms: float
    what: str = ""  # why it was validated: "the chosen plan", "one group in context", ... (the run's record says it)
    expected_ms: float | None = None

    @property
    def predicted_ms(self) -> float:
        """What the plan was expected to save in the program: by the profile where there was one, else alone."""
        return self.alone_ms if self.expected_ms is None else self.expected_ms

    @property
    def passed(self) -> bool:
        """Correct, and faster than jax.jit beyond noise."""
        r = self.validation.ratio
        return self.validation.ok and r is not None and r.q3_ms < 1.0 and r.median_ms < 1 - self.noise

    @property
    def saved_time(self) -> bool:
        """Correct, and faster than jax.jit in the program, if only within noise: a group worth composing with others,
        the composed plan then judged as a whole (`passed`)."""
        return self.saving_ms is not None and self.saving_ms > 0

    @property
    def noise(self) -> float:
        r = self.validation.ratio
        return max(r.q3_ms - r.q1_ms, MIN_NOISE) if r is not None else 1.0

    @property
    def saving_ms(self) -> float | None:
        """jax.jit's time less the plan's; also for a plan over the job's memory cap, which is never the plan itself
        (`passed`) but whose groups' time counts toward a composed plan that the cap then judges: a group judged on
        its own may be over the cap where only another group of the plan brings the program under it."""
        v = self.validation
        timed = v.ok or v.status is TrialStatus.OVER_MEMORY
        return v.baseline.median_ms - v.plan.median_ms if timed and v.baseline is not None and v.plan is not None else None

    @property
    def speedup(self) -> float:
        v = self.validation
        return v.baseline.median_ms / v.plan.median_ms if self.saving_ms is not None else 0.0

    def record(self) -> dict:
        """What the plan's provenance and the run keep of it (`composition`), with why it failed where it did."""
        return {"what": self.what, "groups": len(self.plan.groups), "signatures": sorted({g.signature for g in self.plan.groups}),
                "alone_ms": round(self.alone_ms, 4), **({} if self.expected_ms is None else {"expected_ms": round(self.expected_ms, 4)}),
                "realised_ms": None if self.saving_ms is None else round(self.saving_ms, 4),
                "noise": round(self.noise, 4), "status": self.validation.status.value, **failure(self.validation)}


def comparison_record(earlier: Plan, later: Plan, c: ComparisonResult) -> dict:
    """What the run keeps of a close call (`CompareRequest`: the two plans timed against each other), as `show run`
    prints it: the plans' group counts, which one was kept, the head-to-head ratio with its quartiles and pairs."""
    r = c.ratio
    return {"first": len(earlier.groups), "second": len(later.groups), "status": c.status.value,
            "kept": "second" if c.second_faster else "first",
            **({"ratio": round(r.median_ms, 4), "q1": round(r.q1_ms, 4), "q3": round(r.q3_ms, 4), "pairs": r.repeats} if r else {}),
            **{k: round(v, 3) for k, v in c.seconds.items()}, **({"error": c.error} if c.error else {})}


def probe(plan: Plan, chosen: Measured, singles: list[Plan], judge: Callable[..., Measured], measured: list[Measured],
          saving: dict[str, float]) -> list[Plan]:
    """The chosen plan lost much of its groups' savings in the program: each distinct group (`singles`) in context on
    its own, then those that saved time there together (`compose`). A group whose instances saved less alone than
    `measurable_ms` of the chosen plan's timing is not judged (its saving in the program would be the noise's: GPT-2's
    forward judged two groups of 0.06 ms each against a noise of 0.5 ms, 10 s of its selection); those are returned."""
    by_sig: dict[str, Measured] = {}
    todo, small = [], []
    floor = measurable_ms(chosen)
    for single in singles:
        if same_groups(single, plan):  # the chosen plan of one distinct group: measured already
            by_sig[single.groups[0].signature] = chosen
        elif 0 < plan_saving_ms(single, saving) < floor:
            small.append(single)
        else:
            todo.append(single)
    total = 1 + len(todo) + 1
    for k, single in enumerate(todo):
        by_sig[single.groups[0].signature] = judge(single, "one group in context", k + 2, total, todo if k == 0 else [])
    judge_composed(compose(plan, singles, by_sig), measured, judge, total)
    return small


def measurable_ms(m: Measured) -> float:
    """The least saving (ms) that a plan judged in the program the way `m` was could tell from noise: MEASURABLE of
    `m`'s noise, in ms of its jax.jit time (0 where it has none)."""
    base = m.validation.baseline
    return MEASURABLE * m.noise * base.median_ms if base is not None else 0.0


def extend(plan: Plan, extras: list[Plan], judge: Callable[..., Measured]) -> None:
    """The chosen plan kept most of its groups' savings in the program: only groups of the plans of the largest
    savings alone that it lacks and that share no node with it (`extras`: `extras_beside`) are tried, each in context, then the chosen
    plan with those that saved time there (within their own noise too, as in `compose`). GPT-2's forward kept 92% of 61 ms, 99% of 1.4 ms with cuDNN attention:
    taking each of its groups apart again cost about a minute and found nothing."""
    total = 1 + len(extras) + 1
    saved = []
    for k, extra in enumerate(extras):
        m = judge(extra, "one more group in context", k + 2, total, extras if k == 0 else [])
        if m.saved_time:
            saved.append(m)
    if saved:
        more = Plan(plan.fingerprint, tuple(plan.groups) + tuple(g for m in saved for g in m.plan.groups), dict(plan.provenance))
        judge(more, "the chosen plan and the groups that saved time beside it", total, total, [more])


MAX_REPLACEMENTS = 3  # groups tried in context in place of those that lost there (`replace_losers`)


def replace_losers(plan: Plan, measured: list[Measured], replan: Callable[[frozenset[str]], Plan], saving: dict[str, float],
                   judge: Callable[..., Measured]) -> None:
    """Groups that lost time in the program give way: the plan of the largest savings alone without them (`replan`)
    may hold other fusions of their nodes, and those of its groups that share nodes with them and were not judged
    yet are tried in context, at most MAX_REPLACEMENTS, the largest savings alone first; then the groups that saved
    time in context, all of them so far, composed (`compose`) and judged as a whole where that plan is new.
    GPT-2's step: the cross-entropy pair saved 3.9 ms alone and lost 1.9 in context, and the padded logits GEMM it
    had displaced from the plan of the largest savings alone (1.1 ms in context in an earlier run) was never tried."""
    singles = {m.plan.groups[0].signature: m for m in measured if len({g.signature for g in m.plan.groups}) == 1}
    losers = frozenset(sig for sig, m in singles.items() if not m.saved_time)
    if not losers:
        return
    lost_nodes = {n for sig in losers for g in singles[sig].plan.groups for n in g.nodes}
    todo = [p for p in distinct_groups([replan(losers)], saving) if p.groups[0].signature not in singles
            and any(n in lost_nodes for g in p.groups for n in g.nodes)][:MAX_REPLACEMENTS]
    total = len(todo) + 1
    for k, single in enumerate(todo):
        singles[single.groups[0].signature] = judge(single, "a group in place of those that lost in context", k + 1, total,
                                                    todo if k == 0 else [])
    if todo:
        judge_composed(compose(plan, [m.plan for m in singles.values()], singles), measured, judge, total)


def judge_composed(composed: Plan | None, measured: list[Measured], judge: Callable[..., Measured], total: int) -> None:
    """The groups that saved time in context, composed (`compose`), judged as the last of `total` plans where that plan
    is new."""
    if composed is not None and not any(same_groups(composed, m.plan) for m in measured):
        judge(composed, "the groups that saved time in context", total, total, [composed])


MAX_RIVALS = 2  # plans with one group swapped for a near-tie fusion of its nodes, judged in the program (`swap_rivals`)


def swap_rivals(best: Measured, rivals: Callable[[Plan], Iterable[Plan]], measured: list[Measured], judge: Callable[..., Measured]) -> None:
    """The fastest plan so far with one group swapped for a rival that nearly tied it alone (`rivals`:
    `select.Savings.rivals`), at most MAX_RIVALS, each judged in the program where it is new: what two fusions of
    the same nodes share with their neighbours (a pad, a producer) is invisible when each is timed alone. Only where
    the chosen plan lost much of its savings in the program: GPT-2's forward, which kept 84% of 60 ms, spent 19 s of
    a 98 s job on 4 H200s judging two rivals among its 97 groups, and found nothing."""
    todo: list[Plan] = []
    for swapped in rivals(best.plan):
        if len(todo) == MAX_RIVALS:
            break
        if not any(same_groups(swapped, seen) for seen in [m.plan for m in measured] + todo):
            todo.append(swapped)
    for k, swapped in enumerate(todo):
        judge(swapped, "a near-tie fusion in place of one of the fastest plan's groups", k + 1, len(todo), todo if k == 0 else [])


MAX_EXTRAS = 3  # groups tried one by one beside a chosen plan that kept its savings (`extend`)


def extras_beside(plan: Plan, sources: Iterable[tuple[Plan | None, dict[str, float]]]) -> list[Plan]:
    """The groups to try beside `plan` (`extend`): per distinct group of each source that `plan` lacks, the plan of
    its instances that share no node with `plan`'s groups nor with an extra taken before (an instance `plan` holds
    already is left out, not the group); each source's groups ranked by its own saving per instance times their
    instances, the first source's first; at most MAX_EXTRAS."""
    taken = {n for g in plan.groups for n in g.nodes}
    extras: list[Plan] = []
    for source, saving in sources:
        if source is None:
            continue
        mine: dict[str, list] = {}
        for g in source.groups:
            if not taken.intersection(g.nodes):
                mine.setdefault(g.signature, []).append(g)
        for sig in sorted(mine, key=lambda s: -saving.get(s, 0.0) * len(mine[s])):
            groups = [g for g in mine[sig] if not taken.intersection(g.nodes)]
            if groups and len(extras) < MAX_EXTRAS:
                extras.append(Plan(source.fingerprint, tuple(groups), dict(source.provenance)))
                taken.update(n for g in groups for n in g.nodes)
    return extras


def same_groups(a: Plan, b: Plan) -> bool:
    return sorted(g.nodes for g in a.groups) == sorted(g.nodes for g in b.groups)


ERROR_CHARS = 400  # of a failed plan's reason kept in the run's record: its first line, enough to say which output and how far


def failure(v: ValidationResult) -> dict:
    """`{"error": ...}` for a plan that failed its validation (the reason's first line, cut to `ERROR_CHARS`), else
    nothing: a run's record says why a plan that saved time alone never reached the program."""
    lines = (v.error or "").strip().splitlines()
    if v.status is TrialStatus.OK or not lines:
        return {}
    return {"error": lines[0] if len(lines[0]) <= ERROR_CHARS else lines[0][: ERROR_CHARS - 1] + "…"}


def plan_saving_ms(plan: Plan, saving: dict[str, float]) -> float:
    """What `plan`'s groups save (ms), the sum over its instances of `saving`'s per distinct group (one instance's:
    alone, or in the program by its profile, `select.group_savings`)."""
    return sum(saving.get(g.signature, 0.0) for g in plan.groups)


def group_plans(plan: Plan, alternative: Plan | None, saving: dict[str, float]) -> list[Plan]:
    """One plan per distinct group of `plan` and of `alternative` (`distinct_groups`), at most MAX_IN_CONTEXT; none
    where `plan` has one distinct group and `alternative` nothing else."""
    plans = distinct_groups([plan, alternative], saving)
    return plans[:MAX_IN_CONTEXT] if len(plans) > 1 else []


def distinct_groups(sources: list[Plan | None], saving: dict[str, float]) -> list[Plan]:
    """One plan per distinct group of the `sources` (its instances in the first source that has it), the largest
    `saving` first (per instance: alone, or in the program by its profile). A group that shares nodes with one of larger saving (another fusion of the same GEMM) comes
    after every group that does not: GPT-2's step once spent two of its five tries in context on two fusions of one
    MLP GEMM, and never tried a padded LM-head GEMM that had saved 1.7 ms in context before."""
    groups: dict[str, list] = {}
    for source in sources:
        if source is None:
            continue
        mine: dict[str, list] = {}
        for g in source.groups:
            mine.setdefault(g.signature, []).append(g)
        for sig, gs in mine.items():
            groups.setdefault(sig, gs)
    order = sorted(groups, key=lambda sig: -saving.get(sig, 0.0) * len(groups[sig]))
    taken: set[int] = set()
    apart, overlapping = [], []
    for sig in order:
        nodes = {n for g in groups[sig] for n in g.nodes}
        (overlapping if nodes & taken else apart).append(sig)
        taken |= nodes
    fingerprint = next(src.fingerprint for src in sources if src is not None)
    provenance = next(dict(src.provenance) for src in sources if src is not None)
    return [Plan(fingerprint, tuple(groups[sig]), provenance) for sig in apart + overlapping]


def compose(plan: Plan, singles: list[Plan], measured: dict[str, Measured]) -> Plan | None:
    """The plan of the groups that saved time in the program, whose instances share no node: the largest total saving
    in context (an exact choice, `select.disjoint_savings`). None: fewer than two. A group's saving need not stand out
    of its own measurement's noise: the composed plan is judged as a whole against jax.jit, and a 1 ms saving in a 100 ms
    step is about one noise width (GPT-2 medium's: the dgrad GEMM with GELU' saved 2.5 ms in context, and a padded
    LM-head GEMM 1.2 ms, both left out of a composition of two that saved 4.6 ms)."""
    gains = {}
    for single in singles:
        m = measured.get(single.groups[0].signature)
        if m is not None and m.saved_time:
            gains[single.groups[0].signature] = (single.groups, m.saving_ms)
    chosen = disjoint_savings(gains)
    if len(chosen) < 2:
        return None
    return Plan(plan.fingerprint, tuple(g for sig in chosen for g in gains[sig][0]), dict(plan.provenance))
