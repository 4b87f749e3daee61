"""A layer norm or RMS norm feeding a matmul, folded around the GEMM (`kernels.prologue_fold`) on the Mosaic GPU
lowering: values against `jax.jit` in interpret mode (ragged M and N, the GPT-2 layer norm as the partitioner
cuts it, a QKV split after it), a mean far above the spread (the fold's terms cancel exactly against the rounded
W'), what does not fold (said in one line), and the real CUDA lowering of the folded kernel."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autofuse
from autofuse.graph import Group
from autofuse.kernels import matmul
from autofuse.kernels.mosaic_gpu import matmul as mgpu_matmul
from autofuse.kernels.mosaic_gpu.tiles import Unsupported
from autofuse.runner.evaluator import Evaluator, export_for_cuda
from autofuse.runner.in_program import in_program
from autofuse.runner.protocol import TrialRequest
from autofuse.status import TrialStatus
from autofuse.tuning.partition import is_fusible
from examples.gpt2 import layer_norm
from tests.kernel_checks import rel_err

BF16, F32 = jnp.bfloat16, jnp.float32
S = jax.ShapeDtypeStruct
M, K, N = 100, 128, 136  # M and N ragged against every tile


def ln_gemm_gelu(x, mean, rstd, g, b, w, bias):
    """The normalisation's elementwise half on given statistics, then a GEMM with bias and GELU: one group."""
    y = ((x.astype(F32) - mean) * rstd * g + b).astype(BF16)
    return jax.nn.gelu(y @ w + bias, approximate=True)


def rms_gemm(x, rstd, g, w):
    return ((x.astype(F32) * rstd * g).astype(BF16) @ w,)


def _whole(fn, shapes, dtypes):
    g = autofuse.capture(fn, *[S(s, d) for s, d in zip(shapes, dtypes)])
    group = Group.of(g, [n.id for n in g.nodes])
    spec = matmul.match(group)
    assert spec is not None and spec.pro, "one dot with a prologue on A"
    return group, spec


def _inputs(shapes, dtypes, mean=0.0, seed=0):
    """Random inputs whose statistics are x's own: x (with `mean` added to every row), then its mean and 1 / spread
    for a layer norm (7 inputs) or its 1 / root mean square for an RMS norm (4), then the rest."""
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    xs = [jax.random.normal(k, s, F32).astype(d) for k, s, d in zip(keys, shapes, dtypes)]
    x = (xs[0].astype(F32) + mean).astype(xs[0].dtype)
    xf = x.astype(F32)
    if len(shapes) == 7:
        return [x, xf.mean(-1, keepdims=True), jax.lax.rsqrt(xf.var(-1, keepdims=True) + 1e-5), *xs[3:]]
    return [x, jax.lax.rsqrt((xf * xf).mean(-1, keepdims=True) + 1e-5), *xs[2:]]


LN_SHAPES = [(M, K), (M, 1), (M, 1), (K,), (K,), (K, N), (N,)]
LN_DTYPES = [BF16, F32, F32, F32, F32, BF16, BF16]


@pytest.mark.parametrize("mean", [0.0, 100.0], ids=["centred", "mean-100-sigma"])
def test_layer_norm_gemm_folds_and_matches_xla(mean):
    """A mean a hundred times the spread: the mean's term is taken against the rounded W' itself, so it cancels as
    the centred operand would (taken against W unrounded, the error would be ~100x bf16's rounding: ~0.1)."""
    group, spec = _whole(ln_gemm_gelu, LN_SHAPES, LN_DTYPES)
    cfg = mgpu_matmul.default_config(spec)
    kernel = mgpu_matmul.lower(group, spec, cfg, interpret=True, num_sms=2)
    xs = _inputs(LN_SHAPES, LN_DTYPES, mean=mean)
    (out,) = jax.block_until_ready(kernel(*xs))
    ref = jax.jit(ln_gemm_gelu)(*xs)
    assert out.dtype == ref.dtype == BF16
    assert rel_err(out, ref) <= 1e-2


def test_rms_norm_gemm_folds_to_a_row_scale():
    shapes, dtypes = [(M, K), (M, 1), (K,), (K, N)], [BF16, F32, F32, BF16]
    group, spec = _whole(rms_gemm, shapes, dtypes)
    fold = mgpu_matmul.folded(spec)
    assert [n.name for n in fold.spec.group.nodes][:2] == ["dot_general", "mul"]  # x @ (g W), then the row scale: no terms
    kernel = mgpu_matmul.lower(group, spec, {**mgpu_matmul.default_config(spec), "pingpong": 0}, interpret=True, num_sms=2)
    xs = _inputs(shapes, dtypes)
    (out,) = kernel(*xs)
    (ref,) = jax.jit(rms_gemm)(*xs)
    assert rel_err(out, ref) <= 1e-2


def _gpt2_graph(N_out):
    """GPT-2's layer norm as written (its statistics, the normalisation, gamma and beta), a GEMM after it."""
    def block(x, p):
        h = layer_norm(x, p)
        y = h @ p["w"] + p["b"]
        if N_out == 3 * 64:
            q, k, v = jnp.split(y, 3, axis=-1)
            return q, k * 2, v + 1
        return jax.nn.gelu(y, approximate=True)

    k = jax.random.split(jax.random.key(1), 5)
    p = {"scale": 1 + 0.1 * jax.random.normal(k[0], (K,), BF16), "bias": 0.1 * jax.random.normal(k[1], (K,), BF16),
         "w": jax.random.normal(k[2], (K, N_out), BF16) / 10, "b": jax.random.normal(k[3], (N_out,), BF16)}
    x = jax.random.normal(k[4], (2, 50, K), BF16)
    return autofuse.capture(block, x, p)


def _trial(graph, group, config=None):
    spec = matmul.match(group)
    ev = Evaluator(graph, measure="device", interpret=True, n_input_sets=1, repeats=1, target_ms=1.0)
    cfg = {"backend": "mosaic_gpu", **(config or mgpu_matmul.default_config(spec))}
    return ev.handle(TrialRequest(group.node_ids, "matmul", cfg))


@pytest.mark.slow  # a trial through the evaluator: the quick subset keeps the kernel's own cases
def test_the_partitioners_layer_norm_gemm_group_folds_and_passes_its_check():
    """The group the partitioner offers (the normalisation's second half, the GEMM, bias and GELU; the statistics
    and x's float32 copy XLA's) runs on Mosaic GPU in a trial that checks it against XLA; timed alone, x's float32
    copy is made in front of it (`in_program`), as the program holds it."""
    graph = _gpt2_graph(N)
    groups = [c.group for c in autofuse.tuning.partition.enumerate_candidates(graph)
              if c.template == "matmul" and matmul.match(c.group).pro]
    group = max(groups, key=lambda g: len(g.node_ids))
    assert {"sub", "dot_general", "tanh"} <= {n.name for n in group.nodes}
    assert "convert_element_type" in [n.name for n in in_program(group).prologue]
    res = _trial(graph, group)
    assert res.status is TrialStatus.OK, res.error


@pytest.mark.slow
def test_a_qkv_split_with_its_layer_norm_is_offered_and_runs():
    graph = _gpt2_graph(3 * 64)
    offered = matmul.TEMPLATE.candidate_groups(graph, lambda i: is_fusible(graph, i))
    with_norm = [g for g, spec, _ in offered if spec.windows and spec.pro]
    assert len(with_norm) == 1 and "rsqrt" in {n.name for n in with_norm[0].nodes}
    res = _trial(graph, with_norm[0], {**mgpu_matmul.default_config(matmul.match(with_norm[0])), "pingpong": 0})
    assert res.status is TrialStatus.OK, res.error


@pytest.mark.parametrize("fn,why", [
    (lambda x, w: (jnp.tanh(x.astype(F32)).astype(BF16) @ w,), "not affine"),
    (lambda x, w: ((x * 2).astype(BF16) @ w,), "not exact"),  # x float32: rounding it would change the operand
], ids=["tanh", "float32-source"])
def test_a_prologue_that_does_not_fold_is_declined_in_one_line(fn, why):
    group, spec = _whole(fn, [(M, K), (K, N)], [BF16 if why == "not affine" else F32, BF16])
    with pytest.raises(Unsupported, match=why):
        mgpu_matmul.check_group(spec)
    assert "\n" not in matmul.TEMPLATE.unsupported(spec, "mosaic_gpu")


def test_the_folded_kernel_lowers_for_cuda():
    """The real Mosaic GPU lowering (no GPU) of the folded kernel, its default config and the cooperative one."""
    group, spec = _whole(ln_gemm_gelu, LN_SHAPES, LN_DTYPES)
    for cfg in (mgpu_matmul.default_config(spec), {**mgpu_matmul.default_config(spec), "pingpong": 0}):
        exp = export_for_cuda(mgpu_matmul.lower(group, spec, cfg), [S(a.shape, a.dtype) for a in group.input_avals()])
        assert "mosaic_gpu_v2" in exp.mlir_module()
        assert [(o.shape, o.dtype) for o in exp.out_avals] == [(a.shape, a.dtype) for a in group.output_avals()]


def test_a_widening_conversion_is_made_in_front_of_a_group_and_a_narrowing_one_is_not():
    def fn(x):
        return jnp.exp(x.astype(F32)), jnp.exp(x.astype(F32).astype(BF16))

    graph = autofuse.capture(fn, S((8, 16), BF16))
    exps = [Group.of(graph, [n.id]) for n in graph.nodes if n.name == "exp"]
    assert [[n.name for n in in_program(g).prologue] for g in exps] == [["convert_element_type"], []]
    np.testing.assert_array_equal(np.asarray(in_program(exps[0]).around(lambda *a: a)(jnp.ones((8, 16), BF16))[0]),
                                  np.ones((8, 16), np.float32))
