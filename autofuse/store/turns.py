"""Write turns on a SQLite file for the processes of one host, taken just before ``BEGIN IMMEDIATE``.

A SQLite writer that finds the file locked polls it with growing sleeps (SQLite's busy handler: 1, 2, 5, 10,
... 100 ms), so when several processes write at once the lock sits idle between their polls. Tuning workers
sharing one store write many short transactions per trial (Optuna's storage takes the write lock for each of
its ~20), and with two workers most of a worker's database time went to those sleeps (0.45 s of SQLite for 175
trials alone; 6.8 s for 108 with a second worker, on this project's CPU machine). Here the writers of one file
queue on a lock file in the temporary directory instead (`fcntl.flock`, polled every half millisecond), so
SQLite's lock is free when they reach it. SQLite's locking stays the guarantee: a process that cannot open the
lock file, or has waited longer than its busy timeout, goes on without a turn.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import sqlite3
import tempfile
import threading
import time
from typing import Any

POLL_S = 0.0005
_registry: dict[str, "Turns"] = {}
_registry_lock = threading.Lock()


def lock_path(database: str) -> str:
    """The lock file of a SQLite file: in the temporary directory (never beside a store that may be read-only)."""
    digest = hashlib.sha256(os.path.realpath(database).encode()).hexdigest()[:20]
    return os.path.join(tempfile.gettempdir(), f"autofuse-sqlite-{digest}.lock")


class Turns:
    """The write turns of one SQLite file in this process: a lock between its threads, `flock` between processes.
    Not re-entrant (a thread nesting two write transactions on one file would wait for itself in SQLite anyway); a
    forked child starts with none held."""

    def __init__(self, database: str) -> None:
        self.path = lock_path(database)
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._locked = False  # whether this process holds the flock

    def _fresh(self) -> None:
        if self._pid != os.getpid():  # forked: the parent's lock and file are not ours
            self._reset()

    def take(self, timeout: float) -> bool:
        """Wait for this file's turn (at most `timeout` seconds for another process's); False: going on without it."""
        self._fresh()
        if not self._lock.acquire(timeout=timeout):
            return False
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            deadline = time.monotonic() + timeout
            while True:
                try:
                    fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    self._locked = True
                    return True
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(POLL_S)
        except OSError:  # no lock file here (a read-only temporary directory): SQLite alone orders the writers
            pass
        self._lock.release()
        return False

    def give_back(self) -> None:
        """End a turn `take` gave."""
        if self._pid != os.getpid():
            return  # taken by the parent before a fork: the parent gives it back
        if self._locked:
            self._locked = False
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._lock.release()


def turns_for(database: str) -> Turns:
    """The one `Turns` of a SQLite file in this process (every engine on it shares them)."""
    key = os.path.realpath(database)
    with _registry_lock:
        if key not in _registry:
            _registry[key] = Turns(database)
        return _registry[key]


class TurnConnection(sqlite3.Connection):
    """A sqlite3 connection that can hold its file's write turn (`take_turn`) until its transaction ends:
    ``sqlite3.connect(..., factory=TurnConnection)``."""

    def __init__(self, database: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(database, *args, **kwargs)
        self._turns = turns_for(os.fspath(database)) if database and os.fspath(database) != ":memory:" else None
        self._turn_timeout = float(kwargs.get("timeout", args[0] if args else 5.0))
        self._holding = False

    def take_turn(self) -> None:
        """The write turn for the transaction this connection is about to begin (released when it ends)."""
        if self._turns is not None and not self._holding:
            self._holding = self._turns.take(self._turn_timeout)

    def _end_turn(self) -> None:
        if self._holding:
            self._holding = False
            self._turns.give_back()

    def commit(self) -> None:
        try:
            super().commit()
        finally:
            self._end_turn()

    def rollback(self) -> None:
        try:
            super().rollback()
        finally:
            self._end_turn()

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._end_turn()
