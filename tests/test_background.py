"""on_miss="tune": a missed shape runs jax.jit at once and is tuned by a separate low-priority process into the store;
a later call of this process picks the plan up."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile

import jax
import numpy as np
import pytest

import autofuse
from autofuse.background import BackgroundTune
from autofuse.device import device_info, software
from autofuse.store import PlanStore
from tests.shape_programs import norm, norm_specs


def _args(rows: int) -> list[jax.Array]:
    rng = np.random.default_rng(rows)
    return [jax.numpy.asarray(rng.standard_normal(s.shape), s.dtype) for s in norm_specs(rows)]


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tail(path: str) -> str:
    return open(path).read()[-3000:] if os.path.exists(path) else "(no log)"


@pytest.mark.slow
def test_on_miss_tune_runs_jax_jit_at_once_and_the_plan_appears(tmp_path, caplog, monkeypatch) -> None:
    """... and leaves nothing behind: its job file, lock and (having succeeded) log are removed (issue 33: the log of
    every job stayed in the temporary directory)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the jobs' files: here, not in the shared /tmp
    url = f"sqlite:///{tmp_path}/plans.db"
    budget = BackgroundTune(trials=2, measure="model", isolate=False)
    f = autofuse.jit(norm, store=url, on_miss="tune", tune_budget=budget)
    a = _args(16)
    with caplog.at_level(logging.WARNING, logger="autofuse"):
        np.testing.assert_allclose(np.asarray(f(*a)), np.asarray(jax.jit(norm)(*a)), rtol=1e-6, atol=1e-6)
    assert f.last_status.startswith("xla: the plan store") and "; tuning these shapes in the background (pid" in f.last_status, f.last_status
    (job,) = f.tuning_jobs
    assert not job.done(), "the call returned only after the tuning job"  # the job needs seconds to start JAX alone
    assert os.nice(0) < os.getpriority(os.PRIO_PROCESS, job.process.pid) or job.done()
    # One job per program at a time: another function missing the same program does not start a second one.
    g = autofuse.jit(norm, store=url, on_miss="tune", tune_budget=budget)
    g(*a)
    assert "not tuned in the background: a background job is already tuning this program" in g.last_status, g.last_status
    assert g.tuning_jobs == []
    assert job.wait(timeout=900) == 0, _tail(job.log)
    assert os.path.dirname(job.log) == str(tmp_path)
    assert [p for p in os.listdir(tmp_path) if p.startswith("autofuse-tune-")] == []  # job file, lock and log
    graph = autofuse.capture(norm, *norm_specs(16))
    hit = PlanStore(url, readonly=True).lookup(graph.fingerprint, device_info()["name"], software())
    assert hit is not None, _tail(job.log)
    # The next call of this process sees the job ended, traces again and runs the plan.
    f(*a)
    assert f.last_status.startswith(("plan: ", "xla-plan: ")) and f"plan {hit.plan_id}" in f.last_status, f.last_status
    assert f.tuning_jobs == []


def test_on_miss_tune_refuses_what_another_process_cannot_import(tmp_path) -> None:
    def local(x):
        return x * 2

    f = autofuse.jit(local, store=f"sqlite:///{tmp_path}/p.db", on_miss="tune")
    f(jax.numpy.ones(4))
    assert "not tuned in the background: tests.test_background:test_on_miss_tune_refuses_what_another_process_cannot_import." \
           "<locals>.local cannot be imported by name in another process" in f.last_status, f.last_status
    assert f.tuning_jobs == []


def test_background_job_tunes_only_the_function_its_command_line_names(tmp_path) -> None:
    """The job's process is started with the function on its command line; a job file (in the shared temporary
    directory) that names another function is refused, and nothing it names is imported."""
    (tmp_path / "planted.py").write_text("open('PLANTED', 'w').close()\ndef payload(x):\n    return x\n")
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"function": "planted:payload", "lock": str(tmp_path / "job.lock"), "log": str(tmp_path / "job.log")}))
    out = subprocess.run([sys.executable, "-P", "-m", "autofuse.tuning.background_entry", "tests.shape_programs:norm", str(job)], cwd=tmp_path,
                         env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "tunes planted:payload, not tests.shape_programs:norm: refused" in out.stderr, out.stderr
    assert not (tmp_path / "PLANTED").exists() and not job.exists()


def test_background_job_loads_jax_only_at_its_lowered_priority() -> None:
    """The job's process lowers its priority before JAX and the tuner load: importing its entry (and through it the
    deploy side's job file format) loads neither."""
    script = ("import sys, autofuse.tuning.background_entry; "
              "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'numpy') or m.startswith('autofuse.tuning.local')))")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr[-2000:]
