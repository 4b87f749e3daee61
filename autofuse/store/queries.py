"""Read queries of the plan store, as SQLAlchemy Core selects.

Every value reaches the database as a bound parameter. Each function returns a
statement; :class:`autofuse.store.base.Db` executes it for the store's parts, as dicts.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import aliased
from sqlalchemy.sql import Select

from autofuse.store.models import (
    Candidate,
    Device,
    Plan,
    PlanEvent,
    PlanShape,
    Program,
    Run,
    Software,
    Trial,
)


#: Trial statuses decided without building anything.
UNMEASURED_STATUSES = ("infeasible", "pruned")


def parse_since(since: str | _dt.date | _dt.datetime | None) -> _dt.datetime | None:
    """``YYYY-MM-DD`` (or an ISO datetime, date, datetime) as an aware UTC datetime.

    Naive values are taken to be UTC. Raises ValueError for other strings.
    """
    if since is None or since == "":
        return None
    if isinstance(since, _dt.datetime):
        value = since
    elif isinstance(since, _dt.date):
        value = _dt.datetime(since.year, since.month, since.day)
    else:
        try:
            value = _dt.datetime.fromisoformat(str(since).strip())
        except ValueError:
            raise ValueError(f"invalid date {since!r}: expected YYYY-MM-DD") from None
    if value.tzinfo is None:
        value = value.replace(tzinfo=_dt.timezone.utc)
    return value.astimezone(_dt.timezone.utc)


def _program_filter(program: str) -> Any:
    """Program name as shown (``module:function``), the function part of it alone, or fingerprint (full or a prefix)."""
    return sa.or_(Program.name == program, Program.name.endswith(":" + program, autoescape=True),
                  Program.fingerprint.startswith(program, autoescape=True))


def _device_filter(device: str) -> Any:
    """Case-insensitive substring of the device name ("h200" matches "NVIDIA H200")."""
    return Device.name.icontains(device, autoescape=True)


def _software_columns() -> list[Any]:
    return [Software.jax, Software.jaxlib, Software.autofuse, Software.backend]


def _key_columns() -> list[Any]:
    """What names a run's or plan's key in a listing: program name and fingerprint, device, software versions."""
    return [Program.name.label("program"), Program.fingerprint, Device.name.label("device"), *_software_columns()]


def run_columns() -> list[Any]:
    n_candidates = (
        sa.select(sa.func.count(Candidate.id)).where(Candidate.run_id == Run.id).scalar_subquery()
    )
    def count(statuses: Any) -> Any:
        return (
            sa.select(sa.func.count(Trial.id))
            .join(Candidate, Candidate.id == Trial.candidate_id)
            .where(Candidate.run_id == Run.id, statuses)
            .scalar_subquery()
        )

    # measured: built and run (whatever the outcome); infeasible: decided without compiling (constraints, pruning).
    # Running and lost trials (a dead worker's, retried elsewhere) are neither.
    n_trials = count(Trial.status.not_in(UNMEASURED_STATUSES + ("running", "lost")))
    n_infeasible = count(Trial.status.in_(UNMEASURED_STATUSES))
    return [
        Run.id,
        *_key_columns(),
        Run.status,
        Run.measure,
        Run.sampler,
        Run.seed,
        Run.budget,
        Run.started_at,
        Run.ended_at,
        Run.baseline_ms,
        Run.best_ms,
        Run.speedup,
        n_candidates.label("n_candidates"),
        n_trials.label("n_trials"),
        n_infeasible.label("n_infeasible"),
        Run.host,
        Run.pid,
        Run.optuna_storage,
        Run.optuna_study_prefix,
        Run.error,
        Run.program_id,
        Run.device_id,
        Run.software_id,
    ]


def _join_names(q: Select[Any], model: type) -> Select[Any]:
    """`q` over `model` (runs, plans) joined with the program, device and software its rows point at."""
    return (
        q.join(Program, Program.id == model.program_id)
        .join(Device, Device.id == model.device_id)
        .join(Software, Software.id == model.software_id)
    )


def _filtered(q: Select[Any], model: type, created: Any, program: str | None, device: str | None,
              since: _dt.datetime | None, min_speedup: float | None) -> Select[Any]:
    """The listing filters shared by runs, plans and compare."""
    if program:
        q = q.where(_program_filter(program))
    if device:
        q = q.where(_device_filter(device))
    if since is not None:
        q = q.where(created >= since)
    if min_speedup is not None:
        q = q.where(model.speedup >= min_speedup)
    return q


def runs(
    program: str | None = None,
    device: str | None = None,
    since: _dt.datetime | None = None,
    min_speedup: float | None = None,
    statuses: tuple[str, ...] | None = None,
) -> Select[Any]:
    """Runs, newest first, with program/device/software names and counts."""
    q = _join_names(sa.select(*run_columns()), Run)
    q = _filtered(q, Run, Run.started_at, program, device, since, min_speedup)
    if statuses:
        q = q.where(Run.status.in_(statuses))
    return q.order_by(Run.started_at.desc(), Run.id.desc())


def run(run_id: int, v6: bool = True) -> Select[Any]:
    """One run with everything :func:`runs` shows, plus the program signature/size; `v6`: the schema has migration
    0006's phases (an older read-only store reads as not recorded)."""
    return (_join_names(sa.select(*run_columns()), Run)
            .add_columns(Program.signature, Program.size, Run.job, Run.selected_by, Run.phases if v6 else sa.null().label("phases"))
            .where(Run.id == run_id))


def plan_columns(v3: bool = True) -> list[Any]:
    """A plan's columns; `v3`: the schema has migration 0003's (an older read-only store reads as unpinned)."""
    return [
        Plan.id,
        *_key_columns(),
        Plan.run_id,
        Plan.measured_ms,
        Plan.baseline_ms,
        Plan.speedup,
        Plan.measure,
        Plan.tolerance,
        Plan.max_error,
        Plan.is_current,
        Plan.pinned if v3 else sa.false().label("pinned"),
        Plan.noise if v3 else sa.null().label("noise"),
        Plan.created_at,
        Plan.program_id,
        Plan.device_id,
        Plan.software_id,
    ]


def plans(
    program: str | None = None,
    device: str | None = None,
    since: _dt.datetime | None = None,
    min_speedup: float | None = None,
    current_only: bool = False,
    v3: bool = True,
) -> Select[Any]:
    """Plans, newest first."""
    q = _join_names(sa.select(*plan_columns(v3)), Plan)
    q = _filtered(q, Plan, Plan.created_at, program, device, since, min_speedup)
    if current_only:
        q = q.where(Plan.is_current == sa.true())
    return q.order_by(Plan.created_at.desc(), Plan.id.desc())


def plan(plan_id: int, v3: bool = True) -> Select[Any]:
    """One plan with its JSON text and program details."""
    return (_join_names(sa.select(*plan_columns(v3)), Plan)
            .add_columns(Plan.plan_json, Program.signature, Program.size).where(Plan.id == plan_id))


def compare(
    program: str | None = None,
    device: str | None = None,
    since: _dt.datetime | None = None,
    min_speedup: float | None = None,
) -> Select[Any]:
    """One row per (program, device, software) with a current plan.

    ``speedup`` is the current plan's; ``best_speedup`` the best of every plan
    ever saved for the key; ``n_plans`` how many were saved.
    """
    other = aliased(Plan)
    key = sa.and_(
        other.program_id == Plan.program_id,
        other.device_id == Plan.device_id,
        other.software_id == Plan.software_id,
    )
    n_plans = sa.select(sa.func.count(other.id)).where(key).scalar_subquery()
    best = sa.select(sa.func.max(other.speedup)).where(key).scalar_subquery()
    columns = [
        *_key_columns(),
        Plan.id.label("plan_id"),
        Plan.speedup,
        Plan.measured_ms,
        Plan.baseline_ms,
        Plan.measure,
        Plan.created_at,
        best.label("best_speedup"),
        n_plans.label("n_plans"),
    ]
    q = _join_names(sa.select(*columns), Plan).where(Plan.is_current == sa.true())
    q = _filtered(q, Plan, Plan.created_at, program, device, since, min_speedup)
    return q.order_by(
        Program.name, Program.fingerprint, Device.name, Software.backend, Plan.speedup.desc(), Plan.id
    )


def candidates(run_id: int) -> Select[Any]:
    """Candidates of a run, in insertion order."""
    return (
        sa.select(
            Candidate.id,
            Candidate.run_id,
            Candidate.signature,
            Candidate.template,
            Candidate.nodes,
            Candidate.best_config,
            Candidate.best_ms,
            Candidate.xla_ms,
            Candidate.status,
            Candidate.n_trials,
            Candidate.xla_status,
            Candidate.xla_worker,
            Candidate.xla_device,
        )
        .where(Candidate.run_id == run_id)
        .order_by(Candidate.id)
    )


def trials(run_id: int, status: str | None = None) -> Select[Any]:
    """Trials of a run joined with their candidate, by candidate then number."""
    q = (
        sa.select(
            Trial.id,
            Trial.candidate_id,
            Candidate.signature,
            Candidate.template,
            Trial.number,
            Trial.status,
            Trial.median_ms,
            Trial.min_ms,
            Trial.max_ms,
            Trial.config,
            Trial.error,
            Trial.optuna_trial_id,
            Trial.created_at,
            Trial.worker,
            Trial.device,
            Trial.finished_at,
        )
        .join(Candidate, Candidate.id == Trial.candidate_id)
        .where(Candidate.run_id == run_id)
    )
    if status:
        q = q.where(Trial.status == status)
    return q.order_by(Candidate.id, Trial.number)


def _current_plans(software: dict[str, str], device_name: str, *where: Any, extra: tuple[Any, ...] = ()) -> Select[Any]:
    """The current plans matching `where` on this device and backend, with what a deploy-time lookup needs (their
    software's columns, and ``exact``: 1 where made with these very versions), exact versions first, newest first,
    plus `extra` columns."""
    exact = sa.and_(
        Software.jax == software["jax"],
        Software.jaxlib == software["jaxlib"],
        Software.autofuse == software["autofuse"],
    )
    q = sa.select(Plan.id, Plan.plan_json, Plan.speedup, Plan.measured_ms, Plan.measure, Plan.tolerance, Plan.run_id,
                  *_software_columns(), sa.case((exact, 1), else_=0).label("exact"), *extra)
    return (
        _join_names(q, Plan)
        .where(*where, Device.name == device_name, Software.backend == software["backend"], Plan.is_current == sa.true())
        .order_by(sa.desc("exact"), Plan.created_at.desc(), Plan.id.desc())
    )


def lookup(fingerprint: str, device_name: str, software: dict[str, str]) -> Select[Any]:
    """The current plan for fingerprint + device name + backend, exact versions first.

    One query over unique/partial indexes: program by fingerprint, devices by
    name, software by backend, plans by the current-plan index.
    """
    return _current_plans(software, device_name, Program.fingerprint == fingerprint).limit(1)


def plan_events(plan_id: int | None = None, program: str | None = None) -> Select[Any]:
    """The record of plan changes, newest first, with the program's name."""
    q = sa.select(PlanEvent.id, PlanEvent.at, PlanEvent.actor, PlanEvent.action, PlanEvent.plan_id, PlanEvent.run_id,
                  Program.name.label("program"), Program.fingerprint, PlanEvent.detail).join(Program, Program.id == PlanEvent.program_id)
    if plan_id is not None:
        q = q.where(PlanEvent.plan_id == plan_id)
    if program:
        q = q.where(_program_filter(program))
    return q.order_by(PlanEvent.at.desc(), PlanEvent.id.desc())


def plans_of_programs(program_ids: list[int]) -> Select[Any]:
    """Every plan of these programs with its device, backend, versions and whether it is current: what a
    miss at deploy time explains itself with."""
    return (
        sa.select(Plan.id, Plan.program_id, Plan.is_current, Device.name.label("device"), *_software_columns(), Plan.created_at)
        .join(Device, Device.id == Plan.device_id)
        .join(Software, Software.id == Plan.software_id)
        .where(Plan.program_id.in_(program_ids))
        .order_by(Plan.created_at.desc(), Plan.id.desc())
    )


def programs_of(fingerprint: str, function: str | None, legacy_names: tuple[str, ...], v3: bool = True) -> Select[Any]:
    """The program with `fingerprint`, and those of the same function (``module:qualname``; for programs
    stored before migration 0003, a name in `legacy_names`)."""
    cond = Program.fingerprint == fingerprint
    if function and v3:
        cond = sa.or_(cond, Program.function == function, sa.and_(Program.function.is_(None), Program.name.in_(legacy_names)))
    elif legacy_names:
        cond = sa.or_(cond, Program.name.in_(legacy_names))
    return sa.select(Program.id, Program.fingerprint, Program.name, Program.signature).where(cond).order_by(Program.id.desc())


def same_structure(structure: str, device_name: str, software: dict[str, str], exclude: str) -> Select[Any]:
    """The current plans of the programs of `structure` (other than `exclude`, a fingerprint) on this device
    and backend, exact versions first, newest first: the plans that may serve a shape not tuned exactly (the caller
    orders them nearest in size first: `autofuse.shapes.nearest_first`)."""
    return _current_plans(software, device_name, Program.structure == structure, Program.fingerprint != exclude,
                          extra=(Program.fingerprint, Program.signature))


def unstructured_programs(function: str, limit: int) -> Select[Any]:
    """Programs of `function` (``module:qualname``) whose structure is not known yet (stored before migration
    0005), newest first."""
    return (
        sa.select(Program.id, Program.fingerprint, Program.signature)
        .where(Program.function == function, Program.structure.is_(None))
        .order_by(Program.id.desc())
        .limit(limit)
    )


def shape_checks(plan_ids: list[int] | None = None, fingerprint: str | None = None) -> Select[Any]:
    """Checks of plans at shapes they were not tuned for, newest first, with the software they ran with."""
    q = (
        sa.select(PlanShape.id, PlanShape.plan_id, PlanShape.fingerprint, PlanShape.inputs, PlanShape.verdict,
                  PlanShape.detail, PlanShape.actor, PlanShape.checked_at, *_software_columns())
        .join(Software, Software.id == PlanShape.software_id)
    )
    if plan_ids is not None:
        q = q.where(PlanShape.plan_id.in_(plan_ids))
    if fingerprint is not None:
        q = q.where(PlanShape.fingerprint == fingerprint)
    return q.order_by(PlanShape.checked_at.desc(), PlanShape.id.desc())


def plan_programs(plan_ids: list[int]) -> Select[Any]:
    """Each plan's program: its fingerprint, structure and input signature."""
    return (
        sa.select(Plan.id.label("plan_id"), Program.fingerprint, Program.structure, Program.signature)
        .join(Program, Program.id == Plan.program_id)
        .where(Plan.id.in_(plan_ids))
    )
