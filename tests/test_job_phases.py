"""The fixed costs of a tuning job (issue 18): every run records when each of its phases ended (migration 0006),
studies are created with their defaults and get the model's best from their first trial (the same order as before),
and the selection compiles the whole program's reference once and the plans to validate ahead, with the results
of the serial path."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import optuna
import pytest

import autofuse
from autofuse import costmodel
from autofuse.plan import Plan
from autofuse.runner import measure, program_check
from autofuse.runner.evaluator import Evaluator
from autofuse.runner.protocol import CompileRequest, ValidateRequest
from autofuse.status import TrialStatus
from autofuse.store import PlanStore
from autofuse.tables import format_phases
from autofuse.tuning.job import (
    create_study,
    distinct_candidates,
    enqueue_model_best,
    load_study,
    search_spaces,
)
from autofuse.tuning.select import default_plan
from benchmarks.workloads import rms_norm
from tests.dist_programs import rms_norm_inputs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_MARKS = ("start", "setup", "xla", "trials", "selected", "saved")


def _in_order(marks: dict, names) -> bool:
    times = [marks[n] for n in names]
    return times == sorted(times)


@pytest.mark.slow
def test_a_local_run_records_its_phases_and_show_prints_them(tmp_path):
    url = f"sqlite:///{tmp_path}/p.db"
    rep = autofuse.tune(rms_norm, *rms_norm_inputs(), trials=4, store=url, quiet=True, measure="model")
    phases = PlanStore(url).get_run(rep.run_id)["phases"]
    assert set(RUN_MARKS) <= set(phases) and phases["start"] <= 0 and _in_order(phases, RUN_MARKS), phases
    sel = phases["selection"]
    assert {"check", "singles", "cover", "validate"} <= set(sel) and sel["plans"], sel
    assert {"compile", "time", "groups"} <= set(phases["xla_parts"]) and phases["xla_parts"]["groups"] > 0, phases
    assert any(ln.startswith("XLA timings (this process): compile ") for ln in format_phases(phases))
    tp = phases["trial_parts"]
    assert {"ledger", "pick", "trials", "measure", "claim"} <= set(tp) and tp["trials"] >= tp["measure"] > 0, tp
    assert "measure_build" in tp and tp["measure"] >= tp["measure_build"], tp  # the trial process's parts (model mode: no check)
    assert any(ln.startswith("trials (this process): ") for ln in format_phases(phases))
    with_compiles = dict(phases, selection=dict(sel, compile_ahead=3.0, compiled=[{"program": 2.5, "plan": 1.25}]))
    assert "(longest compile of one: program 2.50, plan 1.25)" in "\n".join(format_phases(with_compiles))
    assert all({"groups", "status", "seconds", "compile", "reference", "check"} <= set(p) for p in sel["plans"]), sel
    lines = format_phases(phases)
    assert lines[0].startswith("run: start ") and lines[-1].lstrip().startswith("plan 1 (")
    out = subprocess.run([sys.executable, "-m", "autofuse.cli", "show", "run", str(rep.run_id), "--db", url], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT), check=False)
    assert out.returncode == 0 and "phases (seconds from the run's start" in out.stdout and "  run: start " in out.stdout, out.stderr


@pytest.mark.slow
def test_a_run_with_workers_records_the_launchers_and_each_workers_phases(tmp_path):
    """The launcher starts its workers before it registers the candidates and creates the studies; they wait for
    its marks, and the run's books are those of any run with workers."""
    from tests.test_distributed import RMS, _finish, _tune, check_books

    url = f"sqlite:///{tmp_path}/w.db"
    _finish(_tune(RMS, url, 2, 6))
    books = check_books(url, 6)
    phases = books["run"]["phases"]
    assert _in_order(phases, ("start", "candidates", "setup")) and _in_order(phases, ("candidates", "xla", "trials", "selected", "saved"))
    workers = phases["workers"]
    assert len(workers) == 2, phases
    parts = {k: v for k, v in phases.items() if k.startswith("xla_parts ")}
    assert {k.split(" ", 1)[1] for k in parts} == set(workers) and sum(p.get("groups", 0) for p in parts.values()) > 0, phases
    assert all("store" in p for p in parts.values()), phases  # claiming and recording the timings: apart from the work
    trial_parts = {k.split(" ", 1)[1]: v for k, v in phases.items() if k.startswith("trial_parts ")}
    assert set(trial_parts) == set(workers), phases
    for v in trial_parts.values():  # where each worker's trial time went, the measurements apart from the store and the sampler
        assert {"compiled_ahead", "batches", "ledger", "pick"} <= set(v), v
        assert v.get("trials", 0) >= v.get("measure", 0) + v.get("claim", 0), v
    measured = [v for v in trial_parts.values() if "measure" in v]  # (a worker may run none of the 6 trials)
    assert measured and all({"compile_ahead", "study", "trials", "claim"} <= set(v) and v["measure"] > 0 for v in measured), trial_parts
    from benchmarks.multi_gpu import read_store, workers_cell  # the scaling table says where each worker's loop went

    cell = workers_cell(read_store(f"{tmp_path}/w.db", 0.0)["per_worker"])
    assert all(f"`{w}`" in cell for w in workers) and cell.count("loop s: ") == len(workers) and "sampler " in cell, cell
    for marks in workers.values():
        assert _in_order(marks, ("joined", "ready", "xla", "loop", "trials")) and marks["ready"] >= phases["candidates"], phases
    assert any(line.startswith("trials (") for line in format_phases(phases)), format_phases(phases)


def test_the_models_best_is_queued_by_a_studys_first_trial_where_it_came_before():
    graph = autofuse.capture(rms_norm, *rms_norm_inputs())
    by_sig, cands = distinct_candidates(graph)
    spaces = search_spaces(by_sig, cands, costmodel.H200)
    r = next(c for c in cands if len(spaces[c.signature].first_configs()) > len(spaces[c.signature].defaults()))
    space = spaces[r.signature]
    storage = optuna.storages.InMemoryStorage()
    create_study(storage, None, space, r.signature)
    study = load_study(storage, None, r.signature, 0)
    waiting = lambda: [t.system_attrs["fixed_params"] for t in study.get_trials(deepcopy=False)]
    assert waiting() == [space.optuna_params(c) for c in space.defaults()]
    trial = study.ask()
    assert trial.number == 0
    enqueue_model_best(study, space)
    enqueue_model_best(study, space)  # once
    assert waiting() == [space.optuna_params(c) for c in space.first_configs()]


@pytest.mark.parametrize("ahead", [False, True], ids=["serial", "compiled-ahead"])
@pytest.mark.slow
def test_validation_compiles_the_reference_once_and_plans_ahead_with_the_serial_results(monkeypatch, ahead):
    """Device mode in the trial process (on the CPU): the plan and a smaller one validated one after the other, with
    and without compiling them ahead, give the serial results; the whole program is compiled once."""
    graph = autofuse.capture(rms_norm, *rms_norm_inputs())
    plan = default_plan(graph)
    assert plan.groups
    smaller = Plan(plan.fingerprint, plan.groups[:1], dict(plan.provenance))
    serial = Evaluator(graph, measure="device", repeats=2, n_input_sets=1)
    expect = [serial.handle(ValidateRequest(p.to_json())) for p in (plan, smaller)]
    ev = Evaluator(graph, measure="device", repeats=2, n_input_sets=1)
    compiled = []
    real = ev._compile_program
    monkeypatch.setattr(ev, "_compile_program", lambda: compiled.append(1) or real())
    measure._viewer.cache_clear()  # the inputs' small programs made afresh: compiled ahead (with the plans) or not
    program_check._nudged.clear_cache()
    if ahead:
        done = ev.handle(CompileRequest(tuple(ValidateRequest(p.to_json()) for p in (plan, smaller)), 2))
        assert done.ok and (done.compiled, done.failed) == (3, 0)  # the reference and two plans
        assert set(done.longest) == {"program", "plan", "inputs"} and 0 < done.longest["plan"] <= done.seconds  # what took the time
        made = measure._viewer.cache_info().currsize, program_check._nudged._cache_size()
        assert made[0] > 0  # the random inputs' views (float32 inputs: no nudges)
    got = [ev.handle(ValidateRequest(p.to_json())) for p in (plan, smaller)]
    assert len(compiled) == 1 and ev._plans == {}
    if ahead:  # jax.jit's rounding spread and the checks ran what was compiled ahead, nothing new
        assert (measure._viewer.cache_info().currsize, program_check._nudged._cache_size()) == made
    for a, b in zip(expect, got):
        assert a.status is b.status is TrialStatus.OK
        assert (a.max_error, a.tolerance, a.rounding_sensitivity) == (b.max_error, b.tolerance, b.rounding_sensitivity)
        assert b.baseline is not None and {"compile", "reference", "check", "time"} <= set(b.seconds)
    assert got[1].seconds["reference"] < got[0].seconds["reference"] or ahead  # the second plan reuses the reference


class _ScriptedRunner:
    """A trial process whose whole-plan validations return given speedups (by the plan's group count), and that
    records the order of its requests and of the job's early saves."""

    def __init__(self, speedup_by_groups: dict[int, float | None], events: list):
        self.speedup_by_groups, self.events = speedup_by_groups, events

    def call(self, req):
        from autofuse.runner.protocol import CompareRequest, ComparisonResult, CompileResult, Timing, ValidationResult

        if isinstance(req, CompileRequest):
            self.events.append(("compile", tuple(len(Plan.from_json(it.plan_json).groups) for it in req.items)))
            return CompileResult(TrialStatus.OK, len(req.items), 0, 0.0)
        if isinstance(req, CompareRequest):  # head to head: the speedups' ratio, within half a percent either way
            n1, n2 = (len(Plan.from_json(j).groups) for j in (req.first_json, req.second_json))
            self.events.append(("compare", n1, n2))
            r = self.speedup_by_groups[n1] / self.speedup_by_groups[n2]
            return ComparisonResult(TrialStatus.OK, ratio=Timing(r, r, r, r * 0.995, r * 1.005, 1, 16))
        n = len(Plan.from_json(req.plan_json).groups)
        self.events.append(("validate", n))
        s = self.speedup_by_groups[n]
        if s is None:
            return ValidationResult(TrialStatus.WRONG_RESULT, error="wrong")
        t = lambda ms: Timing(ms, ms, ms, ms * 0.999, ms * 1.001)  # noqa: E731
        return ValidationResult(TrialStatus.OK, baseline=t(10.0), plan=t(10.0 / s), ratio=t(1.0 / s))


def _four_group_plan():
    from autofuse.plan import FusedGroup

    groups = tuple(FusedGroup((i,), "elementwise", {}, f"sig{i}") for i in range(4))
    return Plan("fp", groups, {})


@pytest.mark.parametrize("speedups, kept_groups, early_groups", [
    ({4: 1.5, 2: 1.495, 1: 1.2, 3: 1.49}, 4, 4),  # no other plan faster: the chosen plan, stored early, kept
    ({4: 1.5, 2: 1.505, 1: 1.2, 3: 1.49}, 2, 4),  # one faster within noise (0.5%) and head to head (its median ratio
                                                  # 0.997, upper quartile above 1) replaces it
    ({4: 1.5, 2: 2.0, 1: 1.2, 3: 1.9}, 2, 4),    # one group's plan in context faster beyond noise replaces it
    ({4: None, 2: 1.3, 1: 1.2, 3: 1.35}, 3, 2),  # the chosen plan is wrong: the first that passes is stored early, the
                                                 # plan of the groups that saved time in context replaces it
    ({4: None, 2: None, 1: None, 0: 1.0}, 0, None),  # none passes: XLA's plan (jax.jit timed alone), nothing stored early
])
def test_the_first_plan_that_passes_is_handed_over_before_the_groups_in_context_are_compiled(monkeypatch, speedups, kept_groups,
                                                                                             early_groups):
    """On the GPU the chosen plan and jax.jit's reference are compiled and validated first; the first plan that
    passes goes to `on_passed` at once (the job stores it: a first validated plan does not wait for the rest); then
    each group's plan in context, compiled together, then the groups that saved time together; a later plan
    replaces the first where faster beyond noise, or within it and head to head."""
    from autofuse.tuning import validate as V
    from autofuse.tuning.select import Cover

    plan = _four_group_plan()
    monkeypatch.setattr(V, "group_plans", lambda p, alt, alone: [Plan(p.fingerprint, p.groups[:2], {}), Plan(p.fingerprint, p.groups[3:], {})])
    graph = autofuse.capture(rms_norm, *rms_norm_inputs())
    events: list = []
    early: list = []
    report = V.validate(graph, Cover(plan, 10.0, 5.0), _ScriptedRunner(speedups, events), "device", "p", [], 4, 0.0,
                        compile_workers=4, on_passed=lambda rep: (early.append(rep), events.append(("early", len(rep.plan.groups)))))
    assert events[:2] == [("compile", (4,)), ("validate", 4)]  # the chosen plan alone first (with jax.jit's reference)
    assert len(report.plan.groups) == kept_groups
    if early_groups is None:
        assert early == [] and report.plan.is_xla and report.baseline_ms == 10.0
        return
    assert [len(r.plan.groups) for r in early] == [early_groups]
    assert events.index(("early", early_groups)) == events.index(("validate", early_groups)) + 1  # right after its validation
    assert events.index(("compile", (2, 1))) > events.index(("validate", 4))  # the groups in context compiled after the chosen one's check
    assert events[-2:] == [("compile", (3,)), ("validate", 3)]  # the two groups that saved time in context, together
    assert (report is early[0]) == (kept_groups == early_groups)  # the job stores the kept plan once
    compared = [e for e in events if e[0] == "compare"]
    assert compared == ([("compare", 4, 2)] if speedups[2] == 1.505 else [])  # the close call, timed head to head
    assert report.speedup == pytest.approx(speedups[kept_groups])
    if kept_groups != 4:  # here every plan's groups are some of the chosen plan's
        assert report.plan.provenance["reason"].startswith(f"smaller plan kept ({kept_groups} of 4 groups): the chosen plan")


class _OutOfMemoryRunner(_ScriptedRunner):
    """A trial process whose first `oom` validations run out of GPU memory; `restart` is recorded as an event."""

    def __init__(self, speedup_by_groups: dict[int, float | None], events: list, oom: int):
        super().__init__(speedup_by_groups, events)
        self.oom = oom

    def call(self, req):
        from autofuse.runner.protocol import ValidationResult

        if isinstance(req, ValidateRequest) and self.oom:
            self.oom -= 1
            self.events.append(("validate", len(Plan.from_json(req.plan_json).groups)))
            return ValidationResult(TrialStatus.RESOURCE_EXHAUSTED, error="RESOURCE_EXHAUSTED: Out of memory while trying to allocate 63.56GiB")
        return super().call(req)

    def restart(self):
        self.events.append(("restart",))


@pytest.mark.parametrize("oom, kept_groups", [(1, 4), (2, 2)])
def test_a_validation_out_of_gpu_memory_is_made_again_once_in_a_fresh_trial_process(monkeypatch, oom, kept_groups):
    """A whole program near the card's size needs one contiguous block of the trial process's pool, which the trials'
    buffers may have split (GPT-2 medium's training step, H100): a validation out of memory is made again once per
    job in a fresh trial process; out of memory again, that plan fails and the next one is validated as usual."""
    from autofuse.tuning import validate as V
    from autofuse.tuning.select import Cover

    plan = _four_group_plan()
    monkeypatch.setattr(V, "group_plans", lambda p, alt, alone: [Plan(p.fingerprint, p.groups[:2], {})])
    graph = autofuse.capture(rms_norm, *rms_norm_inputs())
    events: list = []
    report = V.validate(graph, Cover(plan, 10.0, 5.0), _OutOfMemoryRunner({4: 1.5, 2: 1.3}, events, oom), "device", "p", [], 4, 0.0,
                        compile_workers=4)
    assert events[:5] == [("compile", (4,)), ("validate", 4), ("restart",), ("compile", (4,)), ("validate", 4)]
    assert events.count(("restart",)) == 1 and len(report.plan.groups) == kept_groups
    if kept_groups == 2:
        assert "validation failed: resource_exhausted" in report.plan.provenance["reason"]


def test_an_evaluator_reports_a_validation_out_of_gpu_memory_as_such(monkeypatch):
    """Out of memory while checking a whole plan is RESOURCE_EXHAUSTED, not a generic error: the job tries a fresh
    trial process for it (other errors still fail the request as before)."""
    graph = autofuse.capture(rms_norm, *rms_norm_inputs())
    ev = Evaluator(graph, measure="device", repeats=2, n_input_sets=1)
    plan = default_plan(graph)

    def oom(*a, **k):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 63.56GiB with allocator GPU_0_bfc")

    monkeypatch.setattr(ev, "validate", oom)
    res = ev.handle(ValidateRequest(plan.to_json()))
    assert res.status is TrialStatus.RESOURCE_EXHAUSTED and "63.56GiB" in res.error
    monkeypatch.setattr(ev, "validate", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        ev.handle(ValidateRequest(plan.to_json()))


@pytest.mark.slow
def test_a_jobs_early_plan_and_its_final_plan_are_stored_once_each_by_the_promotion_rule(tmp_path):
    """`PlanSaver`: the early plan is stored (current: the first plan of its key); the same report at the end only
    finishes the run; a later, faster plan is stored beside it and becomes current by the promotion rule. The final
    plan is in the store before its run is finished: `autofuse tune --workers` reads the plan of a run it sees
    finished, and once found none (the run finished by a joining worker an instant before its plan was written)."""
    from autofuse.runner.protocol import ValidationResult
    from autofuse.tuning.job import PlanSaver, RunIds
    from autofuse.tuning.report import TuneReport

    url = f"sqlite:///{tmp_path}/p.db"
    rep0 = autofuse.tune(rms_norm, *rms_norm_inputs(), trials=2, store=url, quiet=True, measure="model")
    store = PlanStore(url)
    run = store.get_run(rep0.run_id)
    ids = RunIds(run["program_id"], run["device_id"], run["software_id"])
    finish, at_finish = store.finish_run, {}

    def finishing(run_id, *args, **kwargs):  # the run's plans as a reader sees them the moment it is finished
        at_finish[run_id] = {p["id"] for p in store.plans() if p["run_id"] == run_id}
        return finish(run_id, *args, **kwargs)

    store.finish_run = finishing

    def report(groups: int, speedup: float) -> TuneReport:
        plan = Plan(rep0.fingerprint, _four_group_plan().groups[:groups], {})
        return TuneReport("p", rep0.fingerprint, "device", plan, 10.0, 10.0 / speedup, speedup, 0.01, [], ValidationResult(TrialStatus.OK), 1.0, 4)

    for early_speedup, later_speedup, stored in ((1.5, 1.5, 1), (2.0, 3.0, 2)):  # each run beats the one before beyond noise
        run_id = store.start_run(ids.program, ids.device, ids.software, budget={"trials": 4}, seed=0, sampler="tpe", measure="device")
        saver = PlanSaver(store, ids, run_id)
        first = report(4, early_speedup)
        saver.early(first)
        current = lambda: [p["id"] for p in store.plans(current_only=True) if p["program_id"] == ids.program]  # noqa: E731
        assert current() == [first.plan_id]
        final = first if later_speedup == early_speedup else report(2, later_speedup)
        assert saver.final(final) == final.plan_id
        assert len([p for p in store.plans() if p["run_id"] == run_id]) == stored
        assert current() == [final.plan_id] and final.plan_current
        assert store.get_run(run_id)["status"] == "finished" and final.plan_id in at_finish[run_id]


def test_the_launcher_waits_out_a_moment_with_no_trial_and_no_selection(monkeypatch):
    """`autofuse tune --workers`: after its own workers exit, a run still running with no trial running and no worker
    selecting is what a worker of another host shows between its last trial and taking the selection; the launcher
    waits IDLE_GRACE_S for that before it leaves the run to its user, and reads the run finished when it is."""
    from autofuse.tuning import workers as W

    monkeypatch.setattr(W, "POLL_S", 0.01)
    monkeypatch.setattr(W, "IDLE_GRACE_S", 0.2)
    states = iter([("running", None)] * 3 + [("running", "otherhost:1")] * 3 + [("finished", "otherhost:1")])

    class Store:
        last = ("running", None)

        def get_run(self, run_id):
            self.last = next(states, self.last)
            return {"status": self.last[0], "selected_by": self.last[1]}

        def trials(self, run_id, status):
            return []

    assert W._wait_for_selection(Store(), 1)["status"] == "finished"
    states = iter([])  # nobody ever selects: the run comes back running after the grace
    Store.last = ("running", None)
    t0 = time.monotonic()
    assert W._wait_for_selection(Store(), 1)["status"] == "running" and time.monotonic() - t0 >= 0.2


def test_xla_chunks_shrink_with_the_worker_count_so_the_workers_end_together():
    from autofuse.tuning.workers import xla_chunk

    assert xla_chunk(158, 16, 1) == 32  # one worker: what its 16 threads compile at once
    assert xla_chunk(158, 16, 4) == 20  # four: 8 chunks, two each, not 32+32+32+62
    assert xla_chunk(5, 16, 4) == 1 and xla_chunk(0, 16, 4) == 1


def test_a_validation_first_lets_go_of_the_trials_input_sets():
    """The random input sets a trial was timed on are released before the whole program is checked (on a GPU they
    split the pool that jax.jit's whole-program reference needs in one piece); the validation's result is the same
    as an evaluator's that timed nothing before."""
    graph = autofuse.capture(rms_norm, *rms_norm_inputs())
    plan = default_plan(graph)
    fresh = Evaluator(graph, measure="device", repeats=2, n_input_sets=1).validate(plan)
    ev = Evaluator(graph, measure="device", repeats=2, n_input_sets=1)
    fg = plan.groups[0]
    assert ev.xla(fg.nodes).status is TrialStatus.OK
    (held,) = ev._sets.values()
    assert held and all(x is not None for s in held for x in s)
    res = ev.validate(plan)
    assert len(ev._sets) == 1 and all(s is not held for s in ev._sets.values())  # the program's sets, made anew for its timing
    assert res.status is fresh.status is TrialStatus.OK
    assert (res.max_error, res.tolerance) == (fresh.max_error, fresh.tolerance)


@pytest.mark.parametrize("chosen_saves, rivals_judged", [(4.5, False), (1.0, True)], ids=["kept-its-savings", "lost-them"])
def test_rivals_are_judged_only_where_the_chosen_plan_lost_its_savings_in_the_program(monkeypatch, chosen_saves, rivals_judged):
    """A chosen plan that kept most of its savings alone in the program (here 4.5 of 5 ms) is only extended; one that
    lost them (1 of 5 ms) is taken apart, and the fastest plan then has its groups' near-tie rivals judged too
    (`swap_rivals`)."""
    from autofuse.plan import FusedGroup
    from autofuse.tuning import validate as V
    from autofuse.tuning.select import Cover

    plan = _four_group_plan()
    monkeypatch.setattr(V, "plan_saving_ms", lambda p, saving: 5.0)
    monkeypatch.setattr(V, "group_plans", lambda p, alt, alone: [])

    class Savings:
        def plan(self, without=frozenset()):
            return Plan("fp", (), {})

        def rivals(self, p):
            return [Plan("fp", p.groups[:2] + (FusedGroup((2, 3), "matmul", {}, "rival"),), {})]

        def alone_plan(self):
            return None

    graph = autofuse.capture(rms_norm, *rms_norm_inputs())
    events: list = []
    report = V.validate(graph, Cover(plan, 10.0, 5.0), _ScriptedRunner({4: 10.0 / (10.0 - chosen_saves), 3: 2.0}, events),
                        "device", "p", [], 4, 0.0, savings=Savings())
    assert (("validate", 3) in events) is rivals_judged
    assert len(report.plan.groups) == (3 if rivals_judged else 4)  # the rival, faster beyond noise, is kept where judged


def test_a_kept_plan_is_extended_by_a_group_that_only_the_unpriced_plan_holds(monkeypatch):
    """The chosen plan kept its savings (4.5 of 5 ms): the groups beside it come from the plan of the largest savings
    alone as well as the priced one. Here only the unpriced plan (`Savings.alone_plan`) holds one more group (two
    instances); judged in context it saves time, and the chosen plan with it is kept."""
    from autofuse.plan import FusedGroup
    from autofuse.tuning import validate as V
    from autofuse.tuning.select import Cover

    plan = _four_group_plan()
    monkeypatch.setattr(V, "plan_saving_ms", lambda p, saving: 5.0)

    class Savings:
        def plan(self, without=frozenset()):
            return Plan("fp", (), {})

        def alone_plan(self):
            return Plan("fp", plan.groups[:1] + tuple(FusedGroup((n,), "matmul", {}, "priced-out") for n in (7, 8)), {})

        def rivals(self, p):
            return []

    graph = autofuse.capture(rms_norm, *rms_norm_inputs())
    events: list = []
    report = V.validate(graph, Cover(plan, 10.0, 5.0), _ScriptedRunner({4: 10.0 / 5.5, 2: 1.05, 6: 2.0}, events),
                        "device", "p", [], 4, 0.0, alternative=Plan("fp", (), {}), savings=Savings())
    assert [e for e in events if e[0] == "validate"] == [("validate", 4), ("validate", 2), ("validate", 6)]
    assert sorted(g.signature for g in report.plan.groups) == ["priced-out", "priced-out", "sig0", "sig1", "sig2", "sig3"]


def test_the_selection_is_recorded_as_each_plan_is_judged_so_a_killed_job_keeps_it(monkeypatch, tmp_path):
    """The selection's record grows in the store after every plan validated and every close call (a job killed in
    its selection, as a 170 s limit cut GPT-2's forward while it timed a close call, kept nothing of it before):
    each write holds one more plan than the last, with its savings beside it, and the last write is the whole
    record; a replacing mark overwrites what an earlier one wrote, a plain mark keeps the first."""
    import copy

    from autofuse.tuning import validate as V
    from autofuse.tuning.job import PhaseMarks, open_run
    from autofuse.tuning.select import Cover

    plan = _four_group_plan()
    monkeypatch.setattr(V, "group_plans", lambda p, alt, alone: [Plan(p.fingerprint, p.groups[:2], {}), Plan(p.fingerprint, p.groups[3:], {})])
    graph = autofuse.capture(rms_norm, *rms_norm_inputs())
    pstore, run_id, _ = open_run(f"sqlite:///{tmp_path}/p.db", graph, "p", "device", 4, None, 0, None)
    marks = PhaseMarks(pstore, run_id)
    written: list[dict] = []

    def on_timings(t: dict) -> None:
        written.append(copy.deepcopy(t))
        marks("selection", value=t, replace=True)
        assert pstore.get_run(run_id)["phases"]["selection"] == written[-1]  # in the store at once

    timings: dict = {}
    V.validate(graph, Cover(plan, 10.0, 5.0), _ScriptedRunner({4: 1.5, 2: 1.505, 1: 1.2, 3: 1.49}, []), "device", "p", [], 4, 0.0,
               timings=timings, on_timings=on_timings)
    plans = [len(w.get("plans", [])) for w in written]
    assert plans[0] == 1 and plans[-1] == len(timings["plans"]) == 4, plans  # the chosen plan, two alone, the ones that saved
    assert all(len(w["plans"]) == len(w["composition"]) for w in written)  # each plan's savings written with it
    assert sum(1 for a, b in zip(written, written[1:]) if len(b["plans"]) == len(a["plans"])) == len(timings["comparisons"]) == 1
    assert written[-1] == timings
    marks("selection", value={"check": 1.0})
    assert pstore.get_run(run_id)["phases"]["selection"] == timings  # without `replace`, the first mark stays


def _small_space_candidate():
    """rms_norm's candidates, and the one with the smallest enumerated space of more than one config worth timing."""
    graph = autofuse.capture(rms_norm, *rms_norm_inputs())
    by_sig, cands = distinct_candidates(graph)
    spaces = search_spaces(by_sig, cands, costmodel.H200)
    usable = [c for c in cands if len(_worth(spaces[c.signature])) > 1]
    r = min(usable, key=lambda c: spaces[c.signature].size)
    return graph, by_sig, cands, spaces, r


def _worth(space) -> list[dict]:
    """Every config of an enumerated space that would be timed on the GPU."""
    configs = [{"backend": b, **c} for b, sp in space.spaces.items() for c in (sp.feasible() or [])]
    return [c for c in configs if space.unmeasured_reason(c, "device") is None]


def test_a_space_is_explored_once_every_config_worth_timing_was_tried():
    *_, spaces, r = _small_space_candidate()
    space = spaces[r.signature]
    worth = _worth(space)
    assert not space.explored([], "device") and not space.explored(worth[:-1], "device")
    assert space.explored(worth, "device") and space.explored(list(reversed(worth)), "device")


@pytest.mark.slow
def test_a_repeated_proposal_of_an_explored_space_gives_the_candidate_up_at_once():
    """TPE proposes configs done already once a small space is explored (61 of GPT-2's attention candidate's 96 trial
    steps on an H200, ~80 ms each): where every config worth timing was tried, the scheduler gives the candidate up
    at the first such proposal rather than after `STUCK_AFTER` of them."""
    from autofuse.runner.protocol import TrialResult
    from autofuse.tuning.ledger import MemoryLedger
    from autofuse.tuning.scheduler import STUCK_AFTER, Budget, Scheduler
    from autofuse.tuning.trial import TrialContext, run_trial

    graph, by_sig, cands, spaces, r = _small_space_candidate()
    space = spaces[r.signature]
    ledger = MemoryLedger(cands)
    worth = _worth(space)
    study = optuna.create_study(storage=optuna.storages.InMemoryStorage(), direction="minimize")
    study.tell(study.ask(), 0.0)  # a study's first trial queues the model's best (`enqueue_model_best`): past it
    ctx = TrialContext(ledger, runner=None, measure="device", limit=10**6, worker="me:1")
    for k, c in enumerate(worth):
        claim = ledger.claim(r, c, k, limit=None)
        assert ledger.finish(r, claim.number, TrialResult(TrialStatus.OK, median_ms=1.0 + k))
        study.enqueue_trial(space.optuna_params(worth[0]))  # the sampler proposes the first config again
        assert run_trial(study, r, space, ctx) == ("exhausted" if k == len(worth) - 1 else "duplicate")
    sched = Scheduler(graph, by_sig, cands, spaces, Budget(100), costmodel.H200)
    i = cands.index(r)
    sched.note(i, "duplicate")
    assert sched.idle[i] < STUCK_AFTER  # a repeat alone gives nothing up
    sched.note(i, "exhausted")
    assert sched.idle[i] >= STUCK_AFTER  # the rule `pick` leaves a candidate out by
