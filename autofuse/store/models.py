"""SQLAlchemy 2 ORM models of the autofuse plan store.

All tables are prefixed ``autofuse_`` so that they can share one database
file with Optuna's RDB storage (which owns ``alembic_version``, ``studies``,
``trials``, ...). The schema is created and changed only by the Alembic
migrations in :mod:`autofuse.store.migrations`; a test checks that these models
and the migrated schema agree.

Timestamps are stored as naive UTC and come back as timezone-aware UTC
``datetime`` objects on every backend.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

RUN_STATUSES = ("running", "finished", "interrupted", "failed")
MEASURES = ("device", "model")

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> _dt.datetime:
    """The current time, timezone-aware UTC."""
    return _dt.datetime.now(_dt.timezone.utc)


class UTCDateTime(sa.types.TypeDecorator):
    """A datetime stored as naive UTC, returned as aware UTC.

    Naive datetimes given to it are taken to be UTC already.
    """

    impl = sa.DateTime
    cache_ok = True

    def process_bind_param(self, value: _dt.datetime | None, dialect: Any) -> _dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is not None:
            value = value.astimezone(_dt.timezone.utc).replace(tzinfo=None)
        return value

    def process_result_value(self, value: _dt.datetime | None, dialect: Any) -> _dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=_dt.timezone.utc)
        return value.astimezone(_dt.timezone.utc)


# JSON that stores Python None as SQL NULL rather than the JSON literal null.
JSONType = sa.JSON(none_as_null=True)


class Base(DeclarativeBase):
    metadata = sa.MetaData(naming_convention=NAMING_CONVENTION)


class Program(Base):
    """A captured JAX program, identified by its graph fingerprint."""

    __tablename__ = "autofuse_programs"

    id: Mapped[int] = mapped_column(primary_key=True)
    fingerprint: Mapped[str] = mapped_column(sa.String(128), unique=True, index=True)
    name: Mapped[str] = mapped_column(sa.String(255))
    signature: Mapped[dict[str, Any]] = mapped_column(JSONType)
    size: Mapped[int] = mapped_column(sa.Integer)
    created_at: Mapped[_dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    # ``module:qualname`` of the tuned function (migration 0003; NULL for older rows): a miss at deploy
    # time names this function's plans for other shapes or static values.
    function: Mapped[str | None] = mapped_column(sa.String(512), index=True)
    # Migration 0005: the program with its sizes abstracted (`Graph.structure`; NULL for older rows, filled in
    # when a deploy meets the function again): a plan of one program may serve the others of its structure.
    structure: Mapped[str | None] = mapped_column(sa.String(64), index=True)


class Device(Base):
    """A device kind (not one physical card): name plus capabilities."""

    __tablename__ = "autofuse_devices"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(sa.String(255), index=True)
    compute_capability: Mapped[str | None] = mapped_column(sa.String(32))
    sm_count: Mapped[int | None] = mapped_column(sa.Integer)
    memory_bytes: Mapped[int | None] = mapped_column(sa.BigInteger)

    # NULLs are distinct in a plain UNIQUE constraint on every backend, so the
    # key is enforced by an expression index that maps NULL to a sentinel.
    __table_args__ = (
        sa.Index(
            "uq_autofuse_devices_key",
            "name",
            sa.func.coalesce(sa.column("compute_capability"), ""),
            sa.func.coalesce(sa.column("sm_count"), -1),
            sa.func.coalesce(sa.column("memory_bytes"), -1),
            unique=True,
        ),
    )


class Software(Base):
    """The software stack a measurement was made with."""

    __tablename__ = "autofuse_software"

    id: Mapped[int] = mapped_column(primary_key=True)
    jax: Mapped[str] = mapped_column(sa.String(64))
    jaxlib: Mapped[str] = mapped_column(sa.String(64))
    autofuse: Mapped[str] = mapped_column(sa.String(64))
    backend: Mapped[str] = mapped_column(sa.String(64), index=True)

    __table_args__ = (sa.UniqueConstraint("jax", "jaxlib", "autofuse", "backend"),)


class Run(Base):
    """One tuning job for one program on one device and software stack."""

    __tablename__ = "autofuse_runs"

    id: Mapped[int] = mapped_column(primary_key=True)
    program_id: Mapped[int] = mapped_column(sa.ForeignKey("autofuse_programs.id"), index=True)
    device_id: Mapped[int] = mapped_column(sa.ForeignKey("autofuse_devices.id"), index=True)
    software_id: Mapped[int] = mapped_column(sa.ForeignKey("autofuse_software.id"))
    budget: Mapped[dict[str, Any]] = mapped_column(JSONType)
    seed: Mapped[int] = mapped_column(sa.Integer)
    sampler: Mapped[str] = mapped_column(sa.String(64))
    status: Mapped[str] = mapped_column(sa.String(16), index=True)
    measure: Mapped[str] = mapped_column(sa.String(16))
    started_at: Mapped[_dt.datetime] = mapped_column(UTCDateTime(), default=utcnow, index=True)
    ended_at: Mapped[_dt.datetime | None] = mapped_column(UTCDateTime())
    baseline_ms: Mapped[float | None] = mapped_column(sa.Float)
    best_ms: Mapped[float | None] = mapped_column(sa.Float)
    speedup: Mapped[float | None] = mapped_column(sa.Float)
    host: Mapped[str | None] = mapped_column(sa.String(255))
    pid: Mapped[int | None] = mapped_column(sa.Integer)
    optuna_storage: Mapped[str | None] = mapped_column(sa.Text)
    optuna_study_prefix: Mapped[str] = mapped_column(sa.String(255), default="")
    error: Mapped[str | None] = mapped_column(sa.Text)
    # Runs shared by several workers (migration 0002): what a worker rebuilds the program from, and
    # which worker (host:pid) won the one final selection.
    job: Mapped[dict[str, Any] | None] = mapped_column(JSONType)
    selected_by: Mapped[str | None] = mapped_column(sa.String(255))
    # Migration 0006: seconds from started_at at which each phase of the job ended (setup, xla, trials, selected,
    # saved; the job's own start before the run row as "start"), each worker's under "workers", the selection's
    # parts under "selection" (`PlanStore.mark_phase`); NULL for older runs.
    phases: Mapped[dict[str, Any] | None] = mapped_column(JSONType)

    __table_args__ = (
        sa.CheckConstraint(
            "status IN ('running', 'finished', 'interrupted', 'failed')", name="status"
        ),
        sa.CheckConstraint("measure IN ('device', 'model')", name="measure"),
    )


class Candidate(Base):
    """A candidate fused group of a run, with the best tile config found."""

    __tablename__ = "autofuse_candidates"

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(
        sa.ForeignKey("autofuse_runs.id", ondelete="CASCADE"), index=True
    )
    signature: Mapped[str] = mapped_column(sa.String(128))
    template: Mapped[str] = mapped_column(sa.String(64))
    nodes: Mapped[list[int]] = mapped_column(JSONType)
    best_config: Mapped[dict[str, Any] | None] = mapped_column(JSONType)
    best_ms: Mapped[float | None] = mapped_column(sa.Float)
    xla_ms: Mapped[float | None] = mapped_column(sa.Float)
    status: Mapped[str] = mapped_column(sa.String(32), default="pending")
    n_trials: Mapped[int] = mapped_column(sa.Integer, default=0)
    # Migration 0004: its XLA timing, shared out among a run's workers (NULL: not timed; "running": claimed
    # by xla_worker at xla_claimed_at; then the timing's status) and the device that timed it.
    xla_status: Mapped[str | None] = mapped_column(sa.String(32))
    xla_worker: Mapped[str | None] = mapped_column(sa.String(255))
    xla_claimed_at: Mapped[_dt.datetime | None] = mapped_column(UTCDateTime())
    xla_device: Mapped[str | None] = mapped_column(sa.String(255))

    __table_args__ = (sa.UniqueConstraint("run_id", "signature", "template"),)


class Trial(Base):
    """One measured (or failed) config of a candidate."""

    __tablename__ = "autofuse_trials"

    id: Mapped[int] = mapped_column(primary_key=True)
    candidate_id: Mapped[int] = mapped_column(
        sa.ForeignKey("autofuse_candidates.id", ondelete="CASCADE")
    )
    number: Mapped[int] = mapped_column(sa.Integer)
    config: Mapped[dict[str, Any]] = mapped_column(JSONType)
    median_ms: Mapped[float | None] = mapped_column(sa.Float)
    min_ms: Mapped[float | None] = mapped_column(sa.Float)
    max_ms: Mapped[float | None] = mapped_column(sa.Float)
    status: Mapped[str] = mapped_column(sa.String(32))
    error: Mapped[str | None] = mapped_column(sa.Text)
    optuna_trial_id: Mapped[int | None] = mapped_column(sa.Integer)
    created_at: Mapped[_dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)
    # Migration 0004: who measured it (host:pid), on which device (jax device and CUDA_VISIBLE_DEVICES), when done.
    worker: Mapped[str | None] = mapped_column(sa.String(255))
    device: Mapped[str | None] = mapped_column(sa.String(255))
    finished_at: Mapped[_dt.datetime | None] = mapped_column(UTCDateTime())

    # Also the index that serves "trials of a candidate, in order".
    __table_args__ = (sa.UniqueConstraint("candidate_id", "number"),)


class Plan(Base):
    """A validated fusion plan for (program, device, software).

    At most one row per key has ``is_current`` set; a partial unique index
    enforces it and serves :meth:`PlanStore.lookup`. A pinned plan is always
    the current one.
    """

    __tablename__ = "autofuse_plans"

    id: Mapped[int] = mapped_column(primary_key=True)
    program_id: Mapped[int] = mapped_column(sa.ForeignKey("autofuse_programs.id"))
    device_id: Mapped[int] = mapped_column(sa.ForeignKey("autofuse_devices.id"))
    software_id: Mapped[int] = mapped_column(sa.ForeignKey("autofuse_software.id"))
    run_id: Mapped[int | None] = mapped_column(
        sa.ForeignKey("autofuse_runs.id", ondelete="SET NULL"), index=True
    )
    plan_json: Mapped[str] = mapped_column(sa.Text)
    measured_ms: Mapped[float] = mapped_column(sa.Float)
    baseline_ms: Mapped[float] = mapped_column(sa.Float)
    speedup: Mapped[float] = mapped_column(sa.Float)
    measure: Mapped[str] = mapped_column(sa.String(16))
    tolerance: Mapped[dict[str, Any]] = mapped_column(JSONType)
    max_error: Mapped[float] = mapped_column(sa.Float)
    is_current: Mapped[bool] = mapped_column(sa.Boolean, default=False)
    created_at: Mapped[_dt.datetime] = mapped_column(UTCDateTime(), default=utcnow, index=True)
    # Migration 0003: a pinned plan is current and no tuning job replaces it; noise is the spread of
    # the plan/jax.jit ratio at validation (None: modelled, or older), the margin a successor must beat.
    pinned: Mapped[bool] = mapped_column(sa.Boolean, default=False, server_default=sa.false())
    noise: Mapped[float | None] = mapped_column(sa.Float)

    __table_args__ = (
        sa.CheckConstraint("measure IN ('device', 'model')", name="measure"),
        sa.Index("ix_autofuse_plans_key", "program_id", "device_id", "software_id"),
        sa.Index(
            "uq_autofuse_plans_current",
            "program_id",
            "device_id",
            "software_id",
            unique=True,
            sqlite_where=sa.text("is_current = 1"),
            postgresql_where=sa.text("is_current"),
        ),
    )


class PlanEvent(Base):
    """One change to the plans of a program: what a tuning job decided about its plan, or a person's
    promote, pin, unpin or rm. ``plan_id`` has no foreign key: the record of a removed plan stays."""

    __tablename__ = "autofuse_plan_events"

    id: Mapped[int] = mapped_column(primary_key=True)
    plan_id: Mapped[int] = mapped_column(sa.Integer, index=True)
    program_id: Mapped[int] = mapped_column(sa.ForeignKey("autofuse_programs.id"))
    run_id: Mapped[int | None] = mapped_column(sa.Integer)
    action: Mapped[str] = mapped_column(sa.String(16))
    actor: Mapped[str] = mapped_column(sa.String(255))
    at: Mapped[_dt.datetime] = mapped_column(UTCDateTime(), default=utcnow, index=True)
    detail: Mapped[str | None] = mapped_column(sa.Text)


SHAPE_VERDICTS = ("ok", "failed")


class PlanShape(Base):
    """A plan checked at a shape it was not tuned for (migration 0005): the program it served there (same
    structure, other sizes), its inputs, the software the check ran with, and the verdict of the check against
    jax.jit (``ok``: it serves that shape; ``failed``: it does not, ``detail`` says why). A process meeting the
    shape again with the same software takes the verdict instead of checking again."""

    __tablename__ = "autofuse_plan_shapes"

    id: Mapped[int] = mapped_column(primary_key=True)
    plan_id: Mapped[int] = mapped_column(sa.ForeignKey("autofuse_plans.id", ondelete="CASCADE"), index=True)
    fingerprint: Mapped[str] = mapped_column(sa.String(128))
    inputs: Mapped[list[str]] = mapped_column(JSONType)
    software_id: Mapped[int] = mapped_column(sa.ForeignKey("autofuse_software.id"))
    verdict: Mapped[str] = mapped_column(sa.String(16))
    detail: Mapped[str | None] = mapped_column(sa.Text)
    actor: Mapped[str] = mapped_column(sa.String(255))
    checked_at: Mapped[_dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)

    __table_args__ = (
        sa.UniqueConstraint("plan_id", "fingerprint", "software_id"),
        sa.CheckConstraint("verdict IN ('ok', 'failed')", name="verdict"),
    )


class XlaAutotune(Base):
    """One file of XLA's per-fusion autotune cache (migration 0007): its name (XLA's cache key) and content, as a
    tuning job measured with them on `device` under `jaxlib`. A deploy that finds a plan writes them into its own
    cache directory, so that the plan database alone carries the GEMM kernels the job measured. XLA does not check
    that an entry came from the same compiler or GPU: the key includes both."""

    __tablename__ = "autofuse_xla_autotune"

    id: Mapped[int] = mapped_column(primary_key=True)
    jaxlib: Mapped[str] = mapped_column(sa.String(64))
    device: Mapped[str] = mapped_column(sa.String(255))
    name: Mapped[str] = mapped_column(sa.String(255))
    content: Mapped[str] = mapped_column(sa.Text)
    created_at: Mapped[_dt.datetime] = mapped_column(UTCDateTime(), default=utcnow)

    # Also the index that serves "the entries of a jaxlib and device".
    __table_args__ = (sa.UniqueConstraint("jaxlib", "device", "name"),)
