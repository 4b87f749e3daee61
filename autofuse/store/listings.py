"""The store's reads for people and tools (``autofuse runs``, ``plans``, ``compare``, ``--resume``): rows as dicts,
filtered as the CLI's options say, with runs shown as they stand now."""

from __future__ import annotations

import datetime as _dt
import json
import socket
from typing import Any

from autofuse.processes import pid_alive
from autofuse.store import queries
from autofuse.store.base import PHASES, PROMOTION, Db

UNFINISHED_STATUSES = ("running", "interrupted")


def runs(store: Db, program: str | None = None, device: str | None = None, since: str | _dt.date | None = None,
         min_speedup: float | None = None) -> list[dict[str, Any]]:
    """Runs, newest first. *program*: name or fingerprint (prefix);
    *device*: case-insensitive part of the name; *since*: ``YYYY-MM-DD``
    or a date/datetime (UTC); *min_speedup*: runs with speedup >= it."""
    return _live(store.read(queries.runs(program, device, queries.parse_since(since), min_speedup)))


def unfinished_runs(store: Db, program: str | None = None, device: str | None = None) -> list[dict[str, Any]]:
    """Runs in status running or interrupted (candidates for ``tune --resume``), newest first."""
    return _live(store.read(queries.runs(program, device, statuses=UNFINISHED_STATUSES)))


def plans(store: Db, program: str | None = None, device: str | None = None, since: str | _dt.date | None = None,
          min_speedup: float | None = None, current_only: bool = False) -> list[dict[str, Any]]:
    """Plans (without their JSON), newest first; filters as in :meth:`runs`."""
    return store.read(queries.plans(program, device, queries.parse_since(since), min_speedup, current_only,
                                    store.has(PROMOTION)))


def candidates(store: Db, run_id: int) -> list[dict[str, Any]]:
    """Candidates of a run, with ``speedup`` = xla_ms / best_ms where both are known."""
    rows = store.read(queries.candidates(run_id))
    for r in rows:
        r["speedup"] = _ratio(r["xla_ms"], r["best_ms"])
    return rows


def trials(store: Db, run_id: int, status: str | None = None) -> list[dict[str, Any]]:
    """Trials of a run (optionally of one status), joined with candidate signature and template."""
    return store.read(queries.trials(run_id, status))


def get_run(store: Db, run_id: int) -> dict[str, Any]:
    """One run with program, device and software details; KeyError if absent."""
    rows = store.read(queries.run(run_id, store.has(PHASES)))
    if not rows:
        raise KeyError(f"no run with id {run_id} in {store.shown}")
    return _live(rows)[0]


def get_plan(store: Db, plan_id: int) -> dict[str, Any]:
    """One plan; ``plan`` holds the parsed plan JSON, ``plan_json`` the text; KeyError if absent."""
    rows = store.read(queries.plan(plan_id, store.has(PROMOTION)))
    if not rows:
        raise KeyError(f"no plan with id {plan_id} in {store.shown}")
    r = rows[0]
    r["plan"] = json.loads(r["plan_json"])
    return r


def compare(store: Db, program: str | None = None, device: str | None = None, since: str | _dt.date | None = None,
            min_speedup: float | None = None) -> list[dict[str, Any]]:
    """One row per program x device x software that has a current plan:
    its speedup, the best speedup ever saved for the key, and the number of plans."""
    return store.read(queries.compare(program, device, queries.parse_since(since), min_speedup))


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den <= 0:
        return None
    return num / den


def _live(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Runs as they stand now: one still marked ``running`` whose process on this host is gone is shown
    ``interrupted`` (with why) at once, by any reader, read-only stores included; the next tuning job's
    :meth:`PlanStore.mark_interrupted` writes it. Runs of other hosts cannot be checked and are left as stored."""
    host = socket.gethostname()
    for r in rows:
        if r.get("status") == "running" and r.get("host") == host and r.get("pid") is not None and not pid_alive(r["pid"], r.get("started_at")):
            r["status"] = "interrupted"
            r["error"] = r.get("error") or f"its process ({host}, pid {r['pid']}) is gone"
    return rows
