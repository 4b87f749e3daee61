"""shape-generic plans: each program's structure (sizes abstracted), and the shapes a plan was checked at

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-28

``autofuse_programs.structure``: the hash of the program with its sizes abstracted
(``Graph.structure``); a plan of one program may serve another program of the same
structure (other batch or sequence sizes) once checked. NULL for existing rows: a deploy
that meets the function again computes it (by tracing the function at the stored input
shapes) and fills it in where the store can be written. ``autofuse_plan_shapes``: each check
of a plan at a shape it was not tuned for (plan, the served program's fingerprint and inputs,
the software, verdict ``ok``/``failed``, when and by whom), so that the next process takes
the verdict instead of checking again.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add the nullable column (existing programs read as "structure not known yet") and the table."""
    op.add_column("autofuse_programs", sa.Column("structure", sa.String(length=64), nullable=True))
    op.create_index(op.f("ix_autofuse_programs_structure"), "autofuse_programs", ["structure"], unique=False)
    op.create_table(
        "autofuse_plan_shapes",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("plan_id", sa.Integer(), nullable=False),
        sa.Column("fingerprint", sa.String(length=128), nullable=False),
        sa.Column("inputs", sa.JSON(), nullable=False),
        sa.Column("software_id", sa.Integer(), nullable=False),
        sa.Column("verdict", sa.String(length=16), nullable=False),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.Column("actor", sa.String(length=255), nullable=False),
        sa.Column("checked_at", sa.DateTime(), nullable=False),
        sa.CheckConstraint("verdict IN ('ok', 'failed')", name=op.f("ck_autofuse_plan_shapes_verdict")),
        sa.ForeignKeyConstraint(["plan_id"], ["autofuse_plans.id"], name=op.f("fk_autofuse_plan_shapes_plan_id_autofuse_plans"),
                                ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["software_id"], ["autofuse_software.id"],
                                name=op.f("fk_autofuse_plan_shapes_software_id_autofuse_software")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_autofuse_plan_shapes")),
        sa.UniqueConstraint("plan_id", "fingerprint", "software_id", name=op.f("uq_autofuse_plan_shapes_plan_id_fingerprint_software_id")),
    )
    op.create_index(op.f("ix_autofuse_plan_shapes_plan_id"), "autofuse_plan_shapes", ["plan_id"], unique=False)


def downgrade() -> None:
    """Drop them again (ALTER TABLE ... DROP COLUMN: SQLite >= 3.35 and PostgreSQL)."""
    op.drop_index(op.f("ix_autofuse_plan_shapes_plan_id"), table_name="autofuse_plan_shapes")
    op.drop_table("autofuse_plan_shapes")
    op.drop_index(op.f("ix_autofuse_programs_structure"), table_name="autofuse_programs")
    op.drop_column("autofuse_programs", "structure")
