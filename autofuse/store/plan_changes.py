"""Which plan is current: a tuning job's plan stored and promoted by :func:`autofuse.store.promotion.decide`, or a
person's promote, pin, unpin and rm; every change recorded as a plan event (who, when, why)."""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from autofuse.store import queries
from autofuse.store.base import PROMOTION, Db, check_measure, opt_float, require, since, whoami
from autofuse.store.models import Device, Plan, PlanEvent, Program, Run, Software, utcnow
from autofuse.store.promotion import PlanFigures, decide
from autofuse.store.results import PlanChange, SavedPlan


def save_plan(store: Db, program_id: int, device_id: int, software_id: int, plan_json: dict[str, Any] | str,
              **fields: Any) -> int:
    """Store a plan (a JSON-able dict, or JSON text); returns its id. The keyword fields are :meth:`add_plan`'s."""
    return add_plan(store, program_id, device_id, software_id, plan_json, **fields).plan_id


def add_plan(store: Db, program_id: int, device_id: int, software_id: int, plan_json: dict[str, Any] | str, *,
             run_id: int | None = None, measured_ms: float, baseline_ms: float, speedup: float, measure: str,
             tolerance: dict[str, Any], max_error: float, current: bool | None = None, noise: float | None = None,
             actor: str | None = None) -> SavedPlan:
    """Store a plan and decide, in the same transaction, whether it becomes the current plan of its
    (program, device, software) key; the decision is recorded as a ``saved`` event.

    *current*: None applies :func:`autofuse.store.promotion.decide` (the first
    plan of a key is current; a later one only if measured and faster than the
    current one beyond *noise*, the spread of its plan/jax.jit ratio; never
    over a pinned plan); True promotes it (the user asked; still not over a
    pinned plan); False stores it beside the current one.
    """
    check_measure(measure)
    if isinstance(plan_json, str):
        text = plan_json
        if not isinstance(json.loads(text), dict):
            raise ValueError("plan_json must be a JSON object")
    else:
        text = json.dumps(plan_json)
    who = actor or whoami()

    def fn(s: Session) -> SavedPlan:
        # Writers of one program's plans take turns (the program row's lock): on
        # PostgreSQL (READ COMMITTED) two concurrent writers would otherwise each clear
        # the old current flag, each insert a current plan, and one would fail the
        # partial unique index; now the second waits, then sees and clears the first's.
        require(s, Program, program_id, "program", lock=True)
        require(s, Device, device_id, "device")
        require(s, Software, software_id, "software")
        if run_id is not None:
            require(s, Run, run_id, "run")
        old = _current(s, program_id, device_id, software_id)
        decision = decide(PlanFigures(None, measure, float(speedup), opt_float(noise)), _figures(old), force=current)
        if decision.current and old is not None:
            old.is_current = False
            s.flush()
        row = Plan(program_id=program_id, device_id=device_id, software_id=software_id, run_id=run_id, plan_json=text,
                   measured_ms=float(measured_ms), baseline_ms=float(baseline_ms), speedup=float(speedup), measure=measure,
                   tolerance=dict(tolerance), max_error=float(max_error), is_current=decision.current,
                   noise=opt_float(noise), pinned=False, created_at=utcnow())
        s.add(row)
        s.flush()
        state = "current" if decision.current else "not current"
        _event(s, row, "saved", who, f"{state}: {decision.reason}", run_id=run_id)
        return SavedPlan(row.id, decision.current, decision.reason, old.id if old is not None else None)

    # IntegrityError: should not happen with the lock above; retried as a last resort.
    return store.write(fn, retry_integrity=True)


def promote_plan(store: Db, plan_id: int, *, actor: str | None = None) -> PlanChange:
    """Make plan *plan_id* the current plan of its key (a person's decision, recorded).

    Refused (ValueError) where another plan of the key is pinned: unpin it first.
    """
    return _change(store, plan_id, "promote", actor)


def pin_plan(store: Db, plan_id: int, *, actor: str | None = None) -> PlanChange:
    """Make plan *plan_id* current and pinned: no tuning job replaces it until it is unpinned."""
    return _change(store, plan_id, "pin", actor)


def unpin_plan(store: Db, plan_id: int, *, actor: str | None = None) -> PlanChange:
    """Let tuning jobs replace plan *plan_id* again (it stays current until one beats it)."""
    return _change(store, plan_id, "unpin", actor)


def remove_plan(store: Db, plan_id: int, *, actor: str | None = None) -> PlanChange:
    """Delete plan *plan_id* (recorded). Refused for a pinned plan; removing the current plan leaves its
    key without one (lookups miss) until another is promoted or tuned."""
    return _change(store, plan_id, "rm", actor)


@since(PROMOTION, list)
def plan_events(store: Db, plan_id: int | None = None, program: str | None = None) -> list[dict[str, Any]]:
    """The record of plan changes, newest first: who (``user@host``), when, what (``saved``: a tuning
    job's decision; ``promote``, ``pin``, ``unpin``, ``rm``: a person's), and the detail in words."""
    return store.read(queries.plan_events(plan_id, program))


def _change(store: Db, plan_id: int, action: str, actor: str | None) -> PlanChange:
    """A person's *action* on a plan, in one transaction holding its program's lock (as :func:`add_plan` does)."""
    who = actor or whoami()

    def fn(s: Session) -> PlanChange:
        plan = require(s, Plan, plan_id, "plan")
        require(s, Program, plan.program_id, "program", lock=True)
        old = _current(s, plan.program_id, plan.device_id, plan.software_id)
        replaced = old.id if old is not None and old.id != plan.id else None
        if action in ("promote", "pin") and old is not None and old.pinned and old.id != plan.id:
            raise ValueError(f"plan {old.id} is pinned as the current plan of this program, device and software: "
                             f"unpin it first (autofuse plans unpin {old.id})")
        if action == "rm" and plan.pinned:
            raise ValueError(f"plan {plan_id} is pinned: unpin it first (autofuse plans unpin {plan_id})")
        if action in ("promote", "pin"):
            if old is not None and old.id != plan.id:
                old.is_current = False
                s.flush()
            plan.is_current = True
            plan.pinned = plan.pinned or action == "pin"
            verb = "pinned" if action == "pin" else "promoted"
            message = f"plan {plan_id} {verb}: current" + (f" in place of plan {replaced}" if replaced else
                                                             "" if old is not None else " (the key had no current plan)")
        elif action == "unpin":
            plan.pinned = False
            message = f"plan {plan_id} unpinned: tuning jobs may replace it when they beat it" + (
                "" if plan.is_current else " (it is not current)")
        else:
            was_current = plan.is_current
            _event(s, plan, action, who, _plan_summary(plan) + ("; was current" if was_current else ""))
            s.delete(plan)
            message = f"plan {plan_id} removed" + (
                ": its program now has no current plan on this device and software (autofuse plans promote ID)" if was_current else "")
            return PlanChange(plan_id, action, None, message)
        _event(s, plan, action, who, message)
        return PlanChange(plan_id, action, replaced, message)

    return store.write(fn)


def _current(s: Session, program_id: int, device_id: int, software_id: int) -> Plan | None:
    return s.scalar(sa.select(Plan).where(Plan.program_id == program_id, Plan.device_id == device_id,
                                          Plan.software_id == software_id, Plan.is_current == sa.true()))


def _event(s: Session, plan: Plan, action: str, actor: str, detail: str, run_id: int | None = None) -> None:
    s.add(PlanEvent(plan_id=plan.id, program_id=plan.program_id, run_id=run_id if run_id is not None else plan.run_id,
                    action=action, actor=actor[:255], at=utcnow(), detail=detail))


def _figures(plan: Plan | None) -> PlanFigures | None:
    return None if plan is None else PlanFigures(plan.id, plan.measure, plan.speedup, plan.noise, bool(plan.pinned))


def _plan_summary(plan: Plan) -> str:
    return f"{plan.measure} plan, speedup {plan.speedup:.2f}x, run {plan.run_id}"
