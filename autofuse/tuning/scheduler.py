"""The budget rule: which candidate gets the next trial. One rule, one trial at a time, for every driver.

1. A config whose worker died is retried first (it waits in its study).
2. Phase 1: every distinct candidate gets its template's default config, by the
   time fusing may save ((XLA time - modelled time) x instances, most first;
   modelled losses last, and none of them when the budget cannot give every
   candidate its default: `phase1_order`); a
   candidate whose configs all failed on shared memory or compilation gets
   another config right away, up to `RETRY_CONFIGS`, and one with no working
   config gets its next backend's default (its study has them enqueued). A
   trial budget smaller than the candidates gives phase 1 half of it
   (`PHASE1_SHARE`): the rest goes to phase 2 first, and the candidates phase 1
   did not reach come after (cross-entropy's 38 candidates once took all 24
   trials, leaving its one kernel that mattered at its default config).
3. Phase 2: the rest goes to the contenders (the fused groups of the cheapest
   cover so far, candidates within 25% of their XLA time, those whose configs
   all failed to fit or compile), each trial to the one furthest behind its
   share, shares in proportion to the program's time at stake (`time_at_stake`:
   the time the best plan so far spends on the candidate, one instance's times
   the instances: GPT-2's LM head, one group of 3.25 ms, once took 19 of 40
   trials from the QKV projections, 24 groups of 0.23 ms; and what a group
   already saved is not at stake), scaled down by each trial since its best by
   how far it missed (`prospect`: GPT-2's cuDNN step gave its attention pair,
   24 x 0.87 ms at stake, 9-13 of its 20 phase-2 trials, each 1.6-4.3x slower
   than its default), never more than a candidate's number of configs (`allocate`).
   A backend that lost to another on two of a template's candidates and won on
   none gets no more trials of the template's others (`set_aside_backends`).
A time budget that runs out therefore leaves undone what can matter least.
The drivers (`local`, `workers`) only run the trial `pick` names.

XLA's time of a candidate matters only beside a fused config of it (the cover's
other choice, phase 2's share): a job times in XLA, before its first trial,
the candidates its trial budget can reach, in phase 1's order by the model's
estimates (`timed_first`; all of them when the budget covers every default),
and any other at its first trial (`TrialLoop.step`). GPT-2 medium's forward
with 24 trials: 24 of 158 candidates, where timing all of them took each of
four workers on 4 H100s 15-20 s, a quarter of the job.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from .. import costmodel
from ..graph import Graph
from ..kernels import TEMPLATES
from ..ops import OpClass, op_class
from ..spaces import DEFAULT_BACKEND
from ..status import TrialStatus
from ..tables import plural
from .ledger import CandidateState
from .partition import Candidate
from .program_costs import ProgramCosts
from .select import Cover, best_cover
from .space import CandidateSpace, config_key

FAILED_MISS = 0.5  # phase 2: a candidate's share, per trial since its best that did not run (`prospect`)
GAIN_STEP = 1.25  # phase 1: modelled savings within this factor count as equal
RETRY_CONFIGS = 3  # configs a candidate whose every config failed to fit or compile gets before it is given up
#: Of a trial budget smaller than the candidates: what phase 1 may take before phase 2 starts. Half: although a
#: candidate's later configs beat its default (by 2% or more) once in ~280 trials of results/' jobs (to 2026-12-01)
#: and about three in four first visits beat XLA, three quarters (with other backends' configs pruned once Mosaic
#: GPU's default ran) gave GPT-2's cuDNN step and forward at 40 trials the same plans (1.11-1.12x, 1.15-1.16x) in
#: 20-50% longer jobs: the visits past each region's first are its variants (results/device_timing_h200.md).
PHASE1_SHARE = 0.5
#: A backend whose best config on a candidate is this much slower than another backend's lost there; one that lost on
#: `LOST_ON` of a template's candidates and won on none is set aside for the template's other candidates that have a
#: working config (`set_aside_backends`). Across results/' jobs to 2026-12-01, Triton's lowering lost to Mosaic GPU's
#: on all 361 matmul, attention, attention-backward and cross-entropy candidates timed in both (1.47x slower at the
#: median, one within 10%), yet each one's Triton default was its second trial: GPT-2's cuDNN step at 40 trials gave
#: about 12 of phase 2's 20 trials to configs 1.2-4.4x slower than the candidate's best (results/lost_regions_h200.md).
LOST_BY = 1.2
LOST_ON = 2
CONTENDER_MARGIN = 1.25  # a candidate within this factor of its XLA time may still win with more trials
STUCK_AFTER = 16  # a candidate whose sampler proposed this many done configs in a row gets no more trials
MAX_RETRY = 2  # a config whose worker died is retried this many times


def allocate(weights: Sequence[float], caps: Sequence[int], total: int) -> list[int]:
    """Share `total` trials: one each first, the rest in proportion to `weights`, capped (largest remainder)."""
    n = len(weights)
    alloc = [0] * n
    order = sorted(range(n), key=lambda i: -weights[i])
    for i in order[: min(total, n)]:
        alloc[i] = 1
    left = total - sum(alloc)
    while left > 0:
        open_ = [i for i in range(n) if alloc[i] < caps[i] and alloc[i] > 0]
        if not open_:
            break
        w = sum(weights[i] for i in open_) or len(open_)
        share = {i: left * (weights[i] or 1.0) / w for i in open_}
        give = {i: min(int(share[i]), caps[i] - alloc[i]) for i in open_}
        if sum(give.values()) == 0:
            for i in sorted(open_, key=lambda i: (-(share[i] - int(share[i])), i))[:left]:
                give[i] = 1
        for i, k in give.items():
            alloc[i] += k
        left = total - sum(alloc)
    return alloc


def xla_time_ms(r: CandidateState, space: CandidateSpace) -> float:
    """XLA's time of a candidate: in the program where the job profiled it (`program_xla_ms`), else measured alone,
    else the model's estimate (not timed yet, or its timing failed)."""
    return xla_measured_ms(r) if xla_measured_ms(r) is not None else space.xla_model_ms


def xla_measured_ms(r: CandidateState) -> float | None:
    """XLA's measured time of a candidate: what fusing one instance saves of XLA's kernels in the program where the job
    profiled it, else XLA's time of the group alone (None: neither)."""
    return r.program_xla_ms if r.program_xla_ms is not None else r.xla_ms


def trial_total(cands: Sequence[CandidateState], spaces: dict[str, CandidateSpace], trials: int) -> int:
    """The trials a job can spend: its budget, but no more than every candidate's configs."""
    return min(trials, sum(spaces[c.signature].size for c in cands))


def timed_first(cands: Sequence[CandidateState], spaces: dict[str, CandidateSpace], total: int) -> list[int]:
    """The candidates timed in XLA before the first trial: as many as `total` trials can reach, in phase 1's order
    (every candidate where the budget covers them all; a short budget reaches no modelled loss in phase 1). Any
    other is timed at its first trial, if it gets one."""
    order = phase1_order(cands, spaces)
    if total >= len(order):
        return order
    return [i for i in order if not skipped_in_phase1(cands[i], spaces[cands[i].signature], total, len(cands))][:total]


def phase1_visits(n_cands: int, total: int) -> int:
    """First visits phase 1 may make before phase 2: every candidate where `total` trials cover every default,
    else PHASE1_SHARE of them."""
    return n_cands if total >= n_cands else max(1, int(total * PHASE1_SHARE))


def time_at_stake(r: CandidateState) -> float:
    """What more trials of `r` can still save in the program, at most (ms): the time the best plan so far spends on
    it, every instance: its best config's time, or XLA's where that is faster (or no config worked yet). Phase 2's
    shares follow it. By XLA's time alone, GPT-2's attention (24 x 2.5 ms in XLA, 0.21 ms at its default) took 33-60
    of 96 trials and none beat its default, while the GEMMs beside it (24 x ~0.2 ms) had 4-7 each; by this, 8-10 and
    5-9 (2 H200s, results/tuning_h200_run26.md)."""
    times = [t for t in (r.best_ms, xla_measured_ms(r)) if t is not None]
    return min(times, default=0.0) * r.instances


def prospect(r: CandidateState) -> float:
    """Phase 2's weight of `r`: its time at stake, times best / time for each trial (counted against the budget) it
    ran after its best config, `FAILED_MISS` for one that did not run: a search whose proposals land far from its best
    is unlikely to beat it, and the trials are worth more elsewhere; one whose proposals come close keeps its share."""
    spent = sorted(r.spent(), key=lambda t: t.number)
    ok = [t for t in spent if t.status is TrialStatus.OK and t.median_ms]
    weight = time_at_stake(r)
    if not ok:
        return weight
    best = min(ok, key=lambda t: (t.median_ms, t.number))
    for t in spent:
        if t.number > best.number:
            weight *= min(1.0, best.median_ms / t.median_ms) if t.status is TrialStatus.OK and t.median_ms else FAILED_MISS
    return weight


def default_ms(r: CandidateState, space: CandidateSpace) -> float:
    """The model's time of `r`'s default config. A lowering that is XLA's own operations (`Template.xla_kernels`) is
    scaled by XLA's measured time of the group over the model's time of XLA's option: both sides run XLA's kernels, so
    what the model misses on one it misses on the other. GPT-2's QKV gradient concatenation written once for both
    GEMMs (`concat_sink`) was modelled 0.379 ms against XLA's 0.4285, while XLA's kernels for it were priced 0.407 in
    the program: a modelled saving of 0.028 ms an instance where it saves the 0.05 of one copy."""
    t = space.default_ms()
    xla = xla_measured_ms(r)
    if xla is not None and space.xla_model_ms > 0 and TEMPLATES[r.template].xla_kernels(space.default["backend"]):
        return t * xla / space.xla_model_ms
    return t


def modelled_saving(r: CandidateState, space: CandidateSpace) -> float:
    """What fusing every instance of `r` at its default config saves in the program (ms): XLA's time (by the model
    where it was not measured yet: `xla_time_ms`) less the default's (`default_ms`) and less what the group's outputs
    cost its neighbours (`costmodel.cut_outputs_ms`: intermediates XLA would never write); negative: a modelled loss."""
    return (xla_time_ms(r, space) - default_ms(r, space) - space.cut_ms) * r.instances


def modelled_loss(r: CandidateState, space: CandidateSpace) -> bool:
    return modelled_saving(r, space) <= 0


def skipped_in_phase1(r: CandidateState, space: CandidateSpace, total: int, n_cands: int) -> bool:
    """A budget of `total` trials that cannot give each of the `n_cands` candidates its default spends none of phase 1
    on a modelled loss."""
    return total < n_cands and modelled_loss(r, space)


def anchor(r: CandidateState) -> set[int]:
    """The nodes that carry a candidate's work: its contractions, else its reductions, else all its nodes. A candidate
    is a variant of a region where the region's first holds some of them (the same GEMM or reduction with more or less
    of its epilogue); one that only shares elementwise ops at its edge is another computation: GPT-2's layer norm
    forward shares only the residual add with the residual GEMM before it, and as that GEMM's variant it got no visit
    in 40 trials, where its groups ran 1.45-1.50x alone (x47) in the 80-trial job's plan (results/concat_once_h200.md)."""
    if len(r.ops) == len(r.nodes):
        for cls in (OpClass.CONTRACTION, OpClass.REDUCTION):
            found = {n for n, op in zip(r.nodes, r.ops) if op_class(op) is cls}
            if found:
                return found
    return set(r.nodes)


def lost_to_xla(r: CandidateState) -> bool:
    """Measured, and no config of it has beaten XLA's time so far (none worked, or the best is slower)."""
    xla = xla_measured_ms(r)
    return bool(r.spent()) and (r.best_ms is None or (xla is not None and r.best_ms >= xla))


#: Of one region of the program (`phase1_order`), the candidates measured slower than XLA among its firsts after which
#: its other variants wait in rounds. Without a limit each variant of a losing region was placed as a first once the
#: one before it lost: GPT-2's cuDNN step at 40 trials gave 8 of phase 1's 20 visits to variants of one dgrad GEMM
#: (each lost, 0.81-1.0x in the program), its layer norms' backward (1.67x alone in the job before) none, and came out
#: 1.13x against 1.19x (results/lost_regions_h200.md).
LOST_FIRSTS = 2


@dataclass
class _Region:
    """Nodes of the program that phase 1's firsts so far hold (`phase1_order`): the first of them, the nodes of all,
    how many were measured slower than XLA, and whether one was not (then the region's other candidates wait)."""

    first: int
    nodes: set[int]
    lost: int = 0
    held: bool = False


def phase1_order(cands: Sequence[CandidateState], spaces: dict[str, CandidateSpace]) -> list[int]:
    """Phase 1 visits the candidates by the time fusing them may save, most first: (XLA time - the model's time
    of the default config) x instances, in steps of 25% (within a step, the larger group first: it subsumes the
    smaller ones). A short budget on a whole model thus reaches its attention and heads before its many small
    groups (a group that merely leaves intermediates in memory has a large XLA time, but saves little). XLA's
    time is the model's estimate for a candidate not timed yet (`xla_time_ms`).

    Among the modelled gains, one candidate per region of the program first: a candidate whose GEMM or reduction one
    placed before it holds (a variant of the same ops, of which one plan holds one: `anchor`) comes after every
    candidate that is not; then the variants in rounds, each region's k-th variant before any region's (k+1)-th, in the same order
    within a round. SPLADE's training step at 24 trials gave a dozen variants of one vocabulary GEMM their defaults
    and its attention pair (4 instances of 0.47 ms, 2.6x alone) none; GPT-2's step at 40 gave six near-copies of its
    LM head the visits after its regions' firsts (results/norm_backward_h200.md).

    A region's first that lost to XLA once measured (`lost_to_xla`) holds no region: a variant of it is placed as a
    first by its own modelled saving. GPT-2's step at 40 trials never measured its forward logits GEMM padded
    (`aligned_dot`: 3.07 -> 2.19 ms alone on an H200), a variant of the cross-entropy pair that lost (0.88x). Once
    `LOST_FIRSTS` of a region's firsts lost, its other variants wait in the rounds.

    Modelled losses come last, the nearest to break-even (XLA's time over the default's) first: tuning may still
    make one of those win, where a group modelled at a tenth of XLA's speed will not. A budget that cannot give
    every candidate its default gives them none in phase 1 (`Scheduler.pick`)."""
    def key(i: int) -> tuple:
        r = cands[i]
        sp = spaces[r.signature]
        gain = modelled_saving(r, sp)
        if gain > 0:
            return (0, -math.floor(math.log(gain) / math.log(GAIN_STEP)), -len(r.nodes))
        fused = default_ms(r, sp) + sp.cut_ms
        return (1, -(xla_time_ms(r, sp) / fused if fused > 0 else 0.0), -len(r.nodes))

    order = sorted(range(len(cands)), key=key)
    gains = [i for i in order if key(i)[0] == 0]
    first: list[int] = []
    regions: list[_Region] = []
    variants: dict[int, list[int]] = {}  # a region's first candidate -> its variants, in order
    for i in gains:
        work = anchor(cands[i])
        region = next((g for g in regions if work & g.nodes), None)
        if region is None:
            region = _Region(i, set())
            regions.append(region)
        elif region.held or region.lost >= LOST_FIRSTS:
            variants.setdefault(region.first, []).append(i)
            continue
        first.append(i)
        region.nodes |= set(cands[i].nodes)
        if lost_to_xla(cands[i]):
            region.lost += 1
        else:
            region.held = True
    rounds = [[v[k] for v in variants.values() if k < len(v)] for k in range(max(map(len, variants.values()), default=0))]
    return first + [i for r in rounds for i in sorted(r, key=key)] + order[len(gains):]


def phase1_lines(cands: Sequence[CandidateState], spaces: dict[str, CandidateSpace], total: int, most: int = 40) -> list[str]:
    """Phase 1's order as the job sees it after timing XLA (`-v`): each candidate's XLA price (in the program where
    profiled), its default's modelled time, what its outputs cost its neighbours, its modelled saving over every
    instance, and whether a budget of `total` trials visits it. Why a group got no trial, in the job's own numbers."""
    visits = phase1_visits(len(cands), total)
    lines = [f"phase 1 order ({plural(visits, 'first visit')} of {plural(total, 'trial')}; saving = (xla - default - cut) x instances):"]
    for k, i in enumerate(phase1_order(cands, spaces)[:most]):
        r, sp = cands[i], spaces[cands[i].signature]
        skipped = skipped_in_phase1(r, sp, total, len(cands))
        note = "modelled loss: no phase-1 visit" if skipped else "" if k < visits else "past phase 1's visits"
        lines.append(f"  {k + 1:3d} {r.signature[:12]} {r.template:<12} x{r.instances:<3d} xla {xla_time_ms(r, sp):.4f} default "
                     f"{default_ms(r, sp):.4f} cut {sp.cut_ms:.4f} ms  saving {modelled_saving(r, sp):+.3f} ms  {note}".rstrip())
    return lines


def set_aside_backends(cands: Sequence[CandidateState], spaces: dict[str, CandidateSpace]) -> None:
    """Sets each candidate's `CandidateSpace.set_aside`: the backends that lost (by `LOST_BY` or more, against
    another backend of the same candidate) on `LOST_ON` or more of the job's candidates of its template and won on
    none, where the candidate has a working config on a backend not set aside (one whose only working lowering is
    such a backend keeps it: a failure of one lowering says nothing of another's)."""
    lost: dict[tuple[str, str], int] = {}
    won: set[tuple[str, str]] = set()
    for r in cands:
        best: dict[str, float] = {}
        for t in r.trials:
            if t.status is TrialStatus.OK and t.median_ms is not None:
                b = t.config.get("backend", DEFAULT_BACKEND)
                best[b] = min(best.get(b, math.inf), t.median_ms)
        for b, ms in best.items():
            other = min((v for c, v in best.items() if c != b), default=None)
            if other is not None and ms >= LOST_BY * other:
                lost[r.template, b] = lost.get((r.template, b), 0) + 1
            elif other is not None and ms < other:
                won.add((r.template, b))
    out = {k: n for k, n in lost.items() if n >= LOST_ON and k not in won}
    for r in cands:
        space = spaces[r.signature]
        aside = {b: f"{b} lost to another backend by {LOST_BY}x or more on {n} of the job's {r.template} candidates and won on none"
                 for (tmpl, b), n in out.items() if tmpl == r.template and b in space.spaces}
        working = {t.config.get("backend", DEFAULT_BACKEND) for t in r.trials if t.status is TrialStatus.OK}
        space.set_aside = aside if working - set(aside) else {}


def config_failures_only(r: CandidateState) -> bool:
    """Every trial so far failed in a way another config may not (shared memory, compile), and fewer than
    RETRY_CONFIGS were tried: the next config (the model's best, then the sampler's) deserves a trial."""
    tried = r.spent()
    return r.best_ms is None and 0 < len(tried) < RETRY_CONFIGS and all(t.status.config_failure for t in tried)


def backend_untried(r: CandidateState, space: CandidateSpace) -> bool:
    """No config has worked so far and one of the candidate's backends was never tried: a failure (even a wrong
    result) of one lowering says nothing of another's."""
    tried = {t.config.get("backend", DEFAULT_BACKEND) for t in r.spent()}
    return r.best_ms is None and bool(tried) and any(b not in tried for b in space.spaces)


def contenders(graph: Graph, by_sig: dict[str, list[Candidate]], cands: Sequence[CandidateState], model: costmodel.GPUModel,
               cover: Cover | None = None) -> list[int]:
    """Candidates that can change the plan: the fused groups of the cheapest cover so far (`cover`, else solved
    here), those within 25% of their XLA time (in the program where profiled: tuning may still make them win), and
    those whose configs all failed to fit or compile."""
    cover = cover or best_cover(graph, by_sig, cands, model, "device")
    chosen = {fg.signature for fg in cover.plan.groups}

    def near(r: CandidateState) -> bool:
        xla = xla_measured_ms(r)
        return r.best_ms is not None and bool(xla) and r.best_ms < CONTENDER_MARGIN * xla

    return [i for i, r in enumerate(cands) if r.signature in chosen or near(r) or config_failures_only(r)]


@dataclass
class Budget:
    """A job's budget: trials, and a deadline on `clock` (seconds since the epoch; None: none)."""

    trials: int
    deadline: float | None = None
    clock: Callable[[], float] = field(default=time.time)

    def out_of_time(self) -> bool:
        return self.deadline is not None and self.clock() > self.deadline


class Scheduler:
    """Names the candidate of the next trial from what the ledger says so far (see the module docstring)."""

    def __init__(self, graph: Graph, by_sig: dict[str, list[Candidate]], cands: list[CandidateState], spaces: dict[str, CandidateSpace],
                 budget: Budget, model: costmodel.GPUModel, costs: ProgramCosts | None = None):
        self.graph, self.by_sig, self.cands, self.spaces, self.budget, self.model = graph, by_sig, cands, spaces, budget, model
        self.costs = costs  # a profile of jax.jit's program: the cover so far priced in the program (`best_cover`)
        self.caps = [spaces[c.signature].size for c in cands]
        self.total = trial_total(cands, spaces, budget.trials)
        self.phase1_visits = phase1_visits(len(cands), self.total)
        self.idle = [0] * len(cands)  # proposals in a row that were configs already done
        self._contenders: tuple[tuple, list[int]] | None = None
        self._cover: tuple[tuple, Cover] | None = None
        self.planned: dict[int, int] = {}  # phase 2: the trials each contender is still due at the last pick (`allocate`)

    def spent(self) -> int:
        return sum(len(c.spent()) for c in self.cands)

    def done(self) -> bool:
        return self.spent() >= self.total or self.budget.out_of_time()

    def pick(self) -> int | None:
        """The candidate of the next trial; None when the budget or the time is spent, or no candidate can use more."""
        self.planned = {}
        if self.done():
            return None
        set_aside_backends(self.cands, self.spaces)
        counted = [len(c.spent()) for c in self.cands]
        open_ = [i for i in range(len(self.cands)) if counted[i] < self.caps[i] and self.idle[i] < STUCK_AFTER]
        for i in open_:  # a dead worker's config first: its retry waits in the study
            live = {config_key(t.config) for t in self.cands[i].trials if t.status is not TrialStatus.LOST}
            lost = [config_key(t.config) for t in self.cands[i].trials if t.status is TrialStatus.LOST]
            if any(k not in live and lost.count(k) <= MAX_RETRY for k in lost):
                return i
        visits_left = self.phase1_visits - sum(1 for n in counted if n)
        order = phase1_order(self.cands, self.spaces)
        for i in order:
            r = self.cands[i]
            first_visit = not counted[i] and visits_left > 0 and not skipped_in_phase1(r, self.spaces[r.signature], self.total, len(self.cands))
            if i in open_ and (first_visit or config_failures_only(r) or backend_untried(r, self.spaces[r.signature])):
                return i
        cont = [i for i in self.contenders() if i in open_]
        if not cont:  # phase 2 has no one left: the candidates phase 1 did not reach
            return next((i for i in order if i in open_ and not counted[i]), None)
        have = [counted[i] for i in cont]
        weights = [prospect(self.cands[i]) for i in cont]
        target = allocate(weights, [self.caps[i] for i in cont], sum(have) + self.total - sum(counted))
        behind = max(range(len(cont)), key=lambda k: ((target[k] - have[k]) / max(target[k], 1), weights[k]))
        self.planned = {cont[k]: target[k] - have[k] for k in range(len(cont))}
        return cont[behind]

    def due(self, i: int) -> int:
        """The trials candidate i is still due in phase 2 (counting the one it was just picked for); 1 outside phase 2."""
        return max(1, self.planned.get(i, 1))

    def contenders(self) -> list[int]:
        """`contenders`, solved again only when a candidate's best or failures changed."""
        state = tuple((c.best_ms, c.xla_ms, config_failures_only(c)) for c in self.cands)
        if self._contenders is None or self._contenders[0] != state:
            self._contenders = (state, contenders(self.graph, self.by_sig, self.cands, self.model, self.cover()))
        return self._contenders[1]

    def cover(self) -> Cover:
        """The cheapest cover of the candidates' bests so far (what the job would choose now), solved again only
        when a best changed; the progress bar shows its speedup."""
        state = tuple((c.best_ms, c.xla_ms) for c in self.cands)
        if self._cover is None or self._cover[0] != state:
            self._cover = (state, best_cover(self.graph, self.by_sig, self.cands, self.model, "device", costs=self.costs))
        return self._cover[1]

    def note(self, i: int, outcome: str) -> None:
        """What became of candidate i's trial: proposals that measure nothing (done or infeasible configs) count toward
        giving it up; a space with every config worth timing tried ("exhausted") gives it up at once."""
        if outcome == "exhausted":
            self.idle[i] = STUCK_AFTER
        else:
            self.idle[i] = 0 if outcome in ("measured", "spent") else self.idle[i] + 1

