"""Shape-generic plans: whether a plan tuned at some sizes serves a program of the same structure at others.

Programs that differ only in their sizes (a batch, a sequence length) share `Graph.structure`, and their nodes
correspond one to one by id. A plan of one serves another when every fused group still matches its template at
the new sizes and every config still satisfies its search space's constraints (and the backend's own rules) there;
`adapt` checks that without compiling anything and returns the plan re-keyed to the new program, or raises
`PlanError` saying which group and which constraint refuse it. The caller (`autofuse.api`) then checks the adapted
plan once against `jax.jit` at that shape and remembers the verdict in the store. Deploy side: imports no tuner.
"""
from __future__ import annotations

import ast
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import jax
import numpy as np

from .graph import Graph, Group
from .kernels import TEMPLATES
from .plan import Plan, PlanError
from .signatures import parse_aval
from .spaces import _eval


def specs_of(inputs: Sequence[str]) -> list[jax.ShapeDtypeStruct] | None:
    """The `ShapeDtypeStruct`s of a stored signature's inputs; None if one does not parse."""
    out = []
    for text in inputs:
        parsed = parse_aval(text)
        if parsed is None:
            return None
        try:
            out.append(jax.ShapeDtypeStruct(parsed[1], np.dtype(jax.numpy.dtype(parsed[0]))))
        except TypeError:
            return None
    return out


def adapt(plan: Plan, graph: Graph) -> Plan:
    """`plan` (tuned for a program of `graph`'s structure at other sizes) re-keyed to `graph`, if every group still
    matches its template and every config still fits its search space at `graph`'s sizes; else `PlanError` naming
    the group and why (``row_reduce group 3-17: block_rows=64 breaks block_rows <= next_pow2(R) at R=8 (no block
    taller than the rows)``). Builds and compiles nothing."""
    groups = []
    for fg in plan.groups:
        where = f"{fg.template} group {_span(fg.nodes)}"
        if max(fg.nodes) >= len(graph.nodes):
            raise PlanError(f"{where}: the program has {len(graph.nodes)} nodes")
        group = Group.of(graph, fg.nodes)
        tmpl = TEMPLATES[fg.template]
        spec = tmpl.match(group)
        if spec is None:
            raise PlanError(f"{where}: the template no longer matches the group at these sizes")
        config = {**tmpl.defaults, **fg.config}
        sp = tmpl.space_of(group, spec, fg.backend)
        broken = broken_constraint(sp["space"], config, sp["facts"])
        if broken:
            raise PlanError(f"{where}: {broken}")
        why = tmpl.unsupported(spec, fg.backend, config)
        if why:
            raise PlanError(f"{where}: {fg.backend} cannot run its config here: {why}")
        groups.append(replace(fg, signature=group.signature))
    return Plan(graph.fingerprint, tuple(groups), {**plan.provenance, "tuned_for": plan.fingerprint})


def nearest_first(found: Sequence[Any], serving: Sequence[str], inputs: Any = lambda f: f.inputs,
                  exact: Any = lambda f: f.plan.match == "exact") -> list[Any]:
    """Plans of the same structure (`store.SameStructure`s, or anything `inputs` and `exact` read) in the order a
    shape not tuned exactly tries them: exact software versions first, then the bucket nearest `serving` in size
    (the sum over dimensions of |log2| of the size ratios: `signatures.distance`), then, between buckets as near,
    the larger (whose configs were tuned for more work per kernel), then the order given (newest first). Where
    `autofuse tune --shapes` tuned several buckets, a shape between them takes the nearest that adapts."""
    from .signatures import distance, parse_aval

    def elements(f: Any) -> int:
        return sum(int(np.prod(p[1])) for p in map(parse_aval, inputs(f)) if p is not None)

    return sorted(found, key=lambda f: (not exact(f), distance(inputs(f), serving), -elements(f)))


def broken_constraint(space: Any, config: dict, facts: dict) -> str | None:
    """The first choice or constraint of `space` (a `spaces.Space`) that `config` breaks with these `facts`, in
    words with the values that break it; None if it fits."""
    for name, choices in space.params.items():
        if config.get(name) not in choices:
            return f"{name}={config.get(name)!r} is not one of {choices}"
    names = {**facts, **config}
    for c in space.constraints:
        body = c.tree.body
        parts = body.values if isinstance(body, ast.BoolOp) and isinstance(body.op, ast.And) else [body]
        for part in parts:
            try:
                ok = bool(_eval(part, names))
            except (KeyError, ZeroDivisionError, TypeError, ValueError) as e:
                return f"{c.expr} cannot be evaluated ({e})"
            if not ok:
                used = sorted({n.id for n in ast.walk(part) if isinstance(n, ast.Name) and n.id in names})
                cfg = " ".join(f"{k}={config[k]}" for k in used if k in config)
                at = ", ".join(f"{k}={facts[k]}" for k in used if k in facts and k not in config)
                return f"{cfg or 'the config'} breaks {ast.unparse(part)}{f' at {at}' if at else ''} ({c.why})"
    return None


def _span(nodes: Sequence[int]) -> str:
    lo, hi = min(nodes), max(nodes)
    return str(lo) if lo == hi else f"{lo}-{hi}"
