"""Shape-generic plans: a plan tuned for one program may serve another of the same structure (the same computation at
other sizes) once checked there; the store finds such plans and remembers each check's verdict."""

from __future__ import annotations

import os
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from autofuse.store import dimensions, queries
from autofuse.store.base import SHAPES, Db, require, since, whoami
from autofuse.store.models import SHAPE_VERDICTS, Plan, PlanShape, Program, utcnow
from autofuse.store.results import SOFTWARE_KEYS, LookupResult, SameStructure, ShapeVerdict, check_software


@since(SHAPES, list)
def same_structure(store: Db, structure: str, device_name: str, software: dict[str, str], *,
                   exclude: str) -> list[SameStructure]:
    """The current plans, on this device and backend, of the programs of *structure* other than *exclude* (the
    fingerprint that missed): plans tuned at other sizes that may serve it. Exact versions first, newest first.
    Empty for a schema older than 0005. Reads only."""
    return [SameStructure(LookupResult.from_row(r), r["fingerprint"], tuple((r["signature"] or {}).get("inputs") or ()))
            for r in store.read(queries.same_structure(structure, device_name, software, exclude))]


@since(SHAPES, list)
def unstructured_programs(store: Db, function: str, limit: int = 8) -> list[dict[str, Any]]:
    """Programs of *function* whose structure is not recorded (stored before migration 0005): id, fingerprint,
    signature. Empty for an older schema."""
    return store.read(queries.unstructured_programs(function, limit))


def set_structure(store: Db, fingerprint: str, structure: str) -> bool:
    """Record the structure of a program stored without one; False if it had one or is not stored."""

    def fn(s: Session) -> bool:
        res = s.execute(sa.update(Program).where(Program.fingerprint == fingerprint, Program.structure.is_(None))
                        .values(structure=structure))
        return res.rowcount == 1

    return store.write(fn)


@since(SHAPES, lambda: None)
def shape_verdict(store: Db, plan_id: int, fingerprint: str, software: dict[str, str]) -> ShapeVerdict | None:
    """The remembered check of plan *plan_id* at the program *fingerprint* made with exactly this *software*
    (jax, jaxlib, autofuse, backend), or None (never checked so, or a schema older than 0005)."""
    for r in store.read(queries.shape_checks([plan_id], fingerprint)):
        if all(r[k] == software.get(k) for k in SOFTWARE_KEYS):
            return ShapeVerdict(plan_id, fingerprint, r["verdict"], r["detail"] or "", r["checked_at"], r["actor"])
    return None


def record_shape(store: Db, plan_id: int, fingerprint: str, inputs: list[str], software: dict[str, str], verdict: str,
                 detail: str = "", *, actor: str | None = None) -> None:
    """Remember the verdict (``ok`` or ``failed``) of checking plan *plan_id* at the program *fingerprint*
    (inputs as ``Graph.signature()["inputs"]``) with *software*; a later check with the same software replaces it."""
    if verdict not in SHAPE_VERDICTS:
        raise ValueError(f"invalid shape verdict {verdict!r}: expected one of {', '.join(SHAPE_VERDICTS)}")
    check_software(software)
    sw_id = dimensions.software(store, **{k: software[k] for k in SOFTWARE_KEYS})
    who = (actor or f"{whoami()}:{os.getpid()}")[:255]

    def fn(s: Session) -> None:
        require(s, Plan, plan_id, "plan")
        row = s.scalar(sa.select(PlanShape).where(PlanShape.plan_id == plan_id, PlanShape.fingerprint == fingerprint,
                                                  PlanShape.software_id == sw_id))
        if row is None:
            row = PlanShape(plan_id=plan_id, fingerprint=fingerprint, software_id=sw_id)
            s.add(row)
        row.inputs, row.verdict, row.detail, row.actor, row.checked_at = list(inputs), verdict, detail, who, utcnow()

    store.write(fn, retry_integrity=True)


@since(SHAPES, dict)
def plan_shapes(store: Db, plan_ids: list[int]) -> dict[int, dict[str, Any]]:
    """Per plan: ``structure`` (None: not recorded), ``inputs`` (the shapes it was tuned at) and ``checks`` (its
    checks at other shapes, newest first: inputs, verdict, detail, checked_at, actor, versions)."""
    if not plan_ids:
        return {}
    out: dict[int, dict[str, Any]] = {
        r["plan_id"]: {"structure": r["structure"], "inputs": list((r["signature"] or {}).get("inputs") or []), "checks": []}
        for r in store.read(queries.plan_programs(plan_ids))}
    for r in store.read(queries.shape_checks(plan_ids)):
        out.setdefault(r["plan_id"], {"structure": None, "inputs": [], "checks": []})["checks"].append(r)
    return out
