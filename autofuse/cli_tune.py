"""The ``autofuse tune`` and ``autofuse worker`` commands: their arguments, and what they print.

    autofuse tune MODULE:FUNCTION --inputs MODULE:FACTORY [--trials N | --effort quick|default|thorough] [--time-budget S]
                  [-v | --quiet] [--all]
                  [--dry-run] [--workers N] [--shapes SPEC] ...
    autofuse worker RUN MODULE:FUNCTION [--workers N] [-v | --quiet]

By default a job shows a progress bar with its best plan so far, then a table of the groups it measured (the
plan's first) and one summary line; ``-v`` adds a line per trial and per candidate, ``--quiet`` prints the summary
line only, ``--all`` lists the candidates never measured too. ``--dry-run`` only says what a job would tune and
whether the budget is enough. Errors are one line (exit 2), as for every command (`autofuse.cli`).
"""
from __future__ import annotations

import argparse
import json
import os
import textwrap
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from autofuse import refs

if TYPE_CHECKING:
    from autofuse.tuning.options import JobOptions


def add_tune_parser(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "tune",
        parents=parents,
        help="tune a JAX function: search fused kernels, validate against jax.jit, store the plan",
        description=textwrap.fill(
            "Capture MODULE:FUNCTION with the example arguments returned by --inputs MODULE:FACTORY, "
            "enumerate fusible groups, search tile configs with Optuna (each trial built, checked against XLA "
            "and timed), choose the cheapest exact cover, validate the whole plan against jax.jit and store it. "
            "On a machine with no GPU, candidates are ranked with an analytic model of an H200 (said up front, "
            "and marked as modelled in the output and the store).", 100) + "\n\n" + textwrap.fill(
            "Output: a progress bar with the best plan so far (its speedup over jax.jit, its groups measured alone), "
            "then the measured groups (the plan's first, marked *, named by template and ops) and one summary line. "
            "Try --dry-run first on a big program: it says in a second what the budget can and cannot cover.", 100),
        epilog="examples:\n  autofuse tune examples.norms:forward --inputs examples.norms:example_inputs --trials 40\n"
               "  autofuse tune examples.gpt2:forward --inputs examples.gpt2:example_inputs --trials 300 --dry-run\n"
               "  autofuse tune mymodel:forward --inputs mymodel:inputs_at --shapes batch=1-8,seq=128-1024 --trials 100\n"
               "  autofuse tune mymodel:forward --shapes mymodel:buckets --trials 100\n\n"
               "shape buckets (--shapes SPEC): one job tunes the program at each bucket, smallest first, each its own run and plan\n"
               "(stored under that bucket's program; all buckets must be the same program at other sizes). SPEC is\n"
               "  NAME=LO-HI[,NAME=LO-HI...]  axes: every power of two from LO to HI (both powers of two); NAME=N fixes an\n"
               "                              axis at N. Each bucket is --inputs FACTORY(NAME=value, ...); at most 64 buckets\n"
               "  MODULE:BUCKETS              a function returning a list of argument tuples, one per bucket, or a dict of\n"
               "                              them by name (--inputs is then not needed)\n"
               "--trials and --time-budget are each bucket's. Each candidate's study at a bucket first tries the best configs\n"
               "(up to 2) of the same candidate at the nearest bucket tuned before, those that fit this bucket's constraints.\n"
               "At deploy, autofuse.jit serves a shape not tuned with the plan of the nearest bucket (in log size) that adapts.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("target", metavar="MODULE:FUNCTION", help="the function to tune (importable from the current directory)")
    p.add_argument("--inputs", default=None, metavar="MODULE:FACTORY",
                   help="a function returning the example arguments: a tuple of positional args (arrays or jax.ShapeDtypeStruct "
                        "pytrees); arrays are also used to check the whole plan (e.g. a model's own weights), beside random inputs")
    p.add_argument("--shapes", default=None, metavar="SPEC",
                   help="tune a set of shape buckets in one job: NAME=LO-HI,... (powers of two, each bucket built by --inputs "
                        "FACTORY(NAME=...)) or MODULE:BUCKETS (a list or dict of argument tuples); see below")
    p.add_argument("--trials", type=int, default=None, help="trial budget for the whole job (default 48 when no --time-budget)")
    p.add_argument("--effort", default=None, metavar="LEVEL",
                   help="a named trial budget instead of --trials: quick (16 trials), default (48) or thorough (160)")
    p.add_argument("--max-memory", default=None, metavar="SIZE",
                   help="cap a plan's peak device memory on the GPU (e.g. 40GiB): a plan above it is tried again with its groups' "
                        "leaner configs (a cross-entropy in chunks), then fails its validation")
    p.add_argument("--time-budget", type=float, default=None, metavar="S",
                   help="time budget for the whole job, in seconds, counted from its start (which times every distinct candidate in XLA first)")
    p.add_argument("--seed", type=int, default=0, help="sampler seed (same seed and budget: same trials in the same order)")
    p.add_argument("--measure", choices=["device", "model"], default=None, help="time on the GPU or rank with the analytic model (default: device if a GPU is present)")
    p.add_argument("--static-argnums", default="", metavar="I,J", help="positions of arguments that are static (as jax.jit)")
    p.add_argument("--name", default=None,
                   help="program name in the store (default MODULE:FUNCTION as given; 'plans --program' finds it by this name or by FUNCTION)")
    p.add_argument("--resume", metavar="RUN", type=int, default=None, help="continue an interrupted run (its seed and budget are reused)")
    p.add_argument("--no-store", action="store_true", help="keep the result in memory only")
    p.add_argument("--no-isolate", action="store_true", help="run trials in this process (no crash isolation)")
    p.add_argument("--trial-timeout", type=float, default=300.0, metavar="S", help="per-trial time limit (default 300 s)")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="tune with N worker processes on this host, one per GPU (CUDA_VISIBLE_DEVICES), sharing the run's Optuna "
                        "studies in the --db database; more can join from other hosts with 'autofuse worker RUN'")
    p.add_argument("--heartbeat", type=int, default=10, metavar="S",
                   help="with --workers: Optuna heartbeat interval; a worker silent for 5 intervals is dead and its trial retried (default 10)")
    p.add_argument("--compile-workers", type=int, default=None, metavar="N",
                   help="threads compiling at once at the job's start (XLA's reference of each candidate, phase 1's default configs), "
                        "timed on the GPU one at a time after (default: $AUTOFUSE_COMPILE_WORKERS, else this host's cores shared among "
                        "its workers, at most 16)")
    p.add_argument("--backends", default=None, metavar="B,C",
                   help="lowerings to search, the preferred first: mosaic_gpu (Pallas, Hopper: TMA, wgmma), triton (Pallas), "
                        "xla_ops (XLA's own dot on operands padded to aligned rows) (default: mosaic_gpu,triton,xla_ops on a Hopper GPU, "
                        "else triton,xla_ops)")
    p.add_argument("--dry-run", action="store_true",
                   help="tune nothing: list the distinct candidates (template, ops, instances, configs), their modelled savings in the "
                        "order the budget reaches them and the contenders, and warn when the budget cannot give each contender more "
                        "than its default config. Compiles, times and stores nothing")
    p.add_argument("--all", action="store_true", help="list every candidate in the final table, those never measured too")
    p.add_argument("--promote", action="store_true",
                   help="make the new plan the current one (what autofuse.jit runs) even if it does not beat the current plan; "
                        "by default it becomes current only if measured and faster beyond noise (never over a pinned plan)")
    p.add_argument("--json", action="store_true", help="print the report (or the dry run) as JSON")
    out = p.add_mutually_exclusive_group()
    out.add_argument("-v", "--verbose", action="store_true", help="a line per trial and per candidate (workers: what each does)")
    out.add_argument("-q", "--quiet", action="store_true", help="no progress bar and no table: the summary line only")
    p.set_defaults(func=cmd_tune)


def _checked(args: argparse.Namespace) -> tuple[int, ...]:
    """The arguments that need nothing imported, checked first: a mistake is refused at once, not after the seconds
    JAX takes to start. Returns the static argument positions."""
    from autofuse.spaces import USER_SPACES, load_spaces
    from autofuse.tuning.budget import check_budget, parse_bytes, trials_for

    if os.environ.get(USER_SPACES):
        load_spaces()  # a broken user space is refused now, naming its file, not at the program's first candidate
    check_budget(args.trials, args.time_budget, trials_flag="--trials", seconds_flag="--time-budget")
    if args.effort is not None:
        if args.trials is not None:
            raise ValueError("give --trials or --effort, not both")
        args.trials = trials_for(None, args.time_budget, args.effort, effort_flag="--effort")
    if args.max_memory is not None:
        args.max_memory = parse_bytes(args.max_memory, flag="--max-memory")
    for flag, value in (("--compile-workers", args.compile_workers), ("--workers", args.workers), ("--heartbeat", args.heartbeat)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    if args.shapes is not None:
        for flag, on in (("--resume", args.resume is not None), ("--workers", args.workers is not None), ("--dry-run", args.dry_run)):
            if on:
                raise ValueError(f"--shapes tunes its buckets in this process, one run each: drop {flag} (or tune one shape with --inputs)")
    elif args.inputs is None:
        raise ValueError("--inputs MODULE:FACTORY is required (or --shapes MODULE:BUCKETS)")
    if args.dry_run and (args.resume is not None or args.workers is not None):
        raise ValueError("--dry-run tunes nothing: drop --resume and --workers")
    if args.no_store and args.resume is not None:
        raise ValueError("--resume needs the store (drop --no-store)")
    if args.no_store and args.workers is not None:
        raise ValueError("--workers share the run through the database: drop --no-store")
    try:
        return tuple(int(x) for x in args.static_argnums.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--static-argnums must be comma-separated integers, got {args.static_argnums!r}") from None


def _measure(args: argparse.Namespace) -> str:
    """``--measure`` as the job will take it (device where a GPU is present); its error names the flag."""
    import jax

    from autofuse.tuning.job import resolve_measure

    return resolve_measure(args.measure, jax.default_backend() == "gpu", flag="--measure")


def _example(args: argparse.Namespace, statics: tuple[int, ...]) -> tuple[Callable, tuple]:
    """The function and its example arguments, checked to trace (one-line errors)."""
    from autofuse.graph import capture

    fn = refs.resolve(args.target)
    factory = refs.resolve(args.inputs)
    # before the inputs touch a GPU: this process shares the GPUs with the trial processes and the workers, and
    # jax's default would take 75% of every visible GPU's memory here
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    try:
        example = factory()
    except Exception as e:
        raise ValueError(f"the --inputs factory {args.inputs} failed: {type(e).__name__}: {e}") from None
    if not isinstance(example, tuple):
        raise ValueError(f"the --inputs factory {args.inputs} must return a tuple of the function's positional arguments, "
                         f"got a {type(example).__name__} (wrap a single argument as (x,))")
    try:
        capture(fn, *example, static_argnums=statics)
    except Exception as e:
        raise ValueError(f"tracing {args.target} with the example inputs failed: {type(e).__name__}: {e}") from None
    return fn, example


def _backends(args: argparse.Namespace) -> list[str] | None:
    return [b.strip() for b in args.backends.split(",") if b.strip()] if args.backends is not None else None


def _options(args: argparse.Namespace, statics: tuple[int, ...]) -> JobOptions:
    """The job's options from the flags: one place for a single shape and for shape buckets."""
    from autofuse.tuning.options import JobOptions

    return JobOptions(name=args.name or args.target, isolate=not args.no_isolate, trial_timeout_s=args.trial_timeout,
                      heartbeat_s=args.heartbeat, compile_workers=args.compile_workers, static_argnums=statics)


def cmd_tune(args: argparse.Namespace) -> int:
    statics = _checked(args)
    if args.shapes is not None:
        return cmd_tune_buckets(args, statics)
    fn, example = _example(args, statics)
    measure = _measure(args)
    if args.dry_run:
        from autofuse.tuning.dryrun import dry_run

        d = dry_run(fn, *example, trials=args.trials, time_budget_s=args.time_budget, name=args.name or args.target, backends=_backends(args),
                    static_argnums=statics, measure=measure)
        print(json.dumps(d.to_dict(), indent=2) if args.json else d.table())
        return 0
    from autofuse.tuning.local import tune

    store: Any = False  # --no-store
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
    report = tune(fn, *example, trials=trials, time_budget_s=budget, seed=seed, store=store, measure=measure, quiet=args.quiet,
                  verbose=args.verbose, resume=args.resume, workers=args.workers, backends=_backends(args), promote=args.promote,
                  max_memory=args.max_memory, options=_options(args, statics))
    if args.json:
        print(json.dumps({"name": report.name, "fingerprint": report.fingerprint, "measure": report.measure, "device": report.device,
                          "model": report.model, "baseline_ms": report.baseline_ms, "tuned_ms": report.tuned_ms, "speedup": report.speedup,
                          "trials": report.trials_run, "run_id": report.run_id, "plan_id": report.plan_id, "current": report.plan_current, "plan": report.plan.to_dict(),
                          "summary": report.summary()}, indent=2))
    else:
        print(report.summary() if args.quiet else report.table(all_candidates=args.all))
    return 0


def cmd_tune_buckets(args: argparse.Namespace, statics: tuple[int, ...]) -> int:
    """``autofuse tune --shapes SPEC``: every bucket tuned in turn (`autofuse.tuning.buckets`), each report as a
    single job prints it, then a line per bucket."""
    from autofuse.tuning import buckets

    fn = refs.resolve(args.target)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # before the buckets' inputs touch a GPU (as `_example`)
    bucket_list = buckets.prepare(fn, buckets.resolve(args.shapes, args.inputs), statics)
    measure = _measure(args)
    store: Any = False  # --no-store
    if not args.no_store:
        from autofuse.store import PlanStore

        store = PlanStore(getattr(args, "db", None))

    def show(i: int, run: buckets.BucketRun) -> None:
        if not args.json:
            print(f"== bucket {i + 1}/{len(bucket_list)}: {run.bucket.name}")
            print(run.report.summary() if args.quiet else run.report.table(all_candidates=args.all), flush=True)

    runs = buckets.tune_buckets(fn, bucket_list, static_argnums=statics, quiet=args.quiet, on_bucket=show, trials=args.trials,
                                time_budget_s=args.time_budget, seed=args.seed, store=store, measure=measure, verbose=args.verbose,
                                backends=_backends(args), promote=args.promote, max_memory=args.max_memory,
                                options=_options(args, statics))
    if args.json:
        print(json.dumps({"buckets": [r.to_dict() for r in runs]}, indent=2))
    else:
        print(buckets.summary(runs))
    return 0


def add_worker_parser(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "worker",
        parents=parents,
        help="join a tuning run started with 'autofuse tune --workers' from another host",
        description=(
            "Start N worker processes on this host, one per GPU (CUDA_VISIBLE_DEVICES), that join run RUN: they take "
            "trials from the run's Optuna studies in the --db database until its budget is spent; the last one to finish "
            "selects and saves the plan. Name the run's function (as 'autofuse tune --workers' prints it): the workers import "
            "only that, never a function the database names, and refuse a run of another. Run it from the same project "
            "(the working directory is searched after the installed packages). "
            "Needs a server database (PostgreSQL): a SQLite file is for the workers of one host (autofuse tune --workers). "
            "Output: a progress bar of the run's trials (every host's), then one summary line."
        ),
        epilog="example: autofuse worker 12 examples.norms:forward --db postgresql+psycopg://tuner@db.example/autofuse --workers 8",
    )
    p.add_argument("run", metavar="RUN", type=int, help="run id (printed by 'autofuse tune --workers')")
    p.add_argument("program", metavar="MODULE:FUNCTION", help="the function the run tunes (printed by 'autofuse tune --workers'): "
                   "the only code the workers import")
    p.add_argument("--workers", type=int, default=1, metavar="N", help="worker processes on this host, one per GPU (default 1)")
    out = p.add_mutually_exclusive_group()
    out.add_argument("-v", "--verbose", action="store_true", help="each worker says what it does: joined, a line per trial, done")
    out.add_argument("-q", "--quiet", action="store_true", help="no progress bar: the summary line only")
    p.set_defaults(func=cmd_worker)


def cmd_worker(args: argparse.Namespace) -> int:
    from autofuse.store import db

    url = db.resolve_url(getattr(args, "db", None))
    if url.startswith("sqlite"):
        raise ValueError("autofuse worker joins a run from another host and needs a server database (--db postgresql+psycopg://...); "
                         "a SQLite file serves the workers of one host: autofuse tune ... --workers N")
    if args.workers < 1:
        raise ValueError(f"--workers must be at least 1, got {args.workers}")
    from autofuse.store import PlanStore
    from autofuse.tuning.job import progress_bar
    from autofuse.tuning.workers import program_of, start_workers, visible_gpus, watch

    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # counting the GPUs must not take their memory
    store = PlanStore(url)
    run = store.get_run(args.run)  # KeyError (one line) for an unknown run
    if run["status"] != "running":
        raise ValueError(f"run {args.run} is {run['status']}: nothing to join")
    if run.get("job") is not None:  # else its launcher is still setting it up: each worker checks once it is
        program_of(args.run, run["job"], args.program)
    gpus = visible_gpus()
    if run["measure"] == "device" and args.workers > len(gpus):
        raise ValueError(f"{args.workers} workers but {len(gpus)} visible GPU(s) here: one worker per GPU")
    procs = start_workers(args.run, args.program, url, args.workers, gpus, not args.verbose)
    total = (run.get("budget") or {}).get("trials")
    with progress_bar(total if total else None, f"run {args.run}", args.quiet, "worker", "trial") as bar:
        codes = watch(procs, store, args.run, bar)
    run = store.get_run(args.run)
    print(worker_summary(args.run, run, codes))
    if any(codes):
        raise ValueError(f"worker exit codes {codes} (a dead worker's running trial is retried by another)")
    return 0


def worker_summary(run_id: int, run: dict, codes: list[int]) -> str:
    """One line: what this host's workers did and where the run stands."""
    from autofuse.tables import device_label, fmt_x

    here = f"{len(codes)} worker(s) here, exit {', '.join(map(str, codes))}"
    if run["status"] == "finished":
        on = device_label(run["measure"], run["device"], (run.get("budget") or {}).get("model"))
        state = f"run {run_id} finished: {fmt_x(run['speedup'])} jax.jit ({'measured on ' if run['measure'] == 'device' else 'MODELLED, '}{on})"
    else:
        state = f"run {run_id} is {run['status']}" + (f" (plan being selected by {run['selected_by']})" if run.get("selected_by") else "")
    return f"autofuse worker: {state}; {here}"
