"""The fixed costs of a tuning job (issue 18): every run records when each of its phases ended (migration 0006),
studies are created with their defaults and get the model's best from their first trial (the same order as before),
and the selection compiles the whole program's reference once and the plans to validate ahead, with the results
of the serial path."""
from __future__ import annotations

import os
import subprocess
import sys

import optuna
import pytest

import autofuse
from autofuse import costmodel
from autofuse.plan import Plan
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


def test_a_local_run_records_its_phases_and_show_prints_them(tmp_path):
    url = f"sqlite:///{tmp_path}/p.db"
    rep = autofuse.tune(rms_norm, *rms_norm_inputs(), trials=4, store=url, quiet=True, measure="model")
    phases = PlanStore(url).get_run(rep.run_id)["phases"]
    assert set(RUN_MARKS) <= set(phases) and phases["start"] <= 0 and _in_order(phases, RUN_MARKS), phases
    sel = phases["selection"]
    assert {"check", "singles", "cover", "validate"} <= set(sel) and sel["plans"], sel
    assert all({"groups", "status", "seconds", "compile", "reference", "check"} <= set(p) for p in sel["plans"]), sel
    lines = format_phases(phases)
    assert lines[0].startswith("run: start ") and lines[-1].lstrip().startswith("plan 1 (")
    out = subprocess.run([sys.executable, "-m", "autofuse.cli", "show", "run", str(rep.run_id), "--db", url], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT), check=False)
    assert out.returncode == 0 and "phases (seconds from the run's start" in out.stdout and "  run: start " in out.stdout, out.stderr


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
    for marks in workers.values():
        assert _in_order(marks, ("joined", "ready", "xla", "trials")) and marks["ready"] >= phases["candidates"], phases


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
    if ahead:
        done = ev.handle(CompileRequest(tuple(ValidateRequest(p.to_json()) for p in (plan, smaller)), 2))
        assert done.ok and (done.compiled, done.failed) == (3, 0)  # the reference and two plans
    got = [ev.handle(ValidateRequest(p.to_json())) for p in (plan, smaller)]
    assert len(compiled) == 1 and ev._plans == {}
    for a, b in zip(expect, got):
        assert a.status is b.status is TrialStatus.OK
        assert (a.max_error, a.tolerance, a.rounding_sensitivity) == (b.max_error, b.tolerance, b.rounding_sensitivity)
        assert b.baseline is not None and {"compile", "reference", "check", "time"} <= set(b.seconds)
    assert got[1].seconds["reference"] < got[0].seconds["reference"] or ahead  # the second plan reuses the reference
