"""Alembic environment of the autofuse plan store.

Used both programmatically (``autofuse.store.db`` passes an open connection in
``config.attributes["connection"]`` and owns the transaction) and from the
``alembic`` command line with the top-level ``alembic.ini``; there the URL
comes from ``-x db=URL``, else ``sqlalchemy.url`` in the ini file, else
``$AUTOFUSE_DB``, else the default per-user SQLite file.

Only ``autofuse_*`` tables are ours: Optuna's tables and its
``alembic_version`` may live in the same database and are never touched
(``include_object`` hides them from autogenerate).
"""

from __future__ import annotations

from typing import Any

from alembic import context

from autofuse.store import db as _db
from autofuse.store.models import Base, UTCDateTime

config = context.config
if config.config_file_name is not None and config.attributes.get("connection") is None:
    from logging.config import fileConfig

    fileConfig(config.config_file_name, disable_existing_loggers=False)
target_metadata = Base.metadata


def _include_object(obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
    if type_ == "table":
        return bool(name) and name.startswith("autofuse_") and name != _db.VERSION_TABLE
    table = getattr(obj, "table", None)
    if table is not None:
        return table.name.startswith("autofuse_")
    return True


def _render_item(type_: str, obj: Any, autogen_context: Any) -> Any:
    # Migrations must not import our models: render our UTC type as plain DateTime.
    if type_ == "type" and isinstance(obj, UTCDateTime):
        return "sa.DateTime()"
    return False


def _options(dialect_name: str) -> dict[str, Any]:
    return dict(
        target_metadata=target_metadata,
        version_table=_db.VERSION_TABLE,
        include_object=_include_object,
        render_item=_render_item,
        render_as_batch=dialect_name == "sqlite",
        compare_type=True,
    )


def _url() -> str:
    x = context.get_x_argument(as_dictionary=True)
    return _db.resolve_url(x.get("db") or config.get_main_option("sqlalchemy.url") or None)


def run_migrations_offline() -> None:
    url = _url()
    context.configure(url=url, literal_binds=True, **_options(url.split(":", 1)[0].split("+")[0]))
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        context.configure(connection=connection, **_options(connection.dialect.name))
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = _db.create_engine(_url())
    try:
        with _db.transaction(engine, write=True) as conn:
            _db._migration_lock(conn)
            context.configure(connection=conn, **_options(conn.dialect.name))
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
