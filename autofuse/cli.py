"""The ``autofuse`` command line.

    autofuse runs [--program NAME] [--device NAME] [--since YYYY-MM-DD] [--min-speedup X] [--json|--csv]
    autofuse plans [...same filters...] [--current]
    autofuse plans promote|pin|unpin|rm ID ; autofuse plans events [--plan ID]
    autofuse trials RUN [--status S]
    autofuse show run ID | show plan ID
    autofuse compare [...filters...]
    autofuse report RUN --out DIR
    autofuse db upgrade|downgrade|current|history
    autofuse tune ... [-v|--quiet] [--all] [--dry-run] [--workers N]  (autofuse.cli_tune)
    autofuse worker RUN MODULE:FUNCTION [--workers N]  (join a run tuned with workers, from another host; autofuse.cli_tune)
    autofuse --version

Every command takes ``--db URL`` (else ``$AUTOFUSE_DB``, else the per-user
SQLite file); the listings open it read-only and never create one. Errors are one line on stderr and exit status 2; set
``AUTOFUSE_DEBUG=1`` for a traceback. Nothing here imports JAX at module
level, and the store is imported only when a command runs.
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import io
import json
import os
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from .tables import (Column, device_label, fmt_bool, fmt_ms, fmt_short, fmt_time, fmt_x, format_phases, format_table, jsonable,
                     memory_text)

PROG = "autofuse"


# --------------------------------------------------------------------- output


def _cell(value: Any) -> str:
    """A value as one CSV cell: JSON for lists/dicts, ISO for datetimes."""
    if value is None:
        return ""
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(jsonable(value), separators=(",", ":"))
    if isinstance(value, (_dt.datetime, _dt.date)):
        return value.isoformat()
    return str(value)


def _emit(args: argparse.Namespace, rows: list[dict[str, Any]], columns: Sequence[Column], what: str) -> int:
    """Print rows as JSON, CSV (all fields) or an aligned table (chosen columns)."""
    if getattr(args, "json", False):
        print(json.dumps([jsonable(r) for r in rows], indent=2))
    elif getattr(args, "csv", False):
        buf = io.StringIO()
        keys = list(rows[0].keys()) if rows else [c.key or c.header for c in columns]
        w = csv.DictWriter(buf, fieldnames=keys, lineterminator="\n")
        w.writeheader()
        for r in rows:
            w.writerow({k: _cell(r.get(k)) for k in keys})
        sys.stdout.write(buf.getvalue())
    elif not rows:
        print(f"no {what} match", file=sys.stderr)
    else:
        print(format_table(rows, columns))
    return 0


# ------------------------------------------------------------------- arguments


def _date_arg(text: str) -> str:
    try:
        _dt.date.fromisoformat(text) if len(text) == 10 else _dt.datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid date {text!r}: expected YYYY-MM-DD") from None
    return text


def _db_parent() -> argparse.ArgumentParser:
    """``--db URL``, shared by every subcommand (``tune`` included)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument(
        "--db",
        metavar="URL",
        default=argparse.SUPPRESS,
        help="database URL (sqlite:////path/file.db, postgresql+psycopg://...) or a file path; "
        "default: $AUTOFUSE_DB, else ~/.local/share/autofuse/autofuse.db",
    )
    return p


def _format_parent() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--json", action="store_true", help="print a JSON list of objects (all fields)")
    g.add_argument("--csv", action="store_true", help="print CSV with a header row (all fields)")
    return p


def _filter_parent() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--program", metavar="NAME", help="program name, or fingerprint (or a prefix of it)")
    p.add_argument("--device", metavar="NAME", help="device name, case-insensitive substring (e.g. h200)")
    p.add_argument("--since", metavar="YYYY-MM-DD", type=_date_arg, help="only on or after this date (UTC)")
    p.add_argument("--min-speedup", metavar="X", type=float, help="only with speedup >= X")
    return p


# ------------------------------------------------------------------ commands


def _store(args: argparse.Namespace) -> Any:
    """The store opened read-only: listings never create, migrate or write a database (a read-only file or
    volume works; a missing one is an error naming the URL)."""
    from autofuse.store import PlanStore

    return PlanStore(getattr(args, "db", None), readonly=True)


def _write_store(args: argparse.Namespace) -> Any:
    """The store opened for writing (created or upgraded if needed); a read-only one is an error in one line."""
    from autofuse.store import PlanStore

    return PlanStore(getattr(args, "db", None))


def _shown_device(row: dict[str, Any]) -> str:
    """A modelled result's device is the model of a GPU, not the CPU it was computed on."""
    return device_label(row.get("measure"), row.get("device"), row.get("model") or (row.get("budget") or {}).get("model"))


def _with_models(store: Any, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Modelled plans with the GPU their run's model described (``model``), for the device column."""
    models: dict[int, str | None] = {}
    for r in rows:
        if r.get("measure") == "model" and r.get("run_id") is not None:
            if r["run_id"] not in models:
                try:
                    models[r["run_id"]] = (store.get_run(r["run_id"]).get("budget") or {}).get("model")
                except KeyError:
                    models[r["run_id"]] = None
            r["model"] = models[r["run_id"]]
    return rows


RUN_COLUMNS: list[Column] = [
    Column("id", "id"),
    Column("started", "started_at", fmt_time),
    Column("program", "program"),
    Column("fingerprint", "fingerprint", fmt_short(12)),
    Column("device", of_row=_shown_device),
    Column("backend", "backend"),
    Column("status", "status"),
    Column("measure", "measure"),
    Column("cands", "n_candidates"),
    Column("trials", "n_trials"),
    Column("infeasible", "n_infeasible"),
    Column("baseline_ms", "baseline_ms", fmt_ms),
    Column("best_ms", "best_ms", fmt_ms),
    Column("speedup", "speedup", fmt_x),
]

PLAN_COLUMNS: list[Column] = [
    Column("id", "id"),
    Column("created", "created_at", fmt_time),
    Column("program", "program"),
    Column("fingerprint", "fingerprint", fmt_short(12)),
    Column("device", of_row=_shown_device),
    Column("jax", "jax"),
    Column("backend", "backend"),
    Column("measure", "measure"),
    Column("ms", "measured_ms", fmt_ms),
    Column("baseline_ms", "baseline_ms", fmt_ms),
    Column("speedup", "speedup", fmt_x),
    Column("max_error", "max_error", lambda v: "" if v is None else f"{v:.2g}"),
    Column("current", "is_current", fmt_bool),
    Column("pin", "pinned", lambda v: "pin" if v else ""),
    Column("run", "run_id"),
]

EVENT_COLUMNS: list[Column] = [
    Column("at", "at", fmt_time),
    Column("action", "action"),
    Column("plan", "plan_id"),
    Column("program", "program", fmt_short(24)),
    Column("run", "run_id"),
    Column("by", "actor", fmt_short(32)),
    Column("detail", "detail", fmt_short(100)),
]

TRIAL_COLUMNS: list[Column] = [
    Column("cand", "candidate_id"),
    Column("template", "template"),
    Column("signature", "signature", fmt_short(12)),
    Column("#", "number"),
    Column("status", "status"),
    Column("median_ms", "median_ms", fmt_ms),
    Column("min_ms", "min_ms", fmt_ms),
    Column("max_ms", "max_ms", fmt_ms),
    Column("config", "config", fmt_short(48)),
    Column("error", "error", fmt_short(40)),
]

CANDIDATE_COLUMNS: list[Column] = [
    Column("id", "id"),
    Column("template", "template"),
    Column("signature", "signature", fmt_short(12)),
    Column("nodes", "nodes", fmt_short(24)),
    Column("status", "status"),
    Column("trials", "n_trials"),
    Column("best_ms", "best_ms", fmt_ms),
    Column("xla_ms", "xla_ms", fmt_ms),
    Column("speedup", "speedup", fmt_x),
    Column("xla_in_program", "xla_in_program_ms", fmt_ms),
    Column("best_config", "best_config", fmt_short(48)),
]

COMPARE_COLUMNS: list[Column] = [
    Column("program", "program"),
    Column("fingerprint", "fingerprint", fmt_short(12)),
    Column("device", of_row=_shown_device),
    Column("jax", "jax"),
    Column("jaxlib", "jaxlib"),
    Column("autofuse", "autofuse"),
    Column("backend", "backend"),
    Column("plan", "plan_id"),
    Column("measure", "measure"),
    Column("speedup", "speedup", fmt_x),
    Column("best", "best_speedup", fmt_x),
    Column("plans", "n_plans"),
]


def _cmd_runs(args: argparse.Namespace) -> int:
    rows = _store(args).runs(args.program, args.device, args.since, args.min_speedup)
    if args.status:
        rows = [r for r in rows if r["status"] == args.status]
    return _emit(args, rows, RUN_COLUMNS, "runs")


SHAPE_COLUMNS: list[Column] = [
    Column("plan", "plan_id"),
    Column("program", "program", fmt_short(24)),
    Column("shapes", "shapes", fmt_short(60)),
    Column("verdict", "verdict"),
    Column("jax", "jax"),
    Column("at", "at", fmt_time),
    Column("by", "actor", fmt_short(32)),
    Column("detail", "detail", fmt_short(90)),
]


def _cmd_plans(args: argparse.Namespace) -> int:
    store = _store(args)
    rows = _with_models(store, store.plans(args.program, args.device, args.since, args.min_speedup, current_only=args.current))
    if args.shapes:
        return _plan_shapes(args, store, rows)
    return _emit(args, rows, PLAN_COLUMNS, "plans")


def _plan_shapes(args: argparse.Namespace, store: Any, plans: list[dict[str, Any]]) -> int:
    """Per plan: the shapes it may serve (its structure: the inputs with sizes abstracted), the shapes it was tuned at,
    and each check at another shape (``ok``: it served it; ``failed``: why not). JSON/CSV: one object per plan."""
    from autofuse.signatures import pattern, short_inputs

    info = store.plan_shapes([p["id"] for p in plans])
    out: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    for p in plans:
        got = info.get(p["id"]) or {"structure": None, "inputs": [], "checks": []}
        structure = got["structure"]
        may = (f"same structure {structure[:12]} (sizes free, configs that fit, checked once each)" if structure
               else "structure not recorded yet (the next autofuse.jit of its function records it)")
        out.append({"plan_id": p["id"], "program": p["program"], "structure": structure, "may_serve": pattern(got["inputs"]) if structure else None,
                    "tuned_at": got["inputs"], "checks": got["checks"]})
        base = {"plan_id": p["id"], "program": p["program"]}
        rows.append({**base, "shapes": pattern(got["inputs"]) if structure else "?", "verdict": "may serve", "detail": may})
        rows.append({**base, "shapes": short_inputs(got["inputs"]), "verdict": "tuned", "jax": p.get("jax"), "at": p.get("created_at")})
        rows += [{**base, "shapes": short_inputs(c["inputs"] or []), "verdict": c["verdict"], "jax": c["jax"], "at": c["checked_at"],
                  "actor": c["actor"], "detail": c["detail"]} for c in got["checks"]]
    if getattr(args, "json", False) or getattr(args, "csv", False):
        return _emit(args, out, SHAPE_COLUMNS, "plans")
    return _emit(args, rows, SHAPE_COLUMNS, "plans")


def _cmd_plan_change(args: argparse.Namespace) -> int:
    """promote, pin, unpin or rm one plan: one line saying what changed (recorded with who and when)."""
    store = _write_store(args)
    change = {"promote": store.promote_plan, "pin": store.pin_plan, "unpin": store.unpin_plan, "rm": store.remove_plan}[args.action]
    print(change(args.id).message)
    return 0


def _cmd_plan_events(args: argparse.Namespace) -> int:
    rows = _store(args).plan_events(args.plan, args.program)
    return _emit(args, rows, EVENT_COLUMNS, "plan events")


def _cmd_trials(args: argparse.Namespace) -> int:
    store = _store(args)
    store.get_run(args.run)  # KeyError for an unknown run
    return _emit(args, store.trials(args.run, args.status), TRIAL_COLUMNS, "trials")


def _cmd_compare(args: argparse.Namespace) -> int:
    rows = _store(args).compare(args.program, args.device, args.since, args.min_speedup)
    return _emit(args, rows, COMPARE_COLUMNS, "programs with plans")


def _print_fields(d: dict[str, Any], skip: Sequence[str] = ()) -> None:
    width = max(len(k) for k in d)
    for k, v in d.items():
        if k in skip:
            continue
        if isinstance(v, _dt.datetime):
            text = v.isoformat()
        elif isinstance(v, (dict, list)):
            text = json.dumps(jsonable(v), separators=(", ", ": "))
        else:
            text = "" if v is None else str(v)
        print(f"{k.ljust(width)}  {text}")


SIGNATURE_CHARS = 160  # a program's signature longer than this is summed up in `show run` (--json has it whole)


def _signature_text(sig: Any) -> Any:
    """A run's input/output signature as `show run` prints it: whole where short, else counted by type (a model's
    hundreds of weights made a line of thousands of characters)."""
    if not isinstance(sig, dict) or len(json.dumps(sig)) <= SIGNATURE_CHARS:
        return sig

    def counted(avals: Sequence[str]) -> str:
        return ", ".join(a if n == 1 else f"{a} x{n}" for a, n in Counter(avals).items())
    ins, outs = sig.get("inputs") or [], sig.get("outputs") or []
    text = f"{len(ins)} inputs: {counted(ins)}; {len(outs)} output(s): {counted(outs)}"
    return text if len(text) <= 2 * SIGNATURE_CHARS else text[:2 * SIGNATURE_CHARS] + "... (--json: all)"


def _cmd_show(args: argparse.Namespace) -> int:
    store = _store(args)
    if args.kind == "run":
        run = store.get_run(args.id)
        # what one instance of each tuned candidate saves of XLA's kernels in the program, where the job profiled it
        in_program = ((run.get("phases") or {}).get("selection") or {}).get("in_program_xla_ms") or {}
        cands = [dict(c, xla_in_program_ms=in_program.get(c["signature"])) for c in store.candidates(args.id)]
        trials = store.trials(args.id)
        counts: dict[str, int] = {}
        for t in trials:
            counts[t["status"]] = counts.get(t["status"], 0) + 1
        model = (run.get("budget") or {}).get("model")
        plans = [dict(p, model=model) for p in store.plans(run["fingerprint"]) if p["run_id"] == args.id]
        if args.json:
            out = dict(run, candidates=cands, trial_status=counts, plans=plans)
            print(json.dumps(jsonable(out), indent=2))
            return 0
        _print_fields(dict(run, device=_shown_device(run), signature=_signature_text(run.get("signature"))), skip=("phases",))
        print()
        print("phases (seconds from the run's start, + since the mark before):")
        for line in format_phases(run.get("phases")):
            print(f"  {line}")
        print()
        print(f"candidates ({len(cands)}):")
        print(format_table(cands, CANDIDATE_COLUMNS) if cands else "  (none)")
        print()
        print("trials by status: " + (", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "(none)"))
        if plans:
            print()
            print(f"plans saved by this run ({len(plans)}):")
            print(format_table(plans, PLAN_COLUMNS))
        return 0
    plan = store.get_plan(args.id)
    if args.json:
        out = {k: v for k, v in plan.items() if k != "plan_json"}
        print(json.dumps(jsonable(out), indent=2))
        return 0
    model = ((plan.get("plan") or {}).get("provenance") or {}).get("model")
    _print_fields(dict(plan, device=_shown_device(dict(plan, model=model))), skip=("plan", "plan_json", "signature"))
    print(f"signature  {json.dumps(jsonable(plan['signature']))}")
    memory = memory_text((plan.get("plan") or {}).get("provenance") or {})
    if memory:
        print(f"memory     {memory}")
    print()
    print(json.dumps(plan["plan"], indent=2))
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from autofuse.report import write_report

    path = write_report(_store(args), args.run, args.out)
    print(path)
    return 0


def _cmd_db(args: argparse.Namespace) -> int:
    from autofuse.store import db

    if args.action == "history":
        for h in db.history():
            head = " (head)" if h["revision"] == db.HEAD_REVISION else ""
            print(f"{h['down_revision'] or '<base>'} -> {h['revision']}{head}, {h['message']}")
        return 0
    url = getattr(args, "db", None)
    engine = db.reader_engine(url) if args.action == "current" else db.open_engine(url, migrate=False)
    try:
        if args.action == "current":
            revs = _db_call(engine, lambda: db.current(engine))
            if not revs:
                print("(no autofuse schema)")
            known = set(db.known_revisions()) if revs else set()
            for rev in sorted(revs):
                if rev == db.HEAD_REVISION:
                    print(f"{rev} (head)")
                elif rev in known:
                    print(f"{rev} (upgrade available: autofuse db upgrade)")
                else:
                    print(f"{rev} (unknown: created by a newer autofuse)")
            return 0
        if args.action == "upgrade":
            before, after = _db_call(engine, lambda: db.upgrade(engine, args.revision))
        else:
            if not args.yes:
                raise _CliError(
                    "refusing to downgrade without --yes (a downgrade drops autofuse tables and their data)"
                )
            before, after = _db_call(engine, lambda: db.downgrade(engine, args.revision))
        b = ",".join(sorted(before)) or "<base>"
        a = ",".join(sorted(after)) or "<base>"
        print(f"autofuse schema: {b} -> {a}" if before != after else f"autofuse schema already at {a}")
        return 0
    finally:
        engine.dispose()


def _db_call(engine: Any, fn: Callable[[], Any]) -> Any:
    from autofuse.store import db

    try:
        return fn()
    except Exception as e:
        db.raise_translated(e, engine.url)


class _CliError(Exception):
    """A usage problem reported as one line."""


def version_line() -> str:
    """``autofuse 0.1.0 (jax 0.11.2, jaxlib 0.11.2)``: the installed packages' versions, from their metadata (JAX is
    not imported); autofuse's own where it runs from a checkout that is not installed."""
    from importlib import metadata

    from autofuse import __version__

    def installed(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    deps = ", ".join(f"{name} {installed(name) or 'not installed'}" for name in ("jax", "jaxlib"))
    return f"{PROG} {installed('autofuse') or __version__} ({deps})"


class _VersionAction(argparse.Action):
    """``--version``: print `version_line` and exit; looked up only when asked."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, default: Any = argparse.SUPPRESS,
                 help: str | None = None) -> None:  # noqa: A002 -- argparse's own keyword
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option_string: str | None = None) -> None:
        print(version_line())
        parser.exit()


# ------------------------------------------------------------------ parser


def build_parser() -> argparse.ArgumentParser:
    """The ``autofuse`` argument parser."""
    fmt = argparse.RawDescriptionHelpFormatter
    dbp, outp, filt = _db_parent(), _format_parent(), _filter_parent()
    parser = argparse.ArgumentParser(
        prog=PROG,
        formatter_class=fmt,
        description="Auto-tuned kernel fusion for JAX: tune programs, and inspect the plan store "
        "(runs, candidates, trials and plans).",
        epilog="Database: --db URL, else $AUTOFUSE_DB, else ~/.local/share/autofuse/autofuse.db "
        "(created on first use). Run 'autofuse COMMAND --help' for each command.",
    )
    parser.add_argument("--db", metavar="URL", default=None, help="database URL (also accepted after the command)")
    parser.add_argument("--version", action=_VersionAction, help="print the versions of autofuse, jax and jaxlib, and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    from autofuse.cli_tune import add_tune_parser, add_worker_parser

    add_tune_parser(sub, [dbp])
    add_worker_parser(sub, [dbp])

    p = sub.add_parser(
        "runs",
        parents=[dbp, outp, filt],
        formatter_class=fmt,
        help="list tuning runs",
        description="List tuning runs, newest first: program, device, status, candidates and trials "
        "measured, baseline (XLA) and best times, and speedup.",
        epilog="example: autofuse runs --device h200 --since 2026-01-01 --min-speedup 1.1",
    )
    p.add_argument("--status", choices=["running", "finished", "interrupted", "failed"], help="only runs in this status")
    p.set_defaults(func=_cmd_runs)

    p = sub.add_parser(
        "plans",
        parents=[dbp, outp, filt],
        formatter_class=fmt,
        help="list stored plans",
        description="List stored fusion plans, newest first, with their measured time, baseline and "
        "speedup. The current plan of each (program, device, software) is marked '*'; it is the one "
        "autofuse.jit uses. A tuning job's plan becomes current only if it was measured and beats the "
        "current one beyond noise (or with tune --promote); a pinned plan ('pin') is never replaced by one. "
        "Change them with the actions below; each change is recorded (autofuse plans events).",
        epilog="examples: autofuse plans --program mlp --current --json ; autofuse plans promote 12 ; autofuse plans pin 12 ; "
        "autofuse plans events --plan 12",
    )
    p.add_argument("--current", action="store_true", help="only current plans")
    p.add_argument("--shapes", action="store_true",
                   help="the shapes each plan may serve (its structure), was tuned at, and served at other shapes (with verdicts)")
    p.set_defaults(func=_cmd_plans)
    psub = p.add_subparsers(dest="action", metavar="[ACTION]")
    for action, text in (("promote", "make plan ID the current plan of its program, device and software"),
                         ("pin", "make plan ID current and pinned: no tuning job replaces it"),
                         ("unpin", "let tuning jobs replace plan ID again when they beat it"),
                         ("rm", "remove plan ID (refused while pinned; removing the current plan leaves none current)")):
        a = psub.add_parser(action, parents=[dbp], help=text, description=text[0].upper() + text[1:] + ". Recorded with who and when.")
        a.add_argument("id", metavar="ID", type=int, help="plan id (see 'autofuse plans')")
        a.set_defaults(func=_cmd_plan_change)
    a = psub.add_parser("events", parents=[dbp, outp], help="who promoted, pinned, unpinned or removed which plan, and what tuning jobs decided",
                        description="The record of plan changes, newest first: tuning jobs' decisions (saved: current or not, and why) "
                        "and people's promote, pin, unpin and rm, with who (user@host) and when.")
    a.add_argument("--plan", metavar="ID", type=int, help="only this plan's events")
    a.add_argument("--program", metavar="NAME", help="only this program's (name or fingerprint prefix)")
    a.set_defaults(func=_cmd_plan_events)

    p = sub.add_parser(
        "trials",
        parents=[dbp, outp],
        formatter_class=fmt,
        help="list the trials of a run",
        description="List every trial of a run (one tile config of one candidate): status "
        "(ok, infeasible, compile_error, wrong_result, timeout, ...), median/min/max time, config, error.",
        epilog="example: autofuse trials 12 --status compile_error",
    )
    p.add_argument("run", metavar="RUN", type=int, help="run id (see 'autofuse runs')")
    p.add_argument("--status", help="only trials with this status")
    p.set_defaults(func=_cmd_trials)

    p = sub.add_parser(
        "show",
        parents=[dbp],
        formatter_class=fmt,
        help="show one run or plan in detail",
        description="Show one run (fields, candidates, trial status counts, plans it saved) or one "
        "plan (fields and the plan JSON).",
        epilog="examples: autofuse show run 12 ; autofuse show plan 3 --json",
    )
    p.add_argument("kind", choices=["run", "plan"], help="what to show")
    p.add_argument("id", metavar="ID", type=int, help="run or plan id")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_show)

    p = sub.add_parser(
        "compare",
        parents=[dbp, outp, filt],
        formatter_class=fmt,
        help="compare current plans across devices and software",
        description="One row per program x device x software (jax, jaxlib, autofuse, backend) that has "
        "a current plan: its speedup over XLA, the best speedup ever stored for it, and how many plans "
        "were stored.",
        epilog="example: autofuse compare --program mlp",
    )
    p.set_defaults(func=_cmd_compare)

    p = sub.add_parser(
        "report",
        parents=[dbp],
        formatter_class=fmt,
        help="write a Markdown report with plots for a run",
        description="Write DIR/report.md for a run, with PNG plots: search convergence (best-so-far "
        "time per candidate vs trial) and per-candidate speedup over XLA. Prints the report path.",
        epilog="example: autofuse report 12 --out reports/run12",
    )
    p.add_argument("run", metavar="RUN", type=int, help="run id")
    p.add_argument("--out", metavar="DIR", required=True, help="output directory (created)")
    p.set_defaults(func=_cmd_report)

    p = sub.add_parser(
        "db",
        parents=[dbp],
        formatter_class=fmt,
        help="manage the database schema (upgrade, current, history)",
        description="Manage the autofuse schema (Alembic; version table autofuse_alembic_version, so "
        "Optuna tables in the same database are untouched). The schema is also created/upgraded "
        "automatically on first use.",
    )
    dsub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    a = dsub.add_parser("upgrade", parents=[dbp], help="upgrade the schema (default: to head)",
                        description="Create or upgrade the autofuse tables to REVISION (default head).")
    a.add_argument("revision", nargs="?", default="head", help="target revision (default: head)")
    a = dsub.add_parser("downgrade", parents=[dbp], help="downgrade the schema (drops data; needs --yes)",
                        description="Downgrade the autofuse tables to REVISION; 'base' drops them all. "
                        "Optuna's tables are never touched.")
    a.add_argument("revision", help="target revision, or 'base'")
    a.add_argument("--yes", action="store_true", help="really downgrade (data in dropped tables is lost)")
    dsub.add_parser("current", parents=[dbp], help="print the schema revision of the database",
                    description="Print the autofuse schema revision stored in the database.")
    dsub.add_parser("history", parents=[dbp], help="list the schema migrations this autofuse knows",
                    description="List the migrations of this autofuse version, newest first.")
    p.set_defaults(func=_cmd_db)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``autofuse`` command line; returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, or a usage error (status 2)
        return int(e.code or 0) if not isinstance(e.code, str) else 2
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:
        # Output piped into e.g. `head`: not an error.
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115
        except OSError:
            pass
        return 0
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001
        if os.environ.get("AUTOFUSE_DEBUG"):
            raise
        message = _error_message(e)
        if message is None:
            raise
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return 2


def _error_message(e: BaseException) -> str | None:
    """One line for expected failures; None for a bug (traceback wanted). The store (SQLAlchemy: most of a second to
    import) is imported only for an error that may be its own."""
    if isinstance(e, KeyError):
        text = str(e.args[0]) if e.args else "not found"
    elif isinstance(e, (ValueError, _CliError, OSError)):
        text = str(e)
    else:
        from sqlalchemy.exc import SQLAlchemyError

        from autofuse.store.db import StoreError

        if isinstance(e, StoreError):
            text = str(e)
        elif isinstance(e, SQLAlchemyError):
            orig = getattr(e, "orig", None)
            text = f"database error: {orig if orig is not None else e}"
        else:
            return None
    lines = text.strip().splitlines()
    return lines[0] if lines else type(e).__name__


if __name__ == "__main__":
    raise SystemExit(main())
