"""The typed answers of the plan store, shared by its parts and its callers (deploy, tuning, the CLI)."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
from typing import Any, Literal

#: The versions a plan was made with: a lookup matches the backend, and prefers all four equal.
SOFTWARE_KEYS = ("jax", "jaxlib", "autofuse", "backend")


@dataclasses.dataclass(frozen=True)
class LookupResult:
    """A plan found by :meth:`PlanStore.lookup`.

    ``match`` is ``"exact"`` (same jax, jaxlib, autofuse and backend) or
    ``"version"`` (same backend, other versions: the caller should re-verify
    the plan against ``tolerance`` before trusting it).
    """

    plan_id: int
    plan_json: dict[str, Any]
    match: Literal["exact", "version"]
    speedup: float
    measured_ms: float
    software: dict[str, str]
    measure: str = "device"
    tolerance: dict[str, Any] = dataclasses.field(default_factory=dict)
    run_id: int | None = None

    @classmethod
    def from_row(cls, r: dict[str, Any]) -> LookupResult:
        """A row of ``queries.lookup`` or ``queries.same_structure`` (both select ``queries._plan_select``)."""
        return cls(plan_id=r["id"], plan_json=json.loads(r["plan_json"]), match="exact" if r["exact"] else "version",
                   speedup=r["speedup"], measured_ms=r["measured_ms"], software={k: r[k] for k in SOFTWARE_KEYS},
                   measure=r["measure"], tolerance=r["tolerance"] or {}, run_id=r["run_id"])


@dataclasses.dataclass(frozen=True)
class SameStructure:
    """A current plan of another program of the same structure (the same computation at other sizes), found by
    :meth:`PlanStore.same_structure`: the plan, and the fingerprint and input signature of the program it was tuned
    for (``["bfloat16[8, 128]", ...]``)."""

    plan: LookupResult
    fingerprint: str
    inputs: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class ShapeVerdict:
    """A remembered check of a plan at a shape it was not tuned for: ``ok`` (it serves that shape) or ``failed``
    (``detail`` says why), when and by whom."""

    plan_id: int
    fingerprint: str
    verdict: str
    detail: str
    checked_at: _dt.datetime
    actor: str


@dataclasses.dataclass(frozen=True)
class SavedPlan:
    """A plan a tuning job stored: its id, whether it became current, and why (or why not)."""

    plan_id: int
    current: bool
    reason: str
    previous: int | None = None  # the current plan of its key before it was stored


@dataclasses.dataclass(frozen=True)
class PlanChange:
    """What a promote, pin, unpin or rm did: the plan, the one it replaced as current (if any), in words."""

    plan_id: int
    action: str
    replaced: int | None
    message: str


@dataclasses.dataclass(frozen=True)
class MissReason:
    """Why the store has no plan for a program on this device, for a person: ``kind`` is one of
    ``no_plan`` (never tuned), ``other_inputs`` (the function was tuned for other shapes, dtypes or
    static values), ``other_device``, ``other_backend``, ``no_current`` (plans exist, none current),
    ``changed`` (same function and inputs, another program: its code or constants changed)."""

    kind: str
    text: str


def check_software(software: dict[str, str], hint: str = "") -> None:
    """Refuse a software dict that lacks one of :data:`SOFTWARE_KEYS` (a plan's key needs all four)."""
    missing = [k for k in SOFTWARE_KEYS if k not in software]
    if missing:
        raise ValueError(f"software dict lacks {', '.join(missing)}{hint}")
