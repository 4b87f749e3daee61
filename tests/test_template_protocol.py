"""The tuner is closed to templates and backends: it reaches them only through the `Template` protocol and the
registry, so a new template or backend needs no edit under autofuse/tuning/."""
from __future__ import annotations

import ast
from pathlib import Path

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


def test_the_template_base_and_the_tuner_name_no_backend_and_no_template():
    """kernels/template.py and tuning/ reach templates through `TEMPLATES` and backends through the lowering modules:
    no template's or backend's name as a string, no import of a template's or a backend's module. (The default
    backend is `spaces.DEFAULT_BACKEND`, for configs and stored plans that name none.)"""
    root = Path(autofuse.__file__).parent
    names = set(TEMPLATES) | {b for t in TEMPLATES.values() for b in t.backends}
    assert {"triton", "mosaic_gpu", "attention_vjp", "row_reduce"} <= names
    for path in [root / "kernels" / "template.py", *sorted((root / "tuning").glob("*.py"))]:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert node.value not in names, f"{path.name}:{node.lineno} names {node.value!r}"
            if isinstance(node, ast.ImportFrom):
                parts = set((node.module or "").split(".")) | {a.name for a in node.names}
                assert not parts & names, f"{path.name}:{node.lineno} imports {sorted(parts & names)}"
