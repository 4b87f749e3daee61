"""Engines, URL resolution, schema creation/upgrade and error translation.

* URL: an explicit SQLAlchemy URL, else ``$AUTOFUSE_DB``, else the SQLite file
  ``autofuse/autofuse.db`` in the per-user data directory
  (``$XDG_DATA_HOME`` or ``~/.local/share``).
* SQLite: WAL journal, a busy timeout, foreign keys on, and write
  transactions opened with ``BEGIN IMMEDIATE`` so that concurrent writers wait
  for the lock instead of failing on a stale read snapshot; the writers of one
  host queue for it (`turns`) rather than poll. A new file is made
  only in an existing directory (or the default store's, made at first use).
* Read-only stores (:func:`readonly_reason`: a ``?mode=ro`` URL, or a file or
  directory nobody may write, root included) are never written; readers
  (:func:`reader_engine`) leave no file beside a store, read-only or not.
* Schema: our Alembic migrations live inside the package; the Alembic
  ``Config`` is built programmatically (no ``alembic.ini`` needed at run time)
  and the version table is ``autofuse_alembic_version`` so that Optuna's
  ``alembic_version`` in the same database is never touched. A database
  stamped with a revision this code does not know is refused, never
  downgraded.

Alembic is imported lazily: opening an up-to-date database does not load it.
Its INFO lines (plugins set up, each migration run) stay out of the caller's
logging unless the caller set the ``alembic`` logger's level.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import sqlalchemy as sa
from sqlalchemy import event, exc
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.engine.url import URL

from .turns import TurnConnection

ENV_VAR = "AUTOFUSE_DB"
VERSION_TABLE = "autofuse_alembic_version"
#: The newest schema revision this code knows; a test checks it equals the
#: Alembic head, so the fast path of opening a database needs no Alembic.
HEAD_REVISION = "0007"
MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
DEFAULT_TIMEOUT_S = 30.0
# Any constant: serialises schema migrations between processes on PostgreSQL.
_PG_MIGRATION_LOCK = 0x6175746F66  # "autof"

T = TypeVar("T")


class StoreError(Exception):
    """A plan-store problem with a message meant for the user."""


# --------------------------------------------------------------------------- URLs


def data_dir() -> Path:
    """The per-user autofuse data directory (not created)."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "autofuse"


def default_url() -> str:
    """``$AUTOFUSE_DB`` if set, else the SQLite file in :func:`data_dir`."""
    env = os.environ.get(ENV_VAR)
    if env:
        return env
    return f"sqlite:///{data_dir() / 'autofuse.db'}"


def resolve_url(url: str | None = None) -> str:
    """The URL to use: *url* if given, else :func:`default_url`.

    A bare filesystem path (no ``://``) is taken as a SQLite file.
    """
    if url is None or url == "":
        url = default_url()
    if "://" not in url:
        url = f"sqlite:///{Path(url).expanduser().resolve()}"
    return url


def display_url(url: str | URL) -> str:
    """The URL with any password masked, for messages."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return str(url)


def sqlite_path(url: str | URL) -> str | None:
    """The file path of a SQLite URL, or None (not SQLite, or in memory)."""
    u = make_url(url)
    if u.get_backend_name() != "sqlite":
        return None
    db = u.database
    if not db or db == ":memory:" or db.startswith("file:") and "mode=memory" in db:
        return None
    return db


# ------------------------------------------------------------------------ engines


def _shown(url: str | None) -> str:
    """*url* for a message: the URL, or a bare path with the URL it means."""
    resolved = display_url(resolve_url(url))
    return resolved if url is None or "://" in str(url) else f"{url!r} ({resolved})"


def _parse(url: str, shown: str) -> URL:
    try:
        return make_url(url)
    except exc.ArgumentError as e:
        raise StoreError(f"invalid database URL {shown}: {e}") from None


def create_engine(url: str | None = None, *, timeout: float = DEFAULT_TIMEOUT_S) -> Engine:
    """A configured engine for *url* (resolved with :func:`resolve_url`); creates nothing.

    Raises :class:`StoreError` for a malformed URL or a missing database driver.
    """
    url = resolve_url(url)
    u = _parse(url, repr(url))
    try:
        if u.get_backend_name() == "sqlite":
            engine = sa.create_engine(u, connect_args=sqlite_connect_args(timeout))
            _configure_sqlite(engine, timeout)
        else:
            connect_args: dict[str, Any] = {}
            if u.get_backend_name() == "postgresql" and "connect_timeout" not in u.query:
                connect_args["connect_timeout"] = max(1, int(timeout))
            engine = sa.create_engine(u, pool_pre_ping=True, connect_args=connect_args)
    except (ModuleNotFoundError, ImportError, exc.NoSuchModuleError) as e:
        raise StoreError(f"no database driver for {display_url(u)}: {e}") from None
    except exc.ArgumentError as e:
        raise StoreError(f"invalid database URL {display_url(u)}: {e}") from None
    return engine


def sqlite_connect_args(timeout: float) -> dict[str, Any]:
    """The sqlite3 connect arguments of a writing engine: its busy timeout, and connections that take this host's
    write turns on the file before ``BEGIN IMMEDIATE`` (`turns`)."""
    return {"timeout": timeout, "factory": TurnConnection}


def _configure_sqlite(engine: Engine, timeout: float, *, always_immediate: bool = False, foreign_keys: bool = True) -> None:
    """WAL, busy timeout, foreign keys (unless not *foreign_keys*), and BEGIN / BEGIN IMMEDIATE control
    (BEGIN IMMEDIATE for every transaction with *always_immediate*)."""

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Let SQLAlchemy's "begin" event below emit BEGIN itself.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        try:
            cur.execute(f"PRAGMA busy_timeout = {int(timeout * 1000)}")
            if foreign_keys:
                cur.execute("PRAGMA foreign_keys = ON")
            mode = cur.execute("PRAGMA journal_mode").fetchone()[0]
            if mode.lower() not in ("wal", "memory"):
                cur.execute("PRAGMA journal_mode = WAL")
            # Durable against process crashes in WAL mode; only an OS crash or
            # power loss can drop the last transactions.
            cur.execute("PRAGMA synchronous = NORMAL")
        finally:
            cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        if (always_immediate and not _reads.active) or conn.get_execution_options().get("autofuse_write"):
            dbapi_conn = conn.connection.dbapi_connection
            if isinstance(dbapi_conn, TurnConnection):
                dbapi_conn.take_turn()
            try:
                conn.exec_driver_sql("BEGIN IMMEDIATE")
            except BaseException:
                if isinstance(dbapi_conn, TurnConnection):
                    dbapi_conn.rollback()  # no transaction began: this gives the turn back
                raise
        else:
            conn.exec_driver_sql("BEGIN")


class _Reads(threading.local):
    active = False


_reads = _Reads()


@contextlib.contextmanager
def reading() -> Iterator[None]:
    """Transactions this thread begins meanwhile only read: on an engine `serialise_sqlite` made, they take no lock."""
    was, _reads.active = _reads.active, True
    try:
        yield
    finally:
        _reads.active = was


def serialise_sqlite(engine: Engine, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """Make every transaction of another library's SQLite engine (Optuna's) take the write lock up front.

    Python's sqlite3 runs a SELECT outside any transaction and opens one only
    at the next write, so a read-then-update (Optuna taking a waiting trial:
    WAITING -> RUNNING) is not atomic across processes and two workers can take
    the same trial. With ``BEGIN IMMEDIATE`` such transactions take turns,
    waiting up to the busy timeout. Drops the connections pooled so far.
    """
    if engine.dialect.name != "sqlite":
        return
    _configure_sqlite(engine, timeout, always_immediate=True, foreign_keys=False)  # its own rules otherwise unchanged
    engine.dispose()


@contextlib.contextmanager
def transaction(engine: Engine, *, write: bool) -> Iterator[Connection]:
    """A connection inside one transaction, committed on success.

    On SQLite a write transaction takes the write lock up front
    (``BEGIN IMMEDIATE``), waiting up to the busy timeout for it.
    """
    with engine.connect() as conn:
        if write:
            conn.execution_options(autofuse_write=True)
        with conn.begin():
            yield conn


# ------------------------------------------------------------------------ errors


def _first_line(e: BaseException) -> str:
    orig = getattr(e, "orig", None) or e
    text = str(orig).strip() or type(orig).__name__
    return text.splitlines()[0]


def translate_error(e: BaseException, url: str | URL) -> StoreError | None:
    """A :class:`StoreError` for a known, user-facing database failure, else None."""
    if isinstance(e, StoreError):
        return e
    msg = _first_line(e)
    low = msg.lower()
    path = sqlite_path(url)
    if path is not None:
        if "file is not a database" in low or "malformed" in low or "not a database" in low:
            return StoreError(f"file is not an autofuse database or is corrupt: {path}")
        if "unable to open database file" in low:
            return StoreError(f"cannot open database file {path} (check the path and its permissions)")
        if "readonly database" in low or "read-only" in low:
            return StoreError(f"database file is read-only: {path}")
        if "disk i/o error" in low:
            return StoreError(f"disk I/O error on database file {path}")
        return None
    if isinstance(e, (exc.OperationalError, exc.InterfaceError)) or isinstance(e, exc.DBAPIError) and e.connection_invalidated:
        connect_words = ("connect", "could not", "refused", "timeout", "timed out", "resolve", "host", "server")
        if any(w in low for w in connect_words):
            return StoreError(f"cannot reach database server {display_url(url)}: {msg}")
    if isinstance(e, (ModuleNotFoundError, exc.NoSuchModuleError)):
        return StoreError(f"no database driver for {display_url(url)}: {msg}")
    return None


def raise_translated(e: BaseException, url: str | URL) -> NoReturn:
    """Raise *e* as the :class:`StoreError` of :func:`translate_error`, or as it is where that knows no better."""
    err = translate_error(e, url)
    if err is not None:
        raise err from None
    raise e


def is_retryable(e: BaseException) -> bool:
    """A transient lock / serialisation conflict worth retrying."""
    if not isinstance(e, (exc.DBAPIError, sqlite3.Error)):
        return False
    low = _first_line(e).lower()
    if "database is locked" in low or "database table is locked" in low or "database is busy" in low:
        return True
    code = getattr(getattr(e, "orig", None), "sqlstate", None) or getattr(getattr(e, "orig", None), "pgcode", None)
    return code in ("40001", "40P01")  # serialization_failure, deadlock_detected


def with_retry(
    fn: Callable[[], T],
    *,
    url: str | URL,
    deadline_s: float = 120.0,
    retry_integrity: bool = False,
) -> T:
    """Run *fn* (one whole transaction), retrying transient lock conflicts.

    With *retry_integrity*, an ``IntegrityError`` is retried a few times too
    (get-or-create races between processes on a server database).
    """
    start = time.monotonic()
    attempt = 0
    integrity_left = 3
    while True:
        attempt += 1
        try:
            return fn()
        except exc.IntegrityError:
            if not retry_integrity or integrity_left <= 0:
                raise
            integrity_left -= 1
        except (exc.DBAPIError, sqlite3.Error) as e:
            if not is_retryable(e) or time.monotonic() - start > deadline_s:
                raise_translated(e, url)
        time.sleep(min(1.0, 0.01 * 2**attempt) * (0.5 + random.random()))


# ------------------------------------------------------------------------ schema


@contextlib.contextmanager
def quiet_alembic() -> Iterator[None]:
    """Alembic's INFO lines held back while our code imports or runs it: a program logging at INFO did not ask for
    them. Where the program set the ``alembic`` logger's level itself, that level rules; either way it is left as found."""
    logger = logging.getLogger("alembic")
    if logger.level != logging.NOTSET:
        yield
        return
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(logging.NOTSET)


def alembic_config(connection: Connection | None = None) -> Any:
    """An Alembic ``Config`` for our migrations, built without alembic.ini."""
    with quiet_alembic():
        from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("version_table", VERSION_TABLE)
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def _scripts() -> Any:
    """Alembic's ``ScriptDirectory`` of our migrations."""
    with quiet_alembic():
        from alembic.script import ScriptDirectory

        return ScriptDirectory.from_config(alembic_config())


def known_revisions() -> dict[str, Any]:
    """All revisions of our migration scripts, by id."""
    return {s.revision: s for s in _scripts().walk_revisions()}


def head_revision() -> str:
    """The Alembic head revision of our migration scripts."""
    head = _scripts().get_current_head()
    assert head is not None
    return head


def read_revisions(conn: Connection) -> set[str] | None:
    """The revisions in ``autofuse_alembic_version``; None if the table is absent."""
    if not sa.inspect(conn).has_table(VERSION_TABLE):
        return None
    rows = conn.execute(sa.text(f"SELECT version_num FROM {VERSION_TABLE}")).scalars().all()
    return set(rows)


def _check_known(revs: set[str] | None, url: str | URL) -> None:
    if not revs:
        return
    unknown = revs - set(known_revisions())
    if unknown:
        raise StoreError(
            f"database {display_url(url)} has autofuse schema revision "
            f"{', '.join(sorted(unknown))}: created by a newer autofuse; upgrade autofuse "
            f"(this version knows revisions up to {HEAD_REVISION})"
        )


def _migration_lock(conn: Connection) -> None:
    if conn.dialect.name == "postgresql":
        conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_MIGRATION_LOCK})


def _migrate(engine: Engine, direction: str, revision: str) -> tuple[set[str], set[str]]:
    with quiet_alembic():
        from alembic import command

    url = engine.url

    def run() -> tuple[set[str], set[str]]:
        with transaction(engine, write=True) as conn:
            _migration_lock(conn)
            before = read_revisions(conn) or set()
            _check_known(before, url)
            with quiet_alembic():
                getattr(command, direction)(alembic_config(conn), revision)
            after = read_revisions(conn) or set()
        return before, after

    return with_retry(run, url=url)


def upgrade(engine: Engine, revision: str = "head") -> tuple[set[str], set[str]]:
    """Upgrade our schema to *revision*; returns (revisions before, after)."""
    return _migrate(engine, "upgrade", revision)


def downgrade(engine: Engine, revision: str) -> tuple[set[str], set[str]]:
    """Downgrade our schema to *revision* (``base`` drops all autofuse tables)."""
    return _migrate(engine, "downgrade", revision)


def current(engine: Engine) -> set[str]:
    """The schema revisions the database is stamped with (empty: no schema)."""
    with transaction(engine, write=False) as conn:
        return read_revisions(conn) or set()


def history() -> list[dict[str, Any]]:
    """Our migrations, newest first: revision, down_revision, message."""
    out = []
    for rev, s in known_revisions().items():
        out.append({"revision": rev, "down_revision": s.down_revision, "message": s.doc})
    return out


def ensure_schema(engine: Engine) -> None:
    """Create or upgrade our schema if needed; refuse a newer one.

    Fast path (an up-to-date database): one small query, no Alembic import.
    """
    url = engine.url
    revs = with_retry(lambda: current(engine), url=url)
    if revs == {HEAD_REVISION}:
        return
    _check_known(revs, url)
    upgrade(engine, "head")


def open_engine(url: str | None = None, *, timeout: float = DEFAULT_TIMEOUT_S, migrate: bool = True) -> Engine:
    """:func:`create_engine` plus :func:`ensure_schema`, errors as :class:`StoreError`.

    A store that must not be written (:func:`readonly_reason`) is :class:`ReadOnlyStoreError`: read it with
    :func:`open_readonly`. A new SQLite file is made only where :func:`_check_sqlite_file` allows.
    """
    url = resolve_url(url)
    u = _parse(url, _shown(url))
    why = readonly_reason(u)
    if why is not None:
        raise ReadOnlyStoreError(f"the plan store {display_url(u)} is read-only ({why}): it can be read (listings, "
                                 "autofuse.jit lookups), not written")
    path = sqlite_path(u)
    if path is not None:
        _check_sqlite_file(Path(path), display_url(u), create=True)
    engine = create_engine(url, timeout=timeout)

    def ready() -> None:
        if migrate:
            ensure_schema(engine)
        else:
            with transaction(engine, write=False) as conn:
                conn.execute(sa.text("SELECT 1"))

    _guarded(ready, engine, engine.url)
    return engine


class ReadOnlyStoreError(StoreError):
    """A write was asked of a plan store that can only be read."""


def readonly_reason(url: str | URL) -> str | None:
    """Why nothing may write the SQLite store at *url*, or None (it may be written, does not exist yet, or the URL
    is malformed: left to what opens it).

    Its URL asks ``mode=ro``; or the file, or its directory (where SQLite keeps its journal), has no write
    permission bit for anyone, which holds for root too (whose writes the bits do not stop: they still say the
    store is not to change); or this process cannot write it (a read-only mount, another user's file).
    """
    try:
        u = make_url(url)
    except exc.ArgumentError:
        return None
    path = sqlite_path(u)
    if path is None:
        return None
    if u.query.get("mode") == "ro":
        return "its URL says mode=ro"
    file = Path(path)
    if not file.exists():
        return None
    for what, p in (("file", file), ("directory", file.parent)):
        mode = stat.S_IMODE(p.stat().st_mode)
        if not mode & 0o222:
            return f"{what} {p} is mode {mode:04o}, writable by no one"
        if not os.access(p, os.W_OK):
            return f"{what} {p} is not writable"
    return None


def _check_sqlite_file(path: Path, shown: str, *, create: bool) -> None:
    """Refuse a SQLite path that holds no store: a directory, a missing file (to read), or a missing directory (to
    create the file in: a mistyped path is an error, not a new empty store). The default store's directory is made
    at its first use."""
    if path.is_dir():
        raise StoreError(f"{path} is a directory, not a database file")
    if path.exists():
        return
    if not create:
        raise StoreError(f"no plan store at {shown}: {path} does not exist")
    if path.parent.resolve() == data_dir().resolve():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"cannot create the directory of database file {path}: {e.strerror}") from None
    elif not path.parent.is_dir():
        raise StoreError(f"cannot create the plan store {shown}: directory {path.parent} does not exist")


def reader_engine(url: str | None = None, *, timeout: float = DEFAULT_TIMEOUT_S) -> Engine:
    """An engine for reads only: it creates, migrates and writes nothing, and leaves no file beside a SQLite store.

    A missing file, a directory and a malformed URL are :class:`StoreError`s naming the URL.
    """
    resolved, shown = resolve_url(url), _shown(url)
    u = _parse(resolved, shown)
    path = sqlite_path(u)
    if path is None:
        return create_engine(resolved, timeout=timeout)
    _check_sqlite_file(Path(path), shown, create=False)
    return _sqlite_reader(Path(path), timeout, frozen=readonly_reason(u) is not None)


def open_readonly(url: str | None = None, *, timeout: float = DEFAULT_TIMEOUT_S) -> tuple[Engine, str | None]:
    """A :func:`reader_engine` on an autofuse store, and the schema revision it found.

    For reads only (lookups at deploy time, listings). A database without autofuse tables, or with a schema from a
    newer autofuse, is a :class:`StoreError` naming the URL.
    """
    engine = reader_engine(url, timeout=timeout)
    resolved = resolve_url(url)

    def revision() -> str:
        revs = current(engine)
        if not revs:
            raise StoreError(f"{_shown(url)} has no autofuse plan store (nothing was tuned into it)")
        _check_known(revs, resolved)
        return max(revs)

    return engine, _guarded(revision, engine, resolved)


def _guarded[R](fn: Callable[[], R], engine: Engine, url: str | URL) -> R:
    """``fn()``; on any failure the engine is disposed of (nobody else holds it) and the error raised as a
    :class:`StoreError` where it is a known one."""
    try:
        return fn()
    except Exception as e:
        engine.dispose()
        raise_translated(e, url)


def _sqlite_reader(path: Path, timeout: float, *, frozen: bool) -> Engine:
    """A SQLite engine whose reads leave nothing beside the file.

    SQLite deletes a WAL database's ``-wal`` and ``-shm`` only when its last connection closes with write access, so
    a store that may be written is opened so (``query_only``: no statement writes) and each connection is closed
    after its read (no pool). A *frozen* store (:func:`readonly_reason`) opens ``mode=ro``, and ``immutable=1`` while
    no ``-wal`` is beside it: nothing is pending there, and no WAL index is made.
    """
    from urllib.parse import quote

    path = path.resolve()
    uri, wal = f"file:{quote(str(path), safe='/')}", Path(f"{path}-wal")

    def connect() -> sqlite3.Connection:
        mode = "rw" if not frozen else "ro" if wal.exists() else "ro&immutable=1"
        return sqlite3.connect(f"{uri}?mode={mode}", uri=True, timeout=timeout, check_same_thread=False)

    engine = sa.create_engine("sqlite://", creator=connect, poolclass=sa.pool.NullPool)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None
        dbapi_conn.execute(f"PRAGMA busy_timeout = {int(timeout * 1000)}")
        dbapi_conn.execute("PRAGMA query_only = ON")

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN")

    return engine
