"""XLA's per-fusion autotune entries kept beside the plans, so that a store shipped alone compiles the GEMM kernels
its plans were measured with (:mod:`autofuse.xla_autotune` reads and writes XLA's cache directory)."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.orm import Session

from autofuse.store.base import AUTOTUNE, Db, since
from autofuse.store.models import XlaAutotune


def save_autotune(store: Db, jaxlib: str, device: str, entries: dict[str, str]) -> int:
    """Keep XLA's per-fusion autotune `entries` (file name -> content, `xla_autotune.read_entries`) made under
    *jaxlib* on *device*, so that the store alone carries the GEMM kernels its plans were measured with. An entry
    already stored under its key stays as it is (the kernels the first plans were measured with); returns how many
    were added."""
    if not entries:
        return 0

    def fn(s: Session) -> int:
        known = set(s.scalars(sa.select(XlaAutotune.name).where(XlaAutotune.jaxlib == jaxlib, XlaAutotune.device == device)))
        new = [XlaAutotune(jaxlib=jaxlib, device=device, name=n, content=c) for n, c in entries.items() if n not in known]
        s.add_all(new)
        return len(new)

    return store.write(fn, retry_integrity=True)


@since(AUTOTUNE, dict)
def autotune_entries(store: Db, jaxlib: str, device: str) -> dict[str, str]:
    """The autotune entries stored for *jaxlib* and *device* (file name -> content), for a deploy to write into
    its XLA cache directory before compiling a plan; empty for a schema older than 0007. Reads only."""
    stmt = sa.select(XlaAutotune.name, XlaAutotune.content).where(XlaAutotune.jaxlib == jaxlib, XlaAutotune.device == device)
    return {r["name"]: r["content"] for r in store.read(stmt)}
