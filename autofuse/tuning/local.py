"""`tune`: a tuning job in this process (the trials in an isolated child process), or with workers.

1. capture the program; enumerate candidate groups (`job`);
2. time in XLA the distinct candidates the budget can reach (its own kernels
   are always an option; `scheduler.timed_first`), the others at their first trial;
3. trials, one at a time, to the candidate the budget rule names (`scheduler`,
   `trial`), each an Optuna trial of that candidate's study;
4. the cheapest exact cover, validated against jax.jit (`validate`), stored.
`tune` checks what it was given into one `options.Job` and hands it to a driver: `tune_here` (this process) or,
with ``workers=N``, `workers.tune_with_workers` (the same job in N worker processes).
"""
from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING, Any, Callable, Literal, Sequence

import jax

from .. import costmodel
from ..graph import capture, qualified_name
from ..runner import lowering_pool
from ..runner.process import HELPERS, ProcessRunner, ProgramSpec, make_runner
from ..status import TrialStatus
from .ahead import CompileAhead, prefetch_model_bests
from .ahead import compile_workers as compile_workers_for
from .job import (Notes, PhaseMarks, PlanSaver, check_backends, distinct_candidates, modelled_warning, open_run, program_name,
                  progress_bar, register_candidates, resolve_measure, save_example_inputs, search_spaces, spec_of, time_xla,
                  tunable, warn_preallocated)
from .ledger import MemoryLedger, StoreLedger
from .loop import TrialLoop
from .options import Job, JobOptions
from .output import StatusLine
from .program_costs import ProgramCosts, take_profile
from .report import TuneReport
from .scheduler import Budget, Scheduler, phase1_lines, timed_first, trial_total
from .trial import TrialContext
from .validate import finalize

if TYPE_CHECKING:
    from ..store import PlanStore

log = logging.getLogger("autofuse")


def tune(fn: Callable, *args: Any, kwargs: dict | None = None, trials: int | None = None, time_budget_s: float | None = None,
         effort: str | None = None, store: PlanStore | str | Literal[False] | None = None, measure: str | None = None,
         workers: int | None = None, backends: Sequence[str] | None = None, seed: int = 0, promote: bool = False,
         quiet: bool = False, verbose: bool = False, resume: int | None = None, max_memory: int | str | None = None,
         options: JobOptions | None = None, **more_options: Any) -> TuneReport:
    """Tune `fn` for `args` (and keyword arguments `kwargs`): search tile configs and groups, validate, and
    store the plan where `autofuse.jit(fn)` finds it.

    `trials` and/or `time_budget_s` bound the job (default: 48 trials); `effort`
    ("quick", "default", "thorough": 16, 48, 160 trials) names a trial budget;
    `max_memory` (bytes, or "40GiB") caps a plan's peak device memory on the GPU:
    a plan above it fails its validation (each measured plan's peak, and
    jax.jit's, is recorded in its provenance).
    `measure="device"` times on the GPU (the default where one is present);
    `measure="model"` ranks with the analytic model (the default elsewhere).
    `store` is a `PlanStore` or a database URL, by default the store that
    `autofuse.jit` and the CLI use ($AUTOFUSE_DB, else the per-user file);
    the run, every trial and the plan are written there (the report says
    where: `stored_in`), and `resume=RUN` continues an interrupted run.
    `store=False` writes nothing: the result stays in the report.
    `workers=N` (needs a store and an importable `fn`) tunes with N worker
    processes on this host, one per GPU, sharing the run's Optuna studies in
    that database (more can join from other hosts). `backends` are the
    lowerings to search, the preferred first (default: Mosaic GPU and Triton
    on a Hopper GPU, else Triton); a template searches those it has that can
    run the group. The stored plan becomes the current one (what
    `autofuse.jit` runs) only if it was measured and beats the current plan
    beyond noise, or with `promote=True`; a pinned plan is never replaced.
    `quiet` shows no progress bar; `verbose` adds a line per trial and per
    candidate.

    The rest (`name`, `isolate`, `trial_timeout_s`, `static_argnums`, ...) are
    `options` (a `JobOptions`), each also accepted as a keyword of its own
    (``tune(fn, x, trial_timeout_s=60)``), folded into `options`.

    >>> report = autofuse.tune(layer_norm, x, gamma, beta, trials=48, store="sqlite:///plans.db")  # doctest: +SKIP
    >>> print(report.table())  # doctest: +SKIP
    """
    job = Job.of(trials=trials, time_budget_s=time_budget_s, effort=effort, max_memory=max_memory, backends=backends, seed=seed,
                 store=_store_of(store), measure=measure, promote=promote, quiet=quiet, verbose=verbose, resume=resume,
                 options=JobOptions.fold(options, more_options))
    if workers is not None:
        from .workers import tune_with_workers

        return tune_with_workers(fn, args, dict(kwargs or {}), job, workers=workers)
    return tune_here(fn, args, dict(kwargs or {}), job)


def tune_here(fn: Callable, args: tuple, kwargs: dict, job: Job) -> TuneReport:
    """`tune`'s job run by this process (its trials in an isolated child process): the module docstring's steps."""
    o = job.options
    trials, time_budget_s, seed, store = job.trials, job.time_budget_s, job.seed, job.store
    quiet, verbose, progress, name, clock = job.quiet, job.verbose, o.progress, o.name, o.clock
    static_argnums, static_argnames = o.static_argnums, o.static_argnames
    t_start = clock()
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # the trial process shares the GPU
    say = progress or (lambda s: None if quiet else print(s, file=sys.stderr, flush=True))  # notes: stdout is the report's
    phase = progress or (say if verbose or quiet else StatusLine())  # the selection phase's progress: one line rewritten, unless -v
    measure = resolve_measure(job.measure, jax.default_backend() == "gpu")
    backends, left_out = check_backends(job.backends, measure)
    notes = o.notes or Notes(progress)
    warn_preallocated(notes)
    threads = compile_workers_for(o.compile_workers)
    gmodel = costmodel.get_model(o.model)
    notes(left_out)
    if measure == "model":
        notes(modelled_warning(gmodel))
    graph = capture(fn, *args, static_argnums=static_argnums, static_argnames=static_argnames, **kwargs)
    name = name or program_name(fn)
    spec = ProgramSpec(fn, jax.tree_util.tree_map(spec_of, args), jax.tree_util.tree_map(spec_of, kwargs), static_argnums, static_argnames,
                       graph.fingerprint)
    examples = save_example_inputs(graph, fn, args, kwargs, static_argnums, static_argnames)
    runner = make_runner(spec, {"measure": measure, "model": o.model, HELPERS: lowering_pool.helpers_for(measure, threads),
                                **({"example_inputs": examples} if examples else {})},
                         isolate=o.isolate, timeout_s=o.trial_timeout_s)
    if isinstance(runner, ProcessRunner):
        runner.start()  # the trial process imports jax and captures the program while this one enumerates and opens the run
    status, report, pstore, run_id, ids, prefetch, saver = "failed", None, None, None, None, None, None
    try:
        by_sig, cands, left_to_xla = tunable(*distinct_candidates(graph), backends)
        notes(left_to_xla)
        spaces = search_spaces(by_sig, cands, gmodel, backends)
        if store is not None:
            pstore, run_id, ids = open_run(store, graph, name, measure, trials, time_budget_s, seed, job.resume, gmodel,
                                         qualified_name(fn))
            name = pstore.get_run(run_id)["program"]  # the name the store knows the program by (its first), as `plans --program` finds it
        marks = PhaseMarks(pstore, run_id, keep_first=False)  # one process writes this run's marks (the last one's, resumed)
        marks("start", at=t_start)
        if o.isolate and not spec.picklable():
            say("autofuse: the function cannot be pickled by reference, so trials run in this process (no crash isolation)")
        if pstore is not None:
            register_candidates(pstore, run_id, cands)
        marks("setup")
        budget = Budget(trials if trials is not None else 10**9, t_start + time_budget_s if time_budget_s else None, clock)
        total = trial_total(cands, spaces, budget.trials)
        first = timed_first(cands, spaces, total)
        if measure == "device":  # while the XLA timings keep this process waiting (model mode has no such wait)
            prefetch = prefetch_model_bests(cands, spaces, first)
        todo = [cands[i] for i in first if cands[i].xla_ms is None]
        if progress is not None:
            say(f"autofuse: timing {len(todo)} of {len(cands)} distinct candidates in XLA (the others at their first trial)")
        spent: dict = {}
        ahead = CompileAhead(runner, cands, spaces, measure, threads, budget=total)
        time_xla(todo, runner, progress_bar(len(todo), name, quiet or progress is not None, "XLA", "group"), compile_workers=threads,
                 spent=spent, first_trials=ahead.first_compiles())
        marks("xla_parts", value=spent)
        if pstore is not None:
            for r in todo:
                pstore.update_candidate(r.candidate_id, xla_ms=r.xla_ms)
        costs, profiled = None, {}
        if measure == "device":  # the budget rule and the cover weigh fused times against XLA's kernels in the program
            phase("autofuse: profiling jax.jit's program (what XLA's kernels there cost each group's nodes)")
            costs = take_profile(runner, profiled, graph, gmodel)
            if costs is not None:
                costs.price(cands, by_sig, spaces)
        if verbose and not quiet:
            for line in phase1_lines(cands, spaces, total):
                say(line)
        marks("xla")
        if budget.out_of_time():
            log.warning("autofuse: the time budget (%.0f s) ran out while timing %d distinct candidates in XLA (%.0f s): no trials "
                        "will run; give more time or a trial budget", time_budget_s, len(todo), clock() - t_start)
        loop = local_loop(graph, by_sig, cands, spaces, budget, gmodel, measure, runner, pstore, run_id, seed, costs)
        if o.warm_start is not None:
            loop.seeds = o.warm_start(by_sig, cands, spaces)
        loop.ahead = ahead
        ahead.selection_references(graph)
        loop.verbose = verbose and not quiet
        selected = ids is not None and ids.selected  # a run killed in its selection phase (a store's run only)
        if job.resume is not None:
            say(resumed_line(run_id, loop.scheduler.spent(), loop.scheduler.total, selected))
        if not selected:  # a run killed while selecting its plan has all its trials: only the selection runs again
            loop.bar = progress_bar(loop.scheduler.total, name, quiet or progress is not None, "tune", "trial")
            loop.bar.update(loop.scheduler.spent())  # a resumed run's trials
            loop.run()
            loop.bar.close()
            marks("trial_parts", value={**ahead.parts(), **loop.spent})
        if pstore is not None:
            pstore.begin_selection(run_id, f"{os.uname().nodename}:{os.getpid()}")  # a resume after a kill from here on selects only
        marks("trials")
        n_trials = sum(1 for r in cands for t in r.trials if t.status.spends_budget)
        saver = PlanSaver(pstore, ids, run_id, job.promote) if pstore is not None else None
        report = finalize(graph, by_sig, cands, runner, measure, gmodel, loop.ledger, name, n_trials, t_start,
                          say if verbose else (lambda s: None), phase, compile_workers=threads,
                          on_passed=None if saver is None else lambda first: (saver.early(first), marks("first_plan")),
                          max_memory_bytes=job.max_memory_bytes, on_timings=lambda t: marks("selection", value=t, replace=True),
                          costs=costs, profiled=profiled.get("profile"))
        marks("selected")
        report.wall_s = clock() - t_start
        status = "finished"
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    except BaseException as e:
        if pstore is not None:
            pstore.finish_run(run_id, "failed", error=f"{type(e).__name__}: {e}")
        raise
    finally:
        if prefetch is not None:
            prefetch.set()
        if isinstance(phase, StatusLine):
            phase.close()
        runner.close()
        if examples:
            os.unlink(examples)
        if status == "interrupted" and pstore is not None:
            pstore.finish_run(run_id, "interrupted")
    from ..device import device_info

    report.device = device_info()["name"]
    report.model = gmodel.name if measure == "model" else None
    if pstore is not None:
        saver.final(report)
        marks("saved")
    return report


def _store_of(store: PlanStore | str | Literal[False] | None) -> PlanStore | str | None:
    """The store a job writes to: `store` itself, the default one for None (as `autofuse.jit` and the CLI find it:
    $AUTOFUSE_DB, else the per-user file), none for False."""
    if store is False:
        return None
    if store is None:
        from ..store.db import default_url

        return default_url()
    return store


def resumed_line(run_id: int, spent: int, total: int, selected: bool) -> str:
    """What a resumed run reuses: its earlier trials, and whether only the selection is left."""
    rest = ("its trials were done when it stopped: selecting and validating the plan only" if selected else
            f"{max(total - spent, 0)} trial(s) left")
    return f"autofuse: resuming run {run_id}: reusing {spent} earlier trial(s) of {total}; {rest}"


def local_loop(graph: Any, by_sig: dict, cands: list, spaces: dict, budget: Budget, gmodel: costmodel.GPUModel, measure: str, runner: Any,
               pstore: Any, run_id: int | None, seed: int, costs: ProgramCosts | None = None) -> TrialLoop:
    """The trial loop of a job run by this process alone: its books in the store (a resumed run's trials
    included; those left running by the dead process are lost), or in memory; `costs`: the profile of jax.jit's
    program its budget rule prices the cover by."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)  # a failed trial is data here, not a warning
    if pstore is not None:
        from ..store.optuna_storage import optuna_storage

        storage, ledger = optuna_storage(pstore.url), StoreLedger(pstore, run_id, f"{os.uname().nodename}:{os.getpid()}")
        ledger.refresh(cands)
        for r in cands:
            for t in r.trials:
                if t.status is TrialStatus.RUNNING:
                    ledger.mark_lost(r, t.optuna_trial_id, "the job running it was interrupted")
    else:
        storage, ledger = optuna.storages.InMemoryStorage(), MemoryLedger(cands)
    scheduler = Scheduler(graph, by_sig, cands, spaces, budget, gmodel, costs)
    ctx = TrialContext(ledger, runner, measure, scheduler.total, f"{os.uname().nodename}:{os.getpid()}")
    loop = TrialLoop(cands, spaces, scheduler, ctx, storage, run_id, seed)
    loop.creates_studies = True  # each candidate's study made at its first trial: one process, so once (a resumed run's exist)
    return loop
