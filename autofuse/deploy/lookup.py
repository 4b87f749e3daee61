"""Which plan a program runs: the given one, the store's current one for this device and software (graded by
version), or one of the same structure tuned at other sizes (`autofuse.shapes`); else why none. Reads only: never
logs, raises or writes, so that `explain` can ask the same question a trace does."""
from __future__ import annotations

from typing import Any

import jax

from ..device import device_info, software
from ..graph import Graph, capture
from ..plan import Plan, PlanError
from ..shapes import adapt, nearest_first, specs_of
from ..signatures import shape_change
from .resolution import Resolution
from .settings import Deployment
from .stores import open_store, remembered


def resolve(graph: Graph, dep: Deployment) -> Resolution:
    """The plan for this program (given, or the store's current one for this device and software), or why
    there is none."""
    if dep.plan is not None:
        if dep.plan.fingerprint != graph.fingerprint:
            return Resolution("miss", why=f"the given plan is for program {dep.plan.fingerprint}, not this one "
                                          f"(inputs {', '.join(graph.signature()['inputs'])})")
        return Resolution("xla-plan" if dep.plan.is_xla else "plan", dep.plan)
    store, why = open_store(dep.store)
    if store is None:
        return Resolution("miss", why=why)
    device, sw = device_info()["name"], software()
    try:
        hit = store.lookup(graph.fingerprint, device, sw)
    except Exception as e:
        return Resolution("miss", why=f"the plan store cannot be read ({type(e).__name__}: {e})")
    if hit is None:
        served, refusals, learned = _other_shapes(dep, store, graph, device, sw) if dep.on_other_shape == "check" else (None, [], ())
        if served is not None:
            return served
        why = _why_missing(dep, store, graph, device, sw)
        if refusals:
            more = f"; and {len(refusals) - 2} other plan(s) of the same structure" if len(refusals) > 2 else ""
            why = f"{why}; {'; '.join(refusals[:2])}{more}"
        return Resolution("miss", why=why, learned=learned)
    try:
        plan = Plan.from_dict(hit.plan_json)
    except PlanError as e:
        return Resolution("miss", why=f"stored plan {hit.plan_id} is invalid: {e}")
    if hit.match != "exact" and dep.on_version_mismatch == "refuse":
        return Resolution("miss", why=f"stored plan {hit.plan_id} was made with other software ({_versions(hit.software)}; "
                                      f"here {_versions(sw)}) and on_version_mismatch='refuse'")
    kind = "xla-plan" if plan.is_xla else "plan" if hit.match == "exact" else "plan-version"
    return Resolution(kind, plan, hit.plan_id, hit.run_id, dict(hit.software))


def _other_shapes(dep: Deployment, store: Any, graph: Graph, device: str, sw: dict) -> tuple[Resolution | None, list[str], tuple]:
    """A plan of the same structure tuned at other sizes that serves this program (the nearest shapes first, exact
    versions first), as a ``plan-shape`` resolution; else None. Also why each one found refuses (a config that
    no longer fits, the template no longer matching, a failed check remembered) and the structures computed
    for stored programs that had none."""
    serving = graph.signature()["inputs"]
    try:
        found = [(sib, ()) for sib in store.same_structure(graph.structure, device, sw, exclude=graph.fingerprint)]
        found += _unstructured(dep, store, graph, device, sw)
    except Exception as e:  # noqa: BLE001 -- a store that cannot answer is a miss, said why
        return None, [f"plans of the same structure cannot be read ({type(e).__name__}: {str(e)[:200]})"], ()
    learned = tuple(x for _, x in found if x)
    found = nearest_first(found, serving, inputs=lambda f: f[0].inputs, exact=lambda f: f[0].plan.match == "exact")
    refusals = []
    for sib, _ in found:
        tuned, serves = shape_change(sib.inputs, serving)
        head = f"plan {sib.plan.plan_id} (tuned at {tuned})"
        try:
            plan = Plan.from_dict(sib.plan.plan_json)
        except PlanError as e:
            refusals.append(f"{head} is invalid: {e}")
            continue
        if plan.is_xla:
            continue  # nothing was fused at its shape: it says nothing of this one
        if sib.plan.match != "exact" and dep.on_version_mismatch == "refuse":
            refusals.append(f"{head} was made with other software and on_version_mismatch='refuse'")
            continue
        try:
            adapted = adapt(plan, graph)
        except PlanError as e:
            refusals.append(f"{head} does not serve {serves}: {e}")
            continue
        verdict = remembered(store, sib.plan.plan_id, graph.fingerprint, sw, dep.store)
        if verdict is not None and verdict.verdict != "ok":
            refusals.append(verdict.detail or f"{head} failed its check against jax.jit at {serves}")
            continue
        return (Resolution("plan-shape", adapted, sib.plan.plan_id, sib.plan.run_id, dict(sib.plan.software), tuned_at=tuned,
                           serving=serves, remembered=verdict, learned=learned), refusals, learned)
    return None, refusals, learned


def _unstructured(dep: Deployment, store: Any, graph: Graph, device: str, sw: dict) -> list[tuple[Any, tuple[str, str]]]:
    """Stored programs of this function whose structure was not recorded (tuned before it was): traced again at
    their stored input shapes (nothing is compiled); those of this program's structure with a current plan
    here, each with its (fingerprint, structure) to record. Not for functions with static arguments."""
    if dep.static_argnums or dep.static_argnames:
        return []
    from ..store.results import SameStructure  # SQLAlchemy: only once a store is in use

    out = []
    for row in store.unstructured_programs(dep.name):
        inputs = list((row["signature"] or {}).get("inputs") or [])
        specs = specs_of(inputs)
        if row["fingerprint"] == graph.fingerprint or specs is None or len(specs) != len(graph.inputs):
            continue
        try:
            d_args, d_kwargs = jax.tree_util.tree_unflatten(graph.in_tree, specs)
            other = capture(dep.fn, *d_args, **d_kwargs)
        except Exception:  # noqa: BLE001, S112 -- the function no longer traces at those shapes: not a sibling
            continue
        if other.fingerprint != row["fingerprint"] or other.structure != graph.structure:
            continue
        hit = store.lookup(row["fingerprint"], device, sw)
        if hit is not None:
            out.append((SameStructure(hit, row["fingerprint"], tuple(inputs)), (row["fingerprint"], other.structure)))
    return out


def _why_missing(dep: Deployment, store: Any, graph: Graph, device: str, sw: dict) -> str:
    """The store's account of a miss (never tuned; other shapes, dtypes or static values; another device)."""
    try:
        return store.explain_miss(graph.fingerprint, device, sw, function=dep.name, signature=graph.signature()).text
    except Exception:  # noqa: BLE001 -- an explanation must never break the program
        return f"no stored plan for this program on {device}"


def _versions(sw: dict) -> str:
    return ", ".join(f"{k} {sw[k]}" for k in ("jax", "jaxlib", "autofuse") if k in sw)
