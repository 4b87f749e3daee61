"""initial schema: programs, devices, software, runs, candidates, trials, plans

Revision ID: 0001
Revises:
Create Date: 2026-11-26

Self-contained on purpose: a migration never imports the current models.
"""

from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0001"
down_revision: Union[str, Sequence[str], None] = None
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    """Create all autofuse_* tables and their indexes."""
    op.create_table(
        "autofuse_programs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("fingerprint", sa.String(length=128), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("signature", sa.JSON(), nullable=False),
        sa.Column("size", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_autofuse_programs")),
    )
    op.create_index(op.f("ix_autofuse_programs_fingerprint"), "autofuse_programs", ["fingerprint"], unique=True)

    op.create_table(
        "autofuse_devices",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("compute_capability", sa.String(length=32), nullable=True),
        sa.Column("sm_count", sa.Integer(), nullable=True),
        sa.Column("memory_bytes", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_autofuse_devices")),
    )
    op.create_index(op.f("ix_autofuse_devices_name"), "autofuse_devices", ["name"], unique=False)
    # Unique on all four columns, NULL counting as a value (a plain UNIQUE
    # constraint treats NULLs as distinct).
    op.create_index(
        "uq_autofuse_devices_key",
        "autofuse_devices",
        [
            "name",
            sa.text("coalesce(compute_capability, '')"),
            sa.text("coalesce(sm_count, -1)"),
            sa.text("coalesce(memory_bytes, -1)"),
        ],
        unique=True,
    )

    op.create_table(
        "autofuse_software",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("jax", sa.String(length=64), nullable=False),
        sa.Column("jaxlib", sa.String(length=64), nullable=False),
        sa.Column("autofuse", sa.String(length=64), nullable=False),
        sa.Column("backend", sa.String(length=64), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_autofuse_software")),
        sa.UniqueConstraint(
            "jax", "jaxlib", "autofuse", "backend", name=op.f("uq_autofuse_software_jax_jaxlib_autofuse_backend")
        ),
    )
    op.create_index(op.f("ix_autofuse_software_backend"), "autofuse_software", ["backend"], unique=False)

    op.create_table(
        "autofuse_runs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("program_id", sa.Integer(), nullable=False),
        sa.Column("device_id", sa.Integer(), nullable=False),
        sa.Column("software_id", sa.Integer(), nullable=False),
        sa.Column("budget", sa.JSON(), nullable=False),
        sa.Column("seed", sa.Integer(), nullable=False),
        sa.Column("sampler", sa.String(length=64), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("measure", sa.String(length=16), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=False),
        sa.Column("ended_at", sa.DateTime(), nullable=True),
        sa.Column("baseline_ms", sa.Float(), nullable=True),
        sa.Column("best_ms", sa.Float(), nullable=True),
        sa.Column("speedup", sa.Float(), nullable=True),
        sa.Column("host", sa.String(length=255), nullable=True),
        sa.Column("pid", sa.Integer(), nullable=True),
        sa.Column("optuna_storage", sa.Text(), nullable=True),
        sa.Column("optuna_study_prefix", sa.String(length=255), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.CheckConstraint("measure IN ('device', 'model')", name=op.f("ck_autofuse_runs_measure")),
        sa.CheckConstraint(
            "status IN ('running', 'finished', 'interrupted', 'failed')", name=op.f("ck_autofuse_runs_status")
        ),
        sa.ForeignKeyConstraint(
            ["program_id"], ["autofuse_programs.id"], name=op.f("fk_autofuse_runs_program_id_autofuse_programs")
        ),
        sa.ForeignKeyConstraint(
            ["device_id"], ["autofuse_devices.id"], name=op.f("fk_autofuse_runs_device_id_autofuse_devices")
        ),
        sa.ForeignKeyConstraint(
            ["software_id"], ["autofuse_software.id"], name=op.f("fk_autofuse_runs_software_id_autofuse_software")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_autofuse_runs")),
    )
    op.create_index(op.f("ix_autofuse_runs_program_id"), "autofuse_runs", ["program_id"], unique=False)
    op.create_index(op.f("ix_autofuse_runs_device_id"), "autofuse_runs", ["device_id"], unique=False)
    op.create_index(op.f("ix_autofuse_runs_status"), "autofuse_runs", ["status"], unique=False)
    op.create_index(op.f("ix_autofuse_runs_started_at"), "autofuse_runs", ["started_at"], unique=False)

    op.create_table(
        "autofuse_candidates",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("signature", sa.String(length=128), nullable=False),
        sa.Column("template", sa.String(length=64), nullable=False),
        sa.Column("nodes", sa.JSON(), nullable=False),
        sa.Column("best_config", sa.JSON(), nullable=True),
        sa.Column("best_ms", sa.Float(), nullable=True),
        sa.Column("xla_ms", sa.Float(), nullable=True),
        sa.Column("status", sa.String(length=32), nullable=False),
        sa.Column("n_trials", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["autofuse_runs.id"],
            name=op.f("fk_autofuse_candidates_run_id_autofuse_runs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_autofuse_candidates")),
        sa.UniqueConstraint(
            "run_id", "signature", "template", name=op.f("uq_autofuse_candidates_run_id_signature_template")
        ),
    )
    op.create_index(op.f("ix_autofuse_candidates_run_id"), "autofuse_candidates", ["run_id"], unique=False)

    op.create_table(
        "autofuse_trials",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("candidate_id", sa.Integer(), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("median_ms", sa.Float(), nullable=True),
        sa.Column("min_ms", sa.Float(), nullable=True),
        sa.Column("max_ms", sa.Float(), nullable=True),
        sa.Column("status", sa.String(length=32), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("optuna_trial_id", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["candidate_id"],
            ["autofuse_candidates.id"],
            name=op.f("fk_autofuse_trials_candidate_id_autofuse_candidates"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_autofuse_trials")),
        sa.UniqueConstraint("candidate_id", "number", name=op.f("uq_autofuse_trials_candidate_id_number")),
    )

    op.create_table(
        "autofuse_plans",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("program_id", sa.Integer(), nullable=False),
        sa.Column("device_id", sa.Integer(), nullable=False),
        sa.Column("software_id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=True),
        sa.Column("plan_json", sa.Text(), nullable=False),
        sa.Column("measured_ms", sa.Float(), nullable=False),
        sa.Column("baseline_ms", sa.Float(), nullable=False),
        sa.Column("speedup", sa.Float(), nullable=False),
        sa.Column("measure", sa.String(length=16), nullable=False),
        sa.Column("tolerance", sa.JSON(), nullable=False),
        sa.Column("max_error", sa.Float(), nullable=False),
        sa.Column("is_current", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.CheckConstraint("measure IN ('device', 'model')", name=op.f("ck_autofuse_plans_measure")),
        sa.ForeignKeyConstraint(
            ["program_id"], ["autofuse_programs.id"], name=op.f("fk_autofuse_plans_program_id_autofuse_programs")
        ),
        sa.ForeignKeyConstraint(
            ["device_id"], ["autofuse_devices.id"], name=op.f("fk_autofuse_plans_device_id_autofuse_devices")
        ),
        sa.ForeignKeyConstraint(
            ["software_id"], ["autofuse_software.id"], name=op.f("fk_autofuse_plans_software_id_autofuse_software")
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["autofuse_runs.id"], name=op.f("fk_autofuse_plans_run_id_autofuse_runs"), ondelete="SET NULL"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_autofuse_plans")),
    )
    op.create_index("ix_autofuse_plans_key", "autofuse_plans", ["program_id", "device_id", "software_id"], unique=False)
    # At most one current plan per (program, device, software); also the index
    # that serves PlanStore.lookup.
    op.create_index(
        "uq_autofuse_plans_current",
        "autofuse_plans",
        ["program_id", "device_id", "software_id"],
        unique=True,
        sqlite_where=sa.text("is_current = 1"),
        postgresql_where=sa.text("is_current"),
    )
    op.create_index(op.f("ix_autofuse_plans_run_id"), "autofuse_plans", ["run_id"], unique=False)
    op.create_index(op.f("ix_autofuse_plans_created_at"), "autofuse_plans", ["created_at"], unique=False)


def downgrade() -> None:
    """Drop all autofuse_* tables (never Optuna's)."""
    op.drop_table("autofuse_plans")
    op.drop_table("autofuse_trials")
    op.drop_table("autofuse_candidates")
    op.drop_table("autofuse_runs")
    op.drop_table("autofuse_software")
    op.drop_table("autofuse_devices")
    op.drop_table("autofuse_programs")
