"""Optuna's RDB storage in the plan store's database (Optuna owns its own tables and `alembic_version` there).

On SQLite every Optuna transaction takes the write lock up front, so workers
sharing one file never take the same waiting trial; creating Optuna's tables
races when two jobs start on a new file at once, and is retried.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from autofuse.store import db


def optuna_storage(url: str, *, heartbeat_s: int | None = None, on_stale: Callable[[Any, Any], None] | None = None) -> Any:
    """Optuna's RDB storage at `url`. With `heartbeat_s`, trials send heartbeats and a trial silent for
    5 heartbeats (its worker died) is failed, then `on_stale(study, trial)` runs once for it."""
    import optuna
    import sqlalchemy.exc

    kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}
    hb = {"heartbeat_interval": heartbeat_s, "grace_period": 5 * heartbeat_s, "heartbeat_stale_trial_callback": on_stale} if heartbeat_s else {}
    for attempt in range(5):
        try:
            storage = optuna.storages.RDBStorage(url, engine_kwargs=kwargs, **hb)
            db.serialise_sqlite(storage.engine)  # workers on one SQLite file must not take the same waiting trial
            return storage
        except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.OperationalError):
            # Another job created Optuna's tables at the same moment (its alembic_version row races): they exist now.
            if attempt == 4:
                raise
            time.sleep(0.2 * (attempt + 1))
