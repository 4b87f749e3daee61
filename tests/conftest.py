"""Fixtures shared by the test modules."""
from __future__ import annotations

import os
import uuid
from typing import Iterator

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A URL of the test PostgreSQL server ($AUTOFUSE_TEST_PG_URL) whose search_path is a fresh schema, dropped
    after the test, so the database's other contents are never touched."""
    base = os.environ.get("AUTOFUSE_TEST_PG_URL")
    if not base:
        pytest.fail("AUTOFUSE_REQUIRE_PG is set but AUTOFUSE_TEST_PG_URL is not: the PostgreSQL tests cannot run")
    schema = f"autofuse_test_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(base)
    with admin.begin() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    url = make_url(base).update_query_dict({"options": f"-csearch_path={schema}"})
    try:
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.begin() as conn:
            conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()
