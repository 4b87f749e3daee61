"""Where a tuning job's wall time goes besides its trials: one `autofuse tune` command, timed from outside and read
back from its SQLite store (issue 18: the fixed costs of a whole-model job).

    python -m benchmarks.job_overhead [--label before] [--cwd DIR] [--stop-after trials] [--out FILE.md] -- \\
        autofuse tune examples.gpt2:forward --inputs benchmarks.multi_gpu:gpt2_shapes --measure model --trials 4 --workers 1

The command runs in its own process group with a fresh SQLite store (`--db` is added: a file in a temporary
directory); `--cwd` runs it in another checkout (an older commit, to compare). The store is read with plain
sqlite3, so a store of any schema revision is read as it is, never upgraded. From outside, for any version:

- launch: the command's start to the run's row (imports, capture; enumeration before the run row where a version does it);
- to first trial: the run's row to its first trial (candidates, studies, workers starting, their capture and
  enumeration, the XLA timings);
- trials: the first trial to the last one's end;
- selection: the last trial's end to the plan stored (each candidate's best checked, the cover, the plans validated);
- exit: the plan stored to the command's exit.

A run that records its phases (migration 0006) adds them as `autofuse show run` prints them. `--stop-after trials`
ends the command (its process group) once the run's trials are done (its selection begun), for programs whose
selection is too slow to wait for on a CPU (interpret mode at full size); its selection is then not measured.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from typing import Any

from autofuse.tables import format_phases


def _ts(text: str | None) -> float | None:
    if not text:
        return None
    return dt.datetime.fromisoformat(text).replace(tzinfo=dt.UTC).timestamp()


def read(db: str) -> dict[str, Any] | None:
    """The (one) run of the store: its timestamps, trials and phases; None before the run row exists."""
    if not os.path.exists(db):
        return None
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        cols = {r[1] for r in con.execute("PRAGMA table_info(autofuse_runs)")}
        if not cols:
            return None
        row = con.execute("SELECT id, started_at, ended_at, status, selected_by" + (", phases" if "phases" in cols else "")
                          + " FROM autofuse_runs ORDER BY id LIMIT 1").fetchone()
        if row is None:
            return None
        run_id = row[0]
        trials = con.execute("SELECT t.created_at, t.finished_at, t.status FROM autofuse_trials t JOIN autofuse_candidates c "
                             "ON c.id = t.candidate_id WHERE c.run_id = ?", (run_id,)).fetchall()
        plan = con.execute("SELECT MIN(created_at) FROM autofuse_plans WHERE run_id = ?", (run_id,)).fetchone()[0]
        n_cands = con.execute("SELECT COUNT(*) FROM autofuse_candidates WHERE run_id = ?", (run_id,)).fetchone()[0]
    except sqlite3.OperationalError:  # the schema is being created
        return None
    finally:
        con.close()
    return {"started": _ts(row[1]), "ended": _ts(row[2]), "status": row[3], "selected_by": row[4],
            "phases": json.loads(row[5]) if len(row) > 5 and row[5] else None, "plan": _ts(plan), "candidates": n_cands,
            "first_trial": min((_ts(t[0]) for t in trials), default=None),
            "last_trial": max((_ts(t[1]) for t in trials if t[1]), default=None),
            "trials": sum(t[2] not in ("infeasible", "pruned", "lost", "running") for t in trials)}


def run(cmd: list[str], cwd: str | None, stop_after: str | None, timeout_s: float) -> dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix="autofuse-overhead-")
    db = os.path.join(tmp, "run.db")
    full = [*cmd, "--db", f"sqlite:///{db}"]
    log = os.path.join(tmp, "log.txt")
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen(full, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [cwd or os.getcwd(), os.environ.get("PYTHONPATH")]))))
        stopped = None
        while proc.poll() is None:
            time.sleep(0.5)
            if time.time() - t0 > timeout_s:
                stopped = "timeout"
            elif stop_after == "trials":
                r = read(db)
                if r and (r["selected_by"] or "trials" in (r["phases"] or {})):
                    stopped = "after trials"
            if stopped:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                break
    wall = time.time() - t0
    r = read(db) or {}
    return {"command": " ".join(full), "cwd": cwd or os.getcwd(), "exit": proc.returncode, "stopped": stopped, "wall": wall, "t0": t0,
            "log": log, **r}


def breakdown(r: dict[str, Any]) -> dict[str, float | None]:
    """Seconds of each part, from outside (see the module docstring)."""
    def d(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else b - a

    end = r["t0"] + r["wall"]
    return {"launch": d(r["t0"], r.get("started")), "to first trial": d(r.get("started"), r.get("first_trial")),
            "trials": d(r.get("first_trial"), r.get("last_trial")), "selection": d(r.get("last_trial"), r.get("plan")),
            "exit": d(r.get("plan"), end) if r.get("plan") else None, "wall": r["wall"]}


def markdown(rows: list[tuple[str, dict[str, Any]]]) -> str:
    keys = ["launch", "to first trial", "trials", "selection", "exit", "wall"]
    out = ["| run | " + " | ".join(f"{k} s" for k in keys) + " | trials | candidates | stopped | command |",
           "|---|" + "---:|" * len(keys) + "---:|---:|---|---|"]
    for label, r in rows:
        b = breakdown(r)
        out.append(f"| {label} | " + " | ".join("—" if b[k] is None else f"{b[k]:.1f}" for k in keys)
                   + f" | {r.get('trials', '—')} | {r.get('candidates', '—')} | {r.get('stopped') or 'no'} | `{r['command']}` (in `{r['cwd']}`) |")
    for label, r in rows:
        if r.get("phases"):
            out += ["", f"{label}: recorded phases (seconds from the run's start, + since the mark before):", ""]
            out += [f"    {line}" for line in format_phases(r["phases"])]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.job_overhead", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--label", default="run")
    ap.add_argument("--cwd", default=None, help="run the command in this checkout")
    ap.add_argument("--stop-after", choices=["trials"], default=None)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--out", default=None, help="append the table to this Markdown file")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if cmd[:1] == ["autofuse"]:
        cmd = [sys.executable, "-m", "autofuse.cli", *cmd[1:]]
    r = run(cmd, a.cwd, a.stop_after, a.timeout)
    text = markdown([(a.label, r)])
    print(text)
    print(json.dumps({k: v for k, v in r.items() if k != "phases"}, default=str))
    if a.out:
        with open(a.out, "a") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
