"""The tuning job: Optuna studies over tile configs, an exact choice of groups, validation.

One job (`tune`):
1. capture the program; enumerate candidate groups; candidates that compute
   the same thing (same group signature) are tuned once and share the result;
2. time each distinct candidate in XLA (its own kernels are always an option);
3. run one Optuna study per distinct candidate (TPE, seeded, the template's
   default config enqueued first); a config that breaks a search-space
   constraint is reported infeasible and never compiled; on the GPU, one the
   roofline model puts at over 3x the default's time is pruned untimed (the
   model orders the search, measurements decide it); a failed build,
   wrong result, crash or timeout is a failed trial, never a result;
4. choose the cheapest exact cover of the graph from the measured costs
   (HiGHS MILP, `partition.select_cover`);
5. validate the whole plan against `jax.jit` in the same worker process and
   keep it only if it is faster beyond the measured noise; otherwise the plan
   is "XLA" (recorded as such).

Budget rule: phase 1 gives every distinct candidate its template's default
config, the largest groups first. Phase 2 shares the remaining trials, in
rounds, among the contenders (the fused groups of the cheapest cover found so
far; while that cover has none, the candidates within 25% of their XLA time) in proportion to their XLA time, by largest
remainder, never more than a candidate's number of configs. A time budget
that runs out therefore leaves undone what can matter least.
"""
from __future__ import annotations

import logging
import math
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
import numpy as np

from . import costmodel
from .device import device_info, software
from .graph import Graph, capture
from .kernels import TEMPLATES
from .partition import Candidate, Option, enumerate_candidates, select_cover
from .plan import Plan, plan_from_choices
from .worker import ProgramSpec, TrialRunner

log = logging.getLogger("autofuse")
INFEASIBLE_VALUE = 1e9
UNMEASURED = ("infeasible", "pruned")  # statuses decided before anything is compiled
PRUNE_FACTOR = 3.0  # on the GPU, configs modelled this much slower than the default are not timed


# ---------------------------------------------------------------------------
def model_cost_ms(cand: Candidate, model: costmodel.GPUModel = costmodel.H200, config: dict | None = None) -> float:
    cfg = config or TEMPLATES[cand.template].default_config(cand.spec)
    return costmodel.template_time_ms(cand.template, cand.spec, cfg, model)


def default_plan(graph: Graph, model: costmodel.GPUModel = costmodel.H200) -> Plan:
    """A plan from default configs and modelled costs (no measurement)."""
    cands = enumerate_candidates(graph)
    options = [Option(c.nodes, model_cost_ms(c, model), c) for c in cands]
    chosen = select_cover(graph, options, _single_node_costs(graph, model))
    choices = [(o.label.group, o.label.template, TEMPLATES[o.label.template].default_config(o.label.spec)) for o in chosen]
    return plan_from_choices(graph, choices, {"measure": "default", "model": model.name})


def _single_node_costs(graph: Graph, model: costmodel.GPUModel) -> dict[int, float]:
    """Cost of a node left alone in XLA: unfused for fusible nodes; opaque nodes always run in XLA (cost 0)."""
    from .partition import is_fusible

    return {n.id: costmodel.node_time_ms(graph, n.id, model) if is_fusible(graph, n.id) else 0.0 for n in graph.nodes}


# ---------------------------------------------------------------------------
@dataclass
class CandidateResult:
    signature: str
    template: str
    nodes: list[int]
    instances: int
    xla_ms: float | None = None
    best_ms: float | None = None
    best_config: dict | None = None
    status: str = "pending"
    trials: list[dict] = field(default_factory=list)
    candidate_ids: list[int] = field(default_factory=list)

    @property
    def speedup(self) -> float | None:
        return self.xla_ms / self.best_ms if self.xla_ms and self.best_ms else None


@dataclass
class TuneReport:
    """What a tuning job found. Times are measured on the device, or modelled (`measure == "model"`)."""

    name: str
    fingerprint: str
    measure: str
    plan: Plan
    baseline_ms: float | None
    tuned_ms: float | None
    speedup: float | None
    noise: float | None
    candidates: list[CandidateResult]
    validation: dict
    wall_s: float
    trials_run: int
    run_id: int | None = None
    plan_id: int | None = None
    device: str = ""

    def table(self) -> str:
        kind = "measured" if self.measure == "device" else "MODELLED (analytic roofline, no GPU)"
        lines = [
            f"autofuse tune {self.name}  program {self.fingerprint}  ({kind}, device {self.device})",
            f"{'candidate':22} {'template':12} {'nodes':>5} {'x':>3} {'trials':>6} {'xla ms':>10} {'best ms':>10} {'speedup':>8}  config",
        ]
        for c in self.candidates:
            ok = sum(t["status"] == "ok" for t in c.trials)
            cfg = ",".join(f"{k}={v}" for k, v in sorted((c.best_config or {}).items()))
            lines.append(
                f"{c.signature[:22]:22} {c.template:12} {len(c.nodes):5d} {c.instances:3d} {ok:3d}/{len(c.trials):<2d} "
                f"{_f(c.xla_ms):>10} {_f(c.best_ms):>10} {_x(c.speedup):>8}  {cfg}"
            )
        chosen = "XLA (no fused group beats it)" if self.plan.is_xla else f"{len(self.plan.groups)} fused group(s): " + ", ".join(
            f"{g.template}{list(g.nodes)}" for g in self.plan.groups)
        lines += [
            f"plan: {chosen}",
            f"jax.jit {_f(self.baseline_ms)} ms  autofuse {_f(self.tuned_ms)} ms  speedup {_x(self.speedup)}"
            + (f"  (noise ±{self.noise:.1%})" if self.noise is not None else "")
            + f"  max rel error {self.validation.get('max_error', float('nan')):.2e}",
            f"{self.trials_run} trials in {self.wall_s:.1f} s" + (f"; run {self.run_id}, plan {self.plan_id}" if self.run_id else ""),
        ]
        return "\n".join(lines)


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.4f}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


# ---------------------------------------------------------------------------
def allocate(weights: Sequence[float], caps: Sequence[int], total: int) -> list[int]:
    """Share `total` trials: one each first, the rest in proportion to `weights`, capped (largest remainder)."""
    n = len(weights)
    alloc = [0] * n
    order = sorted(range(n), key=lambda i: -weights[i])
    for i in order[: min(total, n)]:
        alloc[i] = 1
    left = total - sum(alloc)
    while left > 0:
        open_ = [i for i in range(n) if alloc[i] < caps[i] and alloc[i] > 0]
        if not open_:
            break
        w = sum(weights[i] for i in open_) or len(open_)
        share = {i: left * (weights[i] or 1.0) / w for i in open_}
        give = {i: min(int(share[i]), caps[i] - alloc[i]) for i in open_}
        if sum(give.values()) == 0:
            for i in sorted(open_, key=lambda i: (-(share[i] - int(share[i])), i))[:left]:
                give[i] = 1
        for i, k in give.items():
            alloc[i] += k
        left = total - sum(alloc)
    return alloc


def _spec_of(x: Any) -> Any:
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype) if hasattr(x, "dtype") and hasattr(x, "shape") else x


def tune(fn: Callable, *args: Any, trials: int | None = None, time_budget_s: float | None = None, seed: int = 0,
         store: Any = None, name: str | None = None, measure: str | None = None, model: str = "h200",
         quiet: bool = False, isolate: bool = True, trial_timeout_s: float = 300.0,
         static_argnums: Sequence[int] = (), static_argnames: Sequence[str] = (), resume: int | None = None,
         progress: Callable[[str], None] | None = None, **kwargs: Any) -> TuneReport:
    """Tune `fn` for `args`: search tile configs and groups, validate, and (with `store`) persist.

    `trials` and/or `time_budget_s` bound the job (default: 48 trials).
    `measure="device"` times on the GPU (the default where one is present);
    `measure="model"` ranks with the analytic model (the default elsewhere).
    `store` is a `PlanStore` or a database URL; with it, the run, every trial
    and the plan are written, and `resume=RUN` continues an interrupted run.
    """
    t_start = time.time()
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # the trial worker shares the GPU
    say = progress or (lambda s: None if quiet else print(s, flush=True))
    has_gpu = jax.default_backend() == "gpu"
    measure = measure or ("device" if has_gpu else "model")
    if measure == "device" and not has_gpu:
        raise RuntimeError("measure='device' needs a GPU; none is present (use measure='model')")
    if measure == "model":  # said even with quiet=True: a modelled plan must never pass for a measured one
        (progress or (lambda m: print(m, file=sys.stderr, flush=True)))(f"autofuse: no GPU measurement ({jax.default_backend()} backend): ranking with the analytic roofline model of "
            f"{costmodel.get_model(model).name}; the times below are estimates, not measurements.")
    if trials is None and time_budget_s is None:
        trials = 48
    budget_trials = trials if trials is not None else 10**9
    static_argnums = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
    static_argnames = (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames)
    graph = capture(fn, *args, static_argnums=static_argnums, static_argnames=static_argnames, **kwargs)
    name = name or getattr(fn, "__qualname__", getattr(fn, "__name__", "program"))
    gmodel = costmodel.get_model(model)

    # distinct candidates ------------------------------------------------------
    by_sig: dict[str, list[Candidate]] = {}
    for c in enumerate_candidates(graph):
        by_sig.setdefault(c.group.signature, []).append(c)
    results = [CandidateResult(sig, cs[0].template, list(cs[0].group.node_ids), len(cs)) for sig, cs in by_sig.items()]

    # store --------------------------------------------------------------------
    pstore, run_id, ids = _open_store(store, graph, name, measure, trials, time_budget_s, seed, resume)
    optuna_storage = _optuna_storage(pstore)
    spec = ProgramSpec(fn, jax.tree_util.tree_map(_spec_of, args), jax.tree_util.tree_map(_spec_of, kwargs), static_argnums, static_argnames, graph.fingerprint)
    runner = TrialRunner(spec, {"measure": measure, "model": model}, isolate=isolate, timeout_s=trial_timeout_s)
    n_trials = 0
    status = "failed"
    try:
        if isolate and not runner.isolate:
            say("autofuse: the function cannot be pickled by reference, so trials run in this process (no crash isolation)")
        # XLA times, largest first ------------------------------------------------
        for r in results:
            resp = runner.call({"op": "xla", "nodes": r.nodes})
            r.xla_ms = resp.get("median_ms") if resp.get("status") == "ok" else None
        spaces = {}
        for r in results:
            c0 = by_sig[r.signature][0]
            spaces[r.signature] = {**TEMPLATES[r.template].space(c0.group, c0.spec),
                                   "model_ms": lambda cfg, c0=c0: model_cost_ms(c0, gmodel, cfg)}
        caps = [math.prod(len(v) for v in spaces[r.signature]["params"].values()) for r in results]
        total = min(budget_trials, sum(caps))
        bar = _progress_bar(total, name, quiet or progress is not None)
        ctx = _Ctx(runner, measure, optuna_storage or _in_memory_storage(), run_id, pstore, bar,
                   t_start + time_budget_s if time_budget_s else None)
        target = [0] * len(results)

        def spent() -> int:  # measured trials so far, a resumed run's earlier ones included
            return sum(t["status"] not in UNMEASURED for r in results for t in r.trials)

        def out_of_budget() -> bool:
            return spent() >= total or (ctx.deadline is not None and time.time() > ctx.deadline)

        # phase 1: every candidate's default config, the largest groups first
        for i in sorted(range(len(results)), key=lambda i: (-len(results[i].nodes), -(results[i].xla_ms or 0.0))):
            if out_of_budget():
                break
            r = results[i]
            if pstore is not None:
                r.candidate_ids = [pstore.add_candidate(run_id, r.signature, r.template, r.nodes)]
            target[i] = 1
            n_trials += _study(r, spaces[r.signature], target[i], ctx, seed + i)
            _update_best(r)
        # phase 2: the rest of the budget to the candidates that can change the plan
        while not out_of_budget():
            cont = [i for i in _contenders(graph, by_sig, results, gmodel) if target[i] < caps[i]]
            if not cont:
                break
            left = total - spent()
            extra = allocate([results[i].xla_ms or 0.0 for i in cont], [caps[i] - target[i] for i in cont], max(len(cont), left // 2))
            got_any = 0
            for i, k in zip(cont, extra):
                if k and not out_of_budget():
                    target[i] += k
                    got = _study(results[i], spaces[results[i].signature], target[i], ctx, seed + i)
                    n_trials += got
                    got_any += got
                    _update_best(results[i])
            if not got_any:
                break
        bar.close()
        for r in results:
            _finish_candidate(r, runner, measure, pstore)
            if r.trials:
                say(f"  candidate {r.signature[:12]} {r.template:11} nodes={len(r.nodes):3d} x{r.instances}: "
                    f"xla {_f(r.xla_ms)} ms, best {_f(r.best_ms)} ms ({_x(r.speedup)}) after {len(r.trials)} trials [{r.status}]")

        # selection and validation -------------------------------------------------
        plan, est = _select(graph, by_sig, results, gmodel, measure)
        report = _validate(graph, plan, est, runner, measure, name, results, n_trials, t_start)
        status = "finished"
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    except BaseException as e:
        if pstore is not None and run_id is not None:
            pstore.finish_run(run_id, "failed", error=f"{type(e).__name__}: {e}")
            run_id = None
        raise
    finally:
        runner.close()
        if status == "interrupted" and pstore is not None and run_id is not None:
            pstore.finish_run(run_id, "interrupted")
    report.device = device_info()["name"]
    if pstore is not None:
        report.run_id = run_id
        report.plan_id = _save(pstore, ids, run_id, report)
    return report


def _progress_bar(total: int, name: str, disable: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=f"tune {name}", unit="trial", disable=disable, leave=True)


@dataclass
class _Ctx:
    runner: TrialRunner
    measure: str
    storage: Any
    run_id: int | None
    pstore: Any
    bar: Any
    deadline: float | None


def _in_memory_storage() -> Any:
    import optuna

    return optuna.storages.InMemoryStorage()


def _study(r: CandidateResult, space: dict, n: int, ctx: _Ctx, seed: int) -> int:
    """Bring one candidate's Optuna study to `n` measured configs; returns the trials run now.

    The study lives in the job's storage, so a later call (or a resumed run) continues it.
    """
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    dist = {k: optuna.distributions.CategoricalDistribution(v) for k, v in space["params"].items()}
    sampler = optuna.samplers.TPESampler(seed=seed + len(r.trials), n_startup_trials=4)
    study_name = f"autofuse-run{ctx.run_id}-{r.signature}" if ctx.run_id is not None else f"autofuse-{r.signature}"
    study = optuna.create_study(direction="minimize", sampler=sampler, storage=ctx.storage, study_name=study_name, load_if_exists=True)
    tried: dict[tuple, dict] = {}
    r.trials = []
    for t in study.trials:  # what this study already did (earlier phase, or the run being resumed)
        if "result" in t.user_attrs:
            tried[tuple(sorted(t.params.items()))] = t.user_attrs["result"]
            r.trials.append(t.user_attrs["result"])
    if not study.trials:
        study.enqueue_trial(space["default"])
    done_now, asks = 0, 0
    measured = lambda: sum(v["status"] not in UNMEASURED for v in tried.values())  # noqa: E731
    while measured() < n and asks < 6 * n + 16:
        if ctx.deadline and time.time() > ctx.deadline:
            break
        asks += 1
        t = study.ask(dist)
        cfg = dict(t.params)
        key = tuple(sorted(cfg.items()))
        if key in tried:  # TPE proposed a config already measured: tell it the known answer, spend nothing
            prev = tried[key]
            t.set_constraint("violations", 1.0 if prev["status"] == "infeasible" else 0.0)
            if prev["status"] == "ok":
                study.tell(t, prev["median_ms"])
            elif prev["status"] in UNMEASURED:
                study.tell(t, INFEASIBLE_VALUE)
            else:
                study.tell(t, state=optuna.trial.TrialState.FAIL)
            continue
        violated = space["space"].violated(cfg, space["facts"])
        pruned = not violated and ctx.measure == "device" and _model_pruned(space, cfg)
        if violated or pruned:  # never compiled, never timed, not counted against the budget
            why = "; ".join(violated) if violated else (
                f"modelled {space['model_ms'](cfg):.4f} ms > {PRUNE_FACTOR}x the default's {space['model_ms'](space['default']):.4f} ms")
            res = {"config": cfg, "status": "infeasible" if violated else "pruned", "error": why, "number": len(r.trials)}
            t.set_constraint("violations", float(len(violated)))
            res["optuna_trial_id"] = t.number
            t.set_user_attr("result", res)
            study.tell(t, INFEASIBLE_VALUE)
        else:
            resp = ctx.runner.call({"op": "trial", "nodes": r.nodes, "template": r.template, "config": cfg})
            res = {"config": cfg, "number": len(r.trials), **{k: resp.get(k) for k in ("status", "median_ms", "min_ms", "max_ms", "error", "max_error")}}
            res["optuna_trial_id"] = t.number
            t.set_constraint("violations", 0.0)
            t.set_user_attr("result", res)
            if resp.get("status") == "ok":
                study.tell(t, float(resp["median_ms"]))
            else:
                study.tell(t, state=optuna.trial.TrialState.FAIL)
            done_now += 1
            ctx.bar.update(1)
        tried[key] = res
        r.trials.append(res)
        if ctx.pstore is not None and r.candidate_ids:
            ctx.pstore.add_trial(r.candidate_ids[0], res["number"], cfg, res["status"], median_ms=res.get("median_ms"), min_ms=res.get("min_ms"),
                                 max_ms=res.get("max_ms"), error=res.get("error"), optuna_trial_id=t.number)
        best = [x for x in r.trials if x["status"] == "ok"]
        if best and r.xla_ms:
            ctx.bar.set_postfix_str(f"{r.signature[:8]} best {r.xla_ms / min(x['median_ms'] for x in best):.2f}x")
    return done_now


def _model_pruned(space: dict, cfg: dict) -> bool:
    """On the GPU, the roofline model prunes configs far worse than the default before anything is timed."""
    return space["model_ms"](cfg) > PRUNE_FACTOR * space["model_ms"](space["default"])


def _update_best(r: CandidateResult) -> None:
    ok = [t for t in r.trials if t["status"] == "ok"]
    if ok:
        b = min(ok, key=lambda t: t["median_ms"])
        r.best_ms, r.best_config = b["median_ms"], b["config"]


def _contenders(graph: Graph, by_sig: dict, results: list[CandidateResult], model: costmodel.GPUModel) -> list[int]:
    """Candidates that can change the plan: the fused groups of the cheapest cover so far; when it has none,
    those within 25% of their XLA time."""
    plan, _ = _select(graph, by_sig, results, model, "device")
    chosen = {fg.signature for fg in plan.groups}
    if chosen:
        return [i for i, r in enumerate(results) if r.signature in chosen]
    return [i for i, r in enumerate(results) if r.best_ms is not None and r.xla_ms and r.best_ms < 1.25 * r.xla_ms]


def _finish_candidate(r: CandidateResult, runner: TrialRunner, measure: str, pstore: Any) -> None:
    """Pick the candidate's best config; in model mode, check it for correctness first (interpret mode)."""
    ok = sorted((t for t in r.trials if t["status"] == "ok"), key=lambda t: t["median_ms"])
    if measure == "model":
        for t in ok[:3]:
            resp = runner.call({"op": "trial", "nodes": r.nodes, "template": r.template, "config": t["config"], "check": True})
            if resp.get("status") == "ok":
                break
            t["status"], t["error"] = resp.get("status", "error"), resp.get("error")
            if pstore is not None and r.candidate_ids:
                pstore.add_trial(r.candidate_ids[0], t["number"], t["config"], t["status"], median_ms=t.get("median_ms"), error=t["error"],
                                 optuna_trial_id=t.get("optuna_trial_id"))
        ok = [t for t in ok if t["status"] == "ok"]
    if ok:
        r.best_ms, r.best_config, r.status = ok[0]["median_ms"], ok[0]["config"], "tuned"
    else:
        r.status = "failed" if r.trials else "skipped"
    if pstore is not None and r.candidate_ids:
        pstore.update_candidate(r.candidate_ids[0], best_config=r.best_config, best_ms=r.best_ms, xla_ms=r.xla_ms, status=r.status, n_trials=len(r.trials))


def _select(graph: Graph, by_sig: dict, results: list[CandidateResult], model: costmodel.GPUModel, measure: str) -> tuple[Plan, dict]:
    """Exact cheapest cover over fused (best config) and XLA options of every candidate instance."""
    options, xla_only = [], []
    for r in results:
        for c in by_sig[r.signature]:
            if r.xla_ms is not None:
                o = Option(c.nodes, r.xla_ms, ("xla", c))
                options.append(o)
                xla_only.append(o)
            if r.best_ms is not None:
                options.append(Option(c.nodes, r.best_ms, ("fused", c, r.best_config)))
    singles = _single_node_costs(graph, model)
    chosen = select_cover(graph, options, singles)
    est_tuned = sum(o.cost for o in chosen) + sum(singles[n.id] for n in graph.nodes if not any(n.id in o.nodes for o in chosen))
    base = select_cover(graph, xla_only, singles) if xla_only else []
    est_base = sum(o.cost for o in base) + sum(singles[n.id] for n in graph.nodes if not any(n.id in o.nodes for o in base))
    fused = [(o.label[1].group, o.label[1].template, o.label[2]) for o in chosen if o.label[0] == "fused"]
    plan = plan_from_choices(graph, fused, {"measure": measure, "model": model.name if measure == "model" else None})
    return plan, {"baseline_ms": est_base, "tuned_ms": est_tuned}


def _validate(graph: Graph, plan: Plan, est: dict, runner: TrialRunner, measure: str, name: str, results: list, n_trials: int, t_start: float) -> TuneReport:
    xla_plan = Plan(graph.fingerprint, (), plan.backend, {**plan.provenance, "reason": ""})
    validation: dict = {"status": "ok", "max_error": 0.0}
    base, tuned, noise = est["baseline_ms"], est["tuned_ms"], None
    if not plan.is_xla:
        validation = runner.call({"op": "validate", "plan": plan.to_json()})
        if validation.get("status") != "ok":
            log.warning("autofuse: the chosen plan failed end-to-end validation (%s); keeping XLA", validation.get("error"))
            xla_plan.provenance["reason"] = f"validation failed: {validation.get('status')}: {validation.get('error')}"
            plan, tuned = xla_plan, base
        elif measure == "device":
            b, p = validation["baseline"], validation["plan"]
            base, tuned = b["median_ms"], p["median_ms"]
            noise = max((b["q3_ms"] - b["q1_ms"]) / b["median_ms"], (p["q3_ms"] - p["q1_ms"]) / p["median_ms"], 0.005)
            if not (p["q3_ms"] < b["q1_ms"] and tuned < base * (1 - noise)):
                xla_plan.provenance["reason"] = f"plan {tuned:.4f} ms is not faster than jax.jit {base:.4f} ms beyond noise ±{noise:.1%}"
                plan = xla_plan
                tuned = base
        elif tuned >= base:
            xla_plan.provenance["reason"] = "modelled plan is not faster than XLA"
            plan, tuned = xla_plan, base
    else:
        xla_plan.provenance["reason"] = "no fused group is cheaper than XLA"
        plan = xla_plan
        if measure == "device":
            validation = runner.call({"op": "validate", "plan": plan.to_json()})
            if validation.get("status") == "ok":
                base = tuned = validation["baseline"]["median_ms"]
    plan.provenance.update({"baseline_ms": base, "tuned_ms": tuned})
    speedup = base / tuned if base and tuned else None
    return TuneReport(name, graph.fingerprint, measure, plan, base, tuned, speedup, noise, results, validation, time.time() - t_start, n_trials)


# ---------------------------------------------------------------------------
def _open_store(store: Any, graph: Graph, name: str, measure: str, trials: int | None, time_budget_s: float | None, seed: int, resume: int | None):
    if store is None:
        return None, None, None
    from .store import PlanStore

    pstore = store if isinstance(store, PlanStore) else PlanStore(store)
    pstore.mark_interrupted()
    dev = device_info()
    ids = {
        "program": pstore.program(graph.fingerprint, name, graph.signature(), len(graph.nodes)),
        "device": pstore.device(dev["name"], compute_capability=dev["compute_capability"], sm_count=dev["sm_count"], memory_bytes=dev["memory_bytes"]),
        "software": pstore.software(**software("triton")),
    }
    if resume is not None:
        run = pstore.get_run(resume)
        if run.get("program_id") != ids["program"]:
            raise ValueError(f"run {resume} tuned another program; cannot resume it for {graph.fingerprint}")
        pstore.resume_run(resume, host=socket.gethostname(), pid=os.getpid())
        return pstore, resume, ids
    run_id = pstore.start_run(ids["program"], ids["device"], ids["software"], budget={"trials": trials, "seconds": time_budget_s}, seed=seed,
                              sampler="TPESampler", measure=measure, host=socket.gethostname(), pid=os.getpid(), optuna_storage=pstore.url)
    return pstore, run_id, ids


def _optuna_storage(pstore: Any) -> Any:
    if pstore is None:
        return None
    import optuna

    return optuna.storages.RDBStorage(pstore.url, engine_kwargs={"connect_args": {"timeout": 60}} if pstore.url.startswith("sqlite") else {})


def _save(pstore: Any, ids: dict, run_id: int, report: TuneReport) -> int:
    tol = report.validation.get("tolerance") or {}
    pstore.finish_run(run_id, "finished", baseline_ms=report.baseline_ms, best_ms=report.tuned_ms, speedup=report.speedup)
    return pstore.save_plan(ids["program"], ids["device"], ids["software"], report.plan.to_dict(), run_id=run_id,
                            measured_ms=report.tuned_ms, baseline_ms=report.baseline_ms, speedup=report.speedup, measure=report.measure,
                            tolerance=tol, max_error=float(report.validation.get("max_error") or 0.0))
