"""The ``autofuse`` command line.

    autofuse runs [--program NAME] [--device NAME] [--since YYYY-MM-DD] [--min-speedup X] [--json|--csv]
    autofuse plans [...same filters...] [--current]
    autofuse trials RUN [--status S]
    autofuse show run ID | show plan ID
    autofuse compare [...filters...]
    autofuse report RUN --out DIR
    autofuse db upgrade|downgrade|current|history
    autofuse tune ... [--workers N]  (added by the search side, see _add_tune_parser)
    autofuse worker RUN [--workers N]  (join a run tuned with workers, from another host)

Every command takes ``--db URL`` (else ``$AUTOFUSE_DB``, else the per-user
SQLite file). Errors are one line on stderr and exit status 2; set
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
from collections.abc import Callable, Sequence
from typing import Any

from .tables import Column, fmt_bool, fmt_ms, fmt_short, fmt_time, fmt_x, format_table, jsonable

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
    from autofuse.store import PlanStore

    return PlanStore(getattr(args, "db", None))


RUN_COLUMNS: list[Column] = [
    Column("id", "id"),
    Column("started", "started_at", fmt_time),
    Column("program", "program", fmt_short(24)),
    Column("fingerprint", "fingerprint", fmt_short(12)),
    Column("device", "device"),
    Column("backend", "backend"),
    Column("status", "status"),
    Column("measure", "measure"),
    Column("cands", "n_candidates"),
    Column("trials", "n_trials"),
    Column("baseline_ms", "baseline_ms", fmt_ms),
    Column("best_ms", "best_ms", fmt_ms),
    Column("speedup", "speedup", fmt_x),
]

PLAN_COLUMNS: list[Column] = [
    Column("id", "id"),
    Column("created", "created_at", fmt_time),
    Column("program", "program", fmt_short(24)),
    Column("fingerprint", "fingerprint", fmt_short(12)),
    Column("device", "device"),
    Column("jax", "jax"),
    Column("backend", "backend"),
    Column("measure", "measure"),
    Column("ms", "measured_ms", fmt_ms),
    Column("baseline_ms", "baseline_ms", fmt_ms),
    Column("speedup", "speedup", fmt_x),
    Column("max_error", "max_error", lambda v: "" if v is None else f"{v:.2g}"),
    Column("current", "is_current", fmt_bool),
    Column("run", "run_id"),
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
    Column("best_config", "best_config", fmt_short(48)),
]

COMPARE_COLUMNS: list[Column] = [
    Column("program", "program", fmt_short(24)),
    Column("fingerprint", "fingerprint", fmt_short(12)),
    Column("device", "device"),
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


def _cmd_plans(args: argparse.Namespace) -> int:
    rows = _store(args).plans(args.program, args.device, args.since, args.min_speedup, current_only=args.current)
    return _emit(args, rows, PLAN_COLUMNS, "plans")


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


def _cmd_show(args: argparse.Namespace) -> int:
    store = _store(args)
    if args.kind == "run":
        run = store.get_run(args.id)
        cands = store.candidates(args.id)
        trials = store.trials(args.id)
        counts: dict[str, int] = {}
        for t in trials:
            counts[t["status"]] = counts.get(t["status"], 0) + 1
        plans = [p for p in store.plans(run["fingerprint"]) if p["run_id"] == args.id]
        if args.json:
            out = dict(run, candidates=cands, trial_status=counts, plans=plans)
            print(json.dumps(jsonable(out), indent=2))
            return 0
        _print_fields(run)
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
    _print_fields(plan, skip=("plan", "plan_json", "signature"))
    print(f"signature  {json.dumps(jsonable(plan['signature']))}")
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
    engine = db.create_engine(getattr(args, "db", None))
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
    except db.StoreError:
        raise
    except Exception as e:
        err = db.translate_error(e, engine.url)
        if err is not None:
            raise err from None
        raise


class _CliError(Exception):
    """A usage problem reported as one line."""


# ------------------------------------------------------------------ parser


def _add_tune_parser(sub: argparse._SubParsersAction) -> None:  # noqa: SLF001
    p = sub.add_parser(
        "tune",
        parents=[_db_parent()],
        help="tune a JAX function: search fused kernels, validate against jax.jit, store the plan",
        description=(
            "Capture MODULE:FUNCTION with the example arguments returned by --inputs MODULE:FACTORY, "
            "enumerate fusible groups, search tile configs with Optuna (each trial built, checked against XLA "
            "and timed), choose the cheapest exact cover, validate the whole plan against jax.jit and store it. "
            "On a machine with no GPU, candidates are ranked with an analytic model of an H200 (said up front, "
            "and marked as modelled in the output and the store)."
        ),
        epilog="example: autofuse tune examples.norms:forward --inputs examples.norms:example_inputs --trials 40",
    )
    p.add_argument("target", metavar="MODULE:FUNCTION", help="the function to tune (importable from the current directory)")
    p.add_argument("--inputs", required=True, metavar="MODULE:FACTORY",
                   help="a function returning the example arguments: a tuple of positional args (arrays or jax.ShapeDtypeStruct "
                        "pytrees); arrays are also used to check the whole plan (e.g. a model's own weights), beside random inputs")
    p.add_argument("--trials", type=int, default=None, help="trial budget for the whole job (default 48 when no --time-budget)")
    p.add_argument("--time-budget", type=float, default=None, metavar="S",
                   help="time budget for the whole job, in seconds, counted from its start (which times every distinct candidate in XLA first)")
    p.add_argument("--seed", type=int, default=0, help="sampler seed (same seed and budget: same trials in the same order)")
    p.add_argument("--measure", choices=["device", "model"], default=None, help="time on the GPU or rank with the analytic model (default: device if a GPU is present)")
    p.add_argument("--static-argnums", default="", metavar="I,J", help="positions of arguments that are static (as jax.jit)")
    p.add_argument("--name", default=None, help="program name in the store (default: the function name)")
    p.add_argument("--resume", metavar="RUN", type=int, default=None, help="continue an interrupted run (its seed and budget are reused)")
    p.add_argument("--no-store", action="store_true", help="keep the result in memory only")
    p.add_argument("--no-isolate", action="store_true", help="run trials in this process (no crash isolation)")
    p.add_argument("--trial-timeout", type=float, default=300.0, metavar="S", help="per-trial time limit (default 300 s)")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="tune with N worker processes on this host, one per GPU (CUDA_VISIBLE_DEVICES), sharing the run's Optuna "
                        "studies in the --db database; more can join from other hosts with 'autofuse worker RUN'")
    p.add_argument("--heartbeat", type=int, default=10, metavar="S",
                   help="with --workers: Optuna heartbeat interval; a worker silent for 5 intervals is dead and its trial retried (default 10)")
    p.add_argument("--backends", default=None, metavar="B,C",
                   help="Pallas lowerings to search, the preferred first: mosaic_gpu (Hopper: TMA, wgmma), triton "
                        "(default: mosaic_gpu,triton on a Hopper GPU, else triton)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar or per-candidate lines")
    p.set_defaults(func=_cmd_tune)


def _import_ref(ref: str) -> Any:
    import importlib

    if ":" not in ref:
        raise ValueError(f"expected MODULE:NAME, got {ref!r}")
    mod, _, attr = ref.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj = importlib.import_module(mod)
    except ImportError as e:
        raise ValueError(f"cannot import module {mod!r}: {e}") from None
    except Exception as e:  # a syntax error, or an error while the module runs: the user's to fix, in one line
        where = f" ({e.filename}, line {e.lineno})" if isinstance(e, SyntaxError) else ""
        raise ValueError(f"importing module {mod!r} failed: {type(e).__name__}: {e.msg if isinstance(e, SyntaxError) else e}{where}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"module {mod!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def _cmd_tune(args: argparse.Namespace) -> int:
    from autofuse.graph import capture
    from autofuse.tuning.job import check_budget
    from autofuse.tuning.local import tune

    check_budget(args.trials, args.time_budget, trials_flag="--trials", seconds_flag="--time-budget")
    fn = _import_ref(args.target)
    factory = _import_ref(args.inputs)
    try:
        example = factory()
    except Exception as e:
        raise ValueError(f"the --inputs factory {args.inputs} failed: {type(e).__name__}: {e}") from None
    if not isinstance(example, tuple):
        raise ValueError(f"the --inputs factory {args.inputs} must return a tuple of the function's positional arguments, "
                         f"got a {type(example).__name__} (wrap a single argument as (x,))")
    try:
        statics = tuple(int(x) for x in args.static_argnums.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--static-argnums must be comma-separated integers, got {args.static_argnums!r}") from None
    try:
        capture(fn, *example, static_argnums=statics)
    except Exception as e:
        raise ValueError(f"tracing {args.target} with the example inputs failed: {type(e).__name__}: {e}") from None
    store = None
    trials, budget, seed = args.trials, args.time_budget, args.seed
    if not args.no_store:
        from autofuse.store import PlanStore

        store = PlanStore(getattr(args, "db", None))
        if args.resume is not None:
            run = store.get_run(args.resume)
            if run["status"] == "finished":
                raise ValueError(f"run {args.resume} already finished")
            if run.get("job") is not None:
                raise ValueError(f"run {args.resume} was tuned with workers: join it while it runs (autofuse worker {args.resume}), "
                                 "or start a new run")
            b = run.get("budget") or {}
            trials, budget, seed = b.get("trials"), b.get("seconds"), run["seed"]
    elif args.resume is not None:
        raise ValueError("--resume needs the store (drop --no-store)")
    if args.workers is not None and args.no_store:
        raise ValueError("--workers share the run through the database: drop --no-store")
    report = tune(fn, *example, trials=trials, time_budget_s=budget, seed=seed, store=store, name=args.name or args.target,
                  measure=args.measure, quiet=args.quiet, isolate=not args.no_isolate, trial_timeout_s=args.trial_timeout,
                  static_argnums=statics, resume=args.resume, workers=args.workers, heartbeat_s=args.heartbeat,
                  backends=[b.strip() for b in args.backends.split(",") if b.strip()] if args.backends is not None else None)
    if args.json:
        print(json.dumps({"name": report.name, "fingerprint": report.fingerprint, "measure": report.measure,
                          "baseline_ms": report.baseline_ms, "tuned_ms": report.tuned_ms, "speedup": report.speedup,
                          "run_id": report.run_id, "plan_id": report.plan_id, "plan": report.plan.to_dict()}, indent=2))
    else:
        print(report.table())
    return 0


def _add_worker_parser(sub: argparse._SubParsersAction) -> None:  # noqa: SLF001
    p = sub.add_parser(
        "worker",
        parents=[_db_parent()],
        help="join a tuning run started with 'autofuse tune --workers' from another host",
        description=(
            "Start N worker processes on this host, one per GPU (CUDA_VISIBLE_DEVICES), that join run RUN: they take "
            "trials from the run's Optuna studies in the --db database until its budget is spent; the last one to finish "
            "selects and saves the plan. Run it from the same project directory (the function is imported by name). "
            "Needs a server database (PostgreSQL): a SQLite file is for the workers of one host (autofuse tune --workers)."
        ),
        epilog="example: autofuse worker 12 --db postgresql+psycopg://tuner@db.example/autofuse --workers 8",
    )
    p.add_argument("run", metavar="RUN", type=int, help="run id (printed by 'autofuse tune --workers')")
    p.add_argument("--workers", type=int, default=1, metavar="N", help="worker processes on this host, one per GPU (default 1)")
    p.add_argument("--quiet", action="store_true", help="no per-worker progress lines")
    p.set_defaults(func=_cmd_worker)


def _cmd_worker(args: argparse.Namespace) -> int:
    from autofuse.store import db

    url = db.resolve_url(getattr(args, "db", None))
    if url.startswith("sqlite"):
        raise _CliError("autofuse worker joins a run from another host and needs a server database (--db postgresql+psycopg://...); "
                        "a SQLite file serves the workers of one host: autofuse tune ... --workers N")
    if args.workers < 1:
        raise _CliError(f"--workers must be at least 1, got {args.workers}")
    from autofuse.tuning.workers import start_workers, visible_gpus
    from autofuse.store import PlanStore

    run = PlanStore(url).get_run(args.run)  # KeyError (one line) for an unknown run
    if run["status"] != "running":
        raise _CliError(f"run {args.run} is {run['status']}: nothing to join")
    gpus = visible_gpus()
    if run["measure"] == "device" and args.workers > len(gpus):
        raise _CliError(f"{args.workers} workers but {len(gpus)} visible GPU(s) here: one worker per GPU")
    codes = [p.wait() for p in start_workers(args.run, url, args.workers, gpus, args.quiet)]
    if any(codes):
        raise _CliError(f"worker exit codes {codes} (a dead worker's running trial is retried by another)")
    return 0


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
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    _add_tune_parser(sub)
    _add_worker_parser(sub)

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
        "autofuse.jit uses.",
        epilog="example: autofuse plans --program mlp --current --json",
    )
    p.add_argument("--current", action="store_true", help="only current plans")
    p.set_defaults(func=_cmd_plans)

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
    """One line for expected failures; None for a bug (traceback wanted)."""
    from autofuse.store.db import StoreError

    if isinstance(e, KeyError):
        text = str(e.args[0]) if e.args else "not found"
    elif isinstance(e, (StoreError, ValueError, _CliError, OSError)):
        text = str(e)
    else:
        try:
            from sqlalchemy.exc import SQLAlchemyError
        except ImportError:  # pragma: no cover
            return None
        if not isinstance(e, SQLAlchemyError):
            return None
        orig = getattr(e, "orig", None)
        text = f"database error: {orig if orig is not None else e}"
    lines = text.strip().splitlines()
    return lines[0] if lines else type(e).__name__


if __name__ == "__main__":
    raise SystemExit(main())
