"""runs shared by several workers: the job description workers rebuild the program from, and who selects the plan

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-26

``job``: JSON (function reference, argument shapes, options) that lets a worker
on any host join the run; NULL for a single-process run. ``selected_by``: the
worker (host:pid) that won the final selection; NULL until then. Both are new
nullable columns: an existing database upgrades in place.
"""

from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: Union[str, Sequence[str], None] = "0001"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    """Add autofuse_runs.job and autofuse_runs.selected_by."""
    op.add_column("autofuse_runs", sa.Column("job", sa.JSON(), nullable=True))
    op.add_column("autofuse_runs", sa.Column("selected_by", sa.String(length=255), nullable=True))


def downgrade() -> None:
    """Drop them again (ALTER TABLE ... DROP COLUMN: SQLite >= 3.35 and PostgreSQL)."""
    op.drop_column("autofuse_runs", "selected_by")
    op.drop_column("autofuse_runs", "job")
