"""Tuning with several worker processes, one per GPU, on one host or many, sharing one run.

This is Optuna's own distributed mode: every worker opens the run's studies (one
per distinct candidate, ``autofuse-run<ID>-<signature>``) in the RDB storage
that shares the database with the plan store, and runs the same trial loop as
a job in one process (`loop`, `scheduler`, `trial`) over the store's ledger
(`StoreLedger`): the trial budget holds exactly across workers and no config
of a candidate is measured twice. Optuna's heartbeats fail the running trial
of a worker that died and ``RetryHeartbeatStaleTrialCallback`` puts its config
back for another worker.

Roles:

* the launcher, ``tune(..., workers=N)`` / ``autofuse tune --workers N``:
  captures the program, opens the run, creates the candidates and their
  studies with their first configs, publishes the job (function reference,
  argument shapes, options) on the run row, starts N workers on this host
  (each named the function on its command line),
  worker i seeing only GPU i (``CUDA_VISIBLE_DEVICES``), waits, and reads the
  plan back;
* ``autofuse worker RUN MODULE:FUNCTION --db URL`` joins the run from another
  host (a server database: a SQLite file serves one host only);
* each worker (``python -P -m autofuse.tuning.workers RUN MODULE:FUNCTION``,
  database in ``$AUTOFUSE_DB``) imports the function its command line names,
  never one the database names, and refuses a run of another (`program_of`);
  it first takes its share of the XLA timings of the
  candidates the budget reaches first (`scheduler.timed_first`; claimed a chunk
  at a time, compiled concurrently, timed on its GPU: each candidate once
  across the workers; `share_xla`) and waits for the rest, then
  runs trials until the budget rule names no candidate, then
  waits until no trial of the run is running (or is failed by heartbeat, then
  retried), and tries ``PlanStore.begin_selection``; the one worker that wins
  checks the bests, selects the cover, validates it against jax.jit and writes
  the plan, once.

Timing on a shared GPU is meaningless, so a GPU has one worker: the launcher
refuses more workers than visible GPUs in device mode, and a measuring worker
holds a lock file on its GPU (the first ``CUDA_VISIBLE_DEVICES`` entry) for its
whole life, so a second worker started on the same GPU of this host, by any
launch, refuses to run.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from typing import Any, Callable, Sequence

import jax

from .. import costmodel
from ..graph import capture
from ..plan import Plan
from ..processes import pid_alive
from ..codec import decode_call, encode_call
from ..refs import python_command, reference, resolve
from ..runner import lowering_pool
from ..runner.process import HELPERS, ProcessRunner, ProgramSpec, make_runner
from ..runner.protocol import ValidationResult
from ..spent import add_since
from ..status import UNCOUNTED, TrialStatus
from ..tables import plural
from .job import (Notes, PhaseMarks, PlanSaver, RunIds, candidates_file, check_backends, create_study, distinct_candidates,
                  load_candidates, modelled_warning, open_run, program_name, progress_bar, register_candidates, resolve_measure,
                  restore_autotune, save_candidates, search_spaces, stored_in, study_name, time_xla, tunable, warn_preallocated)
from .ahead import ENV_VAR as AHEAD_ENV
from .ahead import CompileAhead, chunk_size, compile_workers, prefetch_model_bests
from .helpers import HOST_GPUS_ENV, Helpers, host_gpus, lock_gpu, lock_path
from .ledger import CandidateState, StoreLedger
from .loop import TrialLoop
from .options import Job, JobOptions
from .program_costs import take_profile
from .report import TuneReport
from .scheduler import Budget, Scheduler, timed_first
from .trial import TrialContext
from .validate import finalize

MAX_RETRY = 2  # a config whose worker died is retried this many times
POLL_S = 0.5
IDLE_GRACE_S = 5.0  # a running run with no trial running and no selection, this long, is left to its user (`_wait_for_selection`)


# --------------------------------------------------------------------------- the job, as data
def program_of(run_id: int, job: dict, program: str) -> Callable:
    """The function this worker's command line names (`program`, ``MODULE:FUNCTION``), checked to be the one run
    `run_id` tunes (its job's ``fn``); ValueError (one line) otherwise. Only `program` is imported: never what the
    database names, which anyone who can write the store could point at any code."""
    fn = resolve(program)
    if reference(fn) != job["fn"]:
        raise ValueError(f"run {run_id} tunes {job['fn']}, not {program}: a worker runs only the function its command line names")
    return fn


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES entries (empty without a GPU backend)."""
    if jax.default_backend() != "gpu":
        return []
    n = len(jax.devices("gpu"))
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [e.strip() for e in env.split(",") if e.strip()] if env else [str(i) for i in range(n)]
    return ids[:n]


# --------------------------------------------------------------------------- the launcher
def tune_with_workers(fn: Callable, args: tuple, kwargs: dict, job: Job, *, workers: int) -> TuneReport:
    """`tune`'s `job` with `workers` processes on this host sharing one run (see the module docstring). The launcher
    shows the run's progress (every host's trials) unless quiet; the workers say what they do only when verbose."""
    import optuna

    from ..store.optuna_storage import optuna_storage

    t_start = time.time()
    o = job.options
    say = o.progress or (lambda s: None if job.quiet else print(s, file=sys.stderr, flush=True))
    if job.store is None:
        raise ValueError("workers share the run through the store: not with store=False (autofuse tune --no-store)")
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    if job.resume is not None:
        raise ValueError("resume a run with workers by joining it: autofuse worker RUN --db URL")
    if o.warm_start is not None:
        raise ValueError("seeding studies (warm_start) is for a job run by this process: drop workers")
    warn_preallocated(o.progress)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    gpus = visible_gpus()
    measure = resolve_measure(job.measure, bool(gpus))
    if measure == "device" and workers > len(gpus):
        raise ValueError(f"{workers} workers but {len(gpus)} visible GPU(s): one worker per GPU (two on one GPU would time each other)")
    backends, left_out = check_backends(job.backends, measure)
    notes = Notes(o.progress)
    notes(left_out)
    gmodel = costmodel.get_model(o.model)
    if measure == "model":
        notes(modelled_warning(gmodel))
    wire_args, wire_kwargs = encode_call(args, kwargs)
    row = {"fn": reference(fn), "args": wire_args, "kwargs": wire_kwargs, **o.to_wire(), "backends": list(backends), "workers": workers,
           "max_memory_bytes": job.max_memory_bytes}
    graph = capture(fn, *args, static_argnums=o.static_argnums, static_argnames=o.static_argnames, **kwargs)
    pstore, run_id, _ids = open_run(job.store, graph, o.name or program_name(fn), measure, job.trials, job.time_budget_s, job.seed, None,
                                    gmodel, row["fn"])
    name = pstore.get_run(run_id)["program"]  # the name the store knows it by
    marks = PhaseMarks(pstore, run_id)
    marks("start", at=t_start)
    procs: list[subprocess.Popen] = []
    shared = candidates_file(pstore.url, run_id)
    try:
        # The workers start at once (importing jax, starting their trial processes, capturing and enumerating the
        # program take them seconds) while this process registers the candidates (they wait for the "candidates"
        # mark: the workers share out their XLA timings) and creates the studies with their first configs (they wait
        # for the "setup" mark before their first trial).
        pstore.set_run_job(run_id, {**row, "staged": True})
        procs = start_workers(run_id, row["fn"], pstore.url, workers, gpus, not job.verbose, indexed=True)
        by_sig, cands, left_to_xla = tunable(*distinct_candidates(graph), backends)
        notes(left_to_xla)
        save_candidates(graph, by_sig, shared)  # this host's workers read them rather than enumerate them again
        register_candidates(pstore, run_id, cands)
        marks("candidates")
        say(f"autofuse: run {run_id}: {plural(len(cands), 'candidate')}, {workers} worker(s) on this host"
            + (f" (GPUs {', '.join(gpus[:workers])})" if measure == "device" else "")
            + f"; join from another host: autofuse worker {run_id} {row['fn']} --db URL")
        spaces = search_spaces(by_sig, cands, gmodel, row["backends"])
        storage = optuna_storage(pstore.url)
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        for r in cands:
            create_study(storage, run_id, spaces[r.signature], r.signature)
        marks("setup")
        scheduler = Scheduler(graph, by_sig, cands, spaces, Budget(job.trials if job.trials is not None else 10**9), gmodel)
        with progress_bar(scheduler.total, name, job.quiet or o.progress is not None, "tune", "trial") as bar:
            codes = watch(procs, pstore, run_id, bar, cands, scheduler)
    except BaseException as e:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait()
        pstore.finish_run(run_id, "interrupted" if isinstance(e, KeyboardInterrupt) else "failed", error=f"{type(e).__name__}: {e}")
        raise
    finally:
        with contextlib.suppress(OSError):
            os.unlink(shared)
    run = _wait_for_selection(pstore, run_id)
    died = [f"worker {k} exit {c}" for k, c in enumerate(codes) if c != 0]
    if died:
        say(f"autofuse: {'; '.join(died)} (a dead worker's running trial is retried by another)")
    if run["status"] != "finished":
        raise RuntimeError(f"run {run_id} is {run['status']} after its workers exited ({'; '.join(died) or 'all exit 0'})"
                           + (f": {run['error']}" if run.get("error") else f"; join it with: autofuse worker {run_id} {row['fn']} --db URL"))
    report = report_from_store(pstore, run_id, cands, name, measure, t_start)
    report.model = gmodel.name if measure == "model" else None
    if job.promote and report.plan_id is not None and not report.plan_current:
        pstore.promote_plan(report.plan_id)
        report.plan_current, report.plan_note = True, ""
    return report


def watch(procs: Sequence[subprocess.Popen], pstore: Any, run_id: int, bar: Any, cands: list[CandidateState] | None = None,
          scheduler: Scheduler | None = None) -> list[int]:
    """Wait for this host's workers, showing the run's counted trials (every host's) on `bar`, and with `cands` and
    `scheduler` the run's best plan so far; returns their exit codes."""
    from .output import best_postfix

    ledger = StoreLedger(pstore, run_id)
    solve_next = 0.0
    while any(p.poll() is None for p in procs):
        if not getattr(bar, "disable", False):
            try:
                if cands is not None and scheduler is not None:
                    if any(c.xla_ms is None for c in cands):
                        read_xla(pstore, run_id, cands)
                    ledger.refresh(cands)
                    for c in cands:
                        c.update_best()
                    bar.n = scheduler.spent()
                    if time.monotonic() >= solve_next:  # the cover (a MILP, seconds on a whole model) a tenth of the time at most
                        t0 = time.monotonic()
                        cover = scheduler.cover()
                        solve_next = t0 + max(2.0, 10 * (time.monotonic() - t0))
                        bar.set_postfix_str(best_postfix(cover.baseline_ms, cover.tuned_ms), refresh=False)
                else:
                    bar.n = sum(TrialStatus(t["status"]).spends_budget for t in pstore.trials(run_id))
                bar.refresh()
            except Exception as e:  # noqa: BLE001 - the display never stops the wait (a locked or busy database)
                bar.set_postfix_str(f"(store busy: {type(e).__name__})", refresh=False)
        time.sleep(2 * POLL_S)
    return [p.wait() for p in procs]


def start_workers(run_id: int, program: str, url: str, n: int, gpus: Sequence[str], quiet: bool, *,
                  indexed: bool = False) -> list[subprocess.Popen]:
    """`n` worker processes of the run, each named its `program` (``MODULE:FUNCTION``) on its command line and
    started without the working directory ahead of the installed packages (`refs.python_command`); worker i sees
    only GPU i (round robin in model mode), and this host's cores divided among them for compiling (`ahead`). The
    URL goes by environment, not argv. `indexed`: the run's launcher numbers its workers (their samplers' seeds);
    workers joining from elsewhere use their pids."""
    procs = []
    for i in range(n):
        argv, env = python_command("autofuse.tuning.workers", str(run_id), program, *(["--index", str(i)] if indexed else []),
                                   *(["--quiet"] if quiet else []))
        env.update(AUTOFUSE_DB=url, PYTHONUNBUFFERED="1", XLA_PYTHON_CLIENT_PREALLOCATE="false")
        env[AHEAD_ENV] = str(compile_workers(None, share=n))
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = gpus[i % len(gpus)]
            env[HOST_GPUS_ENV] = ",".join(gpus)  # the selecting worker validates plans on the others' once they are done
        procs.append(subprocess.Popen(argv, env=env))
    return procs


def _wait_for_selection(pstore: Any, run_id: int) -> dict:
    """The run once no worker anywhere is running a trial of it or selecting its plan (after this host's workers exited,
    workers of other hosts may still be), for IDLE_GRACE_S on end: a worker of another host that has just finished
    its last trial takes the selection an instant later."""
    idle_since = None
    while True:
        run = pstore.get_run(run_id)
        if run["status"] != "running":
            return run
        if run["selected_by"] is None and not pstore.trials(run_id, "running"):
            idle_since = time.monotonic() if idle_since is None else idle_since
            if time.monotonic() - idle_since >= IDLE_GRACE_S:
                return run
        else:
            idle_since = None
        host, _, pid = (run["selected_by"] or "").rpartition(":")
        if host == socket.gethostname() and not pid_alive(int(pid)):  # the selecting worker of this host died
            pstore.finish_run(run_id, "failed", error=f"worker {run['selected_by']} died while selecting the plan")
            return pstore.get_run(run_id)
        time.sleep(POLL_S)


def report_from_store(pstore: Any, run_id: int, cands: list[CandidateState], name: str, measure: str, t_start: float) -> TuneReport:
    """The report of a run finished by workers, read back from the store."""
    run = pstore.get_run(run_id)
    rows = {c["signature"]: c for c in pstore.candidates(run_id)}
    for r in cands:
        c = rows[r.signature]
        r.xla_ms, r.best_ms, r.best_config, r.status, r.candidate_id = c["xla_ms"], c["best_ms"], c["best_config"], c["status"], c["id"]
    StoreLedger(pstore, run_id).refresh(cands)
    (plan_row,) = [p for p in pstore.plans(run["fingerprint"]) if p["run_id"] == run_id]
    p = pstore.get_plan(plan_row["id"])
    n = sum(t.status.spends_budget for r in cands for t in r.trials)
    validation = ValidationResult(TrialStatus.OK, p["max_error"], p["tolerance"] or {})
    model = (run.get("budget") or {}).get("model") if measure == "model" else None
    return TuneReport(name, run["fingerprint"], measure, Plan.from_dict(p["plan"]), run["baseline_ms"], run["best_ms"], run["speedup"], None,
                      cands, validation, time.time() - t_start, n, run_id=run_id, plan_id=p["id"], device=run["device"], model=model,
                      plan_current=bool(p["is_current"]), stored_in=stored_in(pstore))


# --------------------------------------------------------------------------- one worker
def run_worker(run_id: int, program: str, url: str | None = None, *, index: int | None = None, quiet: bool = False,
               ready_timeout_s: float = 600.0) -> dict:
    """Join run `run_id`, which must tune `program` (``MODULE:FUNCTION``, `program_of`), and work until its budget is
    spent; returns what this worker did.

    The worker that ends the run selects and saves the plan (`selected` in the result).
    `index` (this host's launcher numbers its workers 0, 1, ...) keeps the workers' samplers apart.
    """
    import optuna

    from ..store import PlanStore

    me = f"{socket.gethostname()}:{os.getpid()}"
    say = (lambda s: None) if quiet else (lambda s: print(f"autofuse worker {me}: {s}", file=sys.stderr, flush=True))
    pstore = PlanStore(url)
    run = pstore.get_run(run_id)
    t0 = time.time()
    while run["job"] is None and run["status"] == "running":  # the launcher is still creating the candidates' studies
        if time.time() - t0 > ready_timeout_s:
            raise RuntimeError(f"run {run_id} has no job description after {ready_timeout_s:.0f} s (not a run tuned with workers?)")
        time.sleep(POLL_S)
        run = pstore.get_run(run_id)
    if run["status"] != "running" or run["selected_by"] is not None:
        say(f"run {run_id} is {run['status']}{' and being selected' if run['selected_by'] else ''}: nothing to do")
        return {"measured": 0, "selected": False}
    job, measure = run["job"], run["measure"]
    marks = PhaseMarks(pstore, run_id)
    marks("joined", worker=me)
    if measure == "device" and jax.default_backend() != "gpu":
        raise RuntimeError(f"run {run_id} measures on a GPU; this host has none")
    lock = _gpu_lock() if measure == "device" else None
    if measure == "device":  # a worker of another host: its trial process starts with the store's autotune entries
        restore_autotune(pstore)
    fn = program_of(run_id, job, program)
    args, kwargs = decode_call(job["args"], job["kwargs"])
    o = JobOptions.from_wire(job)
    statics = (o.static_argnums, o.static_argnames)
    spec = ProgramSpec(fn, args, kwargs, *statics, run["fingerprint"])
    threads = compile_workers(o.compile_workers)
    runner = make_runner(spec, {"measure": measure, "model": o.model, HELPERS: lowering_pool.helpers_for(measure, threads)}, isolate=o.isolate,
                         timeout_s=o.trial_timeout_s)
    if isinstance(runner, ProcessRunner):
        runner.start()  # the trial process imports jax and captures the program while this one enumerates its candidates
    graph = capture(fn, *args, static_argnums=statics[0], static_argnames=statics[1], **kwargs)
    if graph.fingerprint != run["fingerprint"]:
        raise RuntimeError(f"{job['fn']} captures as program {graph.fingerprint} here, but run {run_id} tunes {run['fingerprint']} "
                           "(another version of the code or of jax?)")
    if job.get("staged"):  # the launcher enumerates and registers the candidates while its workers start
        wait_for_phase(pstore, run_id, "candidates", ready_timeout_s)
    # as the launcher of this host found them (another host's worker: enumerated here)
    shared = load_candidates(graph, candidates_file(pstore.url, run_id))
    by_sig, cands, _ = tunable(*(shared or distinct_candidates(graph)), job["backends"])  # the launcher said what it leaves out
    register_candidates(pstore, run_id, cands)
    marks("ready", worker=me)
    gmodel = costmodel.get_model(o.model)
    spaces = search_spaces(by_sig, cands, gmodel, job["backends"])
    budget = run["budget"] or {}
    deadline = run["started_at"].timestamp() + budget["seconds"] if budget.get("seconds") else None
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # a failed trial is data here, not a warning
    scheduler = Scheduler(graph, by_sig, cands, spaces, Budget(budget.get("trials") or 10**9, deadline), gmodel)
    prefetch = None
    say(f"joined run {run_id} ({plural(len(cands), 'candidate')} {'as its launcher found them' if shared else 'enumerated here'}, "
        f"budget {plural(scheduler.total, 'trial')}"
        + (f", GPU {os.environ.get('CUDA_VISIBLE_DEVICES')}" if lock else "") + ")")
    try:
        with runner:
            order = timed_first(cands, spaces, scheduler.total)
            if measure == "device":  # while the XLA timings keep this process waiting (model mode has no such wait)
                prefetch = prefetch_model_bests(cands, spaces, order)
            spent: dict = {}
            first = [cands[i] for i in order]
            ahead = CompileAhead(runner, cands, spaces, measure, threads, share=job.get("workers") or 1, budget=scheduler.total,
                                 index=index)
            timed = share_xla(pstore, run_id, first, runner, me, threads, stale_s=2 * o.trial_timeout_s + 60,
                              share=job.get("workers") or 1, spent=spent, first_trials=ahead.first_compiles())
            marks(f"xla_parts {me}", value=spent)
            say(f"timed {timed} of the {len(first)} candidates the budget reaches first in XLA ({threads} compiling at once; "
                f"{len(cands)} in all, the others at their first trial)")
            marks("xla")  # the XLA time of every candidate timed first is known (the first worker to see it)
            profiled: dict = {}
            if measure == "device":  # each worker profiles jax.jit's program on its own GPU: its budget rule's prices
                scheduler.costs = take_profile(runner, profiled, graph, gmodel)
                if scheduler.costs is not None:
                    scheduler.costs.price(cands, by_sig, spaces)
            marks("xla", worker=me)
            if job.get("staged"):  # the studies with their first configs
                wait_for_phase(pstore, run_id, "setup", ready_timeout_s)
            w = _Worker(pstore, run_id, cands, spaces, scheduler,
                        TrialContext(StoreLedger(pstore, run_id, me), runner, measure, scheduler.total, me),
                        run["seed"], os.getpid() if index is None else index, o.heartbeat_s)
            w.loop.ahead = ahead
            ahead.selection_references(graph)
            w.loop.verbose = not quiet  # a line per trial
            marks("loop", worker=me)  # the trial loop is ready (its storage connected): the first trial comes next
            w.work()
            marks("trials", worker=me)
            marks(f"trial_parts {me}", value={**w.loop.ahead.parts(), **w.loop.spent})
            selected = pstore.begin_selection(run_id, me)
            if selected:
                marks("trials")
                say(f"measured {plural(w.loop.measured, 'trial')}; selecting the plan of run {run_id}")
                gpus = host_gpus(_my_gpu()) if measure == "device" and isinstance(runner, ProcessRunner) else []
                helper_runner = lambda gpu: make_runner(spec, {"measure": measure, "model": o.model}, timeout_s=o.trial_timeout_s, gpu=gpu)  # noqa: E731
                with Helpers(gpus, helper_runner, threads) as helpers:
                    w.select(graph, by_sig, gmodel, run, compile_workers=threads, marks=marks, helpers=helpers,
                             profiled=profiled.get("profile"))
            say(f"done: measured {plural(w.loop.measured, 'trial')}" + ("; plan saved" if selected else ""))
    except BaseException as e:
        if pstore.get_run(run_id)["selected_by"] == me:  # this worker was selecting: the run ends with it
            pstore.finish_run(run_id, "failed", error=f"selection failed in {me}: {type(e).__name__}: {e}")
        raise
    finally:
        if prefetch is not None:
            prefetch.set()
        if lock is not None:
            os.close(lock)
    return {"measured": w.loop.measured, "selected": selected}


def wait_for_phase(pstore: Any, run_id: int, name: str, timeout_s: float) -> None:
    """Wait until the run's launcher has marked phase `name` (`PhaseMarks`); an error if the run stops first or
    `timeout_s` passes."""
    t0 = time.time()
    while True:
        run = pstore.get_run(run_id)
        if name in (run.get("phases") or {}):
            return
        if run["status"] != "running":
            raise RuntimeError(f"run {run_id} is {run['status']} before its launcher finished setting it up"
                               + (f": {run['error']}" if run.get("error") else ""))
        if time.time() - t0 > timeout_s:
            raise RuntimeError(f"run {run_id}: its launcher did not mark {name!r} within {timeout_s:.0f} s")
        time.sleep(POLL_S / 5)


def share_xla(pstore: Any, run_id: int, cands: list[CandidateState], runner: Any, me: str, threads: int, *, stale_s: float,
              share: int = 1, spent: dict | None = None, first_trials: Sequence[Any] = ()) -> int:
    """This worker's part of the XLA timings of `cands` (those the run times first), then everyone's: claim a chunk
    of them nobody timed,
    compile them `threads` at a time and time them one by one (`ahead`), record them with this worker's device;
    again until none is left to claim; then wait for the other workers' chunks (a dead worker's claim is taken
    over after `stale_s`, at once on this host). Each candidate is timed once across the run's workers.
    `share`: the run's worker count, by which the chunks shrink so that the workers end together (`xla_chunk`);
    `spent`: where this worker's time went (`ahead.time_xla_concurrently`, "store": claiming, recording and reading
    back the timings, and "waiting" for the others' chunks). `first_trials` (`CompileAhead.first_compiles`) compile
    with this worker's first chunk, or alone before it waits where it claimed none.
    Sets the `xla_ms` of each of `cands`; returns how many this worker timed."""
    by_id = {r.candidate_id: r for r in cands}
    timed = 0
    spent = {} if spent is None else spent

    def stored(t0: float) -> None:
        add_since(spent, "store", t0)

    while True:
        t0 = time.perf_counter()
        ids = pstore.claim_xla(run_id, me, xla_chunk(len(cands), threads, share), stale_s=stale_s, among=list(by_id))
        stored(t0)
        if ids:
            part = [by_id[i] for i in ids]
            results = time_xla(part, runner, compile_workers=threads, spent=spent, first_trials=first_trials)
            first_trials = ()
            t0 = time.perf_counter()
            pstore.finish_xla_many(me, [(r.candidate_id, res.status.value, r.xla_ms, res.device) for r, res in zip(part, results, strict=True)])
            stored(t0)
            timed += len(part)
            continue
        if first_trials:
            time_xla([], runner, compile_workers=threads, spent=spent, first_trials=first_trials)
            first_trials = ()
        t0 = time.perf_counter()
        pending = read_xla(pstore, run_id, cands)
        stored(t0)
        if not pending or pstore.get_run(run_id)["status"] != "running":
            return timed
        time.sleep(POLL_S)
        spent["waiting"] = round(spent.get("waiting", 0.0) + POLL_S, 3)


def xla_chunk(n_cands: int, threads: int, share: int) -> int:
    """How many candidates a worker claims at once for XLA timings: what its threads compile at once
    (`ahead.chunk_size`), but no more than a half of each worker's part, so that the last chunks spread over the
    workers (GPT-2 medium's 158 candidates in chunks of 32 on 4 workers: one worker timed 62, the others 32). Chunks
    that shrink as the work runs out (guided self-scheduling, tried at c8130c1 on 4 H100s) gave each worker more
    chunks, each waiting for its longest compile, and did not end the workers together either (21.9 s for the
    slowest worker's 44 candidates, 14-18 s for the others)."""
    return max(1, min(chunk_size(threads), -(-n_cands // (2 * max(1, share)))))


def read_xla(pstore: Any, run_id: int, cands: list[CandidateState]) -> int:
    """Every candidate's XLA time as the store has it; returns how many are not timed yet (unclaimed or running)."""
    rows = {c["id"]: c for c in pstore.candidates(run_id)}
    pending = 0
    for r in cands:
        row = rows[r.candidate_id]
        r.xla_ms = row["xla_ms"]
        pending += row["xla_ms"] is None and row["xla_status"] in (None, "running")
    return pending


def _gpu_lock() -> int:
    """Hold a lock file on this worker's GPU for its lifetime; refuse if another worker of this host holds it."""
    gpu = _my_gpu()
    fd = lock_gpu(gpu)
    if fd is None:
        raise RuntimeError(f"GPU {gpu} already has an autofuse worker on this host ({lock_path(gpu)}); "
                           "one worker per GPU")
    return fd


def _my_gpu() -> str:
    return (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip()


class _Worker:
    """One worker's part of a run: the shared trial loop with heartbeats, then waiting for the others' trials."""

    def __init__(self, pstore: Any, run_id: int, cands: list[CandidateState], spaces: dict, scheduler: Scheduler, ctx: TrialContext,
                 seed: int, worker_seed: int, heartbeat_s: int):
        from optuna.exceptions import ExperimentalWarning
        from optuna.storages import RetryHeartbeatStaleTrialCallback

        from ..store.optuna_storage import optuna_storage

        self.pstore, self.run_id, self.cands = pstore, run_id, cands
        with warnings.catch_warnings():  # Optuna's heartbeat API is marked experimental
            warnings.simplefilter("ignore", ExperimentalWarning)
            self.retry = RetryHeartbeatStaleTrialCallback(max_retry=MAX_RETRY)
            storage = optuna_storage(pstore.url, heartbeat_s=heartbeat_s, on_stale=self._on_stale)
        self.index = {r.signature: i for i, r in enumerate(cands)}
        self.loop = TrialLoop(cands, spaces, scheduler, ctx, storage, run_id, seed, worker_seed)

    def _on_stale(self, study: Any, trial: Any) -> None:
        """Optuna failed a trial whose worker stopped sending heartbeats (this runs once per such trial): its row
        stops counting against the budget, and its config goes back to the study for another worker."""
        r = self.cands[self.index[study.study_name[len(study_name(self.run_id, "")):]]]
        self.loop.ledger.mark_lost(r, trial.number, f"worker {trial.user_attrs.get('worker')} died (no heartbeat); retried")
        self.retry(study, trial)

    def work(self) -> None:
        """Trials until the budget is spent and no trial of the run is running anywhere."""
        from optuna.exceptions import ExperimentalWarning
        from optuna.storages import fail_stale_trials

        while True:
            kind = self.loop.step()
            if kind == "closed":
                return
            if kind is not None:
                continue
            waiting = [i for i, r in enumerate(self.cands) if any(t.status is TrialStatus.RUNNING for t in r.trials)]
            if not waiting:
                return
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ExperimentalWarning)
                for j in waiting:  # a dead worker's trial is failed here (and retried) once its heartbeat is stale
                    fail_stale_trials(self.loop.study(j))
                    self._reconcile(j)
            time.sleep(POLL_S)

    def _reconcile(self, i: int) -> None:
        """A running row whose Optuna trial is already finished lost its worker inside the stale-trial callback: lost too."""
        from optuna.trial import TrialState

        failed = {t.number for t in self.loop.study(i).get_trials(deepcopy=False, states=(TrialState.FAIL,))}
        for t in self.cands[i].trials:
            if t.status is TrialStatus.RUNNING and t.optuna_trial_id in failed:
                self.loop.ledger.mark_lost(self.cands[i], t.optuna_trial_id, "worker died (its trial failed by heartbeat)")

    def select(self, graph: Any, by_sig: dict, gmodel: costmodel.GPUModel, run: dict, *, compile_workers: int = 1,
               marks: PhaseMarks | None = None, helpers: Helpers | None = None, profiled: dict | None = None) -> None:
        """Check the bests, choose the cover, validate it and save the plan (the worker that won begin_selection);
        `helpers` validate plans on this host's other GPUs; `profiled`: the record of this worker's profile of the
        program (its prices are the scheduler's `costs`), None where it took none."""
        marks = marks or PhaseMarks(None, None)
        self.loop.ledger.refresh(self.cands)
        for r in self.cands:
            r.trials = [t for t in r.trials if t.status is not TrialStatus.LOST]
        n = sum(t.status.value not in UNCOUNTED for r in self.cands for t in r.trials)
        saver = PlanSaver(self.pstore, RunIds(run["program_id"], run["device_id"], run["software_id"]), self.run_id)
        report = finalize(graph, by_sig, self.cands, self.loop.ctx.runner, self.loop.ctx.measure, gmodel, self.loop.ledger, run["program"], n,
                          run["started_at"].timestamp(), lambda s: None, compile_workers=compile_workers,
                          on_passed=lambda first: (saver.early(first), marks("first_plan")),
                          max_memory_bytes=(run.get("job") or {}).get("max_memory_bytes"), helpers=helpers,
                          on_timings=lambda t: marks("selection", value=t, replace=True), costs=self.loop.scheduler.costs,
                          profiled=profiled)
        marks("selected")
        saver.final(report)
        marks("saved")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m autofuse.tuning.workers RUN MODULE:FUNCTION [--index I] [--quiet]``: one worker of a run that tunes
    that function; the database URL is in $AUTOFUSE_DB."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m autofuse.tuning.workers")
    p.add_argument("run", type=int)
    p.add_argument("program", metavar="MODULE:FUNCTION")
    p.add_argument("--index", type=int, default=None)
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    try:
        run_worker(a.run, a.program, index=a.index, quiet=a.quiet)
    except (RuntimeError, ValueError, KeyError, ImportError) as e:  # one line for what the user can fix
        if os.environ.get("AUTOFUSE_DEBUG"):
            raise
        print(f"autofuse worker: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
