"""Every candidate's default config takes its values from its search space's choices, so a plan of defaults binds
(bind_plan checks each config against the choices): groups of one column or one row once got block_cols=1 from the
elementwise and row_reduce defaults, below the spaces' narrowest block, and GPT-2's training step had no plan of
defaults."""
from __future__ import annotations

import importlib

import pytest

import autofuse
from autofuse import costmodel
from autofuse.plan import bind_plan
from autofuse.tuning.job import distinct_candidates, search_spaces, tunable
from autofuse.tuning.select import default_plan
from tests.quick import slow_except


@pytest.mark.parametrize("model,entry", slow_except([("gpt2", "grad_step"), ("llama", "grad_step"), ("splade", "forward"), ("llama", "forward")],
                                                   "llama-forward"))
def test_default_configs_are_feasible_and_their_plan_binds(model, entry):
    mod = importlib.import_module(f"examples.{model}")
    graph = autofuse.capture(getattr(mod, entry), *mod.small_inputs())
    by_sig, cands, _ = tunable(*distinct_candidates(graph), ("triton",))  # as a job does (a QKV split is Mosaic GPU's only)
    spaces = search_spaces(by_sig, cands, costmodel.H200)
    for r in cands:
        for backend, space in spaces[r.signature].spaces.items():
            outside = {k: v for k, v in space.default.items() if k in space.params and v not in space.params[k]}
            assert not outside, (r.template, backend, outside)
            # and keeps its space's rules (a default that breaks them is a study's first trial lost, and a plan of
            # defaults that cannot adapt to other shapes): short sequences and dimensions took 64- or 128-long blocks
            assert not space.violated(space.default), (r.template, backend, space.default, space.violated(space.default))
    assert bind_plan(graph, default_plan(graph))


@pytest.mark.parametrize("model,entry", slow_except([("gpt2", "grad_step"), ("llama", "grad_step"), ("splade", "grad_step")], "llama-grad_step"))
def test_mosaic_gpu_defaults_keep_the_lowerings_rules(model, entry):
    """Each Mosaic GPU default is a config its lowering accepts (tile, TMA and shared-memory rules): a training
    step's matmul epilogues with several outputs needed 242-274 KB of shared memory at the narrowest block, and
    their first trial was infeasible."""
    from autofuse.kernels import TEMPLATES

    mod = importlib.import_module(f"examples.{model}")
    graph = autofuse.capture(getattr(mod, entry), *mod.small_inputs())
    backends = ("mosaic_gpu", "triton", "xla_ops")  # a Hopper job's, and as a job does, without the groups none runs
    by_sig, cands, _ = tunable(*distinct_candidates(graph), backends)  # (Llama's dual GEMM with five outputs: none fits)
    spaces = search_spaces(by_sig, cands, costmodel.H200, backends)
    checked = 0
    for r in cands:
        space = spaces[r.signature].spaces.get("mosaic_gpu")
        if space is None:
            continue
        tmpl, spec = TEMPLATES[r.template], by_sig[r.signature][0].spec
        assert not space.violated(space.default), (r.template, space.default, space.violated(space.default))
        assert tmpl.unsupported(spec, "mosaic_gpu", space.default) is None, (r.template, space.default, tmpl.unsupported(spec, "mosaic_gpu", space.default))
        checked += 1
    assert checked


@pytest.mark.slow
def test_a_searched_config_is_whole_and_its_plan_binds():
    """What a trial runs is what a plan stores: a config the search suggests carries every parameter of its lowering,
    the unsearched ones at the default (the cross-entropy pair's Mosaic GPU space narrows its backward's parameters
    and left out two added later; every trial of it ran, and every plan holding it failed to bind: GPT-2 medium's
    training step lost its two largest savings, 12.5 and 3.4 ms alone, to "config lacks ['bwd_cluster', ...]").
    At GPT-2's published shapes (one layer), where the Mosaic GPU lowerings take the vocabulary head."""
    import optuna

    from autofuse.kernels import TEMPLATES
    from autofuse.plan import plan_from_choices
    from autofuse.tuning.space import CandidateSpace
    from tests import example_graphs

    _, graph, _ = example_graphs.program("gpt2", "grad_step", "published", 1)
    seen, bound = set(), set()
    for c in example_graphs.candidates("gpt2", "grad_step", "published", 1):
        if c.group.signature in seen:
            continue
        seen.add(c.group.signature)
        space = CandidateSpace.of(c.template, c.group, c.spec, costmodel.H200, ("mosaic_gpu", "triton", "xla_ops"))
        for backend, sp in space.spaces.items():
            params = space.optuna_params({"backend": backend, **sp.default})
            config = space.suggest(optuna.trial.FixedTrial(params))
            tmpl = TEMPLATES[c.template]
            assert set(tmpl.params_of(backend)) <= set(config) | set(tmpl.defaults), (c.template, backend, config)
            assert bind_plan(graph, plan_from_choices(graph, [(c.group, c.template, config, c.stages)]))
            bound.add((c.template, backend))
    assert {("matmul_reduce_vjp", "mosaic_gpu"), ("matmul", "mosaic_gpu"), ("aligned_dot", "xla_ops")} <= bound


@pytest.mark.slow
def test_at_published_shapes_each_default_snapped_to_its_space_still_runs():
    """A space whose choices lack its default's values moves the default to the nearest choice above (`_snap`): the
    cross-entropy pair's Mosaic GPU space had one epilogue width (64) and no 192-wide backward tile, and GPT-2's
    default (32, 192) became (64, 256), 512 bytes over the shared memory: the study's first trial was infeasible and
    its second the Triton lowering's, 2.7x slower than XLA. At GPT-2's published shapes (one layer), every
    candidate's default on every backend, as its space holds it, is accepted by the lowering where the lowering's
    own default is; and the pair's is its own, unmoved."""
    from autofuse.kernels import TEMPLATES
    from autofuse.tuning.space import CandidateSpace
    from tests import example_graphs

    seen, checked = set(), set()
    for c in example_graphs.candidates("gpt2", "grad_step", "published", 1):
        if c.group.signature in seen:
            continue
        seen.add(c.group.signature)
        tmpl = TEMPLATES[c.template]
        space = CandidateSpace.of(c.template, c.group, c.spec, costmodel.H200, ("mosaic_gpu", "triton", "xla_ops"))
        for backend, sp in space.spaces.items():
            own = tmpl.default_config_of(c.spec, backend)
            if tmpl.unsupported(c.spec, backend, own) is None:
                assert tmpl.unsupported(c.spec, backend, sp.default) is None, (c.template, backend, tmpl.unsupported(c.spec, backend, sp.default))
            if c.template == "matmul_reduce_vjp":
                assert {k: v for k, v in sp.default.items() if k in own} == own, (backend, own, sp.default)
            checked.add((c.template, backend))
    assert ("matmul_reduce_vjp", "mosaic_gpu") in checked
