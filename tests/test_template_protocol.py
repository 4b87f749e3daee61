"""The tuner is closed to templates and backends: it reaches them only through the `Template` protocol and the
registry, so a new template or backend needs no edit under autofuse/tuning/."""
from __future__ import annotations

import jax
import jax.numpy as jnp

import autofuse
from autofuse.graph import Group
from autofuse.kernels import TEMPLATES, register_template
from autofuse.kernels.elementwise import ElementwiseTemplate
from autofuse.tuning.partition import enumerate_candidates


class WholeChain(ElementwiseTemplate):
    """A toy template that growth never offers (it matches no group by itself) but that finds one group of its
    own: every fusible node of the program, connected or not (growth offers connected groups only)."""

    name = "toy_whole_chain"

    def match(self, group: Group):
        return None

    def candidate_groups(self, graph, fusible):
        group = Group.of(graph, [nd.id for nd in graph.nodes if fusible(nd.id)])
        spec = super().match(group)
        return [] if spec is None else [(group, spec, ())]


def _two_chains(x, y):
    return jnp.tanh(x * 2.0) - x, jnp.exp(y) + 1.0


def test_a_registered_templates_own_groups_are_offered_by_the_partitioner():
    g = autofuse.capture(_two_chains, *(jax.ShapeDtypeStruct((64, 128), jnp.float32) for _ in range(2)))
    assert not any(c.template == WholeChain.name for c in enumerate_candidates(g))
    saved = dict(TEMPLATES)
    try:
        register_template(WholeChain())
        mine = [c for c in enumerate_candidates(g) if c.template == WholeChain.name]
    finally:
        TEMPLATES.clear()
        TEMPLATES.update(saved)
    assert len(mine) == 1 and set(mine[0].group.node_ids) == {nd.id for nd in g.nodes}
    assert mine[0].spec is not None and mine[0].stages == ()
