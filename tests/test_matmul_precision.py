"""A dot's precision is the program's (issue 31 item 3): read from the jaxpr, never searched.

A float32 dot at default precision runs as TF32 (as XLA's does on the GPU); one at `precision=HIGHEST`, or under
`jax.default_matmul_precision("float32")`, is a `matmul` candidate whose Triton kernel runs three-pass TF32 (exact
float32 in interpret mode on the CPU) and is checked at float32's bound; the Mosaic GPU lowering declines it, and
`precision=HIGH` stays in XLA.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autofuse
from autofuse.graph import Group
from autofuse.kernels import TEMPLATES, matmul
from autofuse.kernels.mosaic_gpu import matmul as mgpu_matmul
from autofuse.kernels.mosaic_gpu.tiles import Unsupported
from autofuse.runner.evaluator import export_for_cuda
from tests.kernel_checks import rel_err

F32, BF16 = jnp.float32, jnp.bfloat16
S = jax.ShapeDtypeStruct
M, N, K = 100, 72, 48  # ragged against the tiles
CFG = {"block_m": 32, "block_n": 32, "block_k": 16, "num_warps": 4, "num_stages": 2, "group_m": 4}


def highest(x, w, b):
    return jnp.tanh(jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST) + b)


def under_float32_context(x, w, b):
    with jax.default_matmul_precision("float32"):
        return jnp.tanh(x @ w + b)


def default(x, w, b):
    return jnp.tanh(x @ w + b)


def _spec(fn, dtype=F32):
    g = autofuse.capture(fn, S((M, K), dtype), S((K, N), dtype), S((N,), dtype))
    group = Group.of(g, [n.id for n in g.nodes])
    return g, group, matmul.match(group)


@pytest.mark.parametrize("fn,dtype,exact", [(highest, F32, True), (under_float32_context, F32, True), (default, F32, False),
                                            (highest, BF16, False)])
def test_the_programs_precision_decides_the_kernels(fn, dtype, exact):
    """HIGHEST on float32 operands asks for an exact product; a 16-bit dot's products are exact at any precision."""
    _, _, spec = _spec(fn, dtype)
    assert spec is not None and spec.exact_f32 is exact


def test_high_precision_stays_in_xla():
    _, _, spec = _spec(lambda x, w, b: jnp.tanh(jnp.dot(x, w, precision=jax.lax.Precision.HIGH) + b))
    assert spec is None


def test_exact_float32_kernel_matches_jit_at_float32s_bound():
    """The Triton kernel of a HIGHEST dot, in interpret mode, against jax.jit: within float32's bound, which the
    tuner's check holds it to (`measure.dot_tolerance`: an explicit precision adds nothing to the dtypes' bound)."""
    _, group, spec = _spec(highest)
    kernel = TEMPLATES["matmul"].build(group, CFG, spec=spec, interpret=True)
    keys = jax.random.split(jax.random.key(0), 3)
    xs = [jax.random.normal(k, a.shape, F32) for k, a in zip(keys, group.input_avals())]
    (out,) = kernel(*xs)
    assert rel_err(out, jax.jit(highest)(*xs)) <= 2e-5


def test_exact_float32_lowers_for_cuda_as_three_pass_tf32_and_mosaic_declines():
    _, group, spec = _spec(highest)
    kernel = TEMPLATES["matmul"].build(group, CFG, spec=spec)
    exp = export_for_cuda(kernel, [S(a.shape, a.dtype) for a in group.input_avals()])
    assert [(o.shape, o.dtype) for o in exp.out_avals] == [(a.shape, a.dtype) for a in group.output_avals()]
    with pytest.raises(Unsupported, match="HIGHEST"):
        mgpu_matmul.check_group(spec)
    assert np.dtype(group.output_avals()[0].dtype) == np.dtype(F32)
