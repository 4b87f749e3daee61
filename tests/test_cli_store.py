"""The `autofuse` store commands, run as real subprocesses (`python -m autofuse.cli`)
on a store filled here, plus in-process `main()` calls for the cheap checks."""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa

from autofuse.cli import build_parser, main
from autofuse.store import PlanStore, db
from autofuse.store.models import Run

SW = {"jax": "0.10.2", "jaxlib": "0.10.2", "autofuse": "0.1.0", "backend": "triton"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("AUTOFUSE_DB", None)
    env.pop("AUTOFUSE_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-m", "autofuse.cli", *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=120
    )


@pytest.fixture(scope="module")
def filled(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Two programs, two devices, three runs (one dated 2025-01-01), plans, candidates, trials."""
    tmp = tmp_path_factory.mktemp("cli")
    url = f"sqlite:///{tmp / 'cli.db'}"
    store = PlanStore(url)
    mlp = store.program("aaaa1111deadbeef", "mlp", {"inputs": [["float32", [256, 512]]]}, 14)
    att = store.program("bbbb2222cafef00d", "attention", {"inputs": []}, 40)
    h200 = store.device("NVIDIA H200", "9.0", 132, 150_000_000_000)
    cpu = store.device("cpu")
    sw = store.software(**SW)
    runs: dict[str, int] = {}
    plans: dict[str, int] = {}
    for key, prog, dev, speedup in [("mlp-h200", mlp, h200, 1.6), ("mlp-cpu", mlp, cpu, 0.95), ("att-h200", att, h200, 1.2)]:
        run = store.start_run(prog, dev, sw, budget={"trials": 6}, seed=1, sampler="tpe", measure="device")
        runs[key] = run
        for c_i, template in enumerate(["row_reduce", "elementwise"]):
            cand = store.add_candidate(run, f"sig{c_i}{key}", template, [c_i, c_i + 1])
            best = None
            for n in range(6):
                ok = n != 2
                ms = 1.0 / (1 + n * 0.1 + c_i) if ok else None
                store.add_trial(cand, n, {"block": 32 * (n + 1)}, "ok" if ok else "compile_error",
                                median_ms=ms, min_ms=ms, max_ms=ms, error=None if ok else "ptxas: out of registers")
                best = ms if ms is not None and (best is None or ms < best) else best
            store.update_candidate(cand, best_config={"block": 192}, best_ms=best, xla_ms=best * speedup,
                                   status="done", n_trials=6)
        plans[key] = store.save_plan(prog, dev, sw, {"version": 1, "run": key}, run_id=run, measured_ms=1 / speedup,
                                     baseline_ms=1.0, speedup=speedup, measure="device",
                                     tolerance={"rtol": 1e-3}, max_error=1e-5)
        store.finish_run(run, "finished", baseline_ms=1.0, best_ms=1 / speedup, speedup=speedup)
    with store.engine.begin() as conn:
        conn.execute(sa.update(Run).where(Run.id == runs["mlp-cpu"]).values(started_at=dt.datetime(2025, 1, 1)))
    store.close()
    return {"url": url, "runs": runs, "plans": plans, "tmp": tmp}


def test_runs_json_and_filters(filled: dict) -> None:
    url, runs = filled["url"], filled["runs"]
    res = cli("runs", "--db", url, "--json")
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)
    assert sorted(r["id"] for r in rows) == sorted(runs.values())
    r = next(r for r in rows if r["id"] == runs["mlp-h200"])
    assert (r["program"], r["device"], r["speedup"], r["n_candidates"], r["n_trials"]) == ("mlp", "NVIDIA H200", 1.6, 2, 12)
    assert dt.datetime.fromisoformat(r["started_at"]).tzinfo is not None



def test_runs_filters(filled: dict, capsys: pytest.CaptureFixture[str]) -> None:
    url, runs = filled["url"], filled["runs"]

    def ids(*args: str) -> list[int]:
        assert main(["runs", "--db", url, "--json", *args]) == 0
        return sorted(r["id"] for r in json.loads(capsys.readouterr().out))

    assert ids("--program", "mlp", "--device", "h200", "--since", "2025-06-01", "--min-speedup", "1.1") == [
        runs["mlp-h200"]
    ]
    assert ids("--program", "bbbb2222") == [runs["att-h200"]]
    assert ids("--device", "CPU") == [runs["mlp-cpu"]]
    assert ids("--since", "2025-06-01") == sorted([runs["mlp-h200"], runs["att-h200"]])
    assert ids("--min-speedup", "1.3") == [runs["mlp-h200"]]
    assert ids("--status", "running") == []
    assert ids("--program", "nope") == []


def test_runs_csv_and_table(filled: dict) -> None:
    url, runs = filled["url"], filled["runs"]
    res = cli("runs", "--db", url, "--csv", "--since", "2025-06-01")
    assert res.returncode == 0, res.stderr
    rows = list(csv.DictReader(io.StringIO(res.stdout)))
    assert sorted(int(r["id"]) for r in rows) == sorted([runs["mlp-h200"], runs["att-h200"]])
    assert json.loads(rows[0]["budget"]) == {"trials": 6}

    res = cli("--db", url, "runs")  # --db before the command works too
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    header = lines[0].split()
    assert header[:3] == ["id", "started", "program"] and "speedup" in header
    assert set(lines[1].replace(" ", "")) == {"-"}
    body = lines[2:]
    assert len(body) == 3
    assert any(line.split()[0] == str(runs["mlp-cpu"]) and "2025-01-01" in line and "0.95x" in line for line in body)


def test_plans_compare_trials(filled: dict, capsys: pytest.CaptureFixture[str]) -> None:
    url, runs, plans = filled["url"], filled["runs"], filled["plans"]
    assert main(["plans", "--db", url, "--json", "--current", "--device", "cpu"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["id"] for r in rows] == [plans["mlp-cpu"]] and rows[0]["is_current"] is True

    assert main(["compare", "--db", url, "--csv", "--min-speedup", "1.0"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert {(r["program"], r["device"], float(r["speedup"])) for r in rows} == {
        ("mlp", "NVIDIA H200", 1.6),
        ("attention", "NVIDIA H200", 1.2),
    }

    res = cli("trials", str(runs["att-h200"]), "--db", url, "--csv")
    assert res.returncode == 0, res.stderr
    rows = list(csv.DictReader(io.StringIO(res.stdout)))
    assert len(rows) == 12 and {r["template"] for r in rows} == {"row_reduce", "elementwise"}
    assert [r["status"] for r in rows].count("compile_error") == 2
    assert main(["trials", str(runs["att-h200"]), "--db", url, "--status", "compile_error"]) == 0
    out = capsys.readouterr().out
    assert "ptxas" in out and len(out.splitlines()) == 2 + 2


def test_show(filled: dict, capsys: pytest.CaptureFixture[str]) -> None:
    url, runs, plans = filled["url"], filled["runs"], filled["plans"]
    res = cli("show", "plan", str(plans["att-h200"]), "--db", url, "--json")
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    assert got["plan"] == {"version": 1, "run": "att-h200"} and got["speedup"] == 1.2

    assert main(["show", "run", str(runs["mlp-h200"]), "--db", url]) == 0
    out = capsys.readouterr().out
    assert "candidates (2):" in out and "row_reduce" in out and "compile_error 2" in out
    assert f"autofuse-run{runs['mlp-h200']}-" in out
    assert main(["show", "plan", str(plans["mlp-h200"]), "--db", url]) == 0
    assert '"run": "mlp-h200"' in capsys.readouterr().out


def test_report(filled: dict) -> None:
    url, runs, tmp = filled["url"], filled["runs"], filled["tmp"]
    out_dir = tmp / "report" / "run"
    res = cli("report", str(runs["mlp-h200"]), "--out", str(out_dir), "--db", url)
    assert res.returncode == 0, res.stderr
    report = Path(res.stdout.strip())
    assert report == out_dir / "report.md" and report.exists()
    text = report.read_text()
    assert f"# autofuse run {runs['mlp-h200']}" in text and "mlp" in text and "NVIDIA H200" in text
    pngs = sorted(out_dir.glob("*.png"))
    assert [p.name for p in pngs] == ["convergence.png", "speedup.png"]
    for p in pngs:
        assert p.read_bytes()[:8] == PNG_MAGIC and p.stat().st_size > 5000
        assert f"]({p.name})" in text


def test_errors_are_one_line(filled: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = filled["url"]
    res = cli("show", "run", "9999", "--db", url)  # one real process: exit status and stderr
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert "Traceback" not in res.stderr
    assert res.stderr.strip() == f"autofuse: error: no run with id 9999 in {url}"

    junk = tmp_path / "junk.db"
    junk.write_bytes(os.urandom(4096))
    for args, expected in (
        (["trials", "9999", "--db", url], "no run with id 9999"),
        (["show", "plan", "9999", "--db", url], "no plan with id 9999"),
        (["report", "9999", "--out", str(tmp_path / "r"), "--db", url], "no run with id 9999"),
        (["runs", "--db", "postgresql+nosuchdriver://u:pw@127.0.0.1:1/x"], "no database driver"),
        (["plans", "--db", f"sqlite:///{junk}"], "is not an autofuse database or is corrupt"),
        (["compare", "--db", f"sqlite:///{tmp_path / 'junk.db' / 'x.db'}"], "no plan store at"),  # read-only: never created
    ):
        assert main(args) == 2, args
        captured = capsys.readouterr()
        assert captured.out == ""
        assert captured.err.startswith("autofuse: error: ") and expected in captured.err, (args, captured.err)
        assert len(captured.err.strip().splitlines()) == 1, captured.err
        assert "pw@" not in captured.err


def test_usage_errors_and_help(filled: dict, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["runs", "--db", filled["url"], "--since", "yesterday"]) == 2
    assert "YYYY-MM-DD" in capsys.readouterr().err
    assert main(["show", "run", "abc", "--db", filled["url"]]) == 2
    capsys.readouterr()
    assert main(["--help"]) == 0
    top = capsys.readouterr().out
    for cmd in ("runs", "plans", "trials", "show", "compare", "report", "db"):
        assert cmd in top
    for cmd in (["runs"], ["plans"], ["trials"], ["show"], ["compare"], ["report"], ["db"], ["db", "upgrade"]):
        assert main([*cmd, "--help"]) == 0
        text = capsys.readouterr().out
        assert "--db" in text and len(text.splitlines()) > 5
    assert main([]) == 2
    # The tune hook is a no-op until the search side fills it in.
    sub_names = set(build_parser()._subparsers._group_actions[0].choices)  # noqa: SLF001
    assert {"runs", "plans", "trials", "show", "compare", "report", "db"} <= sub_names


def test_db_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'db.db'}"
    assert main(["db", "upgrade", "--db", url]) == 0
    assert f"<base> -> {db.HEAD_REVISION}" in capsys.readouterr().out
    res = cli("db", "current", "--db", url)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"{db.HEAD_REVISION} (head)"

    assert main(["db", "downgrade", "base", "--db", url]) == 2  # needs --yes
    assert "--yes" in capsys.readouterr().err
    assert main(["db", "downgrade", "base", "--yes", "--db", url]) == 0
    assert main(["db", "current", "--db", url]) == 0
    assert "(no autofuse schema)" in capsys.readouterr().out
    assert main(["db", "upgrade", "--db", url]) == 0
    assert main(["db", "upgrade", "--db", url]) == 0
    assert "already at" in capsys.readouterr().out.splitlines()[-1]
    assert main(["db", "history"]) == 0
    history = capsys.readouterr().out
    assert f"-> {db.HEAD_REVISION} (head)" in history and "<base> -> 0001" in history

    engine = db.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text(f"UPDATE {db.VERSION_TABLE} SET version_num = 'ffff_newer'"))
    engine.dispose()
    assert main(["db", "current", "--db", url]) == 0
    assert "newer autofuse" in capsys.readouterr().out
    assert main(["runs", "--db", url]) == 2
    err = capsys.readouterr().err
    assert "created by a newer autofuse; upgrade autofuse" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv", [["runs"], ["db", "current"], ["plans", "pin", "1"], ["db", "upgrade"]])
def test_a_directory_given_as_the_store_is_said_to_be_one(argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*argv, "--db", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == f"autofuse: error: {tmp_path} is a directory, not a database file\n", err
    assert os.listdir(tmp_path) == []


def test_show_run_sums_up_a_models_long_signature() -> None:
    """A model's hundreds of weights made `show run`'s signature line thousands of characters long: it is counted by
    type there (short ones stay as they are; --json has the whole)."""
    from autofuse.cli import SIGNATURE_CHARS, _signature_text

    short = {"inputs": ["float32[8, 16]"], "outputs": ["float32[8]"]}
    assert _signature_text(short) is short
    long = {"inputs": ["bfloat16[1024]"] * 146 + ["bfloat16[1024, 4096]"] * 24 + ["int32[8, 2048]"] * 2,
            "outputs": ["bfloat16[8, 2048, 50257]"]}
    text = _signature_text(long)
    assert text == ("172 inputs: bfloat16[1024] x146, bfloat16[1024, 4096] x24, int32[8, 2048] x2; "
                    "1 output(s): bfloat16[8, 2048, 50257]")
    assert len(_signature_text({"inputs": [f"float32[{i}]" for i in range(500)], "outputs": []})) <= 2 * SIGNATURE_CHARS + 20
