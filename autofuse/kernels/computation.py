"""What a value computes, as a hash of its whole computation: two values of two graphs hash alike exactly when the same
primitives, parameters, shapes and literals make them from inputs named alike, whatever the value ids. `attention_vjp`
recognises a backward as the derivative of its forward by it, and `attention_library` a group as JAX's own attention."""
from __future__ import annotations

import hashlib
import re

import jax
import numpy as np

from ..graph import Graph, Lit, bind_node, node_text

_LIT = re.compile(r"lit\([^()]*\)")


def value_hashes(graph: Graph, leaves: dict[int, str], nodes=None) -> dict[int, str]:
    """Hash of each value computable from `leaves` (value -> name) through `nodes` (default: all): its whole
    computation (primitives, params, shapes, literals), whatever the value ids. A scalar computed from literals
    alone hashes as the literal it is (tracing folds `convert(-inf)` in one program and not in another)."""
    h = dict(leaves)
    for n in graph.nodes if nodes is None else nodes:
        if any(v in h for v in n.outputs) or not all(isinstance(a, Lit) or a in h for a in n.inputs):
            continue
        kids = [_lit_text(a.value, a.aval) if isinstance(a, Lit) else h[a] for a in n.inputs]
        if all(k.startswith("lit(") for k in kids) and len(n.outputs) == 1 and graph.avals[n.outputs[0]].shape == () \
                and n.inputs:
            with jax.ensure_compile_time_eval():
                (val,) = bind_node(n, [np.asarray(a.value) if isinstance(a, Lit) else _LIT_VALUES[k] for a, k in zip(n.inputs, kids)])
            h[n.outputs[0]] = _lit_text(np.asarray(val), graph.avals[n.outputs[0]])
            continue
        text = _LIT.sub("%0", node_text(n, graph.avals, {a: 0 for a in (*n.inputs, *n.outputs) if isinstance(a, int)}))
        for i, v in enumerate(n.outputs):
            h[v] = hashlib.sha256(f"{text}|{','.join(kids)}|{i}".encode()).hexdigest()[:20]
    return h


_LIT_VALUES: dict[str, np.ndarray] = {}


def _lit_text(value, aval) -> str:
    arr = np.asarray(value, dtype=aval.dtype)
    text = f"lit({arr.item()!r}:{aval})"
    _LIT_VALUES[text] = arr
    return text
