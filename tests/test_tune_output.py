"""What `autofuse tune`, `autofuse worker`, the listings and `autofuse report` print for a person (issue 16, "Output
a person wants to read"): the compact table and its summary line, -v and --quiet, the dry run, run listings
(measured trials, interrupted runs, modelled devices, program names) and the report's plots. Real SQLite files and
real `python -m autofuse.cli` subprocesses in model mode, on the small programs of tests/dist_programs.py."""
from __future__ import annotations

import datetime as dt
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa

from autofuse.plan import FusedGroup, Plan
from autofuse.runner.protocol import ValidationResult
from autofuse.status import TrialStatus
from autofuse.store import PlanStore
from autofuse.tuning.dryrun import budget_warnings
from autofuse.tuning.ledger import CandidateState, TrialRecord
from autofuse.tuning.output import group_label
from autofuse.tuning.report import TuneReport

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RMS = ["benchmarks.workloads:rms_norm", "--inputs", "tests.dist_programs:rms_norm_inputs"]
LRB = ["benchmarks.workloads:log_relu_bias", "--inputs", "tests.dist_programs:log_relu_bias_inputs"]


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("AUTOFUSE_DB", None)
    return subprocess.run([sys.executable, "-m", "autofuse.cli", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def ok(res: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert res.returncode == 0, res.stderr[-3000:]
    return res


# --------------------------------------------------------------------------- names and the table, in process


def test_group_label_names_template_and_ops_and_shortens_big_groups() -> None:
    attention = ["dot_general", "div", "exp", "reduce_sum", "dot_general"]
    assert group_label("attention", attention) == "attention: dot_general·div·exp·reduce_sum·dot_general"
    assert group_label("elementwise", ["mul", "mul", "mul", "add"]) == "elementwise: mul×3·add"
    big = ["broadcast_in_dim", "dot_general", "convert_element_type", "mul", "reduce_max", "sub", "exp", "reduce_sum", "div",
           "convert_element_type", "dot_general", "reshape"] * 3
    label = group_label("attention", big, width=60)
    assert len(label) <= 60 and label.startswith("attention: dot_general·") and "(36 ops)" in label and "…" in label
    assert "convert" not in label and "broadcast" not in label  # data movement goes first when space is short
    flash = ["dot_general", "mul", "iota", "ge", "select_n", "reduce_max", "stop_gradient", "sub", "exp", "reduce_sum", "div",
             "convert_element_type", "dot_general"] + ["broadcast_in_dim", "add", "mul", "integer_pow"] * 3
    assert group_label("attention", flash) == "attention: dot_general·reduce_max·exp·reduce_sum·dot_general (25 ops)"  # what defines it


def _report(plan_groups: tuple[FusedGroup, ...], measure: str = "device") -> TuneReport:
    def cand(sig: str, template: str, ops: tuple[str, ...], xla: float, times: list[float | None], n: int = 1) -> CandidateState:
        trials = [TrialRecord(k, {"backend": "triton", "block_rows": k + 1}, TrialStatus.OK if t else TrialStatus.INFEASIBLE, t)
                  for k, t in enumerate(times)]
        c = CandidateState(sig, template, list(range(len(ops))), n, xla_ms=xla, trials=trials, ops=ops)
        c.update_best()
        return c

    cands = [
        cand("s-slow", "elementwise", ("add",), 1.0, [1.25]),
        cand("s-never", "elementwise", ("sub", "mul"), 1.0, [None, None]),  # only infeasible configs: never measured
        cand("s-norm", "row_reduce", ("mul", "reduce_sum", "div"), 2.0, [1.5, 1.0], n=2),
        cand("s-fast", "elementwise", ("exp",), 1.0, [0.5]),
    ]
    plan = Plan("fp" * 16, plan_groups, {"measure": measure})
    return TuneReport("m:f", "fp" * 16, measure, plan, 4.0, 2.0, 2.0, 0.004, cands, ValidationResult(TrialStatus.OK, 1e-6), 12.5, 5,
                      run_id=3, plan_id=7, device="NVIDIA H100 80GB HBM3", model="NVIDIA H200" if measure == "model" else None,
                      stored_in="sqlite:////srv/plans.db")


def test_table_lists_the_plan_first_marked_hides_unmeasured_and_ends_with_the_summary() -> None:
    best = {"backend": "triton", "block_rows": 2}
    g = FusedGroup((0, 1, 2), "row_reduce", best, "s-norm")
    rep = _report((g, FusedGroup((5, 6, 7), "row_reduce", best, "s-norm")))
    lines = rep.table().splitlines()
    body = lines[3:3 + 3]
    assert body[0].startswith("*  row_reduce: mul·reduce_sum·div") and "2/2" in body[0] and "2.00x" in body[0]
    assert body[1].lstrip().startswith("elementwise: exp") and body[2].lstrip().startswith("elementwise: add")  # then by speedup
    assert "sub·mul" not in rep.table() and "1 candidate(s) never measured not shown" in rep.table()
    assert "[0, 1, 2]" not in rep.table()  # groups are named by what they compute, not by node indices
    assert "sub·mul" in rep.table(all_candidates=True)
    assert "plan:" not in rep.table()
    assert lines[-1] == rep.summary()
    assert rep.summary() == ("autofuse: m:f: 2.00x over jax.jit (4 -> 2 ms, noise ±0.4%, max rel error 1.0e-06; measured on NVIDIA H100 80GB "
                             "HBM3) with 2 fused groups (row_reduce×2); 5 trials in 12.5 s; run 3, plan 7 in sqlite:////srv/plans.db")


def test_table_shows_the_config_the_plan_runs_where_it_is_not_the_fastest_trials() -> None:
    """A plan validated again with leaner configs (under --max-memory) runs a group at a config other than its
    fastest trial's: its row says which config the plan runs, then the fastest, and a note says why."""
    rep = _report((FusedGroup((0, 1, 2), "row_reduce", {"backend": "triton", "block_rows": 1}, "s-norm"),))
    row = next(line for line in rep.table().splitlines() if line.startswith("*"))
    assert row.endswith("plan: triton block_rows=1 (fastest: triton block_rows=2)"), row
    assert "plan: the config the plan runs where it is not the fastest trial's" in rep.table()


def test_summary_puts_a_large_error_beside_jax_jits_own_move() -> None:
    """A plan held to jax.jit's own spread (rounding-noise outputs) says so beside its worst error; a small error
    is left alone."""
    import dataclasses

    rep = _report((FusedGroup((0, 1, 2), "row_reduce", {"block_rows": 2}, "s-norm"),))
    noisy = dataclasses.replace(rep, validation=ValidationResult(TrialStatus.OK, 1.7, rounding_sensitivity=[0.01, 1.53]))
    assert "max rel error 1.7e+00 (jax.jit's own move up to 1.5);" in noisy.summary()
    assert "own move" not in rep.summary()


def test_summary_says_what_the_plan_saved_alone_and_in_the_program_and_its_peak_memory() -> None:
    """A measured plan's summary line says what its groups saved alone and in the program and its peak device memory
    beside jax.jit's (both recorded in its provenance by the validation)."""
    import dataclasses

    rep = _report((FusedGroup((0, 1, 2), "row_reduce", {"block_rows": 2}, "s-norm"),))
    prov = {**rep.plan.provenance, "alone_ms": 2.5, "realised_ms": 2.0, "peak_bytes": int(17.4 * 2**30), "baseline_peak_bytes": int(64.7 * 2**30)}
    line = dataclasses.replace(rep, plan=dataclasses.replace(rep.plan, provenance=prov)).summary()
    assert "saved 2.500 ms alone, 2.000 ms in the program (80%), peak memory 17.4 GiB (jax.jit 64.7 GiB);" in line, line
    res = cli("tune", *RMS, "--max-memory", "plenty", "--dry-run")
    assert res.returncode == 2 and res.stderr.strip() == ("autofuse: error: --max-memory must be a size such as 40GiB, 512MiB or 8e9 "
                                                          "(bytes), got 'plenty'")


def test_summary_of_a_modelled_or_xla_plan_says_so() -> None:
    rep = _report((), measure="model")
    assert "MODELLED on a model of NVIDIA H200, not measured" in rep.summary() and "XLA's own plan" in rep.summary()
    assert "H100" not in rep.table().splitlines()[0] and "model of NVIDIA H200" in rep.table().splitlines()[0]


def test_counts_agree_with_their_nouns() -> None:
    """Issue 33: the summary said '1 trials'."""
    import dataclasses

    from autofuse.tuning.output import candidate_line

    rep = dataclasses.replace(_report((FusedGroup((0, 1, 2), "row_reduce", {"block_rows": 2}, "s-norm"),)), trials_run=1)
    assert "with 1 fused group (row_reduce); 1 trial in 12.5 s; run 3" in rep.summary()
    assert "after 1 trial [" in candidate_line(rep.candidates[0]) and "after 2 trials [" in candidate_line(rep.candidates[1])
    assert budget_warnings(8, 5, 1, None)[0].startswith("1 trial for 8 distinct candidates: 7 of them")


def test_budget_warnings() -> None:
    assert "never get even their default config" in budget_warnings(8, 5, 3, None)[0]
    assert "cannot give each of the 5 contenders more than its default" in budget_warnings(8, 5, 10, None)[0]
    assert budget_warnings(8, 5, 13, None) == []
    assert "time budget" in budget_warnings(8, 5, None, 60.0)[0]


# --------------------------------------------------------------------------- the CLI, in real processes


@pytest.mark.slow
def test_cli_tune_default_quiet_and_verbose_output(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path}/t.db"
    out = ok(cli("tune", *RMS, "--trials", "8", "--db", db))
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("autofuse tune benchmarks.workloads:rms_norm") and "MODELLED" in lines[0]
    assert any(ln.startswith("*  row_reduce: ") for ln in lines) or "XLA's own plan" in lines[-1]
    assert lines[-1].startswith("autofuse: benchmarks.workloads:rms_norm: ") and lines[-1].endswith(f"run 1, plan 1 in {db}")  # where it is
    assert "  candidate " not in out.stderr and "  trial " not in out.stderr  # per-candidate and per-trial lines only with -v
    assert "best plan " in out.stderr and "best candidate" not in out.stderr  # the bar: the job's best plan so far

    quiet = ok(cli("tune", *RMS, "--trials", "4", "--db", db, "--quiet"))
    assert len(quiet.stdout.strip().splitlines()) == 1 and quiet.stdout.startswith("autofuse: benchmarks.workloads:rms_norm: ")
    assert "tune benchmarks" not in quiet.stderr  # no bar

    verbose = ok(cli("tune", *RMS, "--trials", "4", "--db", db, "-v", "--all"))
    assert verbose.stderr.count("  trial ") >= 4 and "  candidate " in verbose.stderr
    n_cands = len(PlanStore(db).candidates(3))
    assert sum(1 for ln in verbose.stdout.splitlines() if ln.lstrip("* ").split(":")[0] in ("elementwise", "row_reduce")) == n_cands

    assert cli("tune", *RMS, "--db", db, "-v", "--quiet").returncode == 2  # one or the other


@pytest.mark.slow
def test_cli_tune_refuses_a_store_whose_directory_is_missing(tmp_path: Path) -> None:
    """A mistyped --db is one line naming the missing directory, not a new store somewhere."""
    db = f"sqlite:///{tmp_path}/nodir/sub/a.db"
    res = cli("tune", *RMS, "--trials", "1", "--db", db)
    assert res.returncode == 2 and res.stdout == "", res.stderr[-3000:]
    assert res.stderr == f"autofuse: error: cannot create the plan store {db}: directory {tmp_path}/nodir/sub does not exist\n"
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_cli_refuses_bad_arguments_before_importing_jax_and_names_its_flags() -> None:
    """Issue 33: `--trials 0` took 3.5 s to refuse (JAX imported first); --measure device without a GPU named the
    Python keyword (measure='device'), not the flag."""
    code = "import sys; from autofuse.cli import main; code = main(sys.argv[1:]); print(code, 'jax' in sys.modules)"
    for argv, message in ((["--trials", "0"], "--trials must be a positive whole number of trials, got 0"),
                          (["--time-budget", "-1"], "--time-budget must be a positive number of seconds, got -1.0"),
                          (["--workers", "0"], "--workers must be at least 1, got 0"),
                          (["--static-argnums", "a"], "--static-argnums must be comma-separated integers, got 'a'"),
                          (["--no-store", "--resume", "3"], "--resume needs the store (drop --no-store)")):
        out = subprocess.run([sys.executable, "-c", code, "tune", "no_such_module:f", "--inputs", "no_such_module:g", *argv], cwd=ROOT,
                             env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=120)
        assert out.stdout.split() == ["2", "False"], (argv, out.stdout, out.stderr)  # refused, and JAX never imported
        assert out.stderr.strip() == f"autofuse: error: {message}"
    device = cli("tune", *RMS, "--measure", "device", "--trials", "2")
    assert device.returncode == 2
    assert device.stderr.strip().splitlines()[-1] == ("autofuse: error: --measure device needs a GPU; none is present (cpu backend): "
                                                      "use --measure model")


def test_cli_version_names_autofuse_and_jax() -> None:
    from importlib import metadata

    out = ok(cli("--version"))
    assert out.stdout == (f"autofuse {metadata.version('autofuse')} (jax {metadata.version('jax')}, "
                          f"jaxlib {metadata.version('jaxlib')})\n")


@pytest.mark.slow
def test_cli_dry_run_tunes_and_stores_nothing(tmp_path: Path) -> None:
    db = tmp_path / "never.db"
    out = ok(cli("tune", *RMS, "--trials", "3", "--db", f"sqlite:///{db}", "--dry-run"))
    lines = out.stdout.strip().splitlines()
    assert "--dry-run" in lines[0] and "nothing compiled, timed or stored" in lines[0]
    rows = [ln for ln in lines if ln[:1].isdigit() and " triton " in ln]
    assert len(rows) == 8 and [int(r.split()[0]) for r in rows] == list(range(1, 9))  # the 8 distinct candidates, in phase-1 order
    assert any(": " in r and "row_reduce" in r for r in rows)
    assert lines[-1].startswith("warning: 3 trials for 8 distinct candidates")
    assert not db.exists() and "no GPU measurement" not in out.stderr
    enough = ok(cli("tune", *RMS, "--trials", "200", "--dry-run", "--json"))
    data = json.loads(enough.stdout)
    assert data["warnings"] == [] and len(data["candidates"]) == 8 and data["model"] == "NVIDIA H200"
    assert {"order", "template", "ops", "instances", "configs", "xla_ms", "default_ms", "saving_ms", "contender"} <= set(data["candidates"][0])


@pytest.mark.slow
def test_listings_name_the_program_as_shown_count_measured_trials_and_show_the_model(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path}/l.db"
    ok(cli("tune", *RMS, "--trials", "6", "--db", db, "--quiet"))
    (run,) = json.loads(ok(cli("runs", "--db", db, "--json")).stdout)
    assert run["program"] == "benchmarks.workloads:rms_norm"
    trials = PlanStore(db).trials(run["id"])
    measured = [t for t in trials if t["status"] not in ("infeasible", "pruned", "lost", "running")]
    assert run["n_trials"] == len(measured) and run["n_infeasible"] == len(trials) - len(measured)
    table = ok(cli("runs", "--db", db)).stdout
    assert "benchmarks.workloads:rms_norm " in table and "model of NVIDIA H200" in table and " cpu " not in table
    for name in ("benchmarks.workloads:rms_norm", "rms_norm", run["fingerprint"][:8]):  # the name shown, its function, the fingerprint
        assert [p["run_id"] for p in json.loads(ok(cli("plans", "--db", db, "--json", "--program", name)).stdout)] == [run["id"]], name
    assert cli("plans", "--db", db, "--program", "norm").stdout == ""  # no substring matching
    assert "model of NVIDIA H200" in ok(cli("plans", "--db", db)).stdout
    shown = ok(cli("show", "plan", "1", "--db", db)).stdout
    assert any(ln.split() == ["device", "model", "of", "NVIDIA", "H200"] for ln in shown.splitlines())


@pytest.mark.slow
def test_a_dead_run_reads_interrupted_to_any_command_and_a_resumed_run_clears_its_error(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/i.db"
    store = PlanStore(url)
    p, d, s = store.program("fp1", "m:f", {}, 1), store.device("cpu"), store.software("j", "jl", "a", "pallas")
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    kw = {"budget": {"trials": 4}, "seed": 0, "sampler": "tpe", "measure": "model"}
    dead = store.start_run(p, d, s, host=socket.gethostname(), pid=child.pid, **kw)
    alive = store.start_run(p, d, s, **kw)  # this process
    elsewhere = store.start_run(p, d, s, host="another-host", pid=child.pid, **kw)
    rows = {r["id"]: r for r in json.loads(ok(cli("runs", "--db", url, "--json")).stdout)}
    assert (rows[dead]["status"], rows[alive]["status"], rows[elsewhere]["status"]) == ("interrupted", "running", "running")
    assert "is gone" in rows[dead]["error"]
    assert [r["id"] for r in json.loads(ok(cli("runs", "--db", url, "--json", "--status", "interrupted")).stdout)] == [dead]
    assert store.get_run(dead)["status"] == "interrupted"
    with store.engine.connect() as conn:  # shown, not written: a reader never writes (read-only stores work the same)
        assert conn.execute(sa.text("SELECT status FROM autofuse_runs WHERE id = :i"), {"i": dead}).scalar() == "running"
    assert store.mark_interrupted() == [dead]
    assert store.get_run(dead)["error"]
    assert store.resume_run(dead)["error"] is None


# --------------------------------------------------------------------------- backends


@pytest.mark.slow
def test_backends_asked_for_are_never_replaced_by_another_silently(tmp_path: Path) -> None:
    """Issue 33: --backends mosaic_gpu tuned Triton kernels for every group without a Mosaic GPU lowering. In model
    mode (no GPU) Mosaic GPU's kernels are built and checked in interpret mode, so it is tuned where a template has it;
    the other candidates are left to XLA and the job says so; a program with none is refused in one line."""
    db = f"sqlite:///{tmp_path}/b.db"
    out = ok(cli("tune", "benchmarks.workloads:matmul_bias_gelu", "--inputs", "tests.dist_programs:matmul_bias_gelu_inputs",
                 "--backends", "mosaic_gpu", "--trials", "3", "--db", db, "--quiet", "--no-isolate"))
    (note,) = [ln for ln in out.stderr.splitlines() if "left to XLA" in ln]
    assert "have no mosaic_gpu lowering" in note and "elementwise" in note, out.stderr
    (run,) = PlanStore(db).runs()
    assert {c["template"] for c in PlanStore(db).candidates(run["id"])} == {"matmul"}
    assert {t["config"]["backend"] for t in PlanStore(db).trials(run["id"])} == {"mosaic_gpu"}
    refused = cli("tune", *RMS, "--backends", "mosaic_gpu", "--trials", "3", "--db", db)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert refused.stderr.strip().splitlines()[-1].startswith("autofuse: error: no candidate of this program has a mosaic_gpu lowering")
    assert len(PlanStore(db).runs()) == 1  # refused before a run was opened


def test_backends_this_gpu_cannot_measure_are_left_out_or_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Measuring Mosaic GPU's kernels needs a Hopper GPU: asked for alone elsewhere, refused; beside Triton, left out
    and said. (A GPU that is not a Hopper, as jax would describe it: there is none on the test machine.)"""
    from autofuse import device
    from autofuse.tuning.job import check_backends

    class A100:
        platform, device_kind, compute_capability = "gpu", "NVIDIA A100-SXM4-80GB", "8.0"

    monkeypatch.setattr(device.jax, "devices", lambda *a: [A100()])
    with pytest.raises(ValueError, match=r"^none of the backends asked for \(mosaic_gpu\) can be tuned here: mosaic_gpu needs a "
                                         r"Hopper GPU \(compute capability 9.x\) to be measured; this is NVIDIA A100-SXM4-80GB \(8.0\)$"):
        check_backends(["mosaic_gpu"], "device")
    assert check_backends(["mosaic_gpu", "triton"], "device") == (("triton",), "autofuse: backend mosaic_gpu left out (mosaic_gpu needs "
                                                                  "a Hopper GPU (compute capability 9.x) to be measured; this is NVIDIA "
                                                                  "A100-SXM4-80GB (8.0)): tuning triton")
    assert check_backends(["mosaic_gpu"], "model") == (("mosaic_gpu",), "")  # interpret mode and the model of an H200
    assert check_backends(None, "device") == (("triton", "xla_ops"), "")  # and XLA's own operations (aligned_dot)


# --------------------------------------------------------------------------- workers


@pytest.mark.slow
def test_workers_print_the_summary_only_when_quiet(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path}/w.db"
    out = ok(cli("tune", *LRB, "--trials", "4", "--db", db, "--workers", "2", "--heartbeat", "1", "--quiet"))
    assert len(out.stdout.strip().splitlines()) == 1 and out.stdout.startswith("autofuse: benchmarks.workloads:log_relu_bias: ")
    assert "autofuse worker" not in out.stderr and "  trial " not in out.stderr
    assert [ln for ln in out.stderr.strip().splitlines() if "no GPU measurement" not in ln and "not current" not in ln] == []


# --------------------------------------------------------------------------- autofuse report


def test_report_plots_converge_per_job_trial_and_mark_the_plan(tmp_path: Path) -> None:
    from autofuse.report import (
        convergence_series,
        run_title,
        speedup_axis,
        speedup_figure,
    )

    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    cands = [{"id": i, "xla_ms": 1.0, "signature": f"s{i}", "template": "elementwise", "speedup": v}
             for i, v in ((1, 1.06), (2, 1.13), (3, 0.9))]
    trials = [{"id": k, "candidate_id": c, "status": "ok", "median_ms": ms, "created_at": t0 + dt.timedelta(seconds=k)}
              for k, (c, ms) in enumerate([(1, 1 / 1.06), (2, 1 / 1.13), (3, 1 / 0.9)])]  # one trial per candidate
    series = convergence_series(trials, cands)
    assert series[1] == ([1, 3], [pytest.approx(1.06), pytest.approx(1.06)])  # a level held to the job's last trial
    assert series[3] == ([3], [pytest.approx(0.9)])

    scale, lo, hi = speedup_axis([1.06, 1.13])
    assert scale == "linear" and lo < 1.0 and hi > 1.13 and (1.13 - 1.06) / (hi - lo) > 0.3  # 1.06x vs 1.13x: far apart
    assert speedup_axis([0.5, 9.0])[0] == "log"
    ax = speedup_figure(cands, {"s2"}, "t").axes[0]
    widths = sorted(round(p.get_width(), 3) for p in ax.patches if p.get_width())
    assert widths == [-0.1, 0.06, 0.13] and all(p.get_x() == 1.0 for p in ax.patches if p.get_width())  # grown from 1.0
    bold = [t.get_text() for t in ax.get_yticklabels() if t.get_fontweight() == "bold"]
    assert bold == ["#2 elementwise s2 (plan)"]

    assert run_title({"id": 4, "program": "m:f", "measure": "model", "device": "cpu", "budget": {"model": "NVIDIA H200"}}) == \
        "run 4: m:f on a model of NVIDIA H200"
    assert run_title({"id": 4, "program": "m:f", "measure": "device", "device": "NVIDIA H100", "budget": {}}) == "run 4: m:f on NVIDIA H100"


@pytest.mark.slow
def test_cli_report_of_a_real_run_names_the_model(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path}/r.db"
    ok(cli("tune", *RMS, "--trials", "9", "--db", db, "--quiet"))
    report = Path(ok(cli("report", "1", "--out", str(tmp_path / "rep"), "--db", db)).stdout.strip())
    text = report.read_text()
    assert "**model of NVIDIA H200** (modelled" in text and (tmp_path / "rep" / "convergence.png").stat().st_size > 5000


@pytest.mark.slow
def test_report_counts_the_trials_the_summary_line_counts(tmp_path: Path) -> None:
    """Issue 33: report.md counted the configs found infeasible (never compiled) as trials, the job's summary line did
    not. One definition, the trials that spent budget (`TrialStatus.spends_budget`), the others said apart."""
    db = f"sqlite:///{tmp_path}/c.db"
    out = ok(cli("tune", *LRB, "--trials", "20", "--db", db, "--quiet", "--no-isolate"))
    assert "; 20 trials in " in out.stdout
    statuses = [TrialStatus(t["status"]) for t in PlanStore(db).trials(1)]
    uncounted = sum(not s.spends_budget for s in statuses)
    # log_relu_bias's space has configs that break its constraints: its sampler proposes some once the neighbours
    # of its best (all feasible) are spent
    assert uncounted and len(statuses) == 20 + uncounted
    text = Path(ok(cli("report", "1", "--out", str(tmp_path / "rep"), "--db", db)).stdout.strip()).read_text()
    assert f"| candidates / trials | 1 / 20 (and {uncounted} not counted: configs found infeasible or pruned without compiling" in text


def test_worker_summary_is_one_line_on_the_run() -> None:
    from autofuse.cli_tune import worker_summary

    run = {"status": "finished", "speedup": 1.2, "measure": "model", "device": "cpu", "budget": {"model": "NVIDIA H200"}}
    assert worker_summary(5, run, [0, 0]) == "autofuse worker: run 5 finished: 1.20x jax.jit (MODELLED, model of NVIDIA H200); 2 worker(s) here, exit 0, 0"
    busy = {"status": "running", "selected_by": "h:12", "measure": "device", "device": "NVIDIA H100"}
    assert worker_summary(5, busy, [0]) == "autofuse worker: run 5 is running (plan being selected by h:12); 1 worker(s) here, exit 0"


@pytest.mark.slow
def test_show_run_and_the_report_say_what_each_validated_plan_saved_alone_and_in_the_program(tmp_path: Path) -> None:
    """A job on the GPU records, for every plan it validated on the whole program, what its groups saved timed alone
    and what the plan saved against jax.jit (`composition.Measured.record`), and what a profile of jax.jit's program expected
    of them there; `autofuse show run` and the report say each, and the report lists the profile's longest kernels."""
    from autofuse.report import write_report

    db = f"sqlite:///{tmp_path}/c.db"
    ok(cli("tune", *RMS, "--trials", "2", "--db", db, "--quiet"))
    store = PlanStore(db)
    (run,) = store.runs()
    records = [{"what": "one group in context", "groups": 24, "signatures": ["a"], "alone_ms": 1.469, "expected_ms": 0.95,
                "realised_ms": 0.916, "noise": 0.006, "status": "ok"},
               {"groups": 47, "signatures": ["b", "c"], "alone_ms": 1.854, "realised_ms": None, "noise": 1.0, "status": "wrong_result",
                "error": "output 3: relative error 0.31 > tolerance 0.02"}]
    sel = dict((store.get_run(run["id"]).get("phases") or {}).get("selection") or {})
    profile = {"kernels": 290, "total_ms": 25.988, "attributed_ms": 25.988, "profile": 5.57,
               "longest": [{"instruction": "cublas-lt-matmul.12", "ms": 0.1336, "ops": "dot_general"}]}
    sig = store.candidates(run["id"])[0]["signature"]
    sel.update(profile=profile, in_program_xla_ms={sig: 0.4321}, composition=records, plans=[{"groups": 24, "status": "ok", "seconds": 6.1},
                                           {"groups": 47, "status": "wrong_result", "seconds": 3.0, "error": "output 3: relative error 0.31 > tolerance 0.02"}])
    store.mark_phase(run["id"], "selection", value=sel, keep_first=False)
    shown = ok(cli("show", "run", str(run["id"]), "--db", db)).stdout
    assert ("plan 1 (one group in context: 24 groups, ok): 6.10; saved 1.469 ms alone (0.950 expected in the program), "
            "0.916 ms in the program (62%; 96% of expected)") in shown
    assert ("plan 2 (47 groups, wrong_result): 3.00; saved 1.854 ms alone, not timed in the program; "
            "why: output 3: relative error 0.31 > tolerance 0.02") in shown
    table = shown.split("candidates (")[1].splitlines()
    assert "xla_in_program" in table[1] and any(sig[:11] in row and "0.4321" in row for row in table[2:])  # a profiled job's price
    text = write_report(store, run["id"], tmp_path / "report").read_text()
    kernels = text.split("## jax.jit's longest kernels")[1].split("##")[0]
    assert "290 kernels, 25.988 ms a call" in kernels and "| cublas-lt-matmul.12 | 0.1336 | dot_general |" in kernels
    section = text.split("## Savings alone and in the program")[1].split("##")[0]
    assert "| 1 | one group in context | 24 | 1 | ok | 1.469 | 0.95 | 0.916 | 62% |" in section  # an older run's record says no "what":
    assert "| 2 | – | 47 | 2 | wrong_result | 1.854 | – |" in section  # nor what a profile expected
    assert "output 3: relative error 0.31 > tolerance 0.02 |" in section


@pytest.mark.slow
def test_an_effort_names_a_trial_budget() -> None:
    """`--effort quick|default|thorough` (16, 48, 160 trials) instead of a number; a wrong name or both flags is one
    line; the Python API takes `effort=` the same way."""
    from autofuse.tuning.budget import trials_for

    for effort, n in (("quick", 16), ("default", 48), ("thorough", 160)):
        assert json.loads(ok(cli("tune", *RMS, "--effort", effort, "--dry-run", "--json")).stdout)["trials"] == n
    for argv, says in ((["--effort", "huge"], "--effort must be one of quick, default, thorough, got 'huge'"),
                       (["--effort", "quick", "--trials", "3"], "give --trials or --effort, not both")):
        res = cli("tune", *RMS, *argv, "--dry-run")
        assert res.returncode == 2 and res.stderr.strip() == f"autofuse: error: {says}", res.stderr
    assert trials_for(None, None, "thorough") == 160 and trials_for(7, None, "quick") == 7 and trials_for(None, 30.0) is None
