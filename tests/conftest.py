"""Fixtures shared by the test modules, the XLA:CPU setting Mosaic GPU interpret mode needs, and a default plan store
of the session's own.

Mosaic GPU interpret mode runs each warpgroup as its own XLA:CPU executable whose callbacks block on the simulated
barriers; XLA's concurrency-optimised scheduler lets those executables' work wait for the threads of the intra-op
pool (two, on a 2-core machine) that blocked callbacks hold: a deadlock that shows at random (a SPLADE case hung in
5 of 6 runs, 0 of 14 with this flag). The plain scheduler only orders independent work differently. `import
autofuse` sets it too (`autofuse.interpret_cpu`), but a test module may start JAX before importing autofuse: set here,
before any test module initialises JAX's CPU backend.
"""
from __future__ import annotations

import importlib.metadata
import os

_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
import shutil
import tempfile
import uuid
from typing import Iterator

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url


# The default plan store (`autofuse.tune()` and `autofuse tune` without a store, `autofuse.jit` without one) is this
# session's own: never the user's $AUTOFUSE_DB or ~/.local/share/autofuse/autofuse.db. Subprocesses inherit it.
os.environ.pop("AUTOFUSE_DB", None)
os.environ.pop("AUTOFUSE_SEARCH_SPACES", None)  # the bundled spaces only, whatever the user's shell sets (test_user_spaces sets its own)
_DATA_HOME = os.environ["XDG_DATA_HOME"] = tempfile.mkdtemp(prefix="autofuse-test-data-")

# autofuse's caches (JAX's compiled programs, the enumerated candidates, built kernels, XLA's autotuning) are the
# suite's own, never the user's ~/.cache/autofuse: $AUTOFUSE_TEST_CACHE, else ~/.cache/autofuse-tests/jaxlib-<v>
# ($XDG_CACHE_HOME if set), kept between runs and clones, shared by the workers and every subprocess. JAX keeps
# compilations of 0.05 s or more there (its default: 1 s), as the suite compiles the same small programs in many tests
# and processes. On the 2-core machine: `--quick` 3:49 -> 3:20 with the caches empty, 2:18 when they are warm.
_CACHE = os.environ.setdefault("AUTOFUSE_TEST_CACHE", os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "autofuse-tests",
    f"jaxlib-{importlib.metadata.version('jaxlib')}"))
for _var, _kind in (("AUTOFUSE_COMPILE_CACHE_DIR", "jax-compile"), ("AUTOFUSE_ENUMERATION_CACHE", "candidates"),
                    ("AUTOFUSE_KERNEL_CACHE_DIR", "kernels"), ("AUTOFUSE_XLA_AUTOTUNE_DIR", "xla-autotune")):
    os.environ[_var] = os.path.join(_CACHE, _kind)
os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)  # autofuse's directory above, not one the user's shell names
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.05"


def pytest_sessionfinish(session, exitstatus) -> None:  # noqa: ANN001
    shutil.rmtree(_DATA_HOME, ignore_errors=True)


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


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ANN001
    """Say why the PostgreSQL tests were skipped (``-q`` shows only a count): one line, with how to run them."""
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if "postgres" in getattr(r, "keywords", {})]
    if not skipped:
        return
    longrepr = skipped[0].longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    reason = reason.removeprefix("Skipped: ")
    terminalreporter.write_line(f"{len(skipped)} PostgreSQL test(s) skipped: {reason} "
                                "(AUTOFUSE_TEST_PG_URL=$(scripts/start-postgres) ./scripts/test -m postgres starts a local server)",
                                yellow=True)
