"""What every part of the plan store shares: one :class:`Db` (engine, transactions, schema revision) and the schema
check, in one place, so that the parts (runs, trials, plans, shapes, listings...) hold only their own queries.

A part is a module of functions taking the :class:`Db` first; :class:`autofuse.store.PlanStore` binds them.
"""

from __future__ import annotations

import functools
import getpass
import os
import socket
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

from sqlalchemy import exc
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from autofuse.store import db
from autofuse.store.models import MEASURES

T = TypeVar("T")
R = TypeVar("R")
P = ParamSpec("P")

# The migrations a read must ask about: a read-only store may be older than this code (a writable one is always
# upgraded to the head), and reads what a later migration added as "not recorded".
PROMOTION = "0003"  # plan pins, noise and events; a program's function
SHAPES = "0005"  # program structures and shape checks
PHASES = "0006"  # run phases
AUTOTUNE = "0007"  # XLA autotune entries


class Db:
    """The store's one database: an engine (a fresh pool after a fork), its schema revision, and each call one
    transaction, retried on lock conflicts."""

    def __init__(self, url: str | None, *, timeout: float, readonly: bool) -> None:
        self.url: str = db.resolve_url(url)
        self.readonly = readonly
        if readonly:
            self._engine, self.revision = db.open_readonly(url, timeout=timeout)
        else:
            self._engine, self.revision = db.open_engine(self.url, timeout=timeout), db.HEAD_REVISION
        self._pid = os.getpid()

    def has(self, revision: str) -> bool:
        """Whether the schema has migration *revision*'s tables and columns: the one schema check of the store."""
        return (self.revision or "") >= revision

    @property
    def shown(self) -> str:
        """The URL with any password masked, for messages."""
        return db.display_url(self.url)

    @property
    def engine(self) -> Engine:
        """The SQLAlchemy engine (after a fork, a fresh pool for this process)."""
        if os.getpid() != self._pid:
            # Never share pooled connections across fork().
            self._engine.dispose(close=False)
            self._pid = os.getpid()
        return self._engine

    def close(self) -> None:
        """Release pooled connections (the store can still be used after)."""
        self._engine.dispose()

    def guard(self, fn: Callable[[], T], *, retry_integrity: bool = False) -> T:
        """``fn()`` retried on lock conflicts, a known database failure raised as a :class:`db.StoreError`."""
        try:
            return db.with_retry(fn, url=self.url, retry_integrity=retry_integrity)
        except (exc.SQLAlchemyError, OSError) as e:
            db.raise_translated(e, self.url)

    def write(self, fn: Callable[[Session], T], *, retry_integrity: bool = False) -> T:
        """Run ``fn(session)`` in one write transaction, retried on lock conflicts."""
        if self.readonly:
            raise db.ReadOnlyStoreError(f"the plan store {self.shown} was opened read-only; a write was asked for")

        def attempt() -> T:
            with self.engine.connect() as conn:
                conn.execution_options(autofuse_write=True)
                with Session(bind=conn, expire_on_commit=False, autoflush=True) as s, s.begin():
                    return fn(s)

        return self.guard(attempt, retry_integrity=retry_integrity)

    def read(self, stmt: Any) -> list[dict[str, Any]]:
        """The rows of *stmt* as dicts, in one read transaction."""

        def attempt() -> list[dict[str, Any]]:
            with db.transaction(self.engine, write=False) as conn:
                return [dict(r._mapping) for r in conn.execute(stmt)]

        return self.guard(attempt)


def since(revision: str, empty: Callable[[], R]) -> Callable[[Callable[Concatenate[Db, P], R]], Callable[Concatenate[Db, P], R]]:
    """A read of what migration *revision* added: on an older store it answers ``empty()`` (nothing recorded)
    instead of asking for tables or columns that are not there."""

    def wrap(fn: Callable[Concatenate[Db, P], R]) -> Callable[Concatenate[Db, P], R]:
        @functools.wraps(fn)
        def checked(store: Db, /, *args: P.args, **kwargs: P.kwargs) -> R:
            return fn(store, *args, **kwargs) if store.has(revision) else empty()

        return checked

    return wrap


def require(s: Session, model: type, ident: int, what: str, *, lock: bool = False) -> Any:
    """The row *ident* of *model*; KeyError if absent.

    *lock*: also row-lock it until the transaction ends (``SELECT ... FOR NO KEY UPDATE`` on PostgreSQL, which does
    not block other writers' foreign-key checks against the row; SQLite ignores it, its writers are serialised
    already).
    """
    obj = s.get(model, ident, with_for_update={"key_share": True} if lock else None)
    if obj is None:
        raise KeyError(f"no {what} with id {ident}")
    return obj


def whoami() -> str:
    """``user@host``, recorded with every change to a plan."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry in some containers
        user = f"uid{os.getuid()}"
    return f"{user}@{socket.gethostname()}"


def this_process(host: str | None, pid: int | None) -> tuple[str | None, int | None]:
    """*host* and *pid*, or this process's where neither is given: who owns a run, for telling when it died."""
    if host is None and pid is None:
        return socket.gethostname(), os.getpid()
    return host, pid


def check_measure(measure: str) -> None:
    """Refuse a measure the store does not know (a typo would make plans incomparable)."""
    if measure not in MEASURES:
        raise ValueError(f"invalid measure {measure!r}: expected one of {', '.join(MEASURES)}")


def opt_float(x: float | None) -> float | None:
    """*x* as a float, None kept: numpy scalars must not reach the database driver."""
    return None if x is None else float(x)
