"""Differentiable plans: `jax.grad` / `jax.vjp` through `autofuse.jit` match `jax.grad` of the plain function
(interpret mode on the CPU), the forward pass runs the fused kernels, and the residuals are the groups' inputs."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autofuse
from autofuse.differentiate import VJPRule, recompute_rule
from autofuse.kernels import TEMPLATES, attention
from autofuse.plan import Plan, PlanError, bind_plan, plan_from_choices
from autofuse.runner.measure import compare
from autofuse.tuning.partition import enumerate_candidates
from autofuse.tuning.select import default_plan
from autofuse.tuning.space import SearchSpace
from benchmarks.workloads import attention_bhld_causal, cross_entropy, layer_norm, rms_norm
from tests.attention_programs import (bias_blhd, causal_iota_minus_1e9, causal_then_softcap, gqa_repeat, heads_split_causal,
                                     padding_mask, sliding_window, softcap_then_causal)
from tests import example_graphs
from tests.quick import slow_except

S = jax.ShapeDtypeStruct
F32, BF16 = jnp.float32, jnp.bfloat16
SMALL_ATTN = {"block_q": 16, "block_k": 16, "num_warps": 4, "num_stages": 2}  # several blocks: skipping and edges


def _inputs(specs, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for s in specs:
        if jnp.issubdtype(s.dtype, jnp.floating):
            out.append(jnp.asarray(rng.standard_normal(s.shape), s.dtype))
        elif s.dtype == jnp.bool_:
            out.append(jnp.asarray(rng.random(s.shape) < 0.8))
        else:
            out.append(jnp.asarray(rng.integers(0, 40, s.shape), s.dtype))
    return out


def _loss(f):
    """A scalar of every output, weighted so that each output element gets its own cotangent."""
    def loss(*args):
        leaves = jax.tree_util.tree_leaves(f(*args))
        return sum(jnp.sum(jnp.sin(jnp.arange(x.size, dtype=F32).reshape(x.shape) * 0.37) * x.astype(F32)) for x in leaves)
    return loss


def _plan(fn, specs, template=None, config=None) -> tuple[Plan, object]:
    """The default plan, or one fusing the first candidate of `template` with `config`."""
    graph = autofuse.capture(fn, *specs)
    if template is None:
        plan = default_plan(graph)
    else:
        cand = next(c for c in enumerate_candidates(graph) if c.template == template)
        plan = plan_from_choices(graph, [(cand.group, template, config or TEMPLATES[template].default_config(cand.spec))])
    assert plan.groups, "the plan fuses something"
    return plan, graph


def _assert_grads_match(fn, specs, plan, argnums, tol=1e-4, seed=0):
    args = _inputs(specs, seed)
    fused = autofuse.jit(fn, plan=plan, on_miss="error")
    got = jax.grad(_loss(fused), argnums)(*args)
    assert fused.last_status.startswith("plan:")  # the fused program was differentiated, not the XLA fallback
    want = jax.grad(_loss(jax.jit(fn)), argnums)(*args)
    for k, (g, w) in enumerate(zip(got, want)):
        ok, _, why = compare(g, w, tol)
        assert ok, f"d/d arg {argnums[k]}: {why}"
    return fused, args


def _bindable(plan: Plan, graph) -> Plan:
    """`plan` without the groups whose default config lies outside their search space (default_plan gives an
    elementwise group one column wide block_cols=1, below the space's 32)."""
    def ok(fg):
        try:
            bind_plan(graph, dataclasses.replace(plan, groups=(fg,)))
            return True
        except PlanError:
            return False

    return dataclasses.replace(plan, groups=tuple(fg for fg in plan.groups if ok(fg)))


def _kernels_in(jaxpr) -> list[str]:
    """The names of the pallas_call equations anywhere in a jaxpr (the fused kernels that run)."""
    names = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            names.append(str(eqn.params.get("name")))
        for sub in _subjaxprs(eqn.params):
            names += _kernels_in(sub)
    return names


def _subjaxprs(params):
    for v in params.values():
        for x in v if isinstance(v, (tuple, list)) else (v,):
            if hasattr(x, "eqns"):
                yield x
            elif hasattr(x, "jaxpr") and hasattr(x.jaxpr, "eqns"):
                yield x.jaxpr


ATTENTION = [
    pytest.param(attention_bhld_causal, [S((1, 2, 40, 32), F32)] * 3, (0, 1, 2), id="causal-ragged"),
    pytest.param(padding_mask, [S((2, 2, 32, 32), F32)] * 3 + [S((2, 32), jnp.bool_)], (0, 1, 2), id="padding-mask"),
    pytest.param(gqa_repeat, [S((1, 32, 8, 32), F32), S((1, 32, 2, 32), F32), S((1, 32, 2, 32), F32)], (0, 1, 2), id="gqa"),
    pytest.param(heads_split_causal, [S((2, 48, 64), F32)] * 3, (0, 1, 2), id="heads-split-causal"),
    pytest.param(softcap_then_causal, [S((1, 2, 32, 32), F32)] * 3, (0, 1, 2), id="softcap-causal"),
    pytest.param(causal_then_softcap, [S((1, 2, 32, 32), F32)] * 3, (0, 1, 2), id="causal-then-softcap"),
    pytest.param(causal_iota_minus_1e9, [S((1, 2, 48, 32), F32)] * 3, (0, 1, 2), id="max-not-stopped"),
    pytest.param(sliding_window, [S((1, 2, 64, 32), F32)] * 3, (0, 1, 2), id="sliding-window"),
]


@pytest.mark.parametrize("fn,specs,argnums", slow_except(ATTENTION, "causal-ragged"))
def test_grad_through_fused_attention_runs_the_flash_pair(fn, specs, argnums):
    """The forward kernel emits the logsumexp, the backward kernels re-evaluate the scores per tile (masks,
    soft-capping and scale differentiated from the group's own equations, GQA heads summed); nothing of the
    score matrix's size is kept between the passes."""
    plan, _ = _plan(fn, specs, "attention", SMALL_ATTN)
    fused, args = _assert_grads_match(fn, specs, plan, argnums)
    names = _kernels_in(jax.make_jaxpr(jax.grad(_loss(fused), argnums))(*args).jaxpr)
    assert sum("attention_bwd" in n for n in names) == 2 and len(names) == 3, names
    _, pull = jax.vjp(fused, *args)  # kept between the passes: the inputs, the output, the [batch, Lq] logsumexp
    kept = [x.shape for x in jax.tree_util.tree_leaves(pull) if hasattr(x, "shape")]
    assert len(kept) <= len(args) + 2 and len(kept[-1]) == 2, kept


@pytest.mark.slow
def test_attention_with_a_float_bias_keeps_the_recompute_rule():
    """A bias's gradient is not generated: its group is differentiated by XLA, and the gradients still match."""
    specs = [S((1, 32, 2, 32), F32)] * 3 + [S((2, 32, 32), F32)]
    plan, graph = _plan(bias_blhd, specs, "attention", SMALL_ATTN)
    cand = next(c for c in enumerate_candidates(graph) if c.template == "attention")
    assert "side input" in attention.flash_backward_unsupported(cand.spec)
    fused, args = _assert_grads_match(bias_blhd, specs, plan, (0, 1, 2, 3))
    names = _kernels_in(jax.make_jaxpr(jax.grad(_loss(fused), (0, 1, 2, 3)))(*args).jaxpr)
    assert names and not any("attention_bwd" in n for n in names), names


@pytest.mark.slow
def test_flash_rule_serves_every_backend_and_refuses_second_order():
    """A float32 Mosaic GPU group (its forward runs as TF32, its backward declines float32) differentiates with the
    flash pair, the Triton backward; going through the flash kernels a second time is refused with autofuse's message."""
    specs = [S((1, 2, 32, 32), F32)] * 3
    plan, graph = _plan(attention_bhld_causal, specs, "attention", SMALL_ATTN)
    group = next(c.group for c in enumerate_candidates(graph) if c.template == "attention")
    rule = TEMPLATES["attention"].vjp_rule(group, {"block_q": 64, "block_kv": 64}, backend="mosaic_gpu", interpret=True)
    assert rule is not None and rule.name == "flash"
    fused = autofuse.jit(attention_bhld_causal, plan=plan, on_miss="error")
    args = _inputs(specs)
    second = jax.grad(lambda q: jnp.sum(jax.grad(_loss(lambda q: fused(q, *args[1:])))(q) ** 2))
    with pytest.raises(NotImplementedError, match="cannot be differentiated again"):
        second(args[0])


def _custom_calls(graph, plan, fn_of_run, specs) -> dict[str, int]:
    """The kernels of `fn_of_run(run)` exported for CUDA (the real Triton and Mosaic GPU lowerings, no GPU): custom
    call targets and how many of each."""
    import collections
    import re

    from autofuse.plan import executor
    from autofuse.runner.evaluator import export_for_cuda

    text = export_for_cuda(fn_of_run(executor(graph, plan, interpret=False)), specs).mlir_module()
    return dict(collections.Counter(re.findall(r"custom_call @([\w$.]+)", text)))


@pytest.mark.slow
def test_grad_through_mosaic_gpu_attention_runs_its_own_forward_and_backward():
    """A Mosaic GPU attention group differentiates with its own forward (writing the row logsumexp beside O) and
    the Mosaic GPU backward kernels: the gradients match (interpret mode), and the CUDA lowering holds three Mosaic
    GPU kernels and no Triton one."""
    from autofuse.kernels.mosaic_gpu import attention as mgpu_attention

    specs = [S((1, 2, 64, 64), BF16)] * 3
    graph = autofuse.capture(attention_bhld_causal, *specs)
    cand = next(c for c in enumerate_candidates(graph) if c.template == "attention")
    cfg = {**mgpu_attention.default_config(cand.spec), "block_kv": 64, "backend": "mosaic_gpu"}
    plan = plan_from_choices(graph, [(cand.group, "attention", cfg)])
    _assert_grads_match(attention_bhld_causal, specs, plan, (0, 1, 2), tol=2e-2)

    def step(run):
        def f(*a):
            _, pull = jax.vjp(lambda *x: run(x)[0], *a[:-1])
            return pull(a[-1])
        return f

    assert _custom_calls(graph, plan, step, [*specs, specs[0]]) == {"mosaic_gpu_v2": 3}


@pytest.mark.slow
def test_grad_through_fused_attention_bf16():
    specs = [S((1, 2, 64, 64), BF16)] * 3
    plan, _ = _plan(attention_bhld_causal, specs, "attention")
    _assert_grads_match(attention_bhld_causal, specs, plan, (0, 1, 2), tol=2e-2)
    specs = [S((2, 64, 8, 64), BF16), S((2, 64, 2, 64), BF16), S((2, 64, 2, 64), BF16)]
    plan, _ = _plan(gqa_repeat, specs, "attention")
    _assert_grads_match(gqa_repeat, specs, plan, (0, 1, 2), tol=2e-2)


NORMS = [
    pytest.param(layer_norm, [S((64, 256), F32), S((256,), F32), S((256,), F32)], (0, 1, 2), id="layer_norm"),
    pytest.param(rms_norm, [S((64, 256), F32), S((256,), F32)], (0, 1), id="rms_norm"),
    pytest.param(layer_norm, [S((48, 200), BF16), S((200,), BF16), S((200,), BF16)], (0, 1, 2), id="layer_norm-bf16"),
]


@pytest.mark.parametrize("fn,specs,argnums", slow_except(NORMS, "rms_norm", "layer_norm-bf16"))
def test_grad_through_fused_norm(fn, specs, argnums):
    plan, _ = _plan(fn, specs)
    tol = 1e-4 if specs[0].dtype == F32 else 2e-2
    _assert_grads_match(fn, specs, plan, argnums, tol)


@pytest.mark.slow
def test_grad_through_fused_cross_entropy_with_integer_targets():
    """The matmul with an online reduction; the integer targets get no cotangent (float0), the others do."""
    specs = [S((32, 64), F32), S((64, 200), F32), S((32,), jnp.int32)]
    plan, _ = _plan(cross_entropy, specs, "matmul_reduce")
    _assert_grads_match(cross_entropy, specs, plan, (0, 1))
    args = _inputs(specs)
    fused = autofuse.jit(cross_entropy, plan=plan)
    (gt,) = jax.grad(_loss(fused), (2,), allow_int=True)(*args)
    assert gt.dtype == jax.dtypes.float0


def test_vjp_and_jit_of_grad_and_residuals():
    """jax.vjp gives every cotangent; jax.jit(jax.grad(...)) compiles; the forward pass saves the group's inputs
    and no intermediate of the group (the default rule recomputes in the backward)."""
    specs = [S((64, 256), F32), S((256,), F32), S((256,), F32)]
    plan, _ = _plan(layer_norm, specs)
    fused = autofuse.jit(layer_norm, plan=plan, on_miss="error")
    args = _inputs(specs, 1)
    ct = _inputs([S((64, 256), F32)], 2)[0]
    out, pull = jax.vjp(fused, *args)
    want_out, want_pull = jax.vjp(layer_norm, *args)
    assert compare(out, want_out, 1e-5)[0]
    for g, w in zip(pull(ct), want_pull(ct)):
        ok, _, why = compare(g, w, 1e-4)
        assert ok, why
    jitted = jax.jit(jax.grad(_loss(fused), (0, 1, 2)))
    for g, w in zip(jitted(*args), jax.grad(_loss(layer_norm), (0, 1, 2))(*args)):
        assert compare(g, w, 1e-4)[0]
    # what jax.vjp keeps between the passes: the arguments, nothing [64, 256]-sized computed from them
    _, res = jax.vjp(fused, *args)
    kept = [x for x in jax.tree_util.tree_leaves(res) if hasattr(x, "shape")]
    assert all(any(x is a or (x.shape == a.shape and bool(jnp.all(x == a))) for a in args) for x in kept if x.size > 1), \
        [x.shape for x in kept]


@pytest.mark.slow
def test_second_order_reverse_works_and_forward_mode_is_refused_clearly():
    specs = [S((16, 32), F32), S((32,), F32)]
    plan, _ = _plan(rms_norm, specs)
    fused = autofuse.jit(rms_norm, plan=plan, on_miss="error")
    x, s = _inputs(specs, 3)

    def inner(f):
        return lambda x, s: jnp.sum(jax.grad(lambda x: jnp.sum(jnp.tanh(f(x, s))))(x) ** 2)

    ok, _, why = compare(jax.grad(inner(fused), (0, 1))(x, s)[1], jax.grad(inner(rms_norm), (0, 1))(x, s)[1], 1e-4)
    assert ok, why
    with pytest.raises(TypeError, match="forward-mode autodiff"):
        jax.jvp(fused, (x, s), (x, s))
    with pytest.raises(TypeError, match="forward-mode autodiff"):
        jax.jacfwd(lambda s: fused(x, s))(s)


def test_template_rule_is_used_and_recompute_rule_is_the_fallback(monkeypatch):
    """A template's own VJP rule runs when it offers one; without one (every template but attention's backward
    today) the group's sub-jaxpr is differentiated by XLA."""
    specs = [S((64, 256), F32), S((256,), F32), S((256,), F32)]
    plan, _ = _plan(layer_norm, specs)
    (fg,) = plan.groups
    calls = []

    def rule(self, group, config, *, backend="triton", interpret=False):
        base = recompute_rule(group)

        def backward(res, cts):
            calls.append(len(res))
            return [None if g is None else 2 * g for g in base.backward(res, cts)]

        return VJPRule(base.forward, backward, "doubled")

    monkeypatch.setattr(type(TEMPLATES[fg.template]), "vjp_rule", rule)
    args = _inputs(specs)
    got = jax.grad(_loss(autofuse.jit(layer_norm, plan=plan, on_miss="error")), (0, 1, 2))(*args)
    want = jax.grad(_loss(layer_norm), (0, 1, 2))(*args)
    assert calls == [3]
    for g, w in zip(got, want):
        assert compare(g, 2 * w, 1e-4)[0]


@pytest.mark.slow
def test_grad_of_small_gpt2_loss_with_every_group_fused():
    """A whole model: GPT-2's loss (2 layers) with every candidate the default cover picks fused, attention
    included, differentiated for every parameter."""
    from examples import gpt2

    params, batch = gpt2.small_inputs()
    graph = autofuse.capture(gpt2.loss, params, batch)
    plan = _bindable(default_plan(graph), graph)
    templates = {g.template for g in plan.groups}
    assert "attention" in templates and len(templates) >= 2, templates
    fused = autofuse.jit(gpt2.loss, plan=plan, on_miss="error")
    got = jax.grad(fused)(params, batch)
    assert fused.last_status.startswith("plan:")
    want = jax.jit(jax.grad(gpt2.loss))(params, batch)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves(want)):
        ok, _, why = compare(g, w, 1e-3)
        assert ok, f"{jax.tree_util.keystr(path)}: {why}"


# ---------------------------------------------------------------------------
# Tuning a gradient program: attention's forward chain with its own backward (template attention_vjp).
def _linear_loss_grad(fn, specs, argnums):
    """jax.grad of a loss linear in the attention output: the cotangent does not depend on the output, so the
    forward chain and its backward form one convex group."""
    def loss(*a):
        *x, w = a
        return jnp.sum(fn(*x).astype(F32) * w)

    out = jax.eval_shape(fn, *specs)
    return jax.grad(loss, argnums), list(specs) + [S(out.shape, F32)]


GRAD_PROGRAMS = [
    pytest.param(attention_bhld_causal, [S((1, 2, 40, 32), F32)] * 3, (0, 1, 2), 1e-4, id="causal-ragged"),
    pytest.param(gqa_repeat, [S((1, 32, 8, 32), F32), S((1, 32, 2, 32), F32), S((1, 32, 2, 32), F32)], (0, 1, 2), 1e-4, id="gqa"),
    pytest.param(padding_mask, [S((2, 2, 32, 32), F32)] * 3 + [S((2, 32), jnp.bool_)], (0, 1, 2), 1e-4, id="padding-mask"),
    pytest.param(attention_bhld_causal, [S((1, 2, 40, 32), F32)] * 3, (1,), 1e-4, id="only-dk"),
    pytest.param(attention_bhld_causal, [S((1, 2, 64, 64), BF16)] * 3, (0, 1, 2), 2e-2, id="bf16"),
]


@pytest.mark.parametrize("fn,specs,argnums,tol", slow_except(GRAD_PROGRAMS, "padding-mask"))
def test_gradient_program_fuses_attention_with_its_backward(fn, specs, argnums, tol):
    """In the jaxpr of jax.grad the chain's probabilities are read by the backward; the partitioner offers the chain
    with every node of its derivative as one `attention_vjp` candidate (recognised by re-deriving jax.vjp of the
    chain), and the plan running it as the flash pair matches jax.jit."""
    gfn, specs = _linear_loss_grad(fn, specs, argnums)
    graph = autofuse.capture(gfn, *specs)
    (cand,) = [c for c in enumerate_candidates(graph) if c.template == "attention_vjp"]
    assert len(cand.spec.grads) == len(argnums) and sum(n.name == "dot_general" for n in cand.group.nodes) >= 4
    plan = plan_from_choices(graph, [(cand.group, "attention_vjp", SMALL_ATTN)])
    args = _inputs(specs)
    fused = autofuse.jit(gfn, plan=plan, on_miss="error")
    got = fused(*args)
    assert fused.last_status.startswith("plan:")
    names = _kernels_in(jax.make_jaxpr(fused)(*args).jaxpr)
    assert sum("attention_bwd" in n for n in names) == 2, names
    for g, w in zip(got, jax.jit(gfn)(*args)):
        ok, _, why = compare(g, w, tol)
        assert ok, why


@pytest.mark.slow
def test_gradient_program_runs_the_mosaic_gpu_forward_in_two_stages():
    """attention_vjp's Mosaic GPU backend: a loss not linear in the attention output puts forward and backward in
    two stages; with the forward on Mosaic GPU (the logsumexp handed to the backward kernels, Triton's or Mosaic
    GPU's: `bwd_mosaic`) the plan matches jax.jit (interpret mode), and the CUDA lowering holds those kernels."""
    def loss(q, k, v):
        return jnp.sum(jnp.sin(attention_bhld_causal(q, k, v).astype(F32)))

    specs = [S((1, 2, 64, 64), BF16)] * 3
    gfn = jax.grad(loss, (0, 1, 2))
    graph = autofuse.capture(gfn, *specs)
    (cand,) = [c for c in enumerate_candidates(graph) if c.template == "attention_vjp"]
    assert len(cand.stages) == 2
    tmpl = TEMPLATES["attention_vjp"]
    cfg = {**tmpl.default_config_of(cand.spec, "mosaic_gpu"), "block_kv": 64}
    assert set(tmpl.space_of(cand.group, cand.spec, "mosaic_gpu")["params"]) == set(cfg)
    space = SearchSpace.of("attention_vjp", cand.group, cand.spec, backend="mosaic_gpu")
    assert space.default["bwd_mosaic"] == 1 and not space.violated(space.default)  # the Mosaic GPU backward by default
    args = _inputs(specs)
    want = jax.jit(gfn)(*args)
    for bwd, kernels in ((0, {"mosaic_gpu_v2": 1, "__gpu$xla.gpu.triton": 2}), (1, {"mosaic_gpu_v2": 3})):
        mcfg = {**cfg, "bwd_mosaic": bwd, **({"bwd_held": 64, "bwd_step": 64} if bwd else {"bwd_held": 32, "bwd_step": 16})}
        assert tmpl.unsupported(cand.spec, "mosaic_gpu", mcfg) is None
        plan = plan_from_choices(graph, [(cand.group, "attention_vjp", {**mcfg, "backend": "mosaic_gpu"}, cand.stages)])
        assert plan.groups[0].backend == "mosaic_gpu"
        fused = autofuse.jit(gfn, plan=plan, on_miss="error")
        got = fused(*args)
        assert fused.last_status.startswith("plan:")
        for g, w in zip(got, want):
            ok, _, why = compare(g, w, 2e-2)
            assert ok, (bwd, why)
        assert _custom_calls(graph, plan, lambda run: lambda *a: run(a), specs) == kernels


@pytest.mark.slow
def test_training_step_attention_is_recognised_but_not_convex():
    """GPT-2's grad_step: each layer's attention chain is recognised with its backward (the same derivation), but
    the cotangent depends on the output through the rest of the network, so forward + backward is not one convex
    group: the `attention_vjp` candidates offered there run in two stages (tests/test_two_stage.py)."""
    from autofuse.kernels import attention_vjp
    from autofuse.tuning.partition import is_fusible

    _, graph, _ = example_graphs.program("gpt2")
    chains = attention_vjp.forward_chains(graph, lambda i: is_fusible(graph, i))
    assert len(chains) == 2  # one per layer
    for ids, fwd, attn in chains:
        found = [attention_vjp.backward_of(graph, ids, fwd, attn, d) for d in attention_vjp.cotangent_candidates(graph, ids, fwd, attn)]
        assert any(len(members) > len(ids) + 20 and not convex for members, convex in found), [(len(m), c) for m, c in found]
    cands = [c for c in example_graphs.candidates("gpt2") if c.template == "attention_vjp"]
    assert len(cands) == 2 and all(len(c.stages) == 2 for c in cands)


@pytest.mark.parametrize("fn,specs,cfg", [
    pytest.param(attention_bhld_causal, [S((2, 4, 256, 128), BF16)] * 3, {"block_q": 128, "block_k": 128, "num_warps": 8, "num_stages": 3}, id="causal-d128"),
    pytest.param(gqa_repeat, [S((1, 128, 8, 64), BF16), S((1, 128, 2, 64), BF16), S((1, 128, 2, 64), BF16)], SMALL_ATTN, id="gqa"),
    pytest.param(padding_mask, [S((2, 2, 100, 64), BF16)] * 3 + [S((2, 100), jnp.bool_)], SMALL_ATTN, id="padding-ragged"),
])
def test_flash_pair_lowers_for_cuda(fn, specs, cfg):
    """The forward with the logsumexp and both backward kernels go through the real Triton lowering for CUDA
    (interpret mode hides what it rejects: a load with a fill but no mask, non-power-of-two tiles)."""
    from autofuse.plan import executor
    from autofuse.runner.evaluator import export_for_cuda

    graph = autofuse.capture(fn, *specs)
    cand = next(c for c in enumerate_candidates(graph) if c.template == "attention")
    run = executor(graph, plan_from_choices(graph, [(cand.group, "attention", cfg)]), interpret=False)
    out = jax.eval_shape(lambda *a: run(a)[0], *specs)

    def step(*a):
        _, pull = jax.vjp(lambda *x: run(x)[0], *a[:-1])
        return pull(a[-1])

    text = export_for_cuda(step, [*specs, S(out.shape, out.dtype)]).mlir_module()
    assert text.count("__gpu$xla.gpu.triton") == 3


@pytest.mark.slow
def test_backward_tiles_are_the_backwards_own():
    """attention_vjp's `bwd_` parameters tile the backward kernels apart from the forward: dK/dV hold `bwd_held`
    keys and step through the queries `bwd_step` at a time, dQ the reverse. Held 32 and stepped 16 on a ragged
    causal program matches jax.jit (interpret mode); held 128 and stepped 32 at D128 goes through the real Triton
    lowering for CUDA; both are configs of the template's search space."""
    from autofuse.kernels import attention_vjp
    from autofuse.plan import executor
    from autofuse.runner.evaluator import export_for_cuda

    def vjp_plan(specs, cfg):
        gfn, specs = _linear_loss_grad(attention_bhld_causal, specs, (0, 1, 2))
        graph = autofuse.capture(gfn, *specs)
        (cand,) = [c for c in enumerate_candidates(graph) if c.template == "attention_vjp"]
        space = attention_vjp.TEMPLATE.space(cand.group, cand.spec)
        assert not space["space"].violated(cfg, space["facts"]), space["space"].violated(cfg, space["facts"])
        return gfn, specs, graph, plan_from_choices(graph, [(cand.group, "attention_vjp", cfg)])

    gfn, specs, _, plan = vjp_plan([S((1, 2, 40, 32), F32)] * 3, {**SMALL_ATTN, "bwd_held": 32, "bwd_step": 16, "bwd_warps": 4, "bwd_stages": 2})
    args = _inputs(specs)
    fused = autofuse.jit(gfn, plan=plan, on_miss="error")
    for g, w in zip(fused(*args), jax.jit(gfn)(*args)):
        ok, _, why = compare(g, w, 1e-4)
        assert ok, why
    assert fused.last_status.startswith("plan:")

    big = {"block_q": 128, "block_k": 128, "num_warps": 8, "num_stages": 3, "bwd_held": 128, "bwd_step": 32, "bwd_warps": 8, "bwd_stages": 3}
    gfn, specs, graph, plan = vjp_plan([S((2, 4, 256, 128), BF16)] * 3, big)
    (cand,) = [c for c in enumerate_candidates(graph) if c.template == "attention_vjp"]
    # the model sees the backward's tiles (so its best is not an arbitrary backward), and finds the causal block
    # ranges once per tile shape (per config, attention_vjp's 15360 configs took a minute at L2048)
    model = attention_vjp.TEMPLATE.model_time_ms
    assert model(cand.spec, big) != model(cand.spec, {**big, "bwd_held": 32, "bwd_step": 16})
    from autofuse.kernels.attention import block_ranges
    assert block_ranges(cand.spec.attn, 64, 32) is block_ranges(cand.spec.attn, 64, 32)
    run = executor(graph, plan, interpret=False)
    text = export_for_cuda(lambda *a: run(a), specs).mlir_module()
    assert text.count("__gpu$xla.gpu.triton") == 3




@pytest.mark.slow
def test_a_sequence_of_16_differentiates_with_16_row_backward_blocks():
    """The flash backward's default tiles never run past a short sequence (SPLADE's small inputs: 16 tokens): 16-row
    blocks, within the spaces' rule, and the gradients match jax.grad."""
    from autofuse.kernels.attention_vjp import backward_default_config

    specs = [S((1, 2, 16, 64), F32)] * 3
    plan, graph = _plan(attention_bhld_causal, specs, "attention", SMALL_ATTN)
    spec = next(c for c in enumerate_candidates(graph) if c.template == "attention").spec
    assert (backward_default_config(spec)["bwd_held"], backward_default_config(spec)["bwd_step"]) == (16, 16)
    _assert_grads_match(attention_bhld_causal, specs, plan, (0, 1, 2))
