"""Compiling ahead: a job compiles on many CPU cores at once, and times on the GPU one at a time.

A job is mostly compilation: XLA's reference of every distinct candidate (about
0.4 s each on an H100, a minute for GPT-2 medium's 158), phase 1's default
config of each, then every trial's kernel (86-91% of a trial). Compilation is CPU work and XLA releases the
GIL while it compiles, so the trial process compiles a chunk of them on a
thread pool (`CompileRequest`), then the usual requests time them one at a
time on the GPU, finding their executables ready. The results are those of the
serial path: what failed to compile ahead compiles again in its own request,
and a kernel that crashes (or hangs) the trial process during a batch only loses
the batch: the process restarts, its items compile in their own requests, where
the crash fails its one trial, and the job compiles one at a time from then on.

How many threads: `compile_workers` (``--compile-workers``,
``$AUTOFUSE_COMPILE_WORKERS``), else the cores this process may use, shared
among the workers of this host, at most `MAX_COMPILE_WORKERS`.
"""
from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..runner.protocol import (
    CompileItem,
    CompileRequest,
    ProfileRequest,
    ProgramRequest,
    TrialRequest,
    TrialResult,
    XlaRequest,
)
from ..spent import add_since
from ..status import TrialStatus
from .ledger import CandidateState
from .scheduler import phase1_order, phase1_visits, skipped_in_phase1
from .select import lone_contractions
from .space import CandidateSpace, config_key, queue_neighbours, sampler

ENV_VAR = "AUTOFUSE_COMPILE_WORKERS"
MAX_COMPILE_WORKERS = 16  # beyond this, lowering (which holds the GIL) and memory dominate
CHUNK_PER_THREAD = 2  # a chunk compiled at once: this many items per thread
MAX_ASKED_AHEAD = 8  # phase 2: configs of one candidate asked of its sampler at once (they see none of each other's results)
MAX_BATCH_AHEAD = 16  # phase 2: configs compiled in one batch, of several candidates
PROPOSALS_PER_CONFIG = 8  # phase 2: a sampler's proposals looked at per config queued (the rest infeasible or pruned)
ASKED_BY = "asked_ahead_by"  # the user attribute naming the worker that queued (and compiles) a config asked ahead
BATCH_TIMEOUT_S = 120.0  # a batch that takes longer hangs: the trial process is restarted and compiling ahead stops
log = logging.getLogger("autofuse")


def compile_workers(requested: int | None = None, share: int = 1) -> int:
    """Threads that compile at once in one trial process: `requested`, else $AUTOFUSE_COMPILE_WORKERS, else the
    cores this process may use divided among the `share` workers of this host, at most MAX_COMPILE_WORKERS."""
    if requested is None and os.environ.get(ENV_VAR, "").strip():
        try:
            requested = int(os.environ[ENV_VAR])
        except ValueError:
            raise ValueError(f"${ENV_VAR} must be a whole number of threads, got {os.environ[ENV_VAR]!r}") from None
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise ValueError(f"compile workers must be a positive whole number, got {requested!r}")
        return requested
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_COMPILE_WORKERS, cores // max(1, share)))


def chunk_size(workers: int) -> int:
    return max(1, CHUNK_PER_THREAD * workers)


def compile_batch(runner: Any, items: Sequence[CompileItem], workers: int,
                  timeout_s: float | None = BATCH_TIMEOUT_S, longest: dict | None = None, tally: dict | None = None) -> bool:
    """Send one batch to be compiled ahead; False if it crashed or hung the trial process (restarted for the next
    request), after which the caller compiles serially: a crash that repeats would otherwise cost a restart per batch.
    `timeout_s` None: the runner's per-request limit (whole programs, which take longer than a batch of kernels).
    `longest` receives the longest compilation of one item per kind (`CompileResult.longest`); `tally` adds up the
    items that failed to compile ("failed"), the batches that crashed or hung the trial process ("lost") and the kernels
    that lowering helpers lowered ("lowered_apart")."""
    res = runner.call(CompileRequest(tuple(items), workers, timeout_s=timeout_s))
    if longest is not None:
        longest.update(getattr(res, "longest", None) or {})
    if tally is not None:
        tally["failed"] = tally.get("failed", 0) + (getattr(res, "failed", 0) or 0)
        tally["lost"] = tally.get("lost", 0) + (res.status in (TrialStatus.CRASHED, TrialStatus.TIMEOUT))
        if getattr(res, "lowered_apart", 0):
            tally["lowered_apart"] = tally.get("lowered_apart", 0) + res.lowered_apart
    if res.status in (TrialStatus.CRASHED, TrialStatus.TIMEOUT):
        log.warning("autofuse: compiling %d items ahead on %d threads: %s (%s); compiling one at a time from here",
                    len(items), workers, res.status.value, res.error)
        return False
    return True


def time_xla_concurrently(cands: Sequence[CandidateState], runner: Any, workers: int, bar: Any = None,
                          spent: dict | None = None, first_trials: Sequence[CompileItem] = ()) -> list[TrialResult]:
    """XLA's time of each candidate (set on it, None where timing failed), compiled `workers` at a time, timed one
    at a time; one result per candidate, in order. `first_trials` (`CompileAhead.first_compiles`) compile with the
    first chunk (alone where there is none): the first trials' kernels (GPT-2's Mosaic GPU attention: 4-5 s) and
    the whole program compile beside XLA's references instead of after them. `spent` adds up where the time went:
    seconds compiling ahead ("compile"), seconds of the timing requests ("time", with what they compiled
    themselves), groups ("groups"), first trials' kernels compiled with them ("trials"), the longest compile of
    one item of each kind ("longest_xla", "longest_trial", "longest_program"), and what `compile_batch` tallied
    where not none (items that "failed", batches "lost", kernels "lowered_apart" by helper processes)."""
    results: list[TrialResult] = []
    spent = {} if spent is None else spent
    tally: dict[str, int] = {}
    size = chunk_size(workers)
    extra = list(first_trials) if workers > 1 else []
    for part in [cands[k:k + size] for k in range(0, len(cands), size)] or ([[]] if extra else []):
        t0 = time.perf_counter()
        items = [XlaRequest(tuple(r.nodes)) for r in part] + extra
        if extra:
            spent["trials"] = spent.get("trials", 0) + sum(isinstance(q, TrialRequest) for q in extra)
        extra = []
        longest: dict[str, float] = {}
        if workers > 1 and len(items) > 1 and not compile_batch(runner, items, workers, longest=longest, tally=tally):
            workers = 1
        for kind, secs in longest.items():  # the batch waits for its longest compile
            spent[f"longest_{kind}"] = max(spent.get(f"longest_{kind}", 0.0), secs)
        t1 = add_since(spent, "compile", t0)
        for r in part:
            res = runner.call(XlaRequest(tuple(r.nodes)))
            r.xla_ms = res.median_ms if res.ok else None
            results.append(res)
            if bar is not None:
                bar.update(1)
        add_since(spent, "time", t1)
        spent["groups"] = spent.get("groups", 0) + len(part)
    spent.update((k, spent.get(k, 0) + v) for k, v in tally.items() if v)
    return results


class CompileAhead:
    """Phase 1's default configs compiled ahead, a chunk at a time, just before the driver reaches them (`before`);
    phase 2's next configs asked of the samplers and compiled ahead (`ask`).

    `before(i)` runs before each trial of candidate i: when i has no trial yet and its first config was not
    sent ahead, the trial process compiles it together with the next untried candidates in phase 1 order, no
    more than this worker's part of the trials left of `budget`. With `share` workers, every default config
    (one per backend) of those candidates is compiled: the workers go through phase 1 in the same order, each
    taking whichever of a candidate's enqueued configs is next (on 4 H100s, GPT-2's four workers all began with
    attention, then the same row reductions). Before the kernel cache, each worker compiled them all (a guess of
    every fourth candidate per worker missed nearly always, and those trials compiled for 1-2 s each); now the
    numbered workers of a host (`index`) each compile their part (`_ours`) and the trials find the others' kernels
    in the host's caches. A guess that misses costs compile time on a spare core, never a result: the trial
    compiles what it does not find.
    """

    def __init__(self, runner: Any, cands: list[CandidateState], spaces: dict[str, CandidateSpace], measure: str, workers: int,
                 share: int = 1, budget: int | None = None, index: int | None = None):
        self.runner, self.cands, self.spaces, self.measure = runner, cands, spaces, measure
        self.workers, self.share, self.budget, self.index = workers, max(1, share), budget, index
        self.tag = f"{socket.gethostname()}:{os.getpid() if index is None else index}"  # this worker, on its asked configs
        self._turns: dict[int, int] | None = None  # each candidate's worker among the host's (`_ours`)
        self.sent: set[int] = set()
        self.compiled: set[tuple[int, tuple]] = set()  # phase 2: (candidate, config) sent ahead by `ask`
        self.asked_at: dict[int, int] = {}  # phase 2: a candidate's trials that spent budget when its sampler was last asked
        self.batches: list[int] = []  # the size of each batch sent (their seconds: the trial loop's "compile_ahead")
        self.tally: dict[str, int] = {}  # items that failed to compile ahead, batches lost to a crash or hang (`compile_batch`)
        self.along: list[CompileItem] = []  # compiled with the next batch, once (`selection_references`)

    def parts(self) -> dict:
        """What compiling ahead did in the trial loop, for its `trial_parts` mark."""
        return {"compiled_ahead": sum(self.batches), "batches": len(self.batches), **{f"ahead_{k}": v for k, v in self.tally.items()}}

    def first_requests(self, i: int) -> list[XlaRequest | TrialRequest]:
        """Candidate i's XLA reference (its trial checks against it; the trial process skips one it has, timed
        here or not) and its first config (with several workers: each backend's default) as its trial will ask
        for it, those that will be compiled."""
        r, space = self.cands[i], self.spaces[self.cands[i].signature]
        cfgs = space.defaults() if self.share > 1 else [space.default]  # without enumerating the space for the model's best
        return [XlaRequest(tuple(r.nodes))] + [TrialRequest(tuple(r.nodes), r.template, dict(c)) for c in cfgs
                                               if not space.unmeasured_reason(c, self.measure)]

    def first_compiles(self) -> list[CompileItem]:
        """What the job compiles with its XLA timings' first chunk: `first_batch`, and in device mode jax.jit's whole
        program, the reference every validation is judged against (else compiled beside the chosen plan by the first
        validation, on the first plan's critical path: GPT-2 medium's forward, 4.6 s of 15; every worker of a run
        compiles it, as any of them may select the plan), and the same program as the profile after the timings runs
        it (`ProfileRequest`: else compiled alone there, GPT-2's step 10-12 s)."""
        if self.workers <= 1 or self.measure != "device":
            return []
        return self.first_batch() + [ProgramRequest(), ProfileRequest()]

    def first_batch(self) -> list[XlaRequest | TrialRequest]:
        """The batch `before` would send for phase 1's first candidate, marked sent: the job compiles it with its
        first XLA references (`time_xla_concurrently`), whose timings then decide phase 1's order (a first
        candidate guessed wrong has its batch sent by `before`, as any). The workers of one host (`index` given)
        each compile every `share`-th of its candidates, as they all start together: on a GPU each kernel is kept
        lowered and compiled for the others (`kernel_cache`, `compile_cache`), where each worker compiled them all
        (GPT-2's ~31 first kernels: 7-9 s per worker on 4 H200s, results/multi_gpu_h200x4_run18.md)."""
        if self.workers <= 1 or self.measure != "device":
            return []
        first = next((j for j in phase1_order(self.cands, self.spaces) if not self.cands[j].trials), None)
        if first is None:
            return []
        pick = self._pick(first)
        if self.index is not None and self.share > 1:
            pick = pick[self.index % self.share::self.share]
        return [q for j in pick for q in self.first_requests(j)]

    def _pick(self, i: int) -> list[int]:
        """Candidate i and the next untried candidates in phase 1's order, no more than this worker's part of the
        trials left and of phase 1's visits left (a budget short of the candidates visits half as many, and no
        modelled loss: `Scheduler.pick`; GPT-2 at 24 trials compiled 12 defaults no trial asked for); marked sent."""
        n = chunk_size(self.workers)
        if self.budget is not None:  # this worker's part of the trials left, and of phase 1's visits left
            n = min(n, -(-(self.budget - sum(len(c.spent()) for c in self.cands)) // self.share))
            visits = phase1_visits(len(self.cands), self.budget) - sum(1 for c in self.cands if c.spent())
            n = min(n, max(1, -(-visits // self.share)))
        rest = [j for j in phase1_order(self.cands, self.spaces) if j != i and not self.cands[j].trials and j not in self.sent
                and not (self.budget is not None
                         and skipped_in_phase1(self.cands[j], self.spaces[self.cands[j].signature], self.budget, len(self.cands)))]
        pick = [i] + rest[:max(0, n - 1)]
        self.sent.update(pick)
        return pick

    def before(self, i: int) -> None:
        if self.workers <= 1 or self.measure != "device" or self.cands[i].trials or i in self.sent:
            return
        reqs = [q for j in self._pick(i) if j == i or self._ours(j) for q in self.first_requests(j)]
        if len(reqs) > 1:
            self._compile(reqs)

    def _ours(self, j: int) -> bool:
        """Whether candidate j's defaults are this worker's to compile ahead: the numbered workers of a host each
        compile every `share`-th candidate of phase 1's order (the same in every worker once the XLA timings are
        shared; the workers take its candidates in turn), besides the one of its own next trial; whichever worker's
        trial takes a config finds it in the host's kernel and compilation caches. Each compiled every candidate of
        its chunk, in step with the others (2 H200s, results/multi_gpu_h200x2_run25.md: each worker's loop waited
        69-78 s on batches, one worker alone 63 s for twice the trials)."""
        if self.index is None or self.share <= 1:
            return True
        if self._turns is None:  # fixed at the first call: the trial loop's, after the XLA timings
            self._turns = {c: n % self.share for n, c in enumerate(phase1_order(self.cands, self.spaces))}
        return self._turns.get(j, 0) == self.index % self.share

    def selection_references(self, graph: Any) -> None:
        """Compile with the next batch XLA's reference of each lone dot the selection times (`lone_contractions`;
        all of them, where the selection times those near a fused option only): compiled on a trial loop's idle
        CPU instead of on the first plan's critical path (GPT-2 medium: 2.7 s of its 15)."""
        if self.workers > 1 and self.measure == "device":
            known = {r.signature for r in self.cands if r.xla_ms is not None}
            self.along = [XlaRequest((n,)) for n in lone_contractions(graph, known)]

    def _compile(self, reqs: list) -> None:
        reqs, self.along = reqs + self.along, []
        self.batches.append(len(reqs))
        if not compile_batch(self.runner, reqs, self.workers, tally=self.tally):
            self.workers = 1

    def ask(self, due: Sequence[tuple[int, int]], study_of: Callable[[int], Any], spent: dict | None = None) -> None:
        """Phase 2 compiled ahead. `due`: (candidate, the trials it is still due: `Scheduler.due`) for the candidate
        of the next trial first, then the other contenders of phase 2; `study_of(i)`: candidate i's study. Before a
        trial, the configs the next trials of these candidates will take are compiled in one batch (at most
        MAX_BATCH_AHEAD): for each,
        this worker's part of its due trials (at most MAX_ASKED_AHEAD), the configs waiting in its study first (the
        model's best, this worker's own; another's are left to it), then new ones asked of its sampler at once and
        queued behind them (`_queue`). A trial is 86-91% its kernel's build (results/tuning_one_h200_run20.md), and a
        phase 2 candidate is due 1-4 trials at a time: the batch spans candidates, so that its compiles run side by side (a
        candidate due one trial was once left out, and its kernel built in its trial: 44 of GPT-2's 96). The
        others are looked at only when the next trial's candidate has configs to compile (a store read each).
        `spent`: seconds asking ("ask_ahead") and compiling ("compile_ahead")."""
        if self.workers <= 1 or self.measure != "device" or not due:
            return
        spent = {} if spent is None else spent
        t0 = time.perf_counter()
        todo: list[TrialRequest] = []
        for k, (i, n) in enumerate(due):
            if len(todo) >= MAX_BATCH_AHEAD or (k == 1 and not todo):  # the next trial's config is compiled (or not worth it)
                break
            r, space = self.cands[i], self.spaces[self.cands[i].signature]
            fresh = [c for c in self._queue(i, study_of(i), min(-(-n // self.share), MAX_ASKED_AHEAD, MAX_BATCH_AHEAD - len(todo)),
                                            unmarked=k == 0 or self._ours(i))
                     if (i, config_key(c)) not in self.compiled and not space.unmeasured_reason(c, self.measure)][:MAX_BATCH_AHEAD - len(todo)]
            self.compiled.update((i, config_key(c)) for c in fresh)
            todo += [TrialRequest(tuple(r.nodes), r.template, dict(c)) for c in fresh]
        t1 = add_since(spent, "ask_ahead", t0)
        if len(todo) > 1:
            self._compile(todo)
        add_since(spent, "compile_ahead", t1)

    def _queue(self, i: int, study: Any, k: int, unmarked: bool = True) -> list[dict]:
        """The configs candidate i's next trials will take: those waiting in its study, topped up to `k` with the
        untried neighbours of its best config (`queue_neighbours`), then with new ones of its sampler's, queued in the
        study behind them (a trial takes waiting configs first, as it takes the defaults). A queued config is an
        ordinary waiting trial: another worker takes it if this one dies.

        With several workers, a config queued by another (`ASKED_BY`) is theirs to compile: each worker keeps its own
        part of the queue and compiles only that, and whichever trial takes a config finds it in the host's caches.
        The configs no worker asked for (the defaults, the model's best, queued with the study and by its first
        trial) are in the queue where `unmarked`: for the candidate of this worker's next trial, which takes the
        oldest, and for its own part of the others (`_ours`). When each compiled every waiting config, two workers
        on 2 H200s each compiled all of the job's configs (results/multi_gpu_h200x2_run25.md: 1.04x faster than one).

        The new ones are asked of a copy of the study in memory (its finished and running trials; `space.sampler`,
        seeded by the study and its trials): asked of the study in the store, each cost ~72 ms on an H200 (TPE
        reads the trials at every parameter) and left a failed trial behind, and an ask takes waiting trials first.
        Asked together, the constant liar keeps them apart; none sees another's result, the price of compiling them
        at once. Asked once per trial of the candidate that spent budget (asks that found nothing new are not
        repeated), and never for more than its untried configs where the space can be counted. A proposal that breaks a
        constraint or that the model prunes is not queued (its trial would measure nothing): up to
        PROPOSALS_PER_CONFIG proposals are looked at for each config queued."""
        import optuna
        from optuna.trial import TrialState

        r, space = self.cands[i], self.spaces[self.cands[i].signature]
        worth = space.worth_timing(self.measure)
        if worth is not None:
            k = min(k, worth - len({config_key(t.config) for t in r.trials}))
        waiting = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
        queue, theirs = [], []  # theirs: queued by another worker of the run, which compiles them
        for t in waiting:
            cfg = _waiting_config(space, t.system_attrs.get("fixed_params"))
            if cfg is not None:
                by = t.user_attrs.get(ASKED_BY)
                mine = self.share <= 1 or by == self.tag or (by is None and unmarked)  # alone: a resumed job's too
                (queue if mine else theirs).append(cfg)
        if k < 1 or len(queue) >= k or self.asked_at.get(i, -1) >= len(r.spent()):
            return queue
        self.asked_at[i] = len(r.spent())
        queue += queue_neighbours(study, space, r, k - len(queue), self.measure, {config_key(c) for c in queue + theirs}, {ASKED_BY: self.tag})
        if len(queue) >= k:
            return queue
        seed = f"{study.study_name}:{len(r.trials)}" + (f":{self.index}" if self.index else "")  # the workers' asks differ
        aside = optuna.create_study(direction="minimize", sampler=sampler(zlib.crc32(seed.encode())))
        aside.add_trials(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.RUNNING)))
        seen = {config_key(t.config) for t in r.trials} | {config_key(c) for c in queue + theirs}
        for _ in range(PROPOSALS_PER_CONFIG * (k - len(queue))):  # one at a time: each sees the ones before as running
            cfg = space.suggest(aside.ask())                        # (the constant liar)
            if config_key(cfg) in seen:
                continue
            seen.add(config_key(cfg))
            if space.unmeasured_reason(cfg, self.measure) is None:  # an infeasible or pruned one would take a slot
                queue.append(cfg)
                study.enqueue_trial(space.optuna_params(cfg), user_attrs={ASKED_BY: self.tag})
                if len(queue) >= k:
                    break
        return queue


def _waiting_config(space: CandidateSpace, params: dict | None) -> dict | None:
    """The config a waiting Optuna trial will suggest (its fixed parameters); None if they name no whole config."""
    import optuna

    try:
        return space.suggest(optuna.trial.FixedTrial(params or {}))
    except (ValueError, KeyError):
        return None


#: The interpreter's thread switch interval while `prefetch_model_bests` runs. At Python's default 5 ms the main
#: thread waits up to 5 ms for the GIL at every return from I/O (each SQLite step, each answer of the trial
#: process): a store read of a whole model's 158 candidates took 0.18 s instead of 2 ms beside a busy thread, and
#: each of four GPT-2 workers on 4 H100s spent 9-11 s of its 26 s XLA phase in store calls (1 worker: 3.6 s).
PREFETCH_SWITCH_S = 1e-4
_switch_lock = threading.Lock()
_switch_users: list[float] = []  # the interval before the first prefetch still running lowered it


@contextlib.contextmanager
def _short_switch_interval() -> Iterator[None]:
    """The switch interval at most PREFETCH_SWITCH_S while any prefetch runs; the caller's comes back after the last."""
    with _switch_lock:
        if not _switch_users:
            _switch_users.append(sys.getswitchinterval())
            sys.setswitchinterval(min(_switch_users[0], PREFETCH_SWITCH_S))
        else:
            _switch_users.append(_switch_users[0])
    try:
        yield
    finally:
        with _switch_lock:
            before = _switch_users.pop()
            if not _switch_users:
                sys.setswitchinterval(before)


def prefetch_model_bests(cands: Sequence[CandidateState], spaces: dict[str, CandidateSpace],
                         order: Sequence[int] | None = None) -> threading.Event:
    """The model-best config (`CandidateSpace.model_best`, the third config of its study, queued by its first trial)
    of the candidates of `order` (indices; default: all, in phase 1's order) found on a background thread while this
    process mostly waits on the trial process (on the GPU: the XLA timings; then the trials): enumerating a space
    takes up to a second, which its first trial would otherwise wait for. The answer is the same whenever it is
    found (each space keeps it for its facts). Give the candidates the budget can reach (`scheduler.timed_first`):
    all of GPT-2's 158 took about 14 s with Mosaic GPU and Triton, and a thread still busy at phase 2's start
    (where each step solves the cover, in Python too) stalled every worker's trials for 2 s. Returns the event that
    stops it (set it when the job ends)."""
    stop = threading.Event()
    todo = list(phase1_order(list(cands), spaces) if order is None else order)

    def work() -> None:
        try:
            with _short_switch_interval():
                for i in todo:
                    if stop.is_set():
                        return
                    spaces[cands[i].signature].model_best()
        except Exception as e:  # noqa: BLE001 - a trial finds it again itself, and fails there if it must
            log.debug("autofuse: finding the model's best configs ahead stopped: %s: %s", type(e).__name__, e)

    threading.Thread(target=work, name="autofuse-model-best", daemon=True).start()
    return stop
