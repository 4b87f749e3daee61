"""What a trace of a new signature runs: its `Resolution` built into a compiled fused program, re-verified against
jax.jit where it was made with other software or tuned at other sizes, and the miss policy where anything is wrong
(plain jax.jit and one warning, `PlanError`, or plain jax.jit and a background tuning job). A plan that is missing,
fails its check, is malformed or no longer compiles never breaks the program."""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax

from ..graph import Graph, flatten_args
from ..plan import PlanError, executor
from ..runner.program_check import ProgramCheck
from .background import NotQueued, TuningJob, queue
from .lookup import resolve
from .settings import Deployment
from .stores import readonly_why, remember, restore_autotune

log = logging.getLogger("autofuse")

Call = tuple[tuple, dict]  # a call's positional and keyword arguments


@dataclass(frozen=True)
class Served:
    """What a traced signature runs: `run` (the fused program, over the graph's input leaves; None: plain `fn`), the
    `status` line it is known by, and the background tuning `job` its miss started (on_miss="tune")."""

    run: Callable[[list], list] | None
    status: str
    job: TuningJob | None = None


def serve(graph: Graph, dep: Deployment, traced: Call | None = None, caller: Call | None = None) -> Served:
    """Resolve and build the plan for `graph`. `traced`: the arguments the trace received (tracers), for a background
    job; `caller`: the call's own arguments, where it has them, for a check against jax.jit at the caller's inputs."""
    res = resolve(graph, dep)
    if res.learned:
        remember(dep, res, graph, None)
    if res.kind == "miss":
        status = _miss(dep, graph, res.why)
        if dep.on_miss != "tune":
            return Served(None, status)
        more, job = _queue_tuning(dep, graph, traced)
        return Served(None, status + more, job)
    if res.kind == "plan-version":
        log.warning("autofuse: %s: program %s: stored plan %s was made with other software (%s); re-verifying it once",
                    dep.name, graph.fingerprint, res.plan_id, res.software)
    if res.plan_id is not None:  # a plan from the store: its GEMMs compiled as its tuning job measured them
        restore_autotune(dep.store)
    checking = res.kind == "plan-shape" and res.remembered is None
    if checking:
        log.warning("autofuse: %s: program %s: no plan for these shapes; plan %s, tuned at %s, fits %s: checking it once "
                    "against jax.jit", dep.name, graph.fingerprint, res.plan_id, res.tuned_at, res.serving)
    if res.kind == "xla-plan":
        return Served(None, res.status())
    specs = [jax.ShapeDtypeStruct(graph.avals[v].shape, graph.avals[v].dtype) for v in graph.inputs]
    try:
        run = executor(graph, res.plan, interpret=dep.interpret)
        compiled = jax.jit(lambda *leaves: run(leaves)).lower(*specs).compile()
    except Exception as e:  # a plan that no longer builds or compiles never breaks the program
        why = f"its plan does not build here ({type(e).__name__}: {str(e)[:300]})"
        if checking:
            why = f"plan {res.plan_id} (tuned at {res.tuned_at}) does not build at {res.serving} ({type(e).__name__}: {str(e)[:300]})"
            remember(dep, res, graph, ("failed", why))
        return Served(None, _miss(dep, graph, why))
    if res.kind == "plan-version":
        ok, detail = _reverify(dep, graph, compiled, caller)
        if not ok:
            return Served(None, _miss(dep, graph, f"stored plan {res.plan_id}, made with other software versions, failed re-verification ({detail})"))
    if checking:
        ok, detail = _reverify(dep, graph, compiled, caller)
        if not ok:
            why = f"plan {res.plan_id} (tuned at {res.tuned_at}) failed its check against jax.jit at {res.serving} ({detail})"
            if not detail.startswith("undecided"):  # an undecided check is made again at the next trace
                remember(dep, res, graph, ("failed", why))
            return Served(None, _miss(dep, graph, why))
        remember(dep, res, graph, ("ok", ""))
        log.warning("autofuse: %s: program %s: plan %s (tuned at %s) passed its check against jax.jit at %s: serving it",
                    dep.name, graph.fingerprint, res.plan_id, res.tuned_at, res.serving)
    return Served(run, res.status())


def _miss(dep: Deployment, graph: Graph, why: str) -> str:
    """The miss policy: `PlanError` (on_miss="error"), else one warning and the ``xla: <why>`` status."""
    msg = f"autofuse: {dep.name}: program {graph.fingerprint}: {why}"
    if dep.on_miss == "error":
        raise PlanError(msg)
    log.warning("%s; running plain jax.jit", msg)
    return f"xla: {why}"


def _queue_tuning(dep: Deployment, graph: Graph, traced: Call | None) -> tuple[str, TuningJob | None]:
    """Start a background job tuning this missed program; what the status adds and the job, or why not (logged
    once). Never waits for the job."""
    url, readonly = readonly_why(dep.store)
    if readonly is not None:
        why = f"the plan store is read-only: {readonly}"
    else:
        try:
            args, kwargs = traced if traced is not None else ((), {})
            job = queue(dep.fn, graph.fingerprint, graph.signature()["inputs"], args, kwargs, dep.static_argnums, dep.static_argnames,
                        url, dep.tune_budget)
        except (NotQueued, OSError) as e:
            why = str(e)
        else:
            log.warning("autofuse: %s: program %s: queued a background tuning job (pid %s, log %s)", dep.name,
                        graph.fingerprint, job.process.pid, job.log)
            return f"; tuning these shapes in the background (pid {job.process.pid})", job
    log.warning("autofuse: %s: program %s: not tuned in the background: %s", dep.name, graph.fingerprint, why)
    return f"; not tuned in the background: {why}", None


def _reverify(dep: Deployment, graph: Graph, fused: Callable, caller: Call | None) -> tuple[bool, str]:
    """Check the fused program against jax.jit, eagerly (this runs while JAX traces), by the rule the tuning job's
    validation holds a whole plan to (`ProgramCheck`): fresh random inputs, and this call's own arguments where
    they are arrays (not tracers of an enclosing transformation). A bf16 training step on N(0, 1) inputs is
    chaotic: jax.jit's own result moves by more than the bound when its inputs move by one rounding step, so a
    right plan can be told from a wrong one only at the caller's inputs. Returns whether it passed and, if not,
    why; a failure on such outputs without the caller's arrays says "undecided" (not to be remembered)."""
    ref = jax.jit(lambda *a: graph.evaluate(a))
    leaves = _caller_leaves(dep, graph, caller)
    with jax.ensure_compile_time_eval():
        verdict = ProgramCheck(graph, ref, (11, 12), leaves).judge(fused)
    if verdict.ok:
        return True, ""
    if verdict.chaotic() and leaves is None:
        return False, (f"undecided: on random inputs jax.jit's own result moves by up to {max(verdict.sensitivity):.2g} when they move "
                       "by one rounding step, and this call's arguments were tracers (call it with arrays to check it there)")
    return False, verdict.reason[:300]


def _caller_leaves(dep: Deployment, graph: Graph, caller: Call | None) -> list[Any] | None:
    """The arguments of the call now tracing, as `graph`'s input leaves, where they are concrete arrays; None when
    traced otherwise (under `jax.grad`, an enclosing `jax.jit`, `lower`)."""
    if caller is None:
        return None
    try:
        leaves = flatten_args(graph, dep.fn, caller[0], caller[1], dep.static_argnums, dep.static_argnames)
    except ValueError:
        return None
    return None if any(isinstance(x, jax.core.Tracer) for x in leaves) else leaves
