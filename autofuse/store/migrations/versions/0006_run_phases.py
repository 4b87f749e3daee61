"""when each phase of a run ended: autofuse_runs.phases

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-29

``autofuse_runs.phases`` (JSON, nullable): seconds from the run's start at which each phase of the job
ended (``setup``: candidates registered and studies created; ``xla``: every candidate's XLA time known;
``trials``: the trials done; ``selected``: the plan chosen and validated; ``saved``), the job's own start
before the run row (``start``, negative), each worker's marks under ``workers`` and the selection
phase's parts under ``selection``. NULL for existing runs: "not recorded".
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add the nullable column in place (ALTER TABLE ... ADD COLUMN on SQLite and PostgreSQL)."""
    op.add_column("autofuse_runs", sa.Column("phases", sa.JSON(), nullable=True))


def downgrade() -> None:
    """Drop it again (ALTER TABLE ... DROP COLUMN: SQLite >= 3.35 and PostgreSQL)."""
    op.drop_column("autofuse_runs", "phases")
