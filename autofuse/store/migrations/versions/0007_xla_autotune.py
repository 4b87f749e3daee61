"""XLA's autotune results travel with the plans: autofuse_xla_autotune

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-30

``autofuse_xla_autotune``: the files of XLA's per-fusion autotune cache directory
(``--xla_gpu_per_fusion_autotune_cache_dir``) a tuning job measured with, per jaxlib version
and device name: the file name (XLA's cache key) and its content. A deploy that finds a plan
writes those its own directory lacks before compiling, so that a store shipped alone compiles
the GEMM kernels the job measured. Empty for existing stores: "none recorded".
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add the table (its unique key also serves reading a jaxlib's and device's entries)."""
    op.create_table(
        "autofuse_xla_autotune",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("jaxlib", sa.String(length=64), nullable=False),
        sa.Column("device", sa.String(length=255), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("content", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_autofuse_xla_autotune")),
        sa.UniqueConstraint("jaxlib", "device", "name", name=op.f("uq_autofuse_xla_autotune_jaxlib_device_name")),
    )


def downgrade() -> None:
    """Drop it again."""
    op.drop_table("autofuse_xla_autotune")
