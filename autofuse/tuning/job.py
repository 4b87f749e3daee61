"""What every tuning job sets up before its first trial, whichever driver runs it: the candidates (those that
compute the same thing are tuned once), their search spaces, the run in the store, XLA's time of each candidate,
and one Optuna study per candidate with its first configs enqueued."""
from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import pickle
import socket
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import jax
import numpy as np

from .. import costmodel, digests
from ..device import backend_unavailable, default_backends, device_info, software
from ..graph import Graph, Group, flatten_args, qualified_name
from ..processes import pid_alive
from ..runner.protocol import TrialResult
from ..spaces import DEFAULT_BACKEND
from ..store.base import whoami
from ..xla_autotune import chosen_dir
from .ahead import time_xla_concurrently
from .ledger import CandidateState
from .partition import Candidate, enumerate_candidates
from .report import TuneReport
from .space import CandidateSpace, sampler, usable_backends

log = logging.getLogger("autofuse")


def resolve_measure(measure: str | None, has_gpu: bool, *, flag: str = "measure") -> str:
    """"device" where a GPU is present, else "model"; "device" without a GPU is an error, naming the option as the
    caller spells it (`flag`: ``measure`` for Python's ``measure='device'``, ``--measure`` for the command line)."""
    def spelt(value: str) -> str:
        return f"{flag} {value}" if flag.startswith("-") else f"{flag}={value!r}"

    measure = measure or ("device" if has_gpu else "model")
    if measure not in ("device", "model"):
        raise ValueError(f"{flag} must be 'device' or 'model', got {measure!r}")
    if measure == "device" and not has_gpu:
        raise ValueError(f"{spelt('device')} needs a GPU; none is present ({jax.default_backend()} backend): use {spelt('model')}")
    return measure


def warn_preallocated(progress: Callable[[str], None] | None = None) -> None:
    """Say up front, even when quiet, if this process's GPU client holds a preallocated pool (`autofuse.gpumem`)."""
    from .. import gpumem

    if not gpumem.backends_initialised():
        return  # no GPU client in this process yet: no pool (and none will be preallocated once autofuse was imported)
    state = gpumem.STATE or gpumem.AllocatorState(True, {}, False)
    line = gpumem.preallocation_warning(jax.default_backend(), state)
    if line:
        (progress or (lambda m: print(m, file=sys.stderr, flush=True)))(line)


def modelled_warning(model: costmodel.GPUModel) -> str:
    """Said even when quiet: a modelled plan must never pass for a measured one."""
    return (f"autofuse: no GPU measurement ({jax.default_backend()} backend): ranking with the analytic roofline model of {model.name}; "
            "the times below are estimates, not measurements.")


class Notes:
    """What a job says even when quiet (its plan is modelled, a backend was left out), each line once per job: a job
    over shape buckets runs `tune` once per bucket with one `Notes`. To `sink` (default: stderr; stdout is the report's)."""

    def __init__(self, sink: Callable[[str], None] | None = None):
        self.sink = sink or (lambda text: print(text, file=sys.stderr, flush=True))
        self.said: set[str] = set()

    def __call__(self, text: str) -> None:
        if text and text not in self.said:
            self.said.add(text)
            self.sink(text)


def check_backends(backends: Sequence[str] | None, measure: str) -> tuple[tuple[str, ...], str]:
    """The backends to search (`backends` checked against those any template has, or this machine's default) and a
    note naming those asked for that cannot be tuned here (`device.backend_unavailable`): dropped and said, never
    replaced by another silently. ValueError (one line) when none of them can."""
    from ..kernels import TEMPLATES

    if backends is None:
        return default_backends(), ""
    known = {b for t in TEMPLATES.values() for b in t.backends}
    unknown = [b for b in backends if b not in known]
    if unknown or not backends:
        raise ValueError(f"unknown backend(s) {', '.join(unknown) or '(none given)'}; known: {', '.join(sorted(known))}")
    why = {b: backend_unavailable(b, measure) for b in backends}
    kept = tuple(b for b in backends if why[b] is None)
    dropped = [b for b in backends if why[b] is not None]
    reasons = "; ".join(dict.fromkeys(why[b] for b in dropped))
    if not kept:
        raise ValueError(f"none of the backends asked for ({', '.join(backends)}) can be tuned here: {reasons}")
    return kept, f"autofuse: backend {', '.join(dropped)} left out ({reasons}): tuning {', '.join(kept)}" if dropped else ""


def tunable(by_sig: dict[str, list[Candidate]], cands: list[CandidateState],
            backends: Sequence[str]) -> tuple[dict[str, list[Candidate]], list[CandidateState], str]:
    """The candidates that a backend of `backends` can run (`space.usable_backends`), and a note on those left to XLA:
    a job asked for Mosaic GPU alone never tunes Triton kernels in its stead. ValueError (one line) when none is left
    of a program that has candidates."""
    kept = {sig: cs for sig, cs in by_sig.items() if usable_backends(cs[0].template, cs[0].spec, backends)}
    if len(kept) == len(by_sig):
        return by_sig, cands, ""
    left = Counter(cs[0].template for sig, cs in by_sig.items() if sig not in kept)
    kinds = ", ".join(t if n == 1 else f"{t}×{n}" for t, n in left.items())
    if not kept:
        raise ValueError(f"no candidate of this program has a {' or '.join(backends)} lowering (its {len(by_sig)}: {kinds}): "
                         "nothing to tune; add triton to the backends")
    return kept, [r for r in cands if r.signature in kept], (f"autofuse: {len(by_sig) - len(kept)} of {len(by_sig)} distinct candidates "
                                                             f"({kinds}) have no {' or '.join(backends)} lowering: left to XLA")


def distinct_candidates(graph: Graph) -> tuple[dict[str, list[Candidate]], list[CandidateState]]:
    """Candidates grouped by signature (those that compute the same thing are tuned once), one state each; read back
    from this program's enumeration cache (`enumeration_file`) where an earlier job of this code wrote it."""
    path = enumeration_file(graph.fingerprint)
    cached = load_candidates(graph, path) if path is not None else None
    if cached is not None:
        return cached
    by_sig: dict[str, list[Candidate]] = {}
    for c in enumerate_candidates(graph):
        by_sig.setdefault(c.group.signature, []).append(c)
    if path is not None:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            save_candidates(graph, by_sig, path)
        except OSError as e:  # a read-only cache: the next job enumerates again
            log.debug("autofuse: could not keep the candidates of %s in %s: %s", graph.fingerprint, path, e)
    return by_sig, _states(by_sig)


ENUMERATION_CACHE = "AUTOFUSE_ENUMERATION_CACHE"  # a directory, or "off"


def enumeration_file(fingerprint: str) -> str | None:
    """Where the candidates of program `fingerprint` are kept between jobs: GPT-2 medium's forward takes 4-5 s to
    enumerate on the CPU, each job and worker again. Keyed by the code that enumerates too (`_enumeration_code`), so
    that a changed template or partitioner never reads another version's answer. ``$AUTOFUSE_ENUMERATION_CACHE``
    (``off``: none), else ``~/.cache/autofuse/candidates``."""
    base = chosen_dir(os.environ, ENUMERATION_CACHE, os.path.join(os.path.expanduser("~"), ".cache", "autofuse", "candidates"))
    return None if base is None else os.path.join(base, _enumeration_code(), f"{fingerprint}.json")


def _enumeration_code() -> str:
    """A digest of what decides a program's candidates: the partitioner's, the graph's and the kernels' source, and
    the templates registered now (a plugin's too: its name and its module's source). No search space is part of it,
    bundled or the user's ($AUTOFUSE_SEARCH_SPACES): the cache holds groups and templates only, and each job reads
    the spaces afresh, so an edited space is never served from here."""
    h = hashlib.sha256(digests.sources("graph.py", "ops.py", "tuning/partition.py", "kernels/**/*.py").encode())
    digests.templates_digest(h)
    return h.hexdigest()[:16]


def _states(by_sig: dict[str, list[Candidate]]) -> list[CandidateState]:
    return [CandidateState(sig, cs[0].template, list(cs[0].group.node_ids), len(cs), ops=tuple(n.name for n in cs[0].group.nodes))
            for sig, cs in by_sig.items()]


def save_candidates(graph: Graph, by_sig: dict[str, list[Candidate]], path: str) -> None:
    """Write `distinct_candidates(graph)`'s answer (each computation's instances: template, nodes, stages) as JSON
    to `path`, atomically, for the workers of this host (`load_candidates`)."""
    data = {"fingerprint": graph.fingerprint,
            "candidates": [[sig, cs[0].template, [[sorted(c.group.node_ids), [sorted(st) for st in c.stages]] for c in cs]]
                           for sig, cs in by_sig.items()]}
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def load_candidates(graph: Graph, path: str) -> tuple[dict[str, list[Candidate]], list[CandidateState]] | None:
    """`distinct_candidates` of `graph` as `save_candidates` wrote them (None: no such file, or written for another
    graph). Enumerating takes each process seconds (GPT-2 medium's 158 computations in 3500 groups: 4-5 s on the
    CPU, the critical path of four workers' start on 4 H100s); rebuilding the groups from their nodes, a tenth of
    a second (each template match is made when first asked)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("fingerprint") != graph.fingerprint:
        return None
    by_sig: dict[str, list[Candidate]] = {}
    for sig, template, instances in data["candidates"]:
        cs = [Candidate(Group.of(graph, ids), template, stages=tuple(frozenset(st) for st in stages)) for ids, stages in instances]
        if cs[0].group.signature != sig:
            return None
        by_sig[sig] = cs
    return by_sig, _states(by_sig)


def candidates_file(url: str, run_id: int) -> str:
    """Where a run's launcher leaves its candidates for the workers of its host (`save_candidates`)."""
    digest = hashlib.sha1(url.encode()).hexdigest()[:12]
    return os.path.join(tempfile.gettempdir(), f"autofuse-candidates-{digest}-run{run_id}.json")


def search_spaces(by_sig: dict[str, list[Candidate]], cands: Sequence[CandidateState], model: costmodel.GPUModel,
                  backends: Sequence[str] = (DEFAULT_BACKEND,)) -> dict[str, CandidateSpace]:
    """Each distinct candidate's search space over the `backends` that can run it, its configs modelled on `model`."""
    return {r.signature: CandidateSpace.of(r.template, by_sig[r.signature][0].group, by_sig[r.signature][0].spec, model, backends)
            for r in cands}


def time_xla(cands: Sequence[CandidateState], runner: Any, bar: Any = None, *, compile_workers: int = 1,
             spent: dict | None = None, first_trials: Sequence[Any] = ()) -> list[TrialResult]:
    """XLA's time of each of `cands` (an option of the cover beside their fused configs), set on each; with
    `compile_workers` > 1 compiled that many at a time ahead of the timings, the first trials' kernels with them
    (`ahead`; `spent`: where the time went). Returns each candidate's result."""
    return time_xla_concurrently(list(cands), runner, compile_workers, bar, spent, first_trials)


def program_name(fn: Callable) -> str:
    """A program's default name: ``module:function``, as ``autofuse tune MODULE:FUNCTION`` names it (the function
    alone for a script's own)."""
    ref = qualified_name(fn)
    return ref.partition(":")[2] if ref.startswith(("__main__:", "?:")) else ref


def study_name(run_id: int | None, signature: str) -> str:
    return f"autofuse-run{run_id}-{signature}" if run_id is not None else f"autofuse-{signature}"


def create_study(storage: Any, run_id: int | None, space: CandidateSpace, signature: str, first: Sequence[dict] = ()) -> None:
    """A candidate's study, with each backend's default config enqueued first (once, for a new study). The model's
    best comes next (`space.first_configs`), enqueued by the candidate's first trial (`enqueue_model_best`): finding
    it enumerates the space (a tenth of a second on a large one, seconds for a whole model's candidates), which a
    candidate the budget never reaches need not pay. `first`: configs to try before the defaults (a shape bucket's
    study seeded with the best configs of the same computation at the bucket before: `buckets`)."""
    import optuna

    study = optuna.create_study(direction="minimize", storage=storage, study_name=study_name(run_id, signature), load_if_exists=True)
    if not study.trials:
        queued: list[dict] = []
        for cfg in [*first, *space.defaults()]:
            if cfg not in queued:
                queued.append(cfg)
                study.enqueue_trial(space.optuna_params(cfg))


def enqueue_model_best(study: Any, space: CandidateSpace) -> None:
    """The model's best config queued after the defaults (the third of `space.first_configs`), by the trial that took
    the study's first enqueued trial (number 0: one worker takes it), so each study gets it once, where it got it
    when it was created before; not again if the study already has it (a study created so)."""
    defaults = space.defaults()
    best = space.model_best()
    if best is None or best in defaults:
        return
    params = space.optuna_params(best)
    if any(t.params == params or t.system_attrs.get("fixed_params") == params for t in study.get_trials(deepcopy=False)):
        return
    study.enqueue_trial(params)


def load_study(storage: Any, run_id: int | None, signature: str, seed: int) -> Any:
    """A candidate's study as one driver samples it (TPE, seeded; the constant liar sees other workers' running trials)."""
    import optuna

    return optuna.load_study(study_name=study_name(run_id, signature), storage=storage, sampler=sampler(seed))


@dataclass(frozen=True)
class RunIds:
    """The store's rows a run's plan is filed under."""

    program: int
    device: int
    software: int
    selected: bool = False  # a resumed run whose earlier process had finished its trials and begun selecting the plan


def open_run(store: Any, graph: Graph, name: str, measure: str, trials: int | None, time_budget_s: float | None, seed: int,
             resume: int | None, model: costmodel.GPUModel | None = None, function: str | None = None) -> tuple[Any, int, RunIds]:
    """The plan store (a `PlanStore` or a URL), the run (new, or `resume`d) and the rows its plan is filed under.
    A modelled run records the GPU its `model` describes with its budget (listings show "model of <GPU>")."""
    from ..store import PlanStore

    pstore = store if isinstance(store, PlanStore) else PlanStore(store)
    if pstore.readonly:
        raise ValueError(f"{pstore} is read-only: a tuning job needs a store it can write (pass a URL, not a read-only PlanStore)")
    pstore.mark_interrupted()
    dev = device_info()
    ids = RunIds(pstore.program(graph.fingerprint, name, graph.signature(), len(graph.nodes), function=function, structure=graph.structure),
                 pstore.device(dev["name"], compute_capability=dev["compute_capability"], sm_count=dev["sm_count"], memory_bytes=dev["memory_bytes"]),
                 pstore.software(**software()))
    if measure == "device":  # before anything compiles, a resumed run's too
        restore_autotune(pstore)
    if resume is not None:
        run = pstore.get_run(resume)
        if run.get("program_id") != ids.program:
            raise ValueError(f"run {resume} tuned another program; cannot resume it for {graph.fingerprint}")
        pstore.resume_run(resume, host=socket.gethostname(), pid=os.getpid())
        return pstore, resume, replace(ids, selected=run.get("selected_by") is not None)
    budget = {"trials": trials, "seconds": time_budget_s, **({"model": model.name} if measure == "model" and model is not None else {})}
    run_id = pstore.start_run(ids.program, ids.device, ids.software, budget=budget, seed=seed,
                              sampler="TPESampler", measure=measure, host=socket.gethostname(), pid=os.getpid(), optuna_storage=pstore.url)
    return pstore, run_id, ids


class PhaseMarks:
    """When each phase of a run ended, in its store (`PlanStore.mark_phase`: seconds from the run's start, shown by
    ``autofuse show run``); nothing without a store. Run-level marks: start (the job's own start, before the run
    row), setup, xla, trials, first_plan (the first validated plan stored), selected, saved; `worker` marks go under
    that worker. A mark that cannot be written is logged, never fails the job. `replace`: this mark is rewritten as it
    grows (the selection's parts, recorded after each plan it validates), whoever wrote it before."""

    def __init__(self, pstore: Any, run_id: int | None, *, keep_first: bool = True):
        self.pstore, self.run_id, self.keep_first = pstore, run_id, keep_first

    def __call__(self, name: str, *, at: float | None = None, value: Any = None, worker: str | None = None,
                 replace: bool = False) -> None:
        if self.pstore is None or self.run_id is None:
            return
        try:
            self.pstore.mark_phase(self.run_id, name, worker=worker, at=at, value=value,
                                   keep_first=self.keep_first and worker is None and not replace)
        except Exception as e:  # noqa: BLE001 - a mark is for people reading the run later, never a reason to stop
            log.warning("autofuse: could not record phase %s of run %s: %s: %s", name, self.run_id, type(e).__name__, e)


def register_candidates(pstore: Any, run_id: int, cands: Sequence[CandidateState]) -> None:
    """Each candidate's row in the run (found again when the run is resumed)."""
    known = {c["signature"]: c for c in pstore.candidates(run_id)}
    new = [r for r in cands if r.signature not in known]  # registered in one write: a whole model's 158 at once
    ids = pstore.add_candidates(run_id, [(r.signature, r.template, r.nodes) for r in new]) if new else []
    for r, cid in zip(new, ids, strict=True):
        r.candidate_id = cid
    for r in cands:
        row = known.get(r.signature)
        if row:
            r.candidate_id = row["id"]
        if row and row["xla_ms"] is not None and r.xla_ms is None:
            r.xla_ms = row["xla_ms"]
        if row and row["status"] in ("tuned", "failed", "skipped"):  # finished by the run's earlier process: its best is read back
            r.status, r.best_ms, r.best_config, r.checked_trials = row["status"], row["best_ms"], row["best_config"], row["n_trials"]


class PlanSaver:
    """Stores a job's plan in its run: the first plan that passed validation as soon as it passes (`early`, so a
    long selection phase does not keep a validated plan from deploys), the job's final plan at its end (`final`;
    once, when it is that same plan).

    A plan becomes current only by the store's promotion rule (measured, and faster than the current plan
    beyond noise; never over a pinned plan), or with `promote`; otherwise it is stored beside the current
    plan and one line on stderr says why (also in `report.plan_note`)."""

    def __init__(self, pstore: Any, ids: RunIds, run_id: int, promote: bool | None = None):
        self.pstore, self.ids, self.run_id, self.promote = pstore, ids, run_id, promote
        self.first: TuneReport | None = None

    def early(self, report: TuneReport) -> None:
        """Store the first validated plan now (the run goes on selecting)."""
        self.first = report
        self._add(report)

    def final(self, report: TuneReport) -> int:
        """Finish the run with `report`'s plan (stored now unless `early` stored it, and before the run is marked
        finished: a launcher waiting on workers reads the plan of a finished run at once); returns the plan's id."""
        report.run_id, report.stored_in = self.run_id, stored_in(self.pstore)
        if report is not self.first:
            self._add(report)
        self.pstore.finish_run(self.run_id, "finished", baseline_ms=report.baseline_ms, best_ms=report.tuned_ms, speedup=report.speedup)
        if report.measure == "device":
            store_autotune(self.pstore)
        if not report.plan_current:
            print(report.plan_note, file=sys.stderr, flush=True)
        return report.plan_id

    def _add(self, report: TuneReport) -> None:
        v = report.validation
        saved = self.pstore.add_plan(self.ids.program, self.ids.device, self.ids.software, report.plan.to_dict(), run_id=self.run_id,
                                     measured_ms=report.tuned_ms, baseline_ms=report.baseline_ms, speedup=report.speedup,
                                     measure=report.measure, tolerance=v.tolerance or {}, max_error=float(v.max_error or 0.0),
                                     current=True if self.promote else None, noise=report.noise,
                                     actor=f"tune run {self.run_id} ({whoami()})")
        report.plan_id, report.plan_current = saved.plan_id, saved.current
        report.plan_note = "" if saved.current else (f"autofuse: plan {saved.plan_id} is stored but not current: {saved.reason}; "
                                                     f"autofuse plans promote {saved.plan_id} makes it current")


def stored_in(pstore: Any) -> str:
    """Where a job's run and plan went, as a report shows it: the store's URL, its password masked."""
    from ..store.db import display_url

    return display_url(pstore.url)


def store_autotune(pstore: Any) -> int:
    """Copy the files of XLA's autotune directory (where this job's trial processes wrote the GEMM kernels they measured
    with) into the store for this jaxlib and device, so that a deploy shipping only the database compiles the same ones.
    Returns how many were added; a failure is one warning, never the job's end."""
    from .. import xla_autotune

    path = xla_autotune.trial_dir()
    if path is None:
        return 0
    try:
        return pstore.save_autotune(software()["jaxlib"], device_info()["name"], xla_autotune.read_entries(path))
    except Exception as e:  # noqa: BLE001 - the plan is stored already: a deploy without these entries autotunes anew
        log.warning("autofuse: could not copy XLA's autotune results from %s into the plan store: %s: %s", path,
                    type(e).__name__, e)
        return 0


def restore_autotune(pstore: Any) -> int:
    """Write the store's XLA autotune entries for this jaxlib and device that the trial processes' directory lacks,
    before they compile: their GEMMs then skip XLA's autotuning where an earlier job (on any host sharing the store)
    measured them, as a deployed plan's do (`deploy.stores.restore_autotune`). On 4 H100s, GPT-2 medium's four workers compiled
    their XLA references in 3-5 s with the directory filled by a job before, 6-10 s from an empty one. Returns how
    many were written; a failure is one warning: XLA then autotunes as it would."""
    from .. import xla_autotune

    path = xla_autotune.trial_dir()
    if path is None:
        return 0
    try:
        return len(xla_autotune.write_entries(path, pstore.autotune_entries(software()["jaxlib"], device_info()["name"])))
    except Exception as e:  # noqa: BLE001 - an optimisation of the job's start, never its end
        log.warning("autofuse: could not copy the plan store's XLA autotune results into %s: %s: %s", path, type(e).__name__, e)
        return 0


def spec_of(x: Any) -> Any:
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype) if hasattr(x, "dtype") and hasattr(x, "shape") else x


def save_example_inputs(graph: Graph, fn: Callable, args: tuple, kwargs: dict, static_argnums: Sequence[int],
                        static_argnames: Sequence[str]) -> str | None:
    """The caller's inputs, when they are arrays rather than shapes, pickled for the trial process: the whole
    plan is also checked on them (a model's own weights), not only on random ones. Returns the file's path."""
    leaves = flatten_args(graph, fn, args, kwargs, static_argnums, static_argnames)
    if not leaves or any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
        return None
    remove_orphaned_inputs()
    fd, path = tempfile.mkstemp(prefix=f"{INPUTS_PREFIX}{os.getpid()}-", suffix=".pkl")
    with os.fdopen(fd, "wb") as f:
        pickle.dump([np.asarray(x) for x in leaves], f, protocol=pickle.HIGHEST_PROTOCOL)
    return path


INPUTS_PREFIX = "autofuse-inputs-"  # then the writing process's pid: `remove_orphaned_inputs` tells whose a file is


def remove_orphaned_inputs(folder: str | None = None) -> int:
    """Remove the input pickles (`save_example_inputs`) of this host's tuning processes that are gone: a job killed
    before its `finally` leaves a copy of the caller's arrays (a model's weights) behind. Files of live processes,
    and of names without a pid, stay. Returns how many were removed."""
    removed = 0
    for path in glob.glob(os.path.join(folder or tempfile.gettempdir(), INPUTS_PREFIX + "*.pkl")):
        pid = os.path.basename(path)[len(INPUTS_PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or pid_alive(int(pid)):
            continue
        try:
            os.unlink(path)
            removed += 1
        except OSError:  # removed by another job at the same moment, or not ours to remove
            pass
    return removed


def progress_bar(work: int | Sequence, name: str, disable: bool, what: str, unit: str) -> Any:
    """A bar over `work` (a count, or the items to iterate) headed "<what> <name>"."""
    from tqdm.auto import tqdm

    kw = {"total": work} if isinstance(work, int) else {"iterable": work}
    return tqdm(**kw, desc=f"{what} {name}", unit=unit, disable=disable, leave=True)
