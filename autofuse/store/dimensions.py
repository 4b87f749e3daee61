"""The rows every run and plan points at: programs, devices and software versions, each found or created by its
identifying fields, so that concurrent jobs tuning the same thing share one row."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from autofuse.store.base import Db
from autofuse.store.models import Device, Program, Software


def program(store: Db, fingerprint: str, name: str, signature: dict[str, Any], size: int, function: str | None = None,
            structure: str | None = None) -> int:
    """Id of the program with *fingerprint*, created if new.

    An existing program keeps its first name, signature and size; *function*
    (``module:qualname``) and *structure* (``Graph.structure``: the program with
    its sizes abstracted) are filled in where they were not known.
    """
    if not fingerprint:
        raise ValueError("program fingerprint must be a non-empty string")

    def fn(s: Session) -> int:
        found = s.scalar(sa.select(Program).where(Program.fingerprint == fingerprint))
        if found is not None:
            if function and not found.function:
                found.function = function
            if structure and not found.structure:
                found.structure = structure
            return found.id
        row = Program(fingerprint=fingerprint, name=name, signature=signature, size=int(size), function=function,
                      structure=structure)
        s.add(row)
        s.flush()
        return row.id

    return store.write(fn, retry_integrity=True)


def device(store: Db, name: str, compute_capability: str | None = None, sm_count: int | None = None,
           memory_bytes: int | None = None) -> int:
    """Id of the device row with exactly these fields (NULLs included), created if new."""
    return _dimension(store, Device, name=name, compute_capability=compute_capability, sm_count=sm_count,
                      memory_bytes=memory_bytes)


def software(store: Db, jax: str, jaxlib: str, autofuse: str, backend: str) -> int:
    """Id of the software row (jax, jaxlib, autofuse versions + backend), created if new."""
    return _dimension(store, Software, jax=jax, jaxlib=jaxlib, autofuse=autofuse, backend=backend)


def _dimension(store: Db, model: type, **fields: Any) -> int:
    """Id of the `model` row with exactly these field values (NULLs included), created if new."""

    def fn(s: Session) -> int:
        found = s.scalar(sa.select(model.id).where(*(getattr(model, k).is_not_distinct_from(v) for k, v in fields.items())))
        if found is not None:
            return found
        row = model(**fields)
        s.add(row)
        s.flush()
        return row.id

    return store.write(fn, retry_integrity=True)
