"""The example models end to end on the CPU: tune (model mode, interpret-mode checks), deploy, compare with jax.jit.

Each model's forward and `jax.grad` of its loss are tuned with a tiny budget at
`small_inputs()` sizes. The tuned plan must run (`autofuse.jit(fn, plan=...)`)
and match `jax.jit` on the model's own inputs; so must a plan that fuses every
group the job tuned (at small sizes the model often prefers XLA, and that must
not leave the generated kernels untested inside a real model). Repeated layers
must share candidates: fewer distinct candidates than instances.
"""
from __future__ import annotations

import importlib

import jax
import pytest

import autofuse
from autofuse.graph import capture
from autofuse.measure import compare
from autofuse.partition import Option, enumerate_candidates, select_cover
from autofuse.plan import Plan, plan_from_choices
from autofuse.search import tune

TOL = 1e-4  # relative error norm; small_inputs() are float32, fused kernels accumulate in float32
CASES = [(m, f) for m in ("gpt2", "splade", "llama") for f in ("forward", "grad_step")]


def fuse_all_tuned(graph, report) -> Plan:
    """A plan that fuses as many node-instances of the tuned candidates as an acyclic cover allows."""
    best = {c.signature: c for c in report.candidates if c.best_config is not None}
    options = [Option(c.nodes, -float(len(c.nodes)), c) for c in enumerate_candidates(graph) if c.group.signature in best]
    chosen = select_cover(graph, options, {})
    return plan_from_choices(graph, [(o.label.group, o.label.template, best[o.label.group.signature].best_config) for o in chosen])


def assert_matches_jit(fn, plan: Plan, args) -> None:
    fused = autofuse.jit(fn, plan=plan, on_miss="error")
    outs = jax.tree_util.tree_leaves(fused(*args))
    assert fused.last_status == "plan"
    refs = jax.tree_util.tree_leaves(jax.jit(fn)(*args))
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs):
        ok, err, why = compare(o, r, TOL)
        assert ok, why


@pytest.mark.parametrize("model,entry", CASES, ids=[f"{m}-{f}" for m, f in CASES])
def test_model_tunes_and_fused_program_matches_jit(model, entry):
    mod = importlib.import_module(f"examples.{model}")
    fn = getattr(mod, entry)
    args = mod.small_inputs()
    report = tune(fn, *args, trials=4, measure="model", isolate=False, quiet=True, progress=lambda s: None)

    # Repeated layers are tuned once: each layer's groups recur, so distinct candidates < instances.
    assert len(report.candidates) < sum(c.instances for c in report.candidates)
    assert max(c.instances for c in report.candidates) >= 2
    assert any(c.best_config is not None for c in report.candidates)

    assert_matches_jit(fn, report.plan, args)
    graph = capture(fn, *args)
    forced = fuse_all_tuned(graph, report)
    assert forced.groups
    assert_matches_jit(fn, forced, args)


@pytest.mark.parametrize("model,layers", [("gpt2", 24), ("splade", 2), ("llama", 2)])
def test_published_shapes_attention_found_once_per_layer_and_shared(model, layers):
    """At example_inputs() shapes (shapes only): attention written in plain jnp (reshapes, causal or padding
    masks, GQA via jnp.repeat) is a candidate in every layer, and all its instances are one distinct candidate."""
    mod = importlib.import_module(f"examples.{model}")
    cands = enumerate_candidates(capture(mod.forward, *jax.eval_shape(mod.example_inputs)))
    attn = [c for c in cands if c.template == "attention"]
    assert len({c.group.signature for c in attn}) == 1
    assert len({min(c.nodes) for c in attn}) == layers
    if model == "gpt2":  # 24 layers: the job tunes far fewer distinct candidates than it enumerates
        assert len(cands) > 10 * len({c.group.signature for c in cands})
