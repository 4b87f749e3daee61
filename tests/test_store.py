"""Plan store: schema, API, lookup grading, errors. Real SQLite files in tmp_path.

The ``check_*`` functions take a URL or a store and are reused by
``test_store_postgres.py`` against a real PostgreSQL server.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy import exc

from autofuse.store import LookupResult, PlanStore, StoreError, db
from autofuse.store.models import Base, Plan, Run

REPO = Path(__file__).resolve().parents[1]
SW = {"jax": "0.10.2", "jaxlib": "0.10.2", "autofuse": "0.1.0", "backend": "triton"}
OUR_TABLES = {
    "autofuse_programs",
    "autofuse_devices",
    "autofuse_software",
    "autofuse_runs",
    "autofuse_candidates",
    "autofuse_trials",
    "autofuse_plans",
}


# ------------------------------------------------------------------ helpers


def make_keys(store: PlanStore, fp: str = "fp-a", device: str = "NVIDIA H200", sw: dict | None = None):
    p = store.program(fp, "mlp", {"inputs": [["float32", [128, 512]]]}, 12)
    d = store.device(device, "9.0", 132, 150_000_000_000)
    s = store.software(**(sw or SW))
    return p, d, s


def save(store: PlanStore, p: int, d: int, s: int, speedup: float, *, plan: dict | None = None, **kw) -> int:
    return store.save_plan(
        p,
        d,
        s,
        plan if plan is not None else {"version": 1, "groups": [], "speedup": speedup},
        measured_ms=1.0 / speedup,
        baseline_ms=1.0,
        speedup=speedup,
        measure="device",
        tolerance={"rtol": 1e-3, "atol": 1e-3},
        max_error=1e-4,
        **kw,
    )


def our_tables(engine: sa.Engine) -> set[str]:
    return {t for t in sa.inspect(engine).get_table_names() if t.startswith("autofuse_")}


# ------------------------------------------------- checks shared with postgres


def check_schema_roundtrip(url: str) -> None:
    """upgrade head from empty, downgrade base, upgrade again; the store works after."""
    engine = db.create_engine(url)
    try:
        assert db.current(engine) == set()
        before, after = db.upgrade(engine)
        assert before == set() and after == {db.HEAD_REVISION}
        assert our_tables(engine) >= OUR_TABLES
        assert db.current(engine) == {db.HEAD_REVISION}
        # Idempotent.
        assert db.upgrade(engine) == ({db.HEAD_REVISION}, {db.HEAD_REVISION})

        before, after = db.downgrade(engine, "base")
        assert before == {db.HEAD_REVISION} and after == set()
        assert our_tables(engine) == {db.VERSION_TABLE}  # only the (empty) version table is left
        assert db.current(engine) == set()

        db.upgrade(engine, "head")
        assert our_tables(engine) >= OUR_TABLES
    finally:
        engine.dispose()
    store = PlanStore(url)
    p, d, s = make_keys(store)
    assert save(store, p, d, s, 1.5) > 0
    assert store.schema_revision() == db.HEAD_REVISION
    store.close()


def check_one_current(store: PlanStore) -> None:
    """Exactly one current plan per (program, device, software); other keys untouched."""
    p, d, s = make_keys(store, fp="fp-current")
    d2 = store.device("cpu")
    other = save(store, p, d2, s, 1.05)
    ids = [save(store, p, d, s, x) for x in (1.1, 1.2, 1.3)]
    current = [r for r in store.plans(program="fp-current", current_only=True)]
    assert sorted(r["id"] for r in current) == sorted([ids[-1], other])
    all_for_key = [r for r in store.plans(program="fp-current") if r["device_id"] == d]
    assert len(all_for_key) == 3
    assert [r["id"] for r in all_for_key if r["is_current"]] == [ids[-1]]

    # A non-current plan is recorded without taking the flag.
    hist = save(store, p, d, s, 9.9, current=False)
    assert store.get_plan(hist)["is_current"] is False
    assert store.lookup("fp-current", "NVIDIA H200", SW).plan_id == ids[-1]

    # The database itself refuses a second current plan for a key.
    with pytest.raises(exc.IntegrityError):
        with store.engine.begin() as conn:
            conn.execute(
                sa.insert(Plan).values(
                    program_id=p,
                    device_id=d,
                    software_id=s,
                    plan_json="{}",
                    measured_ms=1.0,
                    baseline_ms=1.0,
                    speedup=1.0,
                    measure="device",
                    tolerance={},
                    max_error=0.0,
                    is_current=True,
                    created_at=dt.datetime.now(dt.timezone.utc),
                )
            )


def check_lookup(store: PlanStore) -> None:
    """exact vs version vs miss."""
    p, d, s = make_keys(store, fp="fp-lookup")
    pid = save(store, p, d, s, 1.4, plan={"version": 1, "groups": [{"template": "row_reduce"}]})

    hit = store.lookup("fp-lookup", "NVIDIA H200", SW)
    assert isinstance(hit, LookupResult)
    assert (hit.plan_id, hit.match, hit.speedup) == (pid, "exact", 1.4)
    assert hit.plan_json == {"version": 1, "groups": [{"template": "row_reduce"}]}
    assert hit.software == SW
    assert hit.measured_ms == pytest.approx(1 / 1.4)
    assert hit.tolerance == {"rtol": 1e-3, "atol": 1e-3}
    with pytest.raises(dataclasses_frozen_error()):
        hit.plan_id = 3  # type: ignore[misc]

    newer_jax = {**SW, "jax": "0.11.0"}
    for sw in (newer_jax, {**SW, "jaxlib": "0.9"}, {**SW, "autofuse": "0.2.0"}):
        v = store.lookup("fp-lookup", "NVIDIA H200", sw)
        assert v is not None and v.match == "version" and v.plan_id == pid
        assert v.software == SW  # the software the plan was measured with

    assert store.lookup("fp-lookup", "NVIDIA A100", SW) is None  # other device
    assert store.lookup("fp-other", "NVIDIA H200", SW) is None  # other program
    assert store.lookup("fp-lookup", "NVIDIA H200", {**SW, "backend": "interpret"}) is None  # other backend

    # Once the new versions have their own plan, both are exact; a third
    # version gets the newest plan of the backend.
    s2 = store.software(**newer_jax)
    pid2 = save(store, p, d, s2, 1.2)
    assert store.lookup("fp-lookup", "NVIDIA H200", newer_jax).plan_id == pid2
    assert store.lookup("fp-lookup", "NVIDIA H200", newer_jax).match == "exact"
    assert store.lookup("fp-lookup", "NVIDIA H200", SW).plan_id == pid
    third = store.lookup("fp-lookup", "NVIDIA H200", {**SW, "jax": "0.12.0"})
    assert third.match == "version" and third.plan_id == pid2

    with pytest.raises(ValueError, match="backend"):
        store.lookup("fp-lookup", "NVIDIA H200", {"jax": "0.10.2", "jaxlib": "0.10.2", "autofuse": "0.1.0"})


def dataclasses_frozen_error() -> type[Exception]:
    import dataclasses

    return dataclasses.FrozenInstanceError


def check_newer_schema_refused(url: str) -> None:
    store = PlanStore(url)
    p, d, s = make_keys(store)
    store.close()
    with store.engine.begin() as conn:
        conn.execute(sa.text(f"INSERT INTO {db.VERSION_TABLE} (version_num) VALUES ('9f00_future')"))
    with pytest.raises(StoreError, match="newer autofuse; upgrade autofuse"):
        PlanStore(url)
    # Nothing was touched: our rows and both revisions are still there.
    engine = db.create_engine(url)
    try:
        assert db.current(engine) == {db.HEAD_REVISION, "9f00_future"}
        with pytest.raises(StoreError, match="newer autofuse"):
            db.upgrade(engine)
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM autofuse_programs")).scalar() == 1
    finally:
        engine.dispose()


# ------------------------------------------------------------------- fixtures


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'store.db'}"


@pytest.fixture
def store(url: str) -> PlanStore:
    s = PlanStore(url)
    yield s
    s.close()


# ------------------------------------------------------------------- schema


def test_head_revision_constant_matches_migrations() -> None:
    assert db.HEAD_REVISION == db.head_revision()
    assert [h["revision"] for h in db.history()][0] == db.HEAD_REVISION


def test_schema_roundtrip(url: str) -> None:
    check_schema_roundtrip(url)


def test_models_match_migrations(store: PlanStore) -> None:
    """The migrated schema and the ORM models agree (alembic autogenerate finds nothing)."""
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    def include(obj, name, type_, reflected, compare_to):  # noqa: ANN001
        if type_ == "table":
            return name.startswith("autofuse_") and name != db.VERSION_TABLE
        return True

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # expression-based index cannot be reflected on SQLite
        with store.engine.connect() as conn:
            mc = MigrationContext.configure(conn, opts={"include_object": include, "compare_type": True})
            diff = compare_metadata(mc, Base.metadata)
    assert diff == []


def test_schema_created_on_first_use(tmp_path: Path) -> None:
    path = tmp_path / "x.db"
    store = PlanStore(f"sqlite:///{path}")
    assert path.exists()
    assert our_tables(store.engine) >= OUR_TABLES
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() >= 1000
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1


def test_no_directory_is_created_for_a_store_named_explicitly(tmp_path: Path) -> None:
    """A mistyped path is an error naming the missing directory, not a new empty store (only the default store's
    directory is created: test_default_url_and_env)."""
    url = f"sqlite:///{tmp_path / 'nodir' / 'sub' / 'a.db'}"
    with pytest.raises(StoreError) as e:
        PlanStore(url)
    assert str(e.value) == f"cannot create the plan store {url}: directory {tmp_path / 'nodir' / 'sub'} does not exist"
    assert os.listdir(tmp_path) == []


def test_default_url_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AUTOFUSE_DB", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    store = PlanStore()
    expected = tmp_path / "xdg" / "autofuse" / "autofuse.db"
    assert store.url == f"sqlite:///{expected}"
    assert expected.exists()
    other = f"sqlite:///{tmp_path / 'env.db'}"
    monkeypatch.setenv("AUTOFUSE_DB", other)
    assert PlanStore().url == other
    # A bare path is a SQLite file.
    assert PlanStore(str(tmp_path / "bare.db")).url == f"sqlite:///{tmp_path / 'bare.db'}"


def test_corrupt_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "junk.db"
    path.write_bytes(os.urandom(8192))
    with pytest.raises(StoreError) as e:
        PlanStore(f"sqlite:///{path}")
    assert "is not an autofuse database or is corrupt" in str(e.value)
    assert str(path) in str(e.value)


def test_text_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "notes.db"
    path.write_text("these are my notes, not a database\n" * 100)
    with pytest.raises(StoreError, match="is not an autofuse database or is corrupt"):
        PlanStore(str(path))


def test_newer_schema_is_refused(url: str) -> None:
    check_newer_schema_refused(url)


def test_unopenable_path_and_bad_driver(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreError, match="cannot"):
        PlanStore(f"sqlite:///{tmp_path / 'file' / 'sub' / 'x.db'}")
    with pytest.raises(StoreError, match="no database driver"):
        PlanStore("postgresql+nosuchdriver://user:secret@localhost/db")
    with pytest.raises(StoreError) as e:
        PlanStore("postgresql+nosuchdriver://user:secret@localhost/db")
    assert "secret" not in str(e.value)


# ---------------------------------------------------------------------- API


def test_get_or_create_dimensions(store: PlanStore) -> None:
    assert store.program("fp", "f", {"a": 1}, 3) == store.program("fp", "other name", {}, 9)
    assert store.device("cpu") == store.device("cpu")
    assert store.device("cpu") != store.device("cpu", sm_count=4)
    gpu = store.device("NVIDIA H200", "9.0", 132, 150_000_000_000)
    assert gpu == store.device("NVIDIA H200", "9.0", 132, 150_000_000_000)
    assert gpu != store.device("NVIDIA H200", "9.0", 132, 140_000_000_000)
    s1 = store.software(**SW)
    assert s1 == store.software(**SW)
    assert s1 != store.software(**{**SW, "backend": "interpret"})
    with store.engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM autofuse_devices")).scalar() == 4


def test_run_lifecycle(store: PlanStore) -> None:
    p, d, s = make_keys(store)
    run = store.start_run(p, d, s, budget={"trials": 32, "seconds": 600}, seed=7, sampler="tpe", measure="device")
    r = store.get_run(run)
    assert r["status"] == "running" and r["host"] == socket.gethostname() and r["pid"] == os.getpid()
    assert r["optuna_study_prefix"] == f"autofuse-run{run}-"
    assert r["budget"] == {"trials": 32, "seconds": 600}
    assert r["started_at"].tzinfo is not None and r["ended_at"] is None
    assert r["signature"] == {"inputs": [["float32", [128, 512]]]} and r["size"] == 12

    c1 = store.add_candidate(run, "sig-1", "row_reduce", [3, 4, 5])
    assert store.add_candidate(run, "sig-1", "row_reduce", [3, 4, 5]) == c1  # idempotent (resume)
    c2 = store.add_candidate(run, "sig-1", "elementwise", [3, 4])
    assert c2 != c1
    for i, ms in enumerate([0.5, 0.4, None, 0.45]):
        status = "ok" if ms is not None else "compile_error"
        store.add_trial(c1, i, {"block_rows": 2**i}, status, median_ms=ms, min_ms=ms, max_ms=ms,
                        error=None if ms else "Mosaic: too many registers", optuna_trial_id=100 + i)
    t = store.add_trial(c1, 3, {"block_rows": 8}, "ok", median_ms=0.42)  # same number: replaced
    store.add_trial(c2, 0, {"block": 128}, "infeasible")
    store.update_candidate(c1, best_config={"block_rows": 2}, best_ms=0.4, xla_ms=0.6, status="done", n_trials=4)

    cands = store.candidates(run)
    assert [c["id"] for c in cands] == [c1, c2]
    assert cands[0]["speedup"] == pytest.approx(1.5) and cands[1]["speedup"] is None
    assert cands[0]["nodes"] == [3, 4, 5] and cands[0]["best_config"] == {"block_rows": 2}

    trials = store.trials(run)
    assert len(trials) == 5
    assert [(x["template"], x["number"]) for x in trials][:4] == [("row_reduce", i) for i in range(4)]
    assert trials[3]["id"] == t and trials[3]["median_ms"] == 0.42 and trials[3]["config"] == {"block_rows": 8}
    assert trials[2]["status"] == "compile_error" and "registers" in trials[2]["error"]
    assert [x["number"] for x in store.trials(run, status="ok")] == [0, 1, 3]

    assert store.unfinished_runs()[0]["id"] == run
    store.finish_run(run, "finished", baseline_ms=1.2, best_ms=1.0, speedup=1.2)
    r = store.get_run(run)
    assert (r["status"], r["speedup"], r["n_candidates"], r["n_trials"], r["n_infeasible"]) == ("finished", 1.2, 2, 4, 1)  # measured; infeasible apart
    assert r["ended_at"] >= r["started_at"]
    assert store.unfinished_runs() == []

    with pytest.raises(ValueError):
        store.finish_run(run, "running")
    with pytest.raises(ValueError):
        store.start_run(p, d, s, budget={}, seed=0, sampler="tpe", measure="wallclock")
    with pytest.raises(KeyError, match="no run with id 999"):
        store.get_run(999)
    with pytest.raises(KeyError, match="no plan with id 999"):
        store.get_plan(999)
    with pytest.raises(KeyError):
        store.add_candidate(999, "x", "y", [])
    with pytest.raises(KeyError):
        store.add_trial(999, 0, {}, "ok")
    with pytest.raises(KeyError):
        store.start_run(p, 999, s, budget={}, seed=0, sampler="tpe", measure="model")


def test_plan_json_is_data(store: PlanStore) -> None:
    p, d, s = make_keys(store)
    plan = {"version": 1, "groups": [{"nodes": [1, 2], "config": {"b": 64}}], "note": "ünïcode"}
    pid = save(store, p, d, s, 1.3, plan=plan)
    got = store.get_plan(pid)
    assert got["plan"] == plan and json.loads(got["plan_json"]) == plan
    pid2 = save(store, p, d, s, 1.4, plan=json.dumps(plan))  # JSON text is accepted as is
    assert store.get_plan(pid2)["plan"] == plan
    with pytest.raises(ValueError):
        save(store, p, d, s, 1.4, plan="[1, 2]")


def test_one_current_plan_per_key(store: PlanStore) -> None:
    check_one_current(store)


def test_lookup_grading(store: PlanStore) -> None:
    check_lookup(store)


def test_lookup_is_one_indexed_query(store: PlanStore) -> None:
    from autofuse.store import queries

    p, d, s = make_keys(store)
    save(store, p, d, s, 1.2)
    stmt = queries.lookup("fp-a", "NVIDIA H200", SW)
    compiled = stmt.compile(store.engine)
    params = tuple(compiled.construct_params()[k] for k in compiled.positiontup)
    with store.engine.connect() as conn:
        plan = [r[-1] for r in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + str(compiled), params)]
    assert not any(line.startswith("SCAN") for line in plan), plan
    assert any("uq_autofuse_plans_current" in line for line in plan), plan


def test_listing_filters(store: PlanStore) -> None:
    pa, d, s = make_keys(store, fp="aaaa1111")
    pb = store.program("bbbb2222", "attention", {}, 40)
    cpu = store.device("cpu")
    runs = {}
    for name, prog, dev, speedup in [("a-gpu", pa, d, 1.5), ("a-cpu", pa, cpu, 0.9), ("b-gpu", pb, d, 1.1)]:
        runs[name] = store.start_run(prog, dev, s, budget={"trials": 1}, seed=0, sampler="random", measure="model")
        store.finish_run(runs[name], "finished", baseline_ms=1.0, best_ms=1 / speedup, speedup=speedup)
        save(store, prog, dev, s, speedup, run_id=runs[name])
    with store.engine.begin() as conn:
        conn.execute(
            sa.update(Run).where(Run.id == runs["a-cpu"]).values(started_at=dt.datetime(2025, 1, 1, 12))
        )

    ids = lambda rows: sorted(r["id"] for r in rows)  # noqa: E731
    assert ids(store.runs()) == sorted(runs.values())
    assert ids(store.runs(program="mlp")) == sorted([runs["a-gpu"], runs["a-cpu"]])
    assert ids(store.runs(program="bbbb")) == [runs["b-gpu"]]  # fingerprint prefix
    assert ids(store.runs(device="h200")) == sorted([runs["a-gpu"], runs["b-gpu"]])
    assert ids(store.runs(since="2025-06-01")) == sorted([runs["a-gpu"], runs["b-gpu"]])
    assert ids(store.runs(since=dt.date(2024, 12, 31))) == sorted(runs.values())
    assert ids(store.runs(min_speedup=1.0)) == sorted([runs["a-gpu"], runs["b-gpu"]])
    assert ids(store.runs(program="mlp", device="H200", min_speedup=1.2)) == [runs["a-gpu"]]
    assert store.runs(program="100%_") == []  # LIKE wildcards are escaped
    with pytest.raises(ValueError, match="YYYY-MM-DD"):
        store.runs(since="last tuesday")

    assert len(store.plans(min_speedup=1.2)) == 1
    assert len(store.plans(device="cpu")) == 1
    assert {r["program"] for r in store.compare()} == {"mlp", "attention"}
    cmp = store.compare(program="mlp")
    assert {(r["device"], r["speedup"]) for r in cmp} == {("NVIDIA H200", 1.5), ("cpu", 0.9)}
    assert all(r["n_plans"] == 1 and r["best_speedup"] == r["speedup"] for r in cmp)


def test_mark_interrupted_in_process(store: PlanStore) -> None:
    p, d, s = make_keys(store)
    kw = dict(budget={"trials": 1}, seed=0, sampler="tpe", measure="model")
    mine = store.start_run(p, d, s, **kw)  # this live process
    elsewhere = store.start_run(p, d, s, host="some-other-host", pid=12345, **kw)
    dead_child = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_child.wait()
    dead = store.start_run(p, d, s, host=socket.gethostname(), pid=dead_child.pid, **kw)
    done = store.start_run(p, d, s, host=socket.gethostname(), pid=dead_child.pid, **kw)
    store.finish_run(done, "failed", error="boom")

    assert store.mark_interrupted() == [dead]
    assert store.mark_interrupted() == []
    assert [store.get_run(r)["status"] for r in (mine, elsewhere, dead, done)] == [
        "running",
        "running",
        "interrupted",
        "failed",
    ]
    assert store.get_run(dead)["ended_at"] is not None
    assert {r["id"] for r in store.unfinished_runs()} == {mine, elsewhere, dead}

    # tune --resume: the interrupted run is taken over by this process.
    r = store.resume_run(dead)
    assert (r["status"], r["pid"], r["budget"], r["seed"]) == ("running", os.getpid(), {"trials": 1}, 0)
    store.finish_run(dead, "finished")
    with pytest.raises(ValueError, match="finished"):
        store.resume_run(dead)
    with pytest.raises(ValueError, match="still running"):
        store.resume_run(elsewhere)


def test_store_itself_imports_no_jax(tmp_path: Path) -> None:
    """autofuse.store / cli / report work with JAX imports forbidden.

    The package ``autofuse/__init__.py`` (not the store's) is bypassed with a
    bare package module so that only the store's own imports are checked.
    """
    code = r"""
import sys, types
root, url, out = sys.argv[1:4]
class NoJax:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("jax", "jaxlib"):
            raise ImportError("jax imported by the store: " + name)
        return None
sys.meta_path.insert(0, NoJax())
pkg = types.ModuleType("autofuse"); pkg.__path__ = [root + "/autofuse"]; sys.modules["autofuse"] = pkg
from autofuse.store import PlanStore
from autofuse.report import write_report
from autofuse import cli
s = PlanStore(url)
p = s.program("fp", "f", {}, 1); d = s.device("cpu"); w = s.software("1", "1", "1", "xla")
r = s.start_run(p, d, w, budget={"trials": 1}, seed=0, sampler="tpe", measure="model")
c = s.add_candidate(r, "sig", "elementwise", [0])
s.add_trial(c, 0, {"b": 1}, "ok", median_ms=1.0)
write_report(s, r, out)
assert cli.main(["runs", "--db", url, "--json"]) == 0
bad = [m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib")]
assert not bad, bad
print("OK")
"""
    res = subprocess.run(
        [sys.executable, "-c", code, str(REPO), f"sqlite:///{tmp_path / 's.db'}", str(tmp_path / "rep")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().endswith("OK")
