"""The same schema / lookup checks against a real PostgreSQL server.

Runs only when ``AUTOFUSE_TEST_PG_URL`` is set, e.g.
``postgresql+psycopg://user:pw@localhost/autofuse_test`` (needs the driver:
``pip install psycopg``). Each test works in its own throw-away schema
(``search_path``), dropped afterwards, so the database's other contents are
never touched.
"""

from __future__ import annotations

import os
import threading
import uuid

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from autofuse.store import PlanStore, StoreError

try:
    from test_store import (
        SW,
        check_lookup,
        check_newer_schema_refused,
        check_one_current,
        check_schema_roundtrip,
        make_keys,
        save,
    )
except ImportError:  # tests/ became a package
    from tests.test_store import (  # type: ignore[no-redef]
        SW,
        check_lookup,
        check_newer_schema_refused,
        check_one_current,
        check_schema_roundtrip,
        make_keys,
        save,
    )

PG_URL = os.environ.get("AUTOFUSE_TEST_PG_URL")

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.skipif(not PG_URL, reason="set AUTOFUSE_TEST_PG_URL=postgresql+psycopg://... to run"),
]


@pytest.fixture
def pg_url() -> str:
    """A URL whose search_path is a fresh schema, dropped after the test."""
    assert PG_URL
    schema = f"autofuse_test_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(PG_URL)
    with admin.begin() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    url = make_url(PG_URL).update_query_dict({"options": f"-csearch_path={schema}"})
    try:
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.begin() as conn:
            conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


def test_pg_schema_roundtrip(pg_url: str) -> None:
    check_schema_roundtrip(pg_url)


def test_pg_one_current_plan_per_key(pg_url: str) -> None:
    check_one_current(PlanStore(pg_url))


def test_pg_lookup_grading(pg_url: str) -> None:
    check_lookup(PlanStore(pg_url))


def test_pg_newer_schema_is_refused(pg_url: str) -> None:
    check_newer_schema_refused(pg_url)


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
