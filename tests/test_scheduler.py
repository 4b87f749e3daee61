"""The budget rule is one piece of code: the local driver and a worker of the workers driver, given the same
program, seed, budget, clock and (fake) timings, run the same trials on the same candidates in the same order."""
from __future__ import annotations

import zlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import pytest

import autofuse
from autofuse import costmodel
from autofuse.graph import Group
from autofuse.kernels import TEMPLATES
from autofuse.runner.protocol import TrialRequest, TrialResult, XlaRequest
from autofuse.status import TrialStatus
from autofuse.store import PlanStore
from autofuse.tuning.job import create_study, distinct_candidates, open_run, register_candidates, search_spaces, time_xla
from autofuse.tuning.ledger import CandidateState, StoreLedger
from autofuse.tuning.local import local_loop
from autofuse.tuning.scheduler import Budget, Scheduler
from autofuse.tuning.space import CandidateSpace
from autofuse.tuning.trial import TrialContext
from autofuse.tuning.workers import _Worker
from benchmarks.workloads import layer_norm, log_relu_bias

S = jax.ShapeDtypeStruct


def two_parts(x, g, b, y, c):
    return layer_norm(x, g, b), log_relu_bias(y, c)


ARGS = (S((512, 1024), jnp.bfloat16), S((1024,), jnp.bfloat16), S((1024,), jnp.bfloat16), S((512, 2048), jnp.float32), S((2048,), jnp.float32))


class FakeDevice:
    """Timings that depend only on the group and the config; one config in seven fails to fit in shared memory."""

    def call(self, req):
        key = zlib.crc32(repr(sorted(req.config.items()) if isinstance(req, TrialRequest) else ()).encode() + bytes(str(req.nodes), "ascii"))
        if isinstance(req, XlaRequest):
            return TrialResult(TrialStatus.OK, 1.0 + len(req.nodes) / 10, 1.0, 1.0)
        if key % 7 == 0:
            return TrialResult(TrialStatus.RESOURCE_EXHAUSTED, error="out of shared memory")
        ms = 0.5 + len(req.nodes) / 20 + (key % 1000) / 2000
        return TrialResult(TrialStatus.OK, ms, ms, ms)

    def close(self):
        pass


class FakeClock:
    """Seconds that pass only when a trial is measured."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _setup():
    graph = autofuse.capture(two_parts, *ARGS)
    by_sig, cands = distinct_candidates(graph)
    time_xla(cands, FakeDevice())
    return graph, by_sig, cands, search_spaces(by_sig, cands, costmodel.H200)


class Ticking(FakeDevice):
    """Each measured trial takes a second of the fake clock."""

    def __init__(self, clock):
        self.clock = clock

    def call(self, req):
        if isinstance(req, TrialRequest):
            self.clock.t += 1.0
        return super().call(req)


@pytest.mark.parametrize("trials, seconds", [(40, None), (10**9, 25.0)], ids=["trial-budget", "time-budget"])
@pytest.mark.slow
def test_local_and_workers_drivers_hand_out_trials_in_the_same_order(tmp_path, trials, seconds):
    orders = {}
    # the local driver: its books in memory
    graph, by_sig, cands, spaces = _setup()
    clock = FakeClock()
    loop = local_loop(graph, by_sig, cands, spaces, Budget(trials, seconds, clock), costmodel.H200, "device", Ticking(clock), None, None, 7)
    loop.run()
    orders["local"] = _trials(cands, loop.order)

    # one worker of the workers driver: its books in a SQLite store, its studies in Optuna's RDB storage
    graph, by_sig, cands, spaces = _setup()
    pstore, run_id = _stored_run(tmp_path, graph, cands, spaces, trials, seconds)
    clock = FakeClock()
    scheduler = Scheduler(graph, by_sig, cands, spaces, Budget(trials, seconds, clock), costmodel.H200)
    ctx = TrialContext(StoreLedger(pstore, run_id), Ticking(clock), "device", scheduler.total, "worker-0")
    w = _Worker(pstore, run_id, cands, spaces, scheduler, ctx, 7, 0, heartbeat_s=10)
    w.work()
    orders["workers"] = _trials(cands, w.loop.order)

    steps, configs = orders["local"]
    assert sum(kind == "measured" for _, kind in steps) >= 12, steps
    assert orders["local"] == orders["workers"]
    assert len({sig for sig, kind in steps if kind == "measured"}) > 3  # several candidates got trials: the rule was exercised
    assert any(st is TrialStatus.RESOURCE_EXHAUSTED for trials in configs.values() for _, st in trials)


def _stored_run(tmp_path, graph, cands, spaces, trials, seconds):
    """A run of `two_parts` in a SQLite store with its candidates and their studies (as a workers launcher makes it)."""
    from autofuse.store.optuna_storage import optuna_storage

    pstore = PlanStore(f"sqlite:///{tmp_path}/w.db")
    _, run_id, _ = open_run(pstore, graph, "two_parts", "device", trials, seconds, 7, None)
    register_candidates(pstore, run_id, cands)
    storage = optuna_storage(pstore.url)
    for r in cands:
        create_study(storage, run_id, spaces[r.signature], r.signature)
    return pstore, run_id


def _trials(cands, order):
    """Each step (candidate, outcome) in order, and each candidate's trials (config, status) by number."""
    return ([(cands[i].signature, kind) for i, kind in order],
            {c.signature: [(t.config, t.status) for t in sorted(c.trials, key=lambda t: t.number)] for c in cands})


def test_a_wrong_result_on_one_backend_leaves_the_others_default_to_try():
    """A candidate whose first backend's default was wrong (the Mosaic GPU SPLADE head on the H100) still gets its
    other backend's default in phase 1; once every backend was tried and none worked, it gets no more trials there."""
    from autofuse.tuning.ledger import TrialRecord
    from autofuse.tuning.space import CandidateSpace

    graph = autofuse.capture(lambda x, w, b: jax.nn.gelu(x @ w + b), S((256, 128), jnp.bfloat16), S((128, 256), jnp.bfloat16),
                             S((256,), jnp.bfloat16))
    by_sig, cands = distinct_candidates(graph)
    for r in cands:
        r.xla_ms = 1.0
    spaces = {r.signature: CandidateSpace.of(r.template, by_sig[r.signature][0].group, by_sig[r.signature][0].spec, costmodel.H200,
                                             ("mosaic_gpu", "triton")) for r in cands}
    i = next(k for k, r in enumerate(cands) if r.template == "matmul")
    assert list(spaces[cands[i].signature].spaces) == ["mosaic_gpu", "triton"]
    for k, r in enumerate(cands):  # everyone else has had its default
        if k != i:
            r.trials = [TrialRecord(0, {"backend": "triton"}, TrialStatus.OK, 2.0)]
    sched = Scheduler(graph, by_sig, cands, spaces, Budget(100), costmodel.H200)
    cands[i].trials = [TrialRecord(0, {"backend": "mosaic_gpu"}, TrialStatus.WRONG_RESULT)]
    assert sched.pick() == i  # triton's default is still owed
    cands[i].trials.append(TrialRecord(1, {"backend": "triton"}, TrialStatus.WRONG_RESULT))
    assert sched.pick() != i  # both backends were wrong: no more phase-1 trials for it


def test_a_short_trial_budget_leaves_a_share_to_the_contenders():
    """A trial budget smaller than the candidates (cross-entropy: a dozen small groups beside the matmul_reduce
    that covers the whole program) gives phase 1 its share (`PHASE1_SHARE`); the rest goes to the contenders, the
    largest XLA time first, instead of to the defaults of groups that cannot change the plan."""
    from autofuse.tuning.scheduler import PHASE1_SHARE
    from benchmarks.workloads import cross_entropy

    graph = autofuse.capture(cross_entropy, S((256, 128), jnp.bfloat16), S((128, 512), jnp.bfloat16), S((256,), jnp.int32))
    by_sig, cands = distinct_candidates(graph)
    time_xla(cands, FakeDevice())
    spaces = search_spaces(by_sig, cands, costmodel.H200)
    budget = 10
    assert len(cands) > budget
    clock = FakeClock()
    loop = local_loop(graph, by_sig, cands, spaces, Budget(budget, None, clock), costmodel.H200, "device", Ticking(clock), None, None, 7)
    assert loop.scheduler.phase1_visits == int(budget * PHASE1_SHARE) < budget
    loop.run()
    spent = {r.signature: len(r.spent()) for r in cands}
    assert sum(spent.values()) == budget
    assert sum(1 for n in spent.values() if n) < budget  # some candidate got more than its default
    biggest = max(cands, key=lambda r: r.xla_ms)
    assert spent[biggest.signature] >= 2, spent


class Recording(FakeDevice):
    """FakeDevice that keeps every request, in order."""

    def __init__(self):
        self.requests = []

    def call(self, req):
        self.requests.append(req)
        return super().call(req)


def test_a_candidate_not_timed_first_is_timed_in_xla_at_its_first_trial(tmp_path):
    """Only the candidates a budget can reach are timed in XLA before the trials (`timed_first`); any other is timed
    just before its first trial, once, by the driver that runs it, and recorded in the run (a time another
    worker recorded first stays). Candidates without a trial keep no XLA time."""
    from autofuse.tuning.scheduler import timed_first, trial_total

    graph = autofuse.capture(two_parts, *ARGS)
    by_sig, cands = distinct_candidates(graph)
    spaces = search_spaces(by_sig, cands, costmodel.H200)
    trials = 6
    first = timed_first(cands, spaces, trial_total(cands, spaces, trials))
    assert len(first) == trials < len(cands)
    before = first[1:2]
    time_xla([cands[i] for i in before], FakeDevice())  # as if the job had timed only one of them first
    pstore, run_id = _stored_run(tmp_path, graph, cands, spaces, trials, None)
    other = cands[first[0]]  # another worker timed this one at its own first trial: its time stays, not timed here
    assert pstore.record_xla(other.candidate_id, "elsewhere:1", "ok", 9.0, "gpu:7")
    assert not pstore.record_xla(other.candidate_id, "third:1", "ok", 8.0, "gpu:8")
    scheduler = Scheduler(graph, by_sig, cands, spaces, Budget(trials), costmodel.H200)
    rec = Recording()
    w = _Worker(pstore, run_id, cands, spaces, scheduler, TrialContext(StoreLedger(pstore, run_id, "me:1"), rec, "device",
                                                                       scheduler.total, "me:1"), 7, 0, heartbeat_s=10)
    w.work()

    def key(nodes):
        return tuple(nodes)

    tried = [r for r in cands if r.trials]
    timed_here = [q.nodes for q in rec.requests if isinstance(q, XlaRequest)]
    assert len(timed_here) == len(set(timed_here))  # once each
    for r in tried:
        first_trial = next(k for k, q in enumerate(rec.requests) if isinstance(q, TrialRequest) and q.nodes == key(r.nodes))
        xla_at = [k for k, q in enumerate(rec.requests) if isinstance(q, XlaRequest) and q.nodes == key(r.nodes)]
        if r is other or cands.index(r) in before:
            assert not xla_at  # timed before (by the job, or by the other worker)
        else:
            assert xla_at and xla_at[0] < first_trial
        assert r.xla_ms is not None
    assert other in tried and other.xla_ms == 9.0, "the other worker's time is read back, not measured again"
    rows = {c["id"]: c for c in pstore.candidates(run_id)}
    lazily = [r for r in tried if r is not other and cands.index(r) not in before]
    assert lazily and all(rows[r.candidate_id]["xla_status"] == "ok" and rows[r.candidate_id]["xla_worker"] == "me:1"
                          and rows[r.candidate_id]["xla_ms"] == r.xla_ms for r in lazily)
    untried = [r for r in cands if not r.trials and cands.index(r) not in before]
    assert untried and all(r.xla_ms is None and rows[r.candidate_id]["xla_status"] is None for r in untried)


def test_outputs_xla_would_keep_inside_a_fusion_cost_the_group_what_writing_them_costs():
    """A group that cuts through what XLA fuses writes intermediates XLA never would (GPT-2's first half of a layer
    norm: float32 x - mean and its square, 1.86 ms lost in the program after 0.77 ms saved alone): their bytes,
    written and read back, are charged to it (`costmodel.cut_outputs_ms`), and the budget ranks it by what is left.
    Outputs read after a dot (a residual read again after the GEMMs) or returned by the program cost nothing."""
    def block(x, w):
        xf = x.astype(jnp.float32)
        centred = xf - xf.mean(-1, keepdims=True)
        y = (centred * jax.lax.rsqrt((centred ** 2).mean(-1, keepdims=True) + 1e-5)).astype(x.dtype)
        return x + (y @ w)  # x is read again after the dot its norm feeds

    x, w = S((1024, 512), jnp.bfloat16), S((512, 512), jnp.bfloat16)
    graph = autofuse.capture(block, x, w)
    ids = {n.name: n.id for n in reversed(graph.nodes)}  # the first node of each name
    first_half = Group.of(graph, [n.id for n in graph.nodes if n.id <= ids["sub"]])  # convert, mean, x - mean
    (centred,) = [v for v in first_half.outputs if graph.avals[v].shape == (1024, 512)]
    assert str(graph.avals[centred].dtype) == "float32"
    assert costmodel.cut_outputs_ms(first_half) == pytest.approx(1e3 * 2 * 1024 * 512 * 4 / costmodel.H200.bandwidth_Bps)
    whole_norm = Group.of(graph, [n.id for n in graph.nodes if n.id < ids["dot_general"]])
    assert costmodel.cut_outputs_ms(whole_norm) == 0.0  # its bf16 output feeds the dot: written by XLA too
    assert costmodel.cut_outputs_ms(Group.of(graph, [graph.nodes[-1].id])) == 0.0  # the program's output
    space = CandidateSpace.of("row_reduce", first_half, TEMPLATES["row_reduce"].match(first_half), costmodel.H200)
    assert space.cut_ms == costmodel.cut_outputs_ms(first_half)


def test_a_dots_product_costs_its_neighbours_only_the_bytes_xla_would_not_write():
    """XLA writes a GEMM's product too (or its epilogue's): a group ending at the dot is charged nothing for it where
    its readers widen it (GPT-2's logits, bf16, converted to float32 for the cross-entropy: XLA's GEMM writes the
    float32, 0.77 ms of cut for the padded GEMM before), and the bytes saved where every reader narrows it (a float32
    product converted to bf16, which XLA's epilogue would write instead)."""
    def widened(x, w):
        return jax.nn.logsumexp((x @ w).astype(jnp.float32), axis=-1)

    def narrowed(x, w):
        p = jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
        return jnp.tanh(p) * p

    x, w = S((1024, 512), jnp.bfloat16), S((512, 2048), jnp.bfloat16)
    for fn, cut in ((widened, 0.0), (narrowed, 1e3 * 2 * 1024 * 2048 * 2 / costmodel.H200.bandwidth_Bps)):
        graph = autofuse.capture(fn, x, w)
        (dot,) = [n.id for n in graph.nodes if n.name == "dot_general"]
        assert costmodel.cut_outputs_ms(Group.of(graph, [dot])) == pytest.approx(cut), fn.__name__


def _tuned_repeated_and_once(runner_of: Callable) -> tuple[CandidateState, CandidateState]:
    """A layer norm run once and a head repeated 8 times (8 x 1.4 ms of XLA time against 3.0 ms), tuned past phase 1
    on the fake clock with `runner_of(clock, repeated)`'s timings: the repeated candidate and the one run once."""
    def program(x, g, b, ys, c):
        return layer_norm(x, g, b), [log_relu_bias(y, c) for y in ys]

    args = ARGS[:3] + ([S((512, 2048), jnp.float32)] * 8, ARGS[4])
    graph = autofuse.capture(program, *args)
    by_sig, cands = distinct_candidates(graph)
    time_xla(cands, FakeDevice())
    spaces = search_spaces(by_sig, cands, costmodel.H200)
    repeated = max(cands, key=lambda r: (r.instances, r.xla_ms))
    once = max((r for r in cands if r.instances == 1), key=lambda r: r.xla_ms)
    assert repeated.instances == 8 and repeated.xla_ms < once.xla_ms < 8 * repeated.xla_ms
    clock = FakeClock()
    loop = local_loop(graph, by_sig, cands, spaces, Budget(3 * len(cands), None, clock), costmodel.H200, "device",
                      runner_of(clock, repeated), None, None, 7)
    loop.run()
    return repeated, once


def test_phase_two_shares_follow_the_programs_time_at_stake_not_one_instances():
    """Past phase 1, a group repeated 8 times (8 x 1.4 ms of XLA time) gets more trials than a group run once with
    the largest time of one instance (3.0 ms), its configs as fast: shares follow the time at stake, one instance's
    times the instances (GPT-2's LM head, one 3.25 ms group, once took 19 of 40 trials from 24 QKV projections of
    0.23 ms each)."""
    repeated, once = _tuned_repeated_and_once(lambda clock, _: Ticking(clock))
    assert len(repeated.spent()) > len(once.spent()) + 4, (len(repeated.spent()), len(once.spent()))


def test_phase_two_shares_follow_what_the_plan_still_spends_not_what_xla_spent():
    """A group repeated 8 times whose every config runs at a twentieth of XLA's time has little left to gain: past
    phase 1 it gets fewer trials than a group run once that its configs barely beat, though XLA spends more on the
    first (8 x 1.4 ms against 3.0 ms). Shares by XLA's time gave GPT-2's attention (24 x 2.5 ms in XLA, 0.21 ms at
    its default) 33-60 of 96 trials, none of which beat the default."""
    class SolvedAlready(Ticking):
        def __init__(self, clock, repeated):
            super().__init__(clock)
            self.repeated = repeated

        def call(self, req):
            res = super().call(req)
            if isinstance(req, TrialRequest) and res.ok and tuple(req.nodes) == tuple(self.repeated.nodes):
                ms = self.repeated.xla_ms / 20 * (1 + res.median_ms / 100)
                return TrialResult(TrialStatus.OK, ms, ms, ms)
            return res

    repeated, once = _tuned_repeated_and_once(SolvedAlready)
    assert repeated.best_ms < repeated.xla_ms / 19 and once.best_ms < once.xla_ms
    assert len(once.spent()) > len(repeated.spent()), (len(once.spent()), len(repeated.spent()))


def test_phase_two_gives_less_to_a_candidate_whose_search_keeps_missing():
    """The group repeated 8 times (the most time at stake) whose default stays its best, every later config slower,
    has its share halved per miss: the group run once, whose configs vary, gets more trials than it. GPT-2's cuDNN
    step gave its attention pair (24 x 0.87 ms at stake) 9-13 of its 20 phase-2 trials, none faster than its default."""
    class DefaultIsBest(Ticking):
        def __init__(self, clock, repeated):
            super().__init__(clock)
            self.repeated, self.seen = repeated, set()

        def call(self, req):
            res = super().call(req)
            if isinstance(req, TrialRequest) and res.ok and tuple(req.nodes) == tuple(self.repeated.nodes):
                first = not self.seen
                self.seen.add(repr(sorted(req.config.items())))
                ms = self.repeated.xla_ms * (0.5 if first else 0.9)
                return TrialResult(TrialStatus.OK, ms, ms, ms)
            return res

    repeated, once = _tuned_repeated_and_once(DefaultIsBest)
    assert min(repeated.spent(), key=lambda t: t.median_ms or 1e9).number == min(t.number for t in repeated.spent())
    assert len(once.spent()) > len(repeated.spent()), (len(once.spent()), len(repeated.spent()))


def _three_regions() -> tuple[list[CandidateState], dict[str, CandidateSpace]]:
    """The candidates of a program of three regions (a GEMM with an epilogue, a softmax, a small elementwise chain),
    timed in XLA by `FakeDevice`, and their search spaces."""
    def prog(x, w, y, z):
        h = jnp.tanh((x @ w).astype(jnp.float32)) * 2.0 + 1.0
        return h.astype(jnp.bfloat16), jax.nn.softmax(y.astype(jnp.float32), axis=-1), jnp.exp(z) * 3.0 + 1.0

    graph = autofuse.capture(prog, S((2048, 1024), jnp.bfloat16), S((1024, 2048), jnp.bfloat16), S((512, 1000), jnp.bfloat16),
                             S((64, 64), jnp.float32))
    by_sig, cands = distinct_candidates(graph)
    time_xla(cands, FakeDevice())
    return cands, search_spaces(by_sig, cands, costmodel.H200)


def test_phase_one_measures_one_candidate_per_region_before_its_variants():
    """Phase 1's order (`phase1_order`): the candidates modelled to save, each region of the program once (pairwise
    disjoint nodes) before any variant of a region already placed; the variants in rounds, each region's k-th before
    any region's (k+1)-th; the modelled losses last. A short budget then reaches every part of the program before a
    second variant of one, and every region's second variant before a third of one."""
    from autofuse.tuning.scheduler import modelled_saving, phase1_order

    cands, spaces = _three_regions()
    order = phase1_order(cands, spaces)
    gains = [i for i in order if modelled_saving(cands[i], spaces[cands[i].signature]) > 0]
    assert order[:len(gains)] == gains and sorted(order) == list(range(len(cands)))
    placed, regions = set(), 0
    for i in gains:
        nodes = set(cands[i].nodes)
        if nodes & placed:
            break
        placed |= nodes
        regions += 1
    assert regions == 3 < len(gains), (regions, len(gains))  # each region once, then the variants
    assert all(set(cands[i].nodes) & placed for i in gains[regions:])
    firsts, seen, rounds = gains[:regions], {}, []
    for i in gains[regions:]:
        region = next(f for f in firsts if set(cands[i].nodes) & set(cands[f].nodes))
        rounds.append(seen.get(region, 0))
        seen[region] = rounds[-1] + 1
    assert rounds == sorted(rounds) and len(set(seen)) > 1 and max(rounds) > 0, rounds  # in rounds across the regions


def test_a_variant_of_a_region_whose_first_lost_to_xla_is_placed_as_a_first():
    """Once a region's first is measured slower than XLA (GPT-2's cross-entropy pair, 0.88x), its variants no longer
    wait behind every other region (its forward logits GEMM padded, 1.40x alone, never got a trial in 40): the
    best of them is placed by its own modelled saving among the firsts. A first that won keeps its region."""
    from autofuse.tuning.ledger import TrialRecord
    from autofuse.tuning.scheduler import modelled_saving, phase1_order

    cands, spaces = _three_regions()
    gains = [i for i in phase1_order(cands, spaces) if modelled_saving(cands[i], spaces[cands[i].signature]) > 0]
    lead = gains[0]
    variants = [i for i in gains if i != lead and set(cands[i].nodes) & set(cands[lead].nodes)]
    assert variants and gains.index(variants[0]) > 1

    def measure(ms: float) -> None:
        cands[lead].trials = [TrialRecord(0, dict(spaces[cands[lead].signature].default), TrialStatus.OK, ms, ms, ms)]
        cands[lead].update_best()

    measure(0.5 * cands[lead].xla_ms)  # it won: its variants keep waiting
    assert phase1_order(cands, spaces).index(variants[0]) == gains.index(variants[0])
    measure(2.0 * cands[lead].xla_ms)  # it lost
    order = phase1_order(cands, spaces)
    firsts = [i for i in order if i != lead][:3]
    assert variants[0] in firsts and order.index(variants[0]) < gains.index(variants[0])


def test_a_region_whose_firsts_lost_twice_keeps_its_other_variants_in_the_rounds():
    """A lost first gives its region one more first; once that one lost too (`LOST_FIRSTS`), the region's other
    variants wait behind every other region's first again. GPT-2's cuDNN step gave 8 of phase 1's 20 visits to one
    dgrad GEMM's variants, one after another as each lost, and its layer norms' backward none."""
    from autofuse.tuning.ledger import TrialRecord
    from autofuse.tuning.scheduler import LOST_FIRSTS, modelled_saving, phase1_order

    cands, spaces = _three_regions()
    gains = [i for i in phase1_order(cands, spaces) if modelled_saving(cands[i], spaces[cands[i].signature]) > 0]
    lead = gains[0]
    variants = [i for i in gains if i != lead and set(cands[i].nodes) & set(cands[lead].nodes)]
    others = [i for i in gains if i != lead and i not in variants]
    assert LOST_FIRSTS == 2 and len(variants) >= 2 and others

    def lose(i: int) -> None:
        cands[i].trials = [TrialRecord(0, dict(spaces[cands[i].signature].default), TrialStatus.OK, 2.0 * cands[i].xla_ms,
                                        2.0 * cands[i].xla_ms, 2.0 * cands[i].xla_ms)]
        cands[i].update_best()

    lose(lead)
    order = phase1_order(cands, spaces)
    second = next(i for i in order if i in variants)
    assert order.index(second) < order.index(next(i for i in order if i in variants[1:] and i != second))
    lose(second)
    order = phase1_order(cands, spaces)
    other_firsts, seen = [], set()
    for i in order:
        if i in others and not set(cands[i].nodes) & seen:
            other_firsts.append(i)
        if i in others:
            seen |= set(cands[i].nodes)
    assert len(other_firsts) == 2, other_firsts  # the softmax's and the small chain's regions
    waiting = [i for i in variants if i != second]
    assert all(order.index(i) > max(map(order.index, other_firsts)) for i in waiting)


def test_a_group_sharing_only_elementwise_ops_with_a_region_is_a_region_of_its_own():
    """A residual GEMM and the layer norm after it share the residual add: the GEMM's group is no variant of the
    norm's (the norm holds none of its `anchor`, its GEMM), so phase 1 reaches it right after the norm's first, before
    the norm's own variants; a group cut from the GEMM's (its dot in it) stays the GEMM's variant. GPT-2's layer norm
    forward, as a variant of the residual GEMM, got no visit in 40 trials."""
    from autofuse.tuning.scheduler import anchor, phase1_order

    def block(r, x, w, b, g, beta):
        y = r + (x @ w + b)
        yf = y.astype(jnp.float32)
        c = yf - yf.mean(-1, keepdims=True)
        return y, (c * jax.lax.rsqrt((c * c).mean(-1, keepdims=True) + 1e-5) * g + beta).astype(jnp.bfloat16)

    graph = autofuse.capture(block, S((2048, 1024), jnp.bfloat16), S((2048, 1024), jnp.bfloat16), S((1024, 1024), jnp.bfloat16),
                             S((1024,), jnp.bfloat16), S((1024,), jnp.float32), S((1024,), jnp.float32))
    by_sig, cands = distinct_candidates(graph)
    time_xla(cands, FakeDevice())
    order = phase1_order(cands, search_spaces(by_sig, cands, costmodel.H200))
    norms = [i for i in order if cands[i].template == "row_reduce"]
    gemms = [i for i in order if cands[i].template == "matmul"]
    norm, gemm = cands[norms[0]], cands[gemms[0]]
    assert set(norm.nodes) & set(gemm.nodes) and not anchor(gemm) & set(norm.nodes) and not anchor(norm) & set(gemm.nodes)
    assert anchor(gemm) == {n.id for n in graph.nodes if n.name == "dot_general"}
    assert order.index(gemms[0]) < order.index(norms[1])  # a first, before the norm's variants
    assert all(anchor(cands[i]) <= set(gemm.nodes) for i in gemms[1:])  # the GEMM's variants


def test_verbose_jobs_say_phase_ones_order_with_the_prices_it_weighs(capsys):
    """`-v`: phase 1's order after XLA's timings, each line the candidate's XLA price, modelled default, cut and
    saving, and why the budget passes it by (a modelled loss, or past phase 1's visits): the job's own reasons why
    a group got no trial."""
    from autofuse.tuning.scheduler import modelled_loss, phase1_lines, phase1_order, phase1_visits

    graph, by_sig, cands, spaces = _setup()
    lines = phase1_lines(cands, spaces, total=2)
    order = phase1_order(cands, spaces)
    assert lines[0].startswith(f"phase 1 order ({phase1_visits(len(cands), 2)} first visit") and len(lines) == 1 + min(40, len(order))
    for line, i in zip(lines[1:], order):
        r = cands[i]
        assert r.signature[:12] in line and f"x{r.instances}" in line
        assert ("modelled loss" in line) == (2 < len(cands) and modelled_loss(r, spaces[r.signature]))
    assert any("modelled loss" in ln or "past phase 1" in ln for ln in lines[1:])
    autofuse.tune(two_parts, *[jnp.zeros(a.shape, a.dtype) for a in ARGS], trials=2, store=False, verbose=True)
    assert "phase 1 order (" in capsys.readouterr().err


def test_a_lowering_to_xlas_own_operations_is_priced_by_what_the_model_misses_on_xla():
    """`concat_sink` runs XLA's own operations, so its modelled time is scaled by XLA's measured time of the group
    over the model's time of XLA's option (`scheduler.default_ms`): the saving phase 1 ranks it by is the model's
    saving in XLA's measured terms. A Pallas lowering's model is taken as it is."""
    from autofuse.tuning import scheduler
    from tests.test_concat_sink import NAME, _args, qkv_block

    graph = autofuse.capture(jax.grad(qkv_block, argnums=(0, 1, 2)), *_args(jnp.bfloat16, D=256, M=512))
    by_sig, cands = distinct_candidates(graph)
    backends = ("mosaic_gpu", "triton", "xla_ops")
    spaces = {r.signature: space for r in cands
              for space in [CandidateSpace.of(r.template, by_sig[r.signature][0].group, by_sig[r.signature][0].spec, costmodel.H200, backends)]}
    (r,) = [c for c in cands if c.template == NAME]
    space = spaces[r.signature]
    assert space.default["backend"] == "xla_ops"
    r.program_xla_ms = 0.5 * space.xla_model_ms  # XLA's kernels priced at half what the model says
    assert scheduler.default_ms(r, space) == pytest.approx(0.5 * space.default_ms())
    assert scheduler.modelled_saving(r, space) == pytest.approx((0.5 * (space.xla_model_ms - space.default_ms()) - space.cut_ms) * r.instances)
    other = next(c for c in cands if spaces[c.signature].default["backend"] != "xla_ops")
    other.program_xla_ms = 0.5 * spaces[other.signature].xla_model_ms
    assert scheduler.default_ms(other, spaces[other.signature]) == spaces[other.signature].default_ms()


class TritonSlower(FakeDevice):
    """Mosaic GPU configs at 0.5 ms, Triton's at 1.0 ms; the Mosaic GPU configs of the candidates holding `wrong`
    (a node) give wrong results, so Triton is the only lowering that works there."""

    def __init__(self, wrong: int):
        self.wrong = wrong

    def call(self, req):
        if isinstance(req, XlaRequest):
            return super().call(req)
        mosaic = req.config.get("backend") == "mosaic_gpu"
        if mosaic and self.wrong in req.nodes:
            return TrialResult(TrialStatus.WRONG_RESULT, error="max error 1.0")
        ms = (0.5 if mosaic else 1.0) + (zlib.crc32(repr(sorted(req.config.items())).encode()) % 100) / 10**5
        return TrialResult(TrialStatus.OK, ms, ms, ms)


def test_a_backend_that_lost_on_two_candidates_of_a_template_is_set_aside_for_its_others():
    """Triton's default is each two-backend candidate's second trial; once it lost to Mosaic GPU (by `LOST_BY`) on
    `LOST_ON` matmul candidates, the other matmul candidates' Triton configs are pruned unmeasured and their trials
    go to Mosaic GPU's configs; a candidate whose Mosaic GPU lowering is wrong still gets Triton's. GPT-2's cuDNN step
    gave ~12 of phase 2's 20 trials to Triton configs 1.2-4.4x slower than the candidate's best."""
    from autofuse.tuning.scheduler import LOST_ON

    def heads(x, *ws):  # five GEMMs with an epilogue, each its own matmul candidate
        return [jax.nn.relu(x @ w) for w in ws]

    graph = autofuse.capture(heads, S((512, 256), jnp.bfloat16), *(S((256, 128 * k), jnp.bfloat16) for k in range(1, 6)))
    by_sig, cands = distinct_candidates(graph)
    last_dot = [n.id for n in graph.nodes if n.name == "dot_general"][-1]
    device = TritonSlower(last_dot)
    time_xla(cands, device)
    spaces = search_spaces(by_sig, cands, costmodel.H200, ("mosaic_gpu", "triton"))
    gemms = [r for r in cands if r.template == "matmul" and list(spaces[r.signature].spaces) == ["mosaic_gpu", "triton"]]
    assert len(gemms) > LOST_ON + 2
    loop = local_loop(graph, by_sig, cands, spaces, Budget(12 * len(cands)), costmodel.H200, "device", device, None, None, 7)
    loop.run()

    def measured(r, backend):
        return [t for t in r.trials if t.status is TrialStatus.OK and t.config["backend"] == backend]

    working = [r for r in gemms if measured(r, "mosaic_gpu")]
    lost = [r for r in working if measured(r, "triton")]
    assert len(lost) == LOST_ON, [len(measured(r, "triton")) for r in working]
    aside = [t for r in working for t in r.trials if t.status is TrialStatus.PRUNED and "lost to another backend" in (t.error or "")]
    assert aside and all(t.config["backend"] == "triton" for t in aside)
    assert sum(len(measured(r, "mosaic_gpu")) for r in working if r not in lost) > len(working) - LOST_ON  # their trials went to Mosaic GPU
    wrong = [r for r in gemms if last_dot in r.nodes]
    assert wrong and all(measured(r, "triton") and not measured(r, "mosaic_gpu") for r in wrong)


class TwoKnobs(FakeDevice):
    """A Mosaic GPU GEMM's time falls by 0.05 ms with each of grid_minor_dim = 0 and pingpong = 0 (ties elsewhere);
    Triton's configs and every other template's run at 10 ms."""

    def call(self, req):
        if isinstance(req, XlaRequest):
            return super().call(req)
        c = req.config
        ms = 0.5 + 0.05 * c["grid_minor_dim"] + 0.05 * c["pingpong"] if c.get("backend") == "mosaic_gpu" else 10.0
        return TrialResult(TrialStatus.OK, ms, ms, ms)


def test_phase_two_searches_around_the_best_config_one_parameter_at_a_time():
    """After its defaults, a candidate's trials take the untried configs one parameter away from its best so far
    (`CandidateSpace.neighbours`, the model's fastest first), not TPE's random first proposals (in a Mosaic GPU GEMM's
    space of ~230,000 configs, GPT-2's step measured four, 0.12-0.93x its default): two parameters that each help are
    found one after the other."""
    graph = autofuse.capture(lambda x, w: jax.nn.relu(x @ w), S((1024, 512), jnp.bfloat16), S((512, 1024), jnp.bfloat16))
    by_sig, cands = distinct_candidates(graph)
    device = TwoKnobs()
    time_xla(cands, device)
    spaces = search_spaces(by_sig, cands, costmodel.H200, ("mosaic_gpu", "triton"))
    (r,) = [r for r in cands if r.template == "matmul"]
    space = spaces[r.signature]
    assert space.default["grid_minor_dim"] == 1 and space.default["pingpong"] == 1
    loop = local_loop(graph, by_sig, cands, spaces, Budget(60), costmodel.H200, "device", device, None, None, 7)
    loop.run()

    mosaic = [t for t in sorted(r.trials, key=lambda t: t.number) if t.status is TrialStatus.OK and t.config["backend"] == "mosaic_gpu"]
    assert mosaic[0].config == space.default
    best, model_best = mosaic[0], space.model_best()
    for t in mosaic[1:]:  # each a neighbour of the best before it (but the model's best, phase 1's third config)
        if best.median_ms == pytest.approx(0.5):
            break  # then its neighbours, all ties, and the sampler's
        assert t.config == model_best or sum(t.config[k] != best.config[k] for k in t.config) == 1, (t.config, best.config)
        best = min(best, t, key=lambda u: u.median_ms)
    assert r.best_config["grid_minor_dim"] == 0 and r.best_config["pingpong"] == 0
    assert r.best_ms == pytest.approx(0.5)
