"""plan promotion: pinned plans, each plan's measured noise, an audit trail of plan changes, and the function a program came from

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-26

``autofuse_plans.pinned``: a pinned plan is current and no tuning job replaces it
(NOT NULL, default false, so existing rows read as unpinned). ``autofuse_plans.noise``:
the spread of the plan/jax.jit ratio when it was validated (NULL for older plans and
modelled ones); a new plan must beat the current one beyond it. ``autofuse_programs.function``:
``module:qualname`` of the tuned function, so that a miss at deploy time can name plans of
the same function for other shapes (NULL for older programs). ``autofuse_plan_events``: who
promoted, pinned, unpinned or removed which plan, and what each tuning job decided about its
plan; ``plan_id`` has no foreign key so that the record of a removed plan stays.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add the columns and the events table; existing plans stay as they are (none pinned)."""
    op.add_column("autofuse_plans", sa.Column("pinned", sa.Boolean(), nullable=False, server_default=sa.false()))
    op.add_column("autofuse_plans", sa.Column("noise", sa.Float(), nullable=True))
    op.add_column("autofuse_programs", sa.Column("function", sa.String(length=512), nullable=True))
    op.create_index(op.f("ix_autofuse_programs_function"), "autofuse_programs", ["function"], unique=False)
    op.create_table(
        "autofuse_plan_events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("plan_id", sa.Integer(), nullable=False),
        sa.Column("program_id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=True),
        sa.Column("action", sa.String(length=16), nullable=False),
        sa.Column("actor", sa.String(length=255), nullable=False),
        sa.Column("at", sa.DateTime(), nullable=False),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["program_id"], ["autofuse_programs.id"], name=op.f("fk_autofuse_plan_events_program_id_autofuse_programs")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_autofuse_plan_events")),
    )
    op.create_index(op.f("ix_autofuse_plan_events_plan_id"), "autofuse_plan_events", ["plan_id"], unique=False)
    op.create_index(op.f("ix_autofuse_plan_events_at"), "autofuse_plan_events", ["at"], unique=False)


def downgrade() -> None:
    """Drop them again (ALTER TABLE ... DROP COLUMN: SQLite >= 3.35 and PostgreSQL)."""
    op.drop_index(op.f("ix_autofuse_plan_events_at"), table_name="autofuse_plan_events")
    op.drop_index(op.f("ix_autofuse_plan_events_plan_id"), table_name="autofuse_plan_events")
    op.drop_table("autofuse_plan_events")
    op.drop_index(op.f("ix_autofuse_programs_function"), table_name="autofuse_programs")
    op.drop_column("autofuse_programs", "function")
    op.drop_column("autofuse_plans", "noise")
    op.drop_column("autofuse_plans", "pinned")
