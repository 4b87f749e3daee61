"""The tuning job: candidates, their configs, and the choice of a plan.

`default_plan` makes a plan without measuring: every candidate with its
template's default config, costed by the roofline model, the cheapest exact
cover chosen.
"""
from __future__ import annotations

from . import costmodel
from .graph import Graph
from .kernels import TEMPLATES
from .partition import Candidate, Option, enumerate_candidates, select_cover
from .plan import Plan, plan_from_choices


def model_cost_ms(cand: Candidate, model: costmodel.GPUModel = costmodel.H200) -> float:
    spec = cand.spec
    cfg = TEMPLATES[cand.template].default_config(spec)
    passes = 1 + len(spec.reductions) if -(-spec.C // cfg["block_cols"]) > 1 and spec.reductions else 1
    return costmodel.group_time_ms(cand.group, model, passes)


def default_plan(graph: Graph, model: costmodel.GPUModel = costmodel.H200) -> Plan:
    """A plan from default configs and modelled costs (no measurement)."""
    cands = enumerate_candidates(graph)
    options = [Option(c.nodes, model_cost_ms(c, model), c) for c in cands]
    node_cost = {n.id: costmodel.node_time_ms(graph, n.id, model) for n in graph.nodes}
    chosen = select_cover(graph, options, node_cost)
    choices = [(o.label.group, o.label.template, TEMPLATES[o.label.template].default_config(o.label.spec)) for o in chosen]
    return plan_from_choices(graph, choices, {"measure": "default", "model": model.name})
