"""Tuning with several worker processes, one per GPU, on one host or many, sharing one run.

This is Optuna's own distributed mode: every worker opens the run's studies (one
per distinct candidate, ``autofuse-run<ID>-<signature>``) in the RDB storage
that shares the database with the plan store, and runs trials with
``study.optimize(n_trials=1)``. TPE (with the constant liar) sees every worker's
trials; Optuna's heartbeats fail the running trial of a worker that died and
``RetryFailedTrialCallback`` puts its config back for another worker. The plan
store keeps the run's books in one short transaction per trial, serialised on
the run row (``PlanStore.claim_trial``): the trial budget holds exactly across
workers and no config of a candidate is measured twice.

Roles:

* the launcher, ``tune(..., workers=N)`` / ``autofuse tune --workers N``:
  captures the program, opens the run, times every candidate in XLA, creates
  the studies with their first configs, publishes the job (function reference,
  argument shapes, options) on the run row, starts N workers on this host,
  worker i seeing only GPU i (``CUDA_VISIBLE_DEVICES``), waits, and reads the
  plan back;
* ``autofuse worker RUN --db URL`` joins the run from another host (a server
  database: a SQLite file serves one host only);
* each worker (``python -m autofuse.distributed RUN``, database in
  ``$AUTOFUSE_DB``) follows the budget rule of `search` one trial at a time:
  first a dead worker's config waiting for its retry; phase 1, every
  candidate's default config, the largest modelled saving first; phase 2, the contenders,
  each trial to the one furthest behind its share (`search.allocate`, in
  proportion to XLA time). With nothing left to start, it waits until no trial
  of the run is running (or is failed by heartbeat, then retried), and tries
  ``PlanStore.begin_selection``; the one worker that wins checks the bests,
  selects the cover, validates it against jax.jit and writes the plan, once.

Timing on a shared GPU is meaningless, so a GPU has one worker: the launcher
refuses more workers than visible GPUs in device mode, and a measuring worker
holds a lock file on its GPU (the first ``CUDA_VISIBLE_DEVICES`` entry) for its
whole life, so a second worker started on the same GPU of this host, by any
launch, refuses to run.
"""
from __future__ import annotations

import fcntl
import importlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any, Callable, Sequence

import jax
import numpy as np
from optuna.exceptions import ExperimentalWarning, UpdateFinishedTrialError

from . import costmodel
from .graph import capture
from .plan import Plan
from .search import (INFEASIBLE_VALUE, UNMEASURED, CandidateResult, TuneReport, _contenders, _open_store, _optuna_storage, _save,
                     _spec_of, _update_best, allocate, distinct_candidates, enqueue_first_configs, finalize, learn_shared_memory, measure_config,
                     phase1_order, search_spaces, unmeasured_reason)
from .worker import ProgramSpec, TrialRunner

UNCOUNTED = ("infeasible", "pruned", "lost")  # trial statuses that spend no budget (as PlanStore.claim_trial)
MAX_RETRY = 2  # a config whose worker died is retried this many times
STUCK_AFTER = 16  # a worker leaves a study whose sampler proposed this many done configs in a row
POLL_S = 0.5


class _NoResult(Exception):
    """Ends an Optuna trial as failed: a failed build or check, a config running elsewhere, or no budget left."""


# --------------------------------------------------------------------------- the job, as data
def study_name(run_id: int, signature: str) -> str:
    return f"autofuse-run{run_id}-{signature}"


def function_ref(fn: Callable) -> str:
    """``module:qualname`` of a function that a worker on another host can import."""
    mod, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not mod or mod == "__main__" or "<" in qual:
        raise ValueError(f"tuning with workers needs a function importable by name (module:function), not {mod}:{qual}")
    ref = f"{mod}:{qual}"
    if import_ref(ref) is not fn and getattr(import_ref(ref), "__wrapped__", None) is not fn:
        raise ValueError(f"{ref} does not name the function being tuned")
    return ref


def import_ref(ref: str) -> Any:
    mod, _, attr = ref.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    obj = importlib.import_module(mod)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def encode_args(x: Any) -> Any:
    """Arguments as JSON: arrays by shape and dtype, containers kept, plain scalars as they are."""
    if isinstance(x, dict):
        if not all(isinstance(k, str) for k in x):
            raise ValueError("tuning with workers needs dict arguments with string keys")
        return {"dict": {k: encode_args(v) for k, v in x.items()}}
    if isinstance(x, (list, tuple)):
        return {type(x).__name__: [encode_args(v) for v in x]}
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return {"array": [list(np.shape(x)), str(x.dtype)]}
    if x is None or isinstance(x, (bool, int, float, str)):
        return {"value": x}
    raise ValueError(f"tuning with workers rebuilds the arguments from shapes and dtypes; cannot describe a {type(x).__name__}")


def decode_args(x: Any) -> Any:
    (kind, v), = x.items()
    if kind == "dict":
        return {k: decode_args(e) for k, e in v.items()}
    if kind in ("list", "tuple"):
        seq = [decode_args(e) for e in v]
        return seq if kind == "list" else tuple(seq)
    if kind == "array":
        return jax.ShapeDtypeStruct(tuple(v[0]), jax.numpy.dtype(v[1]))
    return v


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES entries (empty without a GPU backend)."""
    if jax.default_backend() != "gpu":
        return []
    n = len(jax.devices("gpu"))
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [e.strip() for e in env.split(",") if e.strip()] if env else [str(i) for i in range(n)]
    return ids[:n]


# --------------------------------------------------------------------------- the launcher
def tune_with_workers(fn: Callable, args: tuple, kwargs: dict, *, workers: int, trials: int | None, time_budget_s: float | None, seed: int,
                      store: Any, name: str | None, measure: str | None, model: str, quiet: bool, isolate: bool, trial_timeout_s: float,
                      static_argnums: Sequence[int], static_argnames: Sequence[str], heartbeat_s: int,
                      progress: Callable[[str], None] | None) -> TuneReport:
    """`search.tune` with `workers` processes on this host sharing one run (see the module docstring)."""
    import optuna

    t_start = time.time()
    say = progress or (lambda s: None if quiet else print(s, file=sys.stderr, flush=True))
    if store is None:
        raise ValueError("workers share the run through the store: give a database (store=URL, autofuse tune --db URL)")
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    if heartbeat_s < 1:
        raise ValueError(f"the heartbeat interval is a whole number of seconds >= 1, got {heartbeat_s}")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    gpus = visible_gpus()
    measure = measure or ("device" if gpus else "model")
    if measure == "device" and not gpus:
        raise RuntimeError("measure='device' needs a GPU; none is present (use measure='model')")
    if measure == "device" and workers > len(gpus):
        raise ValueError(f"{workers} workers but {len(gpus)} visible GPU(s): one worker per GPU (two on one GPU would time each other)")
    if measure == "model":
        say(f"autofuse: no GPU measurement ({jax.default_backend()} backend): ranking with the analytic roofline model of "
            f"{costmodel.get_model(model).name}; the times below are estimates, not measurements.")
    if trials is None and time_budget_s is None:
        trials = 48
    static_argnums = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
    static_argnames = (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames)
    job = {"fn": function_ref(fn), "args": encode_args(tuple(args)), "kwargs": encode_args(dict(kwargs)), "static_argnums": list(static_argnums),
           "static_argnames": list(static_argnames), "model": model, "isolate": isolate, "trial_timeout_s": trial_timeout_s,
           "heartbeat_s": int(heartbeat_s)}
    graph = capture(fn, *args, static_argnums=static_argnums, static_argnames=static_argnames, **kwargs)
    name = name or getattr(fn, "__qualname__", "program")
    gmodel = costmodel.get_model(model)
    by_sig, results = distinct_candidates(graph)
    pstore, run_id, _ids = _open_store(store, graph, name, measure, trials, time_budget_s, seed, None)
    procs: list[subprocess.Popen] = []
    try:
        # what every worker needs first: candidates with their XLA times, studies with their first configs
        spec = ProgramSpec(fn, jax.tree_util.tree_map(_spec_of, tuple(args)), jax.tree_util.tree_map(_spec_of, dict(kwargs)), static_argnums,
                           static_argnames, graph.fingerprint)
        with TrialRunner(spec, {"measure": measure, "model": model}, isolate=isolate, timeout_s=trial_timeout_s) as runner:
            for r in results:
                resp = runner.call({"op": "xla", "nodes": r.nodes})
                r.candidate_ids = [pstore.add_candidate(run_id, r.signature, r.template, r.nodes)]
                if resp.get("status") == "ok":
                    pstore.update_candidate(r.candidate_ids[0], xla_ms=resp["median_ms"])
        spaces, _ = search_spaces(by_sig, results, gmodel)
        storage = _optuna_storage(pstore)
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        for r in results:
            study = optuna.create_study(direction="minimize", storage=storage, study_name=study_name(run_id, r.signature), load_if_exists=True)
            if not study.trials:
                enqueue_first_configs(study, spaces[r.signature])
        pstore.set_run_job(run_id, job)
        say(f"autofuse: run {run_id}: {len(results)} candidates, {workers} worker(s) on this host"
            + (f" (GPUs {', '.join(gpus[:workers])})" if measure == "device" else "")
            + f"; join from another host: autofuse worker {run_id} --db URL")
        procs = start_workers(run_id, pstore.url, workers, gpus, quiet)
        codes = [p.wait() for p in procs]
    except BaseException as e:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait()
        pstore.finish_run(run_id, "interrupted" if isinstance(e, KeyboardInterrupt) else "failed", error=f"{type(e).__name__}: {e}")
        raise
    run = _wait_for_selection(pstore, run_id)
    died = [f"worker {k} exit {c}" for k, c in enumerate(codes) if c != 0]
    if died:
        say(f"autofuse: {'; '.join(died)} (a dead worker's running trial is retried by another)")
    if run["status"] != "finished":
        raise RuntimeError(f"run {run_id} is {run['status']} after its workers exited ({'; '.join(died) or 'all exit 0'})"
                           + (f": {run['error']}" if run.get("error") else f"; join it with: autofuse worker {run_id} --db URL"))
    return report_from_store(pstore, run_id, by_sig, results, name, measure, t_start)


def start_workers(run_id: int, url: str, n: int, gpus: Sequence[str], quiet: bool) -> list[subprocess.Popen]:
    """`n` worker processes of the run; worker i sees only GPU i (round robin in model mode). The URL goes by environment, not argv."""
    env = dict(os.environ, AUTOFUSE_DB=url, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), *filter(None, [os.environ.get("PYTHONPATH")])])
    procs = []
    for i in range(n):
        e = dict(env)
        if gpus:
            e["CUDA_VISIBLE_DEVICES"] = gpus[i % len(gpus)]
        procs.append(subprocess.Popen([sys.executable, "-m", "autofuse.distributed", str(run_id)] + (["--quiet"] if quiet else []), env=e))
    return procs


def _wait_for_selection(pstore: Any, run_id: int) -> dict:
    """The run once no worker anywhere is running a trial of it or selecting its plan (after this host's workers exited,
    workers of other hosts may still be)."""
    from .store.store import _pid_alive

    while True:
        run = pstore.get_run(run_id)
        if run["status"] != "running" or (run["selected_by"] is None and not pstore.trials(run_id, "running")):
            return run
        host, _, pid = (run["selected_by"] or "").rpartition(":")
        if host == socket.gethostname() and not _pid_alive(int(pid)):  # the selecting worker of this host died
            pstore.finish_run(run_id, "failed", error=f"worker {run['selected_by']} died while selecting the plan")
            return pstore.get_run(run_id)
        time.sleep(POLL_S)


def report_from_store(pstore: Any, run_id: int, by_sig: dict, results: list[CandidateResult], name: str, measure: str, t_start: float) -> TuneReport:
    """The report of a run finished by workers, read back from the store."""
    run = pstore.get_run(run_id)
    cands = {c["signature"]: c for c in pstore.candidates(run_id)}
    rows = pstore.trials(run_id)
    for r in results:
        c = cands[r.signature]
        r.xla_ms, r.best_ms, r.best_config, r.status = c["xla_ms"], c["best_ms"], c["best_config"], c["status"]
        r.candidate_ids = [c["id"]]
        r.trials = [dict(t) for t in rows if t["candidate_id"] == c["id"]]
    (plan_row,) = [p for p in pstore.plans(run["fingerprint"]) if p["run_id"] == run_id]
    p = pstore.get_plan(plan_row["id"])
    n = sum(t["status"] not in UNCOUNTED for t in rows)
    return TuneReport(name, run["fingerprint"], measure, Plan.from_dict(p["plan"]), run["baseline_ms"], run["best_ms"], run["speedup"], None,
                      results, {"status": "ok", "max_error": p["max_error"], "tolerance": p["tolerance"]}, time.time() - t_start, n,
                      run_id=run_id, plan_id=p["id"], device=run["device"])


# --------------------------------------------------------------------------- one worker
def run_worker(run_id: int, url: str | None = None, *, quiet: bool = False, ready_timeout_s: float = 600.0) -> dict:
    """Join run `run_id` and work until its budget is spent; returns what this worker did.

    The worker that ends the run selects and saves the plan (`selected` in the result).
    """
    import optuna

    from .store import PlanStore

    me = f"{socket.gethostname()}:{os.getpid()}"
    say = (lambda s: None) if quiet else (lambda s: print(f"autofuse worker {me}: {s}", file=sys.stderr, flush=True))
    pstore = PlanStore(url)
    run = pstore.get_run(run_id)
    t0 = time.time()
    while run["job"] is None and run["status"] == "running":  # the launcher is still timing candidates in XLA
        if time.time() - t0 > ready_timeout_s:
            raise RuntimeError(f"run {run_id} has no job description after {ready_timeout_s:.0f} s (not a run tuned with workers?)")
        time.sleep(POLL_S)
        run = pstore.get_run(run_id)
    if run["status"] != "running" or run["selected_by"] is not None:
        say(f"run {run_id} is {run['status']}{' and being selected' if run['selected_by'] else ''}: nothing to do")
        return {"measured": 0, "selected": False}
    job, measure = run["job"], run["measure"]
    if measure == "device" and jax.default_backend() != "gpu":
        raise RuntimeError(f"run {run_id} measures on a GPU; this host has none")
    lock = _gpu_lock() if measure == "device" else None
    fn = import_ref(job["fn"])
    args, kwargs = decode_args(job["args"]), decode_args(job["kwargs"])
    statics = (tuple(job["static_argnums"]), tuple(job["static_argnames"]))
    graph = capture(fn, *args, static_argnums=statics[0], static_argnames=statics[1], **kwargs)
    if graph.fingerprint != run["fingerprint"]:
        raise RuntimeError(f"{job['fn']} captures as program {graph.fingerprint} here, but run {run_id} tunes {run['fingerprint']} "
                           "(another version of the code or of jax?)")
    by_sig, results = distinct_candidates(graph)
    cands = {c["signature"]: c for c in pstore.candidates(run_id)}
    for r in results:
        r.candidate_ids, r.xla_ms = [cands[r.signature]["id"]], cands[r.signature]["xla_ms"]
    gmodel = costmodel.get_model(job["model"])
    spaces, caps = search_spaces(by_sig, results, gmodel)
    budget = run["budget"] or {}
    deadline = run["started_at"].timestamp() + budget["seconds"] if budget.get("seconds") else None
    total = min(budget.get("trials") or 10**9, sum(caps))
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # a failed trial is data here, not a warning
    spec = ProgramSpec(fn, args, kwargs, *statics, graph.fingerprint)
    w = _Worker(pstore, run_id, run["seed"], me, graph, by_sig, results, spaces, caps, total, deadline, measure, gmodel, job["heartbeat_s"])
    say(f"joined run {run_id} ({len(results)} candidates, budget {total} trials" + (f", GPU {os.environ.get('CUDA_VISIBLE_DEVICES')}" if lock else "") + ")")
    try:
        with TrialRunner(spec, {"measure": measure, "model": job["model"]}, isolate=job["isolate"], timeout_s=job["trial_timeout_s"]) as runner:
            w.runner = runner
            w.work()
            selected = pstore.begin_selection(run_id, me)
            if selected:
                say(f"measured {w.measured} trials; selecting the plan of run {run_id}")
                w.select(job, run)
            say(f"done: measured {w.measured} trials" + ("; plan saved" if selected else ""))
    except BaseException as e:
        if pstore.get_run(run_id)["selected_by"] == me:  # this worker was selecting: the run ends with it
            pstore.finish_run(run_id, "failed", error=f"selection failed in {me}: {type(e).__name__}: {e}")
        raise
    finally:
        if lock is not None:
            os.close(lock)
    return {"measured": w.measured, "selected": selected}


def _gpu_lock() -> int:
    """Hold a lock file on this worker's GPU for its lifetime; refuse if another worker of this host holds it."""
    gpu = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip()
    path = os.path.join(tempfile.gettempdir(), f"autofuse-gpu-{gpu}.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RuntimeError(f"GPU {gpu} already has an autofuse worker on this host ({path}); one worker per GPU") from None
    return fd


class _Worker:
    """The trial loop of one worker: the shared state is read back from the store before every decision."""

    def __init__(self, pstore: Any, run_id: int, seed: int, me: str, graph: Any, by_sig: dict, results: list[CandidateResult],
                 spaces: dict, caps: list[int], total: int, deadline: float | None, measure: str, gmodel: Any, heartbeat_s: int):
        from optuna.storages import RetryHeartbeatStaleTrialCallback

        self.pstore, self.run_id, self.seed, self.me = pstore, run_id, seed, me
        self.graph, self.by_sig, self.results, self.spaces, self.caps = graph, by_sig, results, spaces, caps
        self.total, self.deadline, self.measure, self.gmodel = total, deadline, measure, gmodel
        with warnings.catch_warnings():  # Optuna's heartbeat API is marked experimental
            warnings.simplefilter("ignore", ExperimentalWarning)
            self.retry = RetryHeartbeatStaleTrialCallback(max_retry=MAX_RETRY)
            self.storage = _optuna_storage(pstore, heartbeat_s, self._on_stale)
        self.index = {r.signature: i for i, r in enumerate(results)}
        self.studies: dict[int, Any] = {}
        self.idle_asks = [0] * len(results)
        self.measured = 0
        self.runner: TrialRunner | None = None

    # shared state ------------------------------------------------------------
    def _on_stale(self, study: Any, trial: Any) -> None:
        """Optuna failed a trial whose worker stopped sending heartbeats (this runs once per such trial): its row
        stops counting against the budget, and its config goes back to the study for another worker."""
        r = self.results[self.index[study.study_name[len(study_name(self.run_id, "")):]]]
        self.pstore.mark_trial_lost(r.candidate_ids[0], trial.number, f"worker {trial.user_attrs.get('worker')} died (no heartbeat); retried")
        self.retry(study, trial)

    def refresh(self) -> None:
        rows = self.pstore.trials(self.run_id)
        for r in self.results:
            r.trials = [t for t in rows if t["candidate_id"] == r.candidate_ids[0]]
            _update_best(r)

    def study(self, i: int) -> Any:
        import optuna

        if i not in self.studies:
            sampler = optuna.samplers.TPESampler(seed=(self.seed + i + 7919 * os.getpid()) % 2**31, n_startup_trials=4, constant_liar=True)
            self.studies[i] = optuna.load_study(study_name=study_name(self.run_id, self.results[i].signature), storage=self.storage, sampler=sampler)
        return self.studies[i]

    def pick(self) -> int | None:
        """The candidate of the next trial, by the budget rule; None when the budget (or the time) is spent."""
        counted = [[t for t in r.trials if t["status"] not in UNCOUNTED] for r in self.results]
        spent = sum(map(len, counted))
        if spent >= self.total or (self.deadline is not None and time.time() > self.deadline):
            return None
        open_ = [i for i in range(len(self.results)) if len(counted[i]) < self.caps[i] and self.idle_asks[i] < STUCK_AFTER]
        for i in open_:  # a dead worker's config first: its retry waits in the study
            r = self.results[i]
            live = {_key(t["config"]) for t in r.trials if t["status"] != "lost"}
            lost = [_key(t["config"]) for t in r.trials if t["status"] == "lost"]
            if any(k not in live and lost.count(k) <= MAX_RETRY for k in lost):
                return i
        for i in phase1_order(self.results, self.spaces):  # phase 1: every candidate's default, by phase1_order
            if i in open_ and not counted[i]:
                return i
        cont = [i for i in _contenders(self.graph, self.by_sig, self.results, self.gmodel) if i in open_]
        if not cont:
            return None
        have = [len(counted[i]) for i in cont]
        weights = [self.results[i].xla_ms or 0.0 for i in cont]
        target = allocate(weights, [self.caps[i] for i in cont], sum(have) + self.total - spent)
        behind = max(range(len(cont)), key=lambda k: ((target[k] - have[k]) / max(target[k], 1), weights[k]))
        return cont[behind]

    def running_elsewhere(self) -> list[int]:
        return [i for i, r in enumerate(self.results) if any(t["status"] == "running" for t in r.trials)]

    # the loop ------------------------------------------------------------------
    def work(self) -> None:
        """Trials until the budget is spent and no trial of the run is running anywhere."""
        from optuna.storages import fail_stale_trials

        while True:
            self.refresh()
            i = self.pick()
            if i is not None:
                if self.trial(i) == "closed":
                    return
                continue
            waiting = self.running_elsewhere()
            if not waiting:
                return
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ExperimentalWarning)
                for j in waiting:  # a dead worker's trial is failed here (and retried) once its heartbeat is stale
                    fail_stale_trials(self.study(j))
                    self._reconcile(j)
            time.sleep(POLL_S)

    def _reconcile(self, i: int) -> None:
        """A running row whose Optuna trial is already finished lost its worker inside the stale-trial callback: lost too."""
        from optuna.trial import TrialState

        failed = {t.number for t in self.study(i).get_trials(deepcopy=False, states=(TrialState.FAIL,))}
        for t in self.results[i].trials:
            if t["status"] == "running" and t["optuna_trial_id"] in failed:
                self.pstore.mark_trial_lost(t["candidate_id"], t["optuna_trial_id"], "worker died (its trial failed by heartbeat)")

    def trial(self, i: int) -> str:
        """One Optuna trial of candidate i, run by `study.optimize` (so with heartbeats); returns what became of it."""
        r, space = self.results[i], self.spaces[self.results[i].signature]
        for t in r.trials:  # any worker's shared-memory failure corrects this group's budget here too
            learn_shared_memory(space, t)
        cid = r.candidate_ids[0]
        outcome = {"kind": "closed"}

        def objective(trial: Any) -> float:
            cfg = {k: trial.suggest_categorical(k, v) for k, v in space["params"].items()}
            trial.set_user_attr("worker", self.me)
            unmeasured = unmeasured_reason(space, cfg, self.measure)
            if unmeasured:
                kind, got = self.pstore.claim_trial(self.run_id, cid, cfg, trial.number, limit=None, status=unmeasured[0], error=unmeasured[1])
            else:
                kind, got = self.pstore.claim_trial(self.run_id, cid, cfg, trial.number, limit=self.total)
            outcome["kind"] = kind
            if kind == "duplicate":  # the sampler proposed a config done (or running) already: nothing spent
                if got["status"] == "ok" or got["status"] in UNMEASURED:
                    trial.set_constraint("violations", 1.0 if got["status"] == "infeasible" else 0.0)
                    return float(got["median_ms"]) if got["status"] == "ok" else INFEASIBLE_VALUE
                raise _NoResult(f"config already tried: {got['status']}")
            if kind != "ok":
                raise _NoResult(f"no trial started: {kind}")
            res = {"config": cfg, "number": got, "optuna_trial_id": trial.number}
            if unmeasured:
                trial.set_constraint("violations", float(unmeasured[2]))
                trial.set_user_attr("result", {**res, "status": unmeasured[0], "error": unmeasured[1]})
                outcome["kind"] = "unmeasured"
                return INFEASIBLE_VALUE
            res.update(measure_config(self.runner, r, cfg))
            if not self.pstore.finish_trial(cid, got, res["status"], median_ms=res["median_ms"], min_ms=res["min_ms"], max_ms=res["max_ms"],
                                            error=res["error"]):
                outcome["kind"] = "stale"  # taken for dead meanwhile (heartbeats late): the retry measures it again
                raise _NoResult("marked lost while running")
            trial.set_constraint("violations", 0.0)
            trial.set_user_attr("result", res)
            outcome["kind"] = "measured"
            if res["status"] != "ok":
                raise _NoResult(f"{res['status']}: {res['error']}")
            return float(res["median_ms"])

        try:
            self.study(i).optimize(objective, n_trials=1, catch=(_NoResult,))
        except UpdateFinishedTrialError:  # another worker failed this trial for a late heartbeat; the store has its fate
            outcome["kind"] = "stale" if outcome["kind"] != "measured" else "measured"
        if outcome["kind"] == "measured":
            self.measured += 1
        self.idle_asks[i] = 0 if outcome["kind"] in ("measured", "spent") else self.idle_asks[i] + 1
        return outcome["kind"]

    # the end -------------------------------------------------------------------
    def select(self, job: dict, run: dict) -> None:
        """Check the bests, choose the cover, validate it and save the plan (the worker that won begin_selection)."""
        self.refresh()
        for r in self.results:
            r.trials = [t for t in r.trials if t["status"] != "lost"]
        n = sum(t["status"] not in UNCOUNTED for r in self.results for t in r.trials)
        t_start = run["started_at"].timestamp()
        report = finalize(self.graph, self.by_sig, self.results, self.runner, self.measure, self.gmodel, self.pstore, run["program"], n,
                          t_start, lambda s: None)
        ids = {"program": run["program_id"], "device": run["device_id"], "software": run["software_id"]}
        _save(self.pstore, ids, self.run_id, report)


def _key(cfg: dict) -> tuple:
    return tuple(sorted(cfg.items()))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m autofuse.distributed RUN [--quiet]``: one worker of a run; the database URL is in $AUTOFUSE_DB."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m autofuse.distributed")
    p.add_argument("run", type=int)
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    try:
        run_worker(a.run, quiet=a.quiet)
    except (RuntimeError, ValueError, KeyError, ImportError) as e:  # one line for what the user can fix
        if os.environ.get("AUTOFUSE_DEBUG"):
            raise
        print(f"autofuse worker: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
