"""Plan store reliability with real processes and real SQLite files (no mocks):
Optuna sharing the database, concurrent writer processes, SIGKILLed runs,
and the Alembic command line with the repository's alembic.ini.

The ``check_*`` functions take a database URL and are reused by
``test_store_postgres.py`` against a real PostgreSQL server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from autofuse.store import PlanStore, db

REPO = Path(__file__).resolve().parents[1]
SW = {"jax": "0.10.2", "jaxlib": "0.10.2", "autofuse": "0.1.0", "backend": "triton"}


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("AUTOFUSE_DB", None)
    return env


@pytest.mark.slow
def test_optuna_and_autofuse_share_one_database(tmp_path: Path) -> None:
    check_optuna_shares_database(f"sqlite:///{tmp_path / 'shared.db'}")


def check_optuna_shares_database(url: str) -> None:
    """Optuna's RDBStorage and our migrations in one (empty) database, both usable."""
    optuna = pytest.importorskip("optuna")
    optuna.logging.set_verbosity(optuna.logging.WARNING)

    # Optuna first, then our schema upgrade and store, then Optuna again.
    storage = optuna.storages.RDBStorage(url)
    study = optuna.create_study(study_name="before", storage=storage, sampler=optuna.samplers.RandomSampler(seed=0))
    study.optimize(lambda t: (t.suggest_float("x", -1, 1) - 0.3) ** 2, n_trials=4)
    engine = db.create_engine(url)
    try:
        assert db.upgrade(engine) == (set(), {db.HEAD_REVISION})  # Optuna's alembic_version is not ours
    finally:
        engine.dispose()

    store = PlanStore(url)
    p = store.program("fp", "mlp", {}, 3)
    d = store.device("cpu")
    s = store.software(**SW)
    run = store.start_run(p, d, s, budget={"trials": 3}, seed=0, sampler="tpe", measure="model", optuna_storage=url)
    prefix = store.get_run(run)["optuna_study_prefix"]
    cand = store.add_candidate(run, "sig", "elementwise", [0, 1])

    study2 = optuna.create_study(study_name=prefix + "sig", storage=url, sampler=optuna.samplers.TPESampler(seed=0))
    for _ in range(3):
        trial = study2.ask()
        b = trial.suggest_categorical("block", [64, 128, 256])
        ms = 1.0 / b
        study2.tell(trial, ms)
        store.add_trial(cand, trial.number, {"block": b}, "ok", median_ms=ms, optuna_trial_id=trial._trial_id)
    store.save_plan(p, d, s, {"v": 1}, run_id=run, measured_ms=1, baseline_ms=2, speedup=2, measure="model",
                    tolerance={}, max_error=0.0)
    store.finish_run(run, "finished", speedup=2.0)
    store.close()

    # Both still usable from fresh handles.
    store = PlanStore(url)
    assert store.lookup("fp", "cpu", SW).match == "exact"
    assert len(store.trials(run)) == 3
    loaded = optuna.load_study(study_name=prefix + "sig", storage=url)
    assert len(loaded.trials) == 3
    assert len(optuna.load_study(study_name="before", storage=url).trials) == 4
    optuna.create_study(study_name="after", storage=url).optimize(lambda t: t.suggest_float("y", 0, 1), n_trials=2)

    engine = sa.create_engine(url)
    with engine.connect() as conn:
        tables = set(sa.inspect(conn).get_table_names())
        assert {"alembic_version", "studies", "trials", db.VERSION_TABLE, "autofuse_trials"} <= tables
        ours = conn.execute(sa.text(f"SELECT version_num FROM {db.VERSION_TABLE}")).scalars().all()
        theirs = conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalars().all()
    assert ours == [db.HEAD_REVISION]
    assert len(theirs) == 1 and theirs != ours

    # Dropping our schema leaves Optuna's intact; recreating it too.
    store.close()
    db.downgrade(store.engine, "base")
    assert len(optuna.load_study(study_name="after", storage=url).trials) == 2
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalars().all() == theirs
    assert db.upgrade(store.engine) == (set(), {db.HEAD_REVISION})
    assert store.lookup("fp", "cpu", SW) is None and store.schema_revision() == db.HEAD_REVISION
    assert len(optuna.load_study(study_name=prefix + "sig", storage=url).trials) == 3
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalars().all() == theirs
    store.close()
    storage.engine.dispose()
    engine.dispose()


WRITER = textwrap.dedent(
    """
    import os, sys, time
    url, tag, go, n_runs, n_trials = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    from autofuse.store import PlanStore, db
    db.known_revisions()                # import alembic now, not in the race
    open(go + "." + tag, "w").close()   # imported: ready
    while not os.path.exists(go):
        time.sleep(0.002)
    store = PlanStore(url)          # both create the schema at the same moment
    store.mark_interrupted()
    p = store.program("fp-shared", "mlp", {"in": [[4, 4]]}, 5)
    d = store.device("NVIDIA H200", "9.0", 132, 1000)
    s = store.software("0.10.2", "0.10.2", "0.1.0", "triton")
    for i in range(n_runs):
        run = store.start_run(p, d, s, budget={"trials": n_trials}, seed=i, sampler=tag, measure="model")
        cand = store.add_candidate(run, f"{tag}-{i}", "row_reduce", [1, 2])
        for j in range(n_trials):
            store.add_trial(cand, j, {"b": j, "who": tag}, "ok", median_ms=1.0 + j)
            time.sleep(0.001)  # "measuring": real jobs leave gaps between writes
        store.update_candidate(cand, best_ms=1.0, xla_ms=1.5, n_trials=n_trials, status="done")
        store.save_plan(p, d, s, {"by": tag, "i": i}, run_id=run, measured_ms=1.0, baseline_ms=1.5,
                        speedup=1.5, measure="model", tolerance={}, max_error=0.0)
        store.finish_run(run, "finished", speedup=1.5)
    print("done", tag, flush=True)
    """
)


@pytest.mark.slow
def test_two_processes_write_concurrently(tmp_path: Path) -> None:
    """Both writers start the same instant on a fresh file (racing to create the
    schema), then interleave short write transactions; every row must land.

    SQLite's busy handler is not fair: a writer in a zero-gap loop can starve the
    other until it finishes (still correct, just serial), so the writers pause 1 ms
    between trials, like a real job pauses to measure.
    """
    check_processes_write_concurrently(f"sqlite:///{tmp_path / 'concurrent.db'}", tmp_path)


def check_processes_write_concurrently(url: str, tmp_path: Path) -> None:
    go = tmp_path / "go"
    n_runs, n_trials = 30, 8
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, url, tag, str(go), str(n_runs), str(n_trials)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
        )
        for tag in ("w1", "w2")
    ]
    deadline = time.monotonic() + 120
    while not all(Path(f"{go}.{tag}").exists() for tag in ("w1", "w2")):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "writers did not start"
        time.sleep(0.01)
    go.write_text("go")
    outs = [p.communicate(timeout=180) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert out.startswith("done")

    store = PlanStore(url)
    runs = store.runs()
    assert len(runs) == 2 * n_runs
    assert all(r["status"] == "finished" and r["n_trials"] == n_trials for r in runs)
    assert {r["sampler"] for r in runs} == {"w1", "w2"}
    # The writers really interleaved (not one after the other).
    order = [r["sampler"] for r in sorted(runs, key=lambda r: r["started_at"])]
    assert sum(a != b for a, b in zip(order, order[1:])) >= 2, order
    with store.engine.connect() as conn:
        count = lambda t: conn.execute(sa.text(f"SELECT count(*) FROM {t}")).scalar()  # noqa: E731
        assert count("autofuse_trials") == 2 * n_runs * n_trials
        assert count("autofuse_candidates") == 2 * n_runs
        assert count("autofuse_programs") == 1
        assert count("autofuse_devices") == 1
        assert count("autofuse_software") == 1
        assert count("autofuse_plans") == 2 * n_runs
    assert len(store.plans(current_only=True)) == 1
    assert store.lookup("fp-shared", "NVIDIA H200", SW).match == "exact"


KILLED = textwrap.dedent(
    """
    import sys, time
    from autofuse.store import PlanStore
    store = PlanStore(sys.argv[1])
    p = store.program("fp-k", "mlp", {}, 2)
    d = store.device("cpu")
    s = store.software("0.10.2", "0.10.2", "0.1.0", "interpret")
    run = store.start_run(p, d, s, budget={"trials": 100, "seconds": 60}, seed=3, sampler="tpe",
                          measure="model", optuna_storage=sys.argv[1])
    cand = store.add_candidate(run, "sig-k", "elementwise", [0])
    for j in range(7):
        store.add_trial(cand, j, {"b": j}, "ok" if j % 3 else "timeout", median_ms=1.0 / (j + 1))
    print(run, flush=True)
    time.sleep(120)
    """
)


def test_sigkilled_run_is_marked_interrupted(tmp_path: Path) -> None:
    check_sigkilled_run(f"sqlite:///{tmp_path / 'killed.db'}")


def check_sigkilled_run(url: str) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED, url], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()
    )
    try:
        line = child.stdout.readline()
        assert line.strip().isdigit(), child.stderr.read() if child.poll() is not None else line
        run_id = int(line)
        store = PlanStore(url)
        assert store.mark_interrupted() == []  # still alive: not touched
        assert store.get_run(run_id)["status"] == "running"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL

    store = PlanStore(url)
    assert store.mark_interrupted() == [run_id]
    run = store.get_run(run_id)
    assert run["status"] == "interrupted" and run["ended_at"] is not None
    # Everything it committed survived the kill, and resume finds what it needs.
    trials = store.trials(run_id)
    assert [t["number"] for t in trials] == list(range(7))
    assert [t["status"] for t in trials].count("timeout") == 3
    unfinished = store.unfinished_runs()
    assert [r["id"] for r in unfinished] == [run_id]
    assert (run["budget"], run["seed"], run["optuna_storage"]) == ({"trials": 100, "seconds": 60}, 3, url)
    assert store.mark_interrupted() == []


@pytest.mark.parametrize("asked", [False, True])
def test_alembic_logs_only_where_the_user_asked_for_them(tmp_path: Path, asked: bool) -> None:
    """A program logging at INFO that creates a store sees no Alembic lines, unless it set the ``alembic`` logger's
    level itself; either way the ``alembic`` logger is left as the program set it."""
    script = textwrap.dedent(f"""
        import logging, sys
        logging.basicConfig(level=logging.INFO, format="LOG %(name)s: %(message)s")
        if {asked}:
            logging.getLogger("alembic").setLevel(logging.INFO)
        from autofuse.store import PlanStore
        PlanStore(sys.argv[1]).close()
        print("LEVEL", logging.getLevelName(logging.getLogger("alembic").level))
    """)
    res = subprocess.run([sys.executable, "-c", script, f"sqlite:///{tmp_path / 'new.db'}"], capture_output=True, text=True,
                         cwd=REPO, env=_env(), timeout=120)
    assert res.returncode == 0, res.stderr
    alembic_lines = [x for x in res.stderr.splitlines() if x.startswith("LOG alembic")]
    assert res.stdout.strip() == ("LEVEL INFO" if asked else "LEVEL NOTSET")
    if asked:
        assert any("Running upgrade  -> 0001" in x for x in alembic_lines), res.stderr
    else:
        assert alembic_lines == [], res.stderr


@pytest.mark.slow
def test_alembic_command_line_with_repo_ini(tmp_path: Path) -> None:
    """`alembic -c alembic.ini -x db=URL upgrade head / current / downgrade base` from another cwd."""
    check_alembic_command_line(f"sqlite:///{tmp_path / 'alembic.db'}", tmp_path)


def check_alembic_command_line(url: str, cwd: Path) -> None:
    def alembic(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "alembic", "-c", str(REPO / "alembic.ini"), "-x", f"db={url}", *args],
            capture_output=True,
            text=True,
            cwd=cwd,
            env=_env(),
            timeout=120,
        )

    res = alembic("upgrade", "head")
    assert res.returncode == 0, res.stderr
    engine = db.create_engine(url)
    try:
        assert db.current(engine) == {db.HEAD_REVISION}
        res = alembic("downgrade", "base")
        assert res.returncode == 0, res.stderr
        assert db.current(engine) == set()
        assert not {t for t in sa.inspect(engine).get_table_names() if t.startswith("autofuse_")} - {db.VERSION_TABLE}
        assert PlanStore(url).schema_revision() == db.HEAD_REVISION  # recreated on first use
    finally:
        engine.dispose()
