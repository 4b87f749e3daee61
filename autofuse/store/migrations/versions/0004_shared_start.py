"""the shared start of a run and where each measurement ran: XLA timings claimed by workers, devices on trials

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-27

``autofuse_candidates.xla_status`` (NULL: not timed yet; ``running``: claimed;
then the timing's status), ``xla_worker`` (host:pid that claimed it),
``xla_claimed_at`` and ``xla_device``: the workers of a run share out the XLA
timings of its candidates, each claimed once (a claim of a dead worker is taken
over). ``autofuse_trials.worker``, ``device`` (the jax device and the
CUDA_VISIBLE_DEVICES its trial process saw) and ``finished_at``: which worker
and GPU measured each trial, and when. All nullable: existing rows read as
"not recorded".
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

CANDIDATE_COLUMNS = (
    ("xla_status", sa.String(length=32)),
    ("xla_worker", sa.String(length=255)),
    ("xla_claimed_at", sa.DateTime()),
    ("xla_device", sa.String(length=255)),
)
TRIAL_COLUMNS = (
    ("worker", sa.String(length=255)),
    ("device", sa.String(length=255)),
    ("finished_at", sa.DateTime()),
)


def upgrade() -> None:
    """Add the nullable columns in place (ALTER TABLE ... ADD COLUMN on SQLite and PostgreSQL)."""
    for name, type_ in CANDIDATE_COLUMNS:
        op.add_column("autofuse_candidates", sa.Column(name, type_, nullable=True))
    for name, type_ in TRIAL_COLUMNS:
        op.add_column("autofuse_trials", sa.Column(name, type_, nullable=True))


def downgrade() -> None:
    """Drop them again (ALTER TABLE ... DROP COLUMN: SQLite >= 3.35 and PostgreSQL)."""
    for name, _ in reversed(TRIAL_COLUMNS):
        op.drop_column("autofuse_trials", name)
    for name, _ in reversed(CANDIDATE_COLUMNS):
        op.drop_column("autofuse_candidates", name)
