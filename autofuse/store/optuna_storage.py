"""Optuna's RDB storage in the plan store's database (Optuna owns its own tables and `alembic_version` there).

On SQLite every Optuna transaction that may write takes the write lock up
front, so workers sharing one file never take the same waiting trial; its
reads (the sampler reading a study's trials, a trial read back) take none, so
they never queue behind the other workers' writes. Creating Optuna's tables
races when two jobs start on a new file at once, and is retried.
"""
from __future__ import annotations

import functools
import time
from typing import Any, Callable

from autofuse.store import db

# RDBStorage's methods that only read: on SQLite their transactions begin unlocked (`db.reading`).
READ_METHODS = ("get_study_id_from_name", "get_study_name_from_id", "get_study_directions", "get_study_user_attrs",
                "get_study_system_attrs", "get_trial_user_attrs", "get_trial_system_attrs", "get_all_studies", "get_trial_param",
                "get_trial_id_from_study_id_trial_number", "get_trial", "get_all_trials", "_get_trials", "get_best_trial",
                "_get_stale_trial_ids")  # the last: at every trial's start, with heartbeats


@functools.cache
def _storage_class() -> type:
    """Optuna's RDBStorage with its reads marked as reads."""
    import optuna

    def unlocked(method: Callable) -> Callable:
        @functools.wraps(method)
        def read(self: Any, *args: Any, **kwargs: Any) -> Any:
            with db.reading():
                return method(self, *args, **kwargs)
        return read

    return type("ReadUnlockedRDBStorage", (optuna.storages.RDBStorage,),
                {name: unlocked(getattr(optuna.storages.RDBStorage, name)) for name in READ_METHODS})


def optuna_storage(url: str, *, heartbeat_s: int | None = None, on_stale: Callable[[Any, Any], None] | None = None) -> Any:
    """Optuna's RDB storage at `url`. With `heartbeat_s`, trials send heartbeats and a trial silent for
    5 heartbeats (its worker died) is failed, then `on_stale(study, trial)` runs once for it."""
    import sqlalchemy.exc

    kwargs = {"connect_args": db.sqlite_connect_args(60)} if url.startswith("sqlite") else {}
    hb = {"heartbeat_interval": heartbeat_s, "grace_period": 5 * heartbeat_s, "heartbeat_stale_trial_callback": on_stale} if heartbeat_s else {}
    for attempt in range(5):
        try:
            storage = _storage_class()(url, engine_kwargs=kwargs, **hb)
            db.serialise_sqlite(storage.engine)  # workers on one SQLite file must not take the same waiting trial
            return storage
        except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.OperationalError):
            # Another job created Optuna's tables at the same moment (its alembic_version row races): they exist now.
            if attempt == 4:
                raise
            time.sleep(0.2 * (attempt + 1))
