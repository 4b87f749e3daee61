"""A tuning job killed (SIGKILL) after its trials, in the selection and validation phase, loses nothing on --resume:
the trials are read back, none is run again, only the selection runs, and the output says what it reused."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading

import pytest

import autofuse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _trial_rows(store: autofuse.PlanStore, run_id: int) -> list[tuple]:
    return [(t["signature"], t["number"], t["status"], t["median_ms"]) for t in store.trials(run_id)]


@pytest.mark.slow
def test_kill_in_selection_phase_then_resume_runs_only_the_selection(tmp_path):
    db = f"sqlite:///{tmp_path}/selection.db"
    cmd = [sys.executable, "-m", "autofuse.cli", "tune", "benchmarks.workloads:layer_norm", "--inputs", "tests.deploy_programs:layer_norm_inputs",
           "--trials", "6", "--seed", "0", "--db", db]
    env = dict(os.environ, PYTHONPATH=ROOT, AUTOFUSE_TEST_PAUSE_IN_SELECTION="900")  # the job waits as its selection phase begins
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    watchdog = threading.Timer(900, lambda: os.killpg(proc.pid, signal.SIGKILL))
    watchdog.start()
    seen = []
    try:
        for line in proc.stdout:  # the phase is told by the job's own progress line
            seen.append(line)
            if "autofuse: selecting the plan from" in line:
                break
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        watchdog.cancel()
        proc.wait(30)
    assert any("autofuse: selecting the plan from" in line for line in seen), "".join(seen)[-3000:]

    store = autofuse.PlanStore(db)
    (run,) = store.runs()
    before = _trial_rows(store, run["id"])
    assert len([t for t in before if t[2] != "infeasible"]) >= 6 and store.plans() == []  # every trial done, no plan written yet

    out = subprocess.run(cmd + ["--resume", str(run["id"])], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True,
                         text=True, timeout=900, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    counted = len([t for t in before if t[2] not in ("infeasible", "pruned", "lost")])
    m = re.search(r"resuming run (\d+): reusing (\d+) earlier trial\(s\) of (\d+); its trials were done when it stopped", (out.stdout + out.stderr))
    assert m and int(m.group(1)) == run["id"] and int(m.group(2)) == counted, (out.stdout + out.stderr)[-3000:]
    assert re.search(r"validating plan 1 of \d+ \(\d+ fused groups? \(row_reduce", (out.stdout + out.stderr)), (out.stdout + out.stderr)[-3000:]  # progress, k of n
    assert _trial_rows(store, run["id"]) == before  # no trial ran again, none was lost
    assert store.get_run(run["id"])["status"] == "finished"
    (plan,) = store.plans()
    assert plan["run_id"] == run["id"] and plan["is_current"]
