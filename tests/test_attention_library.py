"""A cuDNN attention call (`jax.nn.dot_product_attention(..., implementation="cudnn")`) is one opaque node: the
`attention` template reads it as the attention it computes and offers the flash kernel for it, checked here in
interpret mode against JAX's own XLA path (cuDNN cannot run on a CPU; capturing the call needs JAX's cuDNN checks
patched) and lowered for CUDA."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autofuse
from autofuse.kernels import TEMPLATES
from autofuse.kernels.attention_library import cudnn_call
from autofuse.plan import executor, plan_from_choices
from autofuse.runner.evaluator import export_for_cuda, lowering_guard
from autofuse.tuning.partition import enumerate_candidates

S = jax.ShapeDtypeStruct
BF16 = jnp.bfloat16


@pytest.fixture
def cudnn_traceable(monkeypatch):
    """JAX's cuDNN version and compute-capability checks passed, so that the call traces on a CPU (it cannot run)."""
    import jax._src.cudnn.fused_attention_stablehlo as fa

    monkeypatch.setattr(fa, "check_cudnn_version", lambda: 90500)
    monkeypatch.setattr(fa, "check_compute_capability", lambda capability: True)


def cudnn_causal(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


def cudnn_scaled(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, scale=0.3, implementation="cudnn")


def cudnn_windowed(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=(16, 0), implementation="cudnn")


REFERENCES = {  # each call on JAX's own XLA path
    cudnn_causal: lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla"),
    cudnn_scaled: lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=0.3, implementation="xla"),
}


GQA = [(2, 100, 8, 64), (2, 100, 2, 64), (2, 100, 2, 64)]  # four query heads per key head


@pytest.mark.parametrize("fn,backend,config,shapes", [
    pytest.param(cudnn_causal, "triton", {"block_q": 32, "block_k": 32, "num_warps": 4, "num_stages": 2}, [(2, 100, 2, 64)] * 3, id="causal-triton"),
    pytest.param(cudnn_scaled, "mosaic_gpu", None, [(2, 100, 2, 64)] * 3, id="scaled-mosaic-gpu-default-config"),
    pytest.param(cudnn_causal, "mosaic_gpu", None, GQA, id="grouped-query-causal-mosaic-gpu-default-config"),
])
def test_a_cudnn_call_is_an_attention_group_whose_kernel_computes_it(cudnn_traceable, fn, backend, config, shapes):
    """Grouped-query heads too: read as the same attention in plain jnp with the key and value heads repeated."""
    g = autofuse.capture(fn, *[S(shape, BF16) for shape in shapes])
    (node,) = [n for n in g.nodes if n.name == "custom_vjp_call"]
    assert cudnn_call(node) is not None
    cands = [c for c in enumerate_candidates(g) if c.template == "attention"]
    assert [sorted(c.nodes) for c in cands] == [[node.id]]
    tmpl, cand = TEMPLATES["attention"], cands[0]
    cfg = config or tmpl.default_config_of(cand.spec, backend)
    kernel = tmpl.build(cand.group, cfg, backend=backend, interpret=True, spec=cand.spec)
    ins = [jax.random.normal(jax.random.key(i), shape, jnp.float32).astype(BF16) for i, shape in enumerate(shapes)]
    by_position = dict(zip(g.inputs, ins))
    (out,) = kernel(*[by_position.get(v, jnp.zeros(g.aval(v).shape, g.aval(v).dtype)) for v in cand.group.inputs])
    want = jax.jit(REFERENCES[fn])(*ins)
    err = float(jnp.linalg.norm((out - want).astype(jnp.float32)) / jnp.linalg.norm(want.astype(jnp.float32)))
    assert out.shape == want.shape and out.dtype == want.dtype and err < 2e-2, err
    # the whole program with the call replaced: nothing of cuDNN is left to run
    fused = autofuse.jit(fn, plan=plan_from_choices(g, [(cand.group, "attention", {**cfg, "backend": backend})]), on_miss="error")
    got = fused(*ins)
    assert fused.last_status.startswith("plan:") and float(jnp.max(jnp.abs((got - out).astype(jnp.float32)))) == 0.0
    lowering_guard(tmpl.build(cand.group, cfg, backend=backend, interpret=False, spec=cand.spec),
                   [S(a.shape, a.dtype) for a in cand.group.input_avals()])


def test_calls_that_are_not_plain_softmax_attention_stay_cudnns(cudnn_traceable):
    """A sliding window (and a bias, dropout, padding) is no plain attention the captured XLA path would equal: no
    candidate; and a program without a cuDNN call gets none of these groups."""
    g = autofuse.capture(cudnn_windowed, *[S((1, 64, 2, 64), BF16)] * 3)
    (node,) = [n for n in g.nodes if n.name == "custom_vjp_call"]
    assert cudnn_call(node) is None
    assert not [c for c in enumerate_candidates(g) if c.template == "attention"]
    plain = autofuse.capture(lambda x: jnp.tanh(x) * 2, S((8, 8), np.float32))
    assert TEMPLATES["attention"].candidate_groups(plain, lambda i: True) == []


def cudnn_loss(q, k, v):
    """A loss not linear in the attention output: its cotangent depends on the output, so the pair is not convex."""
    return jnp.sum(jnp.sin(cudnn_causal(q, k, v)).astype(jnp.float32) ** 2)


def xla_loss(q, k, v):
    return jnp.sum(jnp.sin(REFERENCES[cudnn_causal](q, k, v)).astype(jnp.float32) ** 2)


@pytest.mark.parametrize("backend,config,shapes", [
    pytest.param("triton", {"block_q": 32, "block_k": 32, "num_warps": 4, "num_stages": 2}, [(2, 100, 2, 64)] * 3, id="triton"),
    pytest.param("mosaic_gpu", None, [(2, 100, 2, 64)] * 3, id="mosaic-gpu-default-config"),
    pytest.param("triton", {"block_q": 32, "block_k": 32, "num_warps": 4, "num_stages": 2}, GQA, id="grouped-query-triton"),
])
def test_a_training_steps_cudnn_pair_runs_as_the_flash_pair(cudnn_traceable, backend, config, shapes):
    """In `jax.grad` cuDNN attention is two primitives, the forward and the backward reading its softmax statistics:
    one `attention_vjp` candidate in two stages (the forward where it is, the backward where it is), whose flash pair
    gives the gradients of JAX's XLA path; a plan of it leaves nothing of cuDNN to run (so it runs on a CPU)."""
    step = jax.grad(cudnn_loss, argnums=(0, 1, 2))
    g = autofuse.capture(step, *[S(shape, BF16) for shape in shapes])
    fwd, bwd = ([n.id for n in g.nodes if n.name == f"dot_product_attention_{d}_wrapper"] for d in ("fwd", "bwd"))
    (cand,) = [c for c in enumerate_candidates(g) if c.template == "attention_vjp"]
    assert sorted(cand.nodes) == fwd + bwd and [sorted(st) for st in cand.stages] == [fwd, bwd]
    tmpl = TEMPLATES["attention_vjp"]
    cfg = {**(config or tmpl.default_config_of(cand.spec, backend)), "backend": backend}
    fused = autofuse.jit(step, plan=plan_from_choices(g, [(cand.group, "attention_vjp", cfg, cand.stages)]), on_miss="error")
    ins = [jax.random.normal(jax.random.key(i), shape, jnp.float32).astype(BF16) for i, shape in enumerate(shapes)]
    got = fused(*ins)
    assert fused.last_status.startswith("plan:")
    for a, b in zip(got, jax.jit(jax.grad(xla_loss, argnums=(0, 1, 2)))(*ins)):
        err = float(jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.linalg.norm(b.astype(jnp.float32)))
        assert a.shape == b.shape and a.dtype == b.dtype and err < 3e-2, err
    for st in tmpl.build_stages(cand.group, cand.stages, cfg, backend=backend, interpret=False, spec=cand.spec):
        assert callable(st)


def test_the_model_prices_cudnn_by_the_flash_kernels_measured_ratio(cudnn_traceable):
    """XLA's option of a cuDNN call (or pair) is the flash kernel's modelled default over cuDNN's measured ratio to it:
    ahead of the kernel at head dim 64, so that a short budget reaches it (at its memory floor, it never was),
    behind it for the pair at 128, where our backward trails cuDNN's."""
    from autofuse import costmodel
    from autofuse.kernels.attention_library import CUDNN_FORWARD_FACTOR, pair_factor
    from autofuse.tuning.space import CandidateSpace

    for d, ahead in ((64, True), (128, False)):
        shape = (2, 256, 2, d)
        (call,) = [c for c in enumerate_candidates(autofuse.capture(cudnn_causal, *[S(shape, BF16)] * 3)) if c.template == "attention"]
        sp = CandidateSpace.of("attention", call.group, call.spec, backends=("mosaic_gpu", "triton"))
        assert sp.xla_model_ms == pytest.approx(CUDNN_FORWARD_FACTOR * TEMPLATES["attention"].default_model_ms(call.spec))
        assert sp.xla_model_ms > sp.default_ms()
        g = autofuse.capture(jax.grad(cudnn_loss, argnums=(0, 1, 2)), *[S(shape, BF16)] * 3)
        (pair,) = [c for c in enumerate_candidates(g) if c.template == "attention_vjp"]
        sp = CandidateSpace.of("attention_vjp", pair.group, pair.spec, backends=("mosaic_gpu", "triton"))
        assert sp.xla_model_ms == pytest.approx(pair_factor(d) * TEMPLATES["attention_vjp"].default_model_ms(pair.spec))
        assert (sp.xla_model_ms > sp.default_ms()) is ahead
    # JAX's XLA path read as the library's attention is no cuDNN: XLA's option is its own fusions, as for any group
    g = autofuse.capture(jax.grad(lambda *a: jnp.sum(projected_gqa(*a).astype(jnp.float32) ** 2), argnums=(0, 1, 2, 3)),
                         *[S(s, BF16) for s in ((2, 100, 128), (128, 512), (128, 128), (128, 128))])
    (pair,) = [c for c in enumerate_candidates(g) if c.template == "attention_vjp"]
    sp = CandidateSpace.of("attention_vjp", pair.group, pair.spec, backends=("mosaic_gpu", "triton"))
    assert pair.spec.feeds and sp.xla_model_ms == pytest.approx(costmodel.xla_group_time_ms(pair.group))


def test_the_xla_paths_gradient_runs_as_the_flash_pair():
    """`jax.grad` through `jax.nn.dot_product_attention` on JAX's XLA path (float32, or where cuDNN declines): one
    two-stage `attention_vjp` candidate, its flash pair's gradients those of `jax.jit` (the key's sequence axis sits
    past the query's unit axis in the score dot's output: once read as a unit axis, its gradient was summed away)."""
    shape = (2, 100, 2, 64)
    step = jax.grad(xla_loss, argnums=(0, 1, 2))
    g = autofuse.capture(step, *[S(shape, np.float32)] * 3)
    (cand,) = [c for c in enumerate_candidates(g) if c.template in ("attention", "attention_vjp")]
    assert cand.template == "attention_vjp" and len(cand.stages) == 2
    cfg = {"block_q": 32, "block_k": 32, "num_warps": 4, "num_stages": 2, "backend": "triton"}
    fused = autofuse.jit(step, plan=plan_from_choices(g, [(cand.group, "attention_vjp", cfg, cand.stages)]), on_miss="error")
    ins = [jax.random.normal(jax.random.key(i), shape, np.float32) for i in range(3)]
    for a, b in zip(fused(*ins), jax.jit(step)(*ins)):
        assert a.shape == b.shape and float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) < 1e-4
    assert fused.last_status.startswith("plan:")


@pytest.mark.parametrize("program", ["call", "pair"])
def test_the_cover_takes_the_flash_kernel_where_it_beat_cudnn_alone(cudnn_traceable, program):
    """Left alone, a cuDNN call (or a step's forward and backward) runs as its group's XLA option: the cover prices it
    so (not at the model's memory floor, where leaving it alone looked free), and takes the kernel exactly where the
    kernel measured faster than cuDNN."""
    from autofuse.tuning.job import distinct_candidates
    from autofuse.tuning.select import best_cover
    from autofuse import costmodel

    fn = cudnn_causal if program == "call" else jax.grad(cudnn_loss, argnums=(0, 1, 2))
    g = autofuse.capture(fn, *[S((2, 256, 2, 64), BF16)] * 3)
    by_sig, cands = distinct_candidates(g)
    (r,) = [c for c in cands if c.template.startswith("attention")]
    for fused_ms, taken in ((0.21, True), (0.23, False)):
        r.xla_ms, r.best_ms, r.best_config = 0.22, fused_ms, {"backend": "triton"}
        cover = best_cover(g, by_sig, cands, costmodel.H200, "device")
        assert any(grp.signature == r.signature for grp in cover.plan.groups) is taken
        assert cover.tuned_ms == pytest.approx(cover.baseline_ms - (0.01 if taken else 0.0))


def projected_gqa(x, wq, wk, wv):
    """Grouped-query attention at `jax.nn.dot_product_attention`'s default (JAX's XLA path), its operands made by
    projections (which the partitioner's growth wanders into before it reaches the second product)."""
    B, T, _ = x.shape
    q, k, v = jnp.tanh(x @ wq).reshape(B, T, 8, 64), (x @ wk).reshape(B, T, 2, 64), (x @ wv).reshape(B, T, 2, 64)
    return jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(B, T, 512) * 2


@pytest.mark.parametrize("backend,config", [
    pytest.param("triton", {"block_q": 32, "block_k": 32, "num_warps": 4, "num_stages": 2}, id="triton"),
    pytest.param("mosaic_gpu", None, id="mosaic-gpu-default-config"),
])
def test_grouped_query_attention_on_jaxs_xla_path_is_one_attention_group(backend, config):
    """JAX's XLA path transposes grouped-query scores between its two products; the call's equations are recognised
    as `jax.nn.dot_product_attention` by what they compute and run as the flash kernel (of the same attention with
    the key and value heads repeated), matching `jax.jit`; a masked or unscaled variant of the path is not it."""
    shapes = [(2, 100, 128), (128, 512), (128, 128), (128, 128)]
    g = autofuse.capture(projected_gqa, *[S(s, BF16) for s in shapes])
    (cand,) = [c for c in enumerate_candidates(g) if c.template == "attention"]
    names = [g.node_index[i].name for i in sorted(cand.nodes)]
    assert names[0] == "reshape" and names.count("dot_general") == 2 and names[-1] == "reshape"
    cfg = {**(config or TEMPLATES["attention"].default_config_of(cand.spec, backend)), "backend": backend}
    fused = autofuse.jit(projected_gqa, plan=plan_from_choices(g, [(cand.group, "attention", cfg)]), on_miss="error")
    ins = [jax.random.normal(jax.random.key(i), s, jnp.float32).astype(BF16) * 0.3 for i, s in enumerate(shapes)]
    got, want = fused(*ins), jax.jit(projected_gqa)(*ins)
    err = float(jnp.linalg.norm((got - want).astype(jnp.float32)) / jnp.linalg.norm(want.astype(jnp.float32)))
    assert fused.last_status.startswith("plan:") and err < 2e-2, err
    lowering_guard(TEMPLATES["attention"].build(cand.group, cfg, backend=backend, interpret=False, spec=cand.spec),
                   [S(a.shape, a.dtype) for a in cand.group.input_avals()])


def test_only_jaxs_own_attention_is_read_as_it():
    """A query scaled before the call is read as the call's own query (the scaled value), and a bias passed to it as
    its bias (an input of the group, fed to the kernel): each group is read as what it computes."""
    from autofuse.kernels.attention_library import xla_path_groups
    from autofuse.kernels.attention import _match

    def biased(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, bias=jnp.ones((1, 8, 100, 100), BF16), is_causal=True)

    def rescaled(q, k, v):
        return jax.nn.dot_product_attention(q * 2, k, v, is_causal=True)

    for fn, n_in in ((biased, 4), (rescaled, 3)):
        g = autofuse.capture(fn, *[S(s, BF16) for s in GQA])
        ((grp, spec),) = xla_path_groups(g, _match)
        assert len(spec.feeds) == len(grp.inputs) == n_in and set(spec.feeds.values()) == set(grp.inputs)
        # the rescaling is outside the group: the group's own q is the scaled one (the biased call's, the program's)
        assert (g.producer.get(spec.feeds[spec.group.graph.inputs[0]]) is not None) == (fn is rescaled)


@pytest.mark.parametrize("backend,config", [
    pytest.param("triton", {"block_q": 32, "block_k": 32, "num_warps": 4, "num_stages": 2}, id="triton"),
    pytest.param("mosaic_gpu", None, id="mosaic-gpu-default-config"),
])
def test_a_training_step_through_grouped_query_attention_on_jaxs_xla_path_runs_the_flash_pair(backend, config):
    """`jax.grad` through it: its forward chain (read past the layout ops that move the output back) and every node
    of its derivative are one two-stage `attention_vjp` candidate; the flash pair's gradients match `jax.jit`'s."""
    def loss(x, wq, wk, wv):
        return jnp.sum(jnp.sin(projected_gqa(x, wq, wk, wv)).astype(jnp.float32) ** 2)

    shapes = [(2, 100, 128), (128, 512), (128, 128), (128, 128)]
    step = jax.grad(loss, argnums=(0, 1, 2, 3))
    g = autofuse.capture(step, *[S(s, BF16) for s in shapes])
    (cand,) = [c for c in enumerate_candidates(g) if c.template in ("attention", "attention_vjp")]
    assert cand.template == "attention_vjp" and len(cand.stages) == 2
    tmpl = TEMPLATES["attention_vjp"]
    cfg = {**(config or tmpl.default_config_of(cand.spec, backend)), "backend": backend}
    fused = autofuse.jit(step, plan=plan_from_choices(g, [(cand.group, "attention_vjp", cfg, cand.stages)]), on_miss="error")
    ins = [jax.random.normal(jax.random.key(i), s, jnp.float32).astype(BF16) * 0.3 for i, s in enumerate(shapes)]
    got = fused(*ins)
    assert fused.last_status.startswith("plan:")
    for a, b in zip(got, jax.jit(step)(*ins)):
        err = float(jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.linalg.norm(b.astype(jnp.float32)))
        assert a.shape == b.shape and err < 3e-2, err


def with_lengths(q, k, v, mask):
    """`jax.nn.dot_product_attention` at its default with the padding given as key lengths summed from a mask in the
    program, as BERT-style encoders write it (examples/splade.py)."""
    return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=jnp.sum(mask, axis=-1, dtype=jnp.int32))


def lengths_loss(q, k, v, mask):
    return jnp.sum(jnp.sin(with_lengths(q, k, v, mask).astype(jnp.float32)) ** 2)


LENGTHS_SHAPE = (2, 100, 2, 64)
#: the second row has no key at all: XLA weighs its masked keys alike (exp(fill - max) = 1); the kernels once
#: overflowed the fill times log2(e) there (NaN), and read the fill itself from memory (a [B, H, L, L] input)
LENGTHS_MASK = (jnp.arange(100)[None, :] < jnp.array([[37], [0]])).astype(jnp.int32)


def _lengths_inputs():
    return [jax.random.normal(jax.random.key(i), LENGTHS_SHAPE, jnp.float32).astype(BF16) for i in range(3)] + [LENGTHS_MASK]


@pytest.mark.parametrize("backend,config", [
    pytest.param("triton", {"block_q": 32, "block_k": 32, "num_warps": 4, "num_stages": 2}, id="triton"),
    pytest.param("mosaic_gpu", None, id="mosaic-gpu-default-config"),
])
def test_key_lengths_on_jaxs_xla_path_are_one_attention_group_with_its_mask_made_inside(backend, config):
    """The forward: the mask's fill is made in the kernel (the widest candidate reads q, k, v and the lengths: no
    [B, H, L, L] array), and a row without keys gets XLA's numbers, not NaN."""
    g = autofuse.capture(with_lengths, *[S(LENGTHS_SHAPE, BF16)] * 3, S((2, 100), jnp.int32))
    cand = max((c for c in enumerate_candidates(g) if c.template == "attention"), key=lambda c: len(c.nodes))
    assert all(len(g.avals[v].shape) < 5 for v in cand.group.inputs) and len(cand.group.inputs) == 4
    cfg = {**(config or TEMPLATES["attention"].default_config_of(cand.spec, backend)), "backend": backend}
    fused = autofuse.jit(with_lengths, plan=plan_from_choices(g, [(cand.group, "attention", cfg)]), on_miss="error")
    got, want = fused(*_lengths_inputs()), jax.jit(with_lengths)(*_lengths_inputs())
    assert fused.last_status.startswith("plan:") and not bool(jnp.any(jnp.isnan(got)))
    assert float(jnp.max(jnp.abs((got - want).astype(jnp.float32)))) < 2e-2


@pytest.mark.parametrize("backend,config", [
    pytest.param("triton", {"block_q": 32, "block_k": 32, "num_warps": 4, "num_stages": 2}, id="triton"),
    pytest.param("mosaic_gpu", None, id="mosaic-gpu-default-config"),
])
def test_a_training_step_through_key_lengths_on_jaxs_xla_path_runs_the_flash_pair(backend, config):
    """The lengths' sum over the mask is an operand of the attention, not part of its chain (the forward chain once
    took it in, found two sums and no attention): one two-stage `attention_vjp` candidate whose gradients match
    jax.jit's, padded keys masked per batch row, a row without keys weighing them alike (its row logsumexp keeps
    log(keys) beside the fill: at float32's lowest it was lost, and each key weighed 1)."""
    step = jax.grad(lengths_loss, argnums=(0, 1, 2))
    g = autofuse.capture(step, *[S(LENGTHS_SHAPE, BF16)] * 3, S((2, 100), jnp.int32))
    (cand,) = [c for c in enumerate_candidates(g) if c.template in ("attention", "attention_vjp")]
    assert cand.template == "attention_vjp" and len(cand.stages) == 2
    cfg = {**(config or TEMPLATES["attention_vjp"].default_config_of(cand.spec, backend)), "backend": backend}
    fused = autofuse.jit(step, plan=plan_from_choices(g, [(cand.group, "attention_vjp", cfg, cand.stages)]), on_miss="error")
    got = fused(*_lengths_inputs())
    assert fused.last_status.startswith("plan:")
    for a, b in zip(got, jax.jit(step)(*_lengths_inputs())):
        err = float(jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.linalg.norm(b.astype(jnp.float32)))
        assert a.shape == b.shape and err < 3e-2, err
    assert float(jnp.max(jnp.abs(got[1][0, 37:]))) == 0.0  # keys past a row's length get no gradient
    if backend == "mosaic_gpu":  # the pair lowers for CUDA for real: the Mosaic GPU forward and backward (the lengths
        # read per CTA in both), no Triton kernel
        run = executor(g, plan_from_choices(g, [(cand.group, "attention_vjp", cfg, cand.stages)]), interpret=False)
        module = export_for_cuda(lambda *a: run(list(a)), [S(LENGTHS_SHAPE, BF16)] * 3 + [S((2, 100), jnp.int32)]).mlir_module()
        assert module.count("custom_call @mosaic_gpu_v2") >= 2 and "__gpu$xla.gpu.triton" not in module


def with_bias(q, k, v, bias):
    return jax.nn.dot_product_attention(q, k, v, bias=bias)


@pytest.mark.parametrize("backend,config", [
    pytest.param("triton", {"block_q": 32, "block_k": 32, "num_warps": 4, "num_stages": 2}, id="triton"),
    pytest.param("mosaic_gpu", None, id="mosaic-gpu-default-config"),
])
def test_a_bias_on_jaxs_xla_path_is_read_along_the_heads_when_they_number_the_batch(backend, config):
    """A bias [1, H, L, L] on JAX's XLA path reaches the scores [G, B, K, L, L] through a reshape to [1, H, 1, L, L]:
    with as many heads as batch rows its sizes match the scores' dim by dim, and the bias was once placed along the
    batch (every row but the first read another row's heads: relative error 0.8). It is placed from the scores."""
    shape = (2, 100, 2, 64)  # B == H
    g = autofuse.capture(with_bias, *[S(shape, BF16)] * 3, S((1, 2, 100, 100), BF16))
    cand = max((c for c in enumerate_candidates(g) if c.template == "attention"), key=lambda c: len(c.nodes))
    cfg = {**(config or TEMPLATES["attention"].default_config_of(cand.spec, backend)), "backend": backend}
    fused = autofuse.jit(with_bias, plan=plan_from_choices(g, [(cand.group, "attention", cfg)]), on_miss="error")
    ins = [jax.random.normal(jax.random.key(i), s, jnp.float32).astype(BF16) for i, s in enumerate([shape] * 3 + [(1, 2, 100, 100)])]
    got, want = fused(*ins), jax.jit(with_bias)(*ins)
    err = float(jnp.linalg.norm((got - want).astype(jnp.float32)) / jnp.linalg.norm(want.astype(jnp.float32)))
    assert fused.last_status.startswith("plan:") and err < 1e-2, err


@pytest.mark.parametrize("backend,config", [
    pytest.param("triton", {"block_q": 32, "block_k": 32, "num_warps": 4, "num_stages": 2}, id="triton"),
    pytest.param("mosaic_gpu", None, id="mosaic-gpu-default-config"),
])
def test_a_training_step_through_a_constant_bias_runs_the_flash_pair_and_a_learned_one_does_not(backend, config):
    """The flash backward generates no bias gradient: a step that differentiates q, k and v only (a fixed bias: ALiBi,
    relative positions) runs the pair, with jax.jit's gradients; one that also reads the bias's gradient keeps XLA's."""
    shape, bshape = (2, 100, 2, 64), (1, 2, 100, 100)

    def loss(q, k, v, bias):
        return jnp.sum(jnp.sin(with_bias(q, k, v, bias).astype(jnp.float32)) ** 2)

    learned = autofuse.capture(jax.grad(loss, argnums=(0, 1, 2, 3)), *[S(shape, BF16)] * 3, S(bshape, BF16))
    assert not [c for c in enumerate_candidates(learned) if c.template == "attention_vjp"]
    step = jax.grad(loss, argnums=(0, 1, 2))
    g = autofuse.capture(step, *[S(shape, BF16)] * 3, S(bshape, BF16))
    (cand,) = [c for c in enumerate_candidates(g) if c.template == "attention_vjp"]
    cfg = {**(config or TEMPLATES["attention_vjp"].default_config_of(cand.spec, backend)), "backend": backend}
    fused = autofuse.jit(step, plan=plan_from_choices(g, [(cand.group, "attention_vjp", cfg, cand.stages)]), on_miss="error")
    ins = [jax.random.normal(jax.random.key(i), s, jnp.float32).astype(BF16) for i, s in enumerate([shape] * 3 + [bshape])]
    got = fused(*ins)
    assert fused.last_status.startswith("plan:")
    for a, b in zip(got, jax.jit(step)(*ins)):
        err = float(jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.linalg.norm(b.astype(jnp.float32)))
        assert a.shape == b.shape and err < 3e-2, err


GQA_EXTRAS = {  # grouped-query heads on JAX's XLA path with another argument: its inputs past q, k, v, and their values
    "key-lengths": (lambda q, k, v, n: jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=n),
                    [S((2,), jnp.int32)], lambda: [jnp.array([37, 0], jnp.int32)]),
    "bias": (lambda q, k, v, b: jax.nn.dot_product_attention(q, k, v, bias=b),
             [S((1, 4, 100, 100), BF16)], lambda: [jax.random.normal(jax.random.key(7), (1, 4, 100, 100)).astype(BF16)]),
    "bias-and-key-lengths": (lambda q, k, v, b, n: jax.nn.dot_product_attention(q, k, v, bias=b, key_value_seq_lengths=n),
                             [S((1, 4, 100, 100), BF16), S((2,), jnp.int32)],
                             lambda: [jax.random.normal(jax.random.key(7), (1, 4, 100, 100)).astype(BF16), jnp.array([37, 0], jnp.int32)]),
    # Mistral's and Gemma's local layers: the window's positions are constants of the trace, matched by their contents
    # (the window once matched and then ran unwindowed: the captured kernel must carry it too)
    "sliding-window": (lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=(16, 0)),
                       [], lambda: []),
}


@pytest.mark.parametrize("kind", list(GQA_EXTRAS))
@pytest.mark.parametrize("backend,config", [
    pytest.param("triton", {"block_q": 32, "block_k": 32, "num_warps": 4, "num_stages": 2}, id="triton"),
    pytest.param("mosaic_gpu", None, id="mosaic-gpu-default-config"),
])
def test_grouped_query_attention_with_lengths_a_bias_or_a_window_on_jaxs_xla_path_runs_the_flash_kernels(kind, backend, config):
    """Grouped-query heads on JAX's XLA path are recognised by what they compute: with key lengths (a row without keys
    among them), a bias or a sliding window too, the call is read with them (`attention_library.XlaCall`) and runs as
    the flash kernel, its training step (q, k, v differentiated) as the flash pair; both match jax.jit."""
    fn, extra_specs, extras = GQA_EXTRAS[kind]
    specs = [S((2, 100, 4, 64), BF16), S((2, 100, 2, 64), BF16), S((2, 100, 2, 64), BF16), *extra_specs]
    ins = [jax.random.normal(jax.random.key(i), s.shape, jnp.float32).astype(BF16) for i, s in enumerate(specs[:3])] + extras()

    def loss(*a):
        return jnp.sum(jnp.sin(fn(*a).astype(jnp.float32)) ** 2)

    for program, template in ((fn, "attention"), (jax.grad(loss, argnums=(0, 1, 2)), "attention_vjp")):
        g = autofuse.capture(program, *specs)
        (cand,) = [c for c in enumerate_candidates(g) if c.template in ("attention", "attention_vjp")]
        assert cand.template == template and cand.spec.feeds
        cfg = {**(config or TEMPLATES[template].default_config_of(cand.spec, backend)), "backend": backend}
        fused = autofuse.jit(program, plan=plan_from_choices(g, [(cand.group, template, cfg, cand.stages)]), on_miss="error")
        got, want = fused(*ins), jax.jit(program)(*ins)
        assert fused.last_status.startswith("plan:")
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            err = float(jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.linalg.norm(b.astype(jnp.float32)))
            assert a.shape == b.shape and err < 3e-2, (template, err)


def test_a_sliding_windows_positions_are_known_at_build_time_so_its_dead_blocks_are_skipped():
    """JAX's XLA path makes a window's positions as constants of the trace: the mask analysis reads them as it reads
    an iota, so the kernels know the window's blocks at build time and visit only those (a quarter of a causal grid's
    keys here, a quarter of its blocks) instead of every block below the diagonal."""
    from autofuse.kernels import attention_masks
    from benchmarks.workloads import attention_library_gqa_window

    g = autofuse.capture(attention_library_gqa_window, S((1, 512, 8, 64), BF16), S((1, 512, 2, 64), BF16), S((1, 512, 2, 64), BF16))
    (cand,) = [c for c in enumerate_candidates(g) if c.template == "attention"]
    assert attention_masks._known_consts(cand.spec)
    attention_masks._analyze_masks(cand.spec)
    live = cand.spec.live.some.mean()
    assert cand.spec.mask_selects and 0.1 < live < 0.35, live  # causal alone: over a half
    ranges = attention_masks.block_ranges(cand.spec, 64, 64)
    assert ranges is not None and max(int(hi - lo) for lo, _, _, hi in ranges) == 3  # window 128 + the diagonal: 3 of 8
