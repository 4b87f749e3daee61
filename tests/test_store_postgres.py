"""The plan store against a real PostgreSQL server: the SQLite tests' checks, plus
PostgreSQL-only ones (schema vs models, index use, Optuna in the same database,
processes and threads racing).

Runs only when ``AUTOFUSE_TEST_PG_URL`` is set, e.g.
``postgresql+psycopg://user:pw@127.0.0.1/autofuse_test`` (the driver is in the
``postgres`` and ``test`` extras); with ``AUTOFUSE_REQUIRE_PG=1`` (CI, see
``.ci/run`` and ``scripts/start-postgres``) a missing URL fails these tests
instead of skipping them. Each test works in its own throw-away schema
(``search_path``), dropped afterwards, so the database's other contents are
never touched.
"""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from autofuse.store import PlanStore, StoreError, db, queries
from autofuse.store.models import Base

try:
    import test_store as ts
    import test_store_reliability as tr
except ImportError:  # tests/ is a package
    from tests import test_store as ts  # type: ignore[no-redef]
    from tests import test_store_reliability as tr  # type: ignore[no-redef]

SW, make_keys, save = ts.SW, ts.make_keys, ts.save

PG_URL = os.environ.get("AUTOFUSE_TEST_PG_URL")
REQUIRE_PG = os.environ.get("AUTOFUSE_REQUIRE_PG", "") not in ("", "0")

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.skipif(
        not PG_URL and not REQUIRE_PG, reason="set AUTOFUSE_TEST_PG_URL=postgresql+psycopg://... to run"
    ),
]


@pytest.fixture(autouse=True)
def _require_pg() -> None:
    if not PG_URL:
        pytest.fail("AUTOFUSE_REQUIRE_PG is set but AUTOFUSE_TEST_PG_URL is not: the PostgreSQL tests cannot run")


@pytest.fixture
def pg_store(pg_url: str) -> PlanStore:
    store = PlanStore(pg_url)
    yield store
    store.close()


def test_pg_schema_roundtrip(pg_url: str) -> None:
    ts.check_schema_roundtrip(pg_url)


def test_pg_models_match_migrations(pg_store: PlanStore) -> None:
    """Types (JSON, timestamps, booleans), constraints and indexes (the expression
    and partial unique ones included) as migrated agree with the models."""
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    def include(obj, name, type_, reflected, compare_to):  # noqa: ANN001
        if type_ == "table":
            return name.startswith("autofuse_") and name != db.VERSION_TABLE
        return True

    store = pg_store
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # expression-based index comparison is skipped
        with store.engine.connect() as conn:
            mc = MigrationContext.configure(conn, opts={"include_object": include, "compare_type": True})
            assert compare_metadata(mc, Base.metadata) == []
            indexes = dict(conn.execute(sa.text(
                "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = current_schema()"
            )).all())
    assert indexes["uq_autofuse_plans_current"].startswith("CREATE UNIQUE INDEX")
    assert indexes["uq_autofuse_plans_current"].endswith("WHERE is_current")
    assert "COALESCE(sm_count" in indexes["uq_autofuse_devices_key"]


def test_pg_get_or_create_dimensions(pg_store: PlanStore) -> None:
    ts.test_get_or_create_dimensions(pg_store)


def test_pg_run_lifecycle(pg_store: PlanStore) -> None:
    """JSON columns, aware UTC timestamps, trial replacement, KeyErrors."""
    ts.test_run_lifecycle(pg_store)


def test_pg_plan_json_is_data(pg_store: PlanStore) -> None:
    ts.test_plan_json_is_data(pg_store)


def test_pg_one_current_plan_per_key(pg_store: PlanStore) -> None:
    ts.check_one_current(pg_store)


def test_pg_lookup_grading(pg_store: PlanStore) -> None:
    ts.check_lookup(pg_store)


def test_pg_lookup_can_use_the_current_plan_index(pg_store: PlanStore) -> None:
    store = pg_store
    p, d, s = make_keys(store)
    save(store, p, d, s, 1.2)
    with store.engine.connect() as conn:
        sql = queries.lookup("fp-a", "NVIDIA H200", SW).compile(conn, compile_kwargs={"literal_binds": True})
        conn.exec_driver_sql("SET enable_seqscan = off")  # tiny tables: make the planner show what it can use
        plan = "\n".join(r[0] for r in conn.exec_driver_sql(f"EXPLAIN {sql}"))
    assert "uq_autofuse_plans_current" in plan, plan


def test_pg_listing_filters(pg_store: PlanStore) -> None:
    """Filters (ILIKE device, LIKE-escaped fingerprint prefix, dates), compare."""
    ts.test_listing_filters(pg_store)


def test_pg_mark_interrupted_and_resume(pg_store: PlanStore) -> None:
    ts.test_mark_interrupted_in_process(pg_store)


def test_pg_newer_schema_is_refused(pg_url: str) -> None:
    ts.check_newer_schema_refused(pg_url)


@pytest.mark.slow
def test_pg_optuna_and_autofuse_share_one_database(pg_url: str) -> None:
    """optuna.storages.RDBStorage(url) and our Alembic migrations in one database (schema):
    a study with trials, then our upgrade, store and lookup, both usable after, our
    autofuse_alembic_version distinct from Optuna's alembic_version."""
    tr.check_optuna_shares_database(pg_url)


@pytest.mark.slow
def test_pg_processes_race_schema_creation_and_writes(pg_url: str, tmp_path: Path) -> None:
    """Two processes create the schema at the same instant, then interleave writes."""
    tr.check_processes_write_concurrently(pg_url, tmp_path)


@pytest.mark.slow
def test_pg_sigkilled_run_is_marked_interrupted(pg_url: str) -> None:
    tr.check_sigkilled_run(pg_url)


@pytest.mark.slow
def test_pg_alembic_command_line(pg_url: str, tmp_path: Path) -> None:
    tr.check_alembic_command_line(pg_url, tmp_path)


@pytest.mark.slow
def test_pg_concurrent_writers_keep_one_current_plan(pg_url: str) -> None:
    """Threads with their own stores race get-or-create and save_plan on one key."""
    PlanStore(pg_url).close()
    errors: list[BaseException] = []

    def work(tag: str) -> None:
        try:
            store = PlanStore(pg_url)
            p, d, s = make_keys(store, fp="fp-race")
            for i in range(15):
                run = store.start_run(p, d, s, budget={}, seed=i, sampler=tag, measure="model")
                cand = store.add_candidate(run, "sig", "elementwise", [0])
                store.add_trial(cand, 0, {"i": i}, "ok", median_ms=1.0)
                save(store, p, d, s, 1.0 + i / 100, run_id=run)
                store.finish_run(run, "finished")
            store.close()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(f"t{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    store = PlanStore(pg_url)
    assert len(store.runs()) == 60
    assert len(store.plans(current_only=True)) == 1
    assert store.lookup("fp-race", "NVIDIA H200", SW).match == "exact"


def test_pg_unreachable_server() -> None:
    assert PG_URL
    u = make_url(PG_URL).set(host="127.0.0.1", port=1, password="hunter2")
    with pytest.raises(StoreError, match="cannot reach database server") as e:
        PlanStore(u.render_as_string(hide_password=False))
    assert "hunter2" not in str(e.value)
