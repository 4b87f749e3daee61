"""Tuning wall time with 1, 2, 4 workers on the same trial budget (autofuse tune --workers N), and without workers.

    PYTHONPATH=. python benchmarks/tuning_scaling.py --trials 32 --workers 0,1,2,4 --repeats 2 [--db-dir DIR]
    PYTHONPATH=. python benchmarks/tuning_scaling.py --program lrb --plugins tests.plugins.slow_template --trials 16 ...

Each configuration tunes the same program into a fresh SQLite file (`--workers 0`: the single-process
`autofuse tune`). Prints one Markdown row per configuration: wall time of the whole command, the trial
phase (first trial started to last measured trial finished, from Optuna's trial timestamps), measured
trials, trials per minute over the trial phase and over the whole run, and the time before the first
trial and after the last (setup, worker start-up; selection and validation), and the 1-minute load average
of the machine when the run started (other processes compete for the same cores).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

PROGRAMS = {  # rms: 8 candidates, CPU-bound trials (interpret-mode builds); lrb: one candidate (with the slow_template
    # plugin its every build waits 2 s: a trial whose time is not spent on this host's cores, as on a GPU)
    "rms": ["benchmarks.workloads:rms_norm", "--inputs", "tests.dist_programs:rms_norm_inputs"],
    "lrb": ["benchmarks.workloads:log_relu_bias", "--inputs", "tests.dist_programs:log_relu_bias_inputs"],
}


def one(program: list[str], workers: int, trials: int, db_dir: str, rep: int) -> dict:
    import optuna

    from autofuse.store import PlanStore

    url = f"sqlite:///{db_dir}/scaling_w{workers}_r{rep}.db"
    load = os.getloadavg()[0]
    cmd = [sys.executable, "-m", "autofuse.cli", "tune", *program, "--trials", str(trials), "--db", url, "--quiet"]
    if workers:
        cmd += ["--workers", str(workers)]
    t0 = time.time()
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    wall = time.time() - t0
    store = PlanStore(url)
    (run,) = store.runs()
    storage = optuna.storages.RDBStorage(url)
    done = []
    for s in optuna.get_all_study_summaries(storage):
        for t in optuna.load_study(study_name=s.study_name, storage=storage).trials:
            res = t.user_attrs.get("result", {})
            if res.get("status") not in (None, "infeasible", "pruned") and t.datetime_complete is not None:
                done.append((t.datetime_start.timestamp(), t.datetime_complete.timestamp()))
    first, last = min(a for a, _ in done), max(b for _, b in done)
    return {"workers": workers, "wall": wall, "phase": last - first, "n": len(done), "before": first - t0, "after": t0 + wall - last,
            "status": run["status"], "load": load}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=32)
    ap.add_argument("--workers", default="0,1,2,4")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--program", choices=sorted(PROGRAMS), default="rms")
    ap.add_argument("--plugins", default="", help="$AUTOFUSE_TEMPLATE_PLUGINS for the runs")
    ap.add_argument("--db-dir", default=None)
    a = ap.parse_args()
    db_dir = a.db_dir or tempfile.mkdtemp(prefix="autofuse-scaling-")
    if a.plugins:
        os.environ["AUTOFUSE_TEMPLATE_PLUGINS"] = a.plugins
    print("| workers | wall s | trial phase s | measured trials | trials/min (phase) | trials/min (wall) | before first trial s "
          "| after last trial s | load avg at start |")
    print("|---|---|---|---|---|---|---|---|---|")
    for rep in range(a.repeats):
        for w in (int(x) for x in a.workers.split(",")):
            r = one(PROGRAMS[a.program], w, a.trials, db_dir, rep)
            assert r["status"] == "finished", r
            print(f"| {w or 'none (single process)'} | {r['wall']:.1f} | {r['phase']:.1f} | {r['n']} | {60 * r['n'] / r['phase']:.1f} | "
                  f"{60 * r['n'] / r['wall']:.1f} | {r['before']:.1f} | {r['after']:.1f} | {r['load']:.1f} |", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONPATH", os.getcwd())
    main()
