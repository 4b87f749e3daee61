"""Products whose rows TMA cannot write (N x itemsize not a multiple of 16 bytes: GPT-2's vocabulary of 50257) written
by the Mosaic GPU `matmul` lowering through their [M / 8, 8 N] view (`interleave`, `RowClasses`), on the CPU: values
in interpret mode against `jax.jit` (the kernel's tiles and XLA's border columns together), the real lowering for
CUDA, the default's choice of G, and what it declines."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import autofuse
from autofuse.graph import Group
from autofuse.kernels import matmul
from autofuse.kernels.mosaic_gpu import matmul as mgpu_matmul
from autofuse.kernels.mosaic_gpu.tiles import Unsupported
from autofuse.runner.evaluator import Evaluator, export_for_cuda
from autofuse.runner.protocol import TrialRequest
from autofuse.status import TrialStatus
from autofuse.tuning.partition import enumerate_candidates
from examples.gpt2 import layer_norm
from tests.kernel_checks import rel_err
from tests.quick import slow_except

BF16, F32 = jnp.bfloat16, jnp.float32
S = jax.ShapeDtypeStruct
SMALL = {"block_m": 64, "block_n": 64, "block_k": 32, "max_concurrent_steps": 3, "epi_tile_m": 64, "epi_tile_n": 32,
         "grid_tile_width": 2, "grid_minor_dim": 0, "wg_dimension": 1}


def lm_head(x, w):  # B stored [N, K], as a tied embedding is
    return jnp.einsum("mk,nk->mn", x, w)


def lm_head_kn(x, w):  # B stored [K, N]: transposed outside the kernel
    return x @ w


def vectors_tanh(x, w, b, s):  # a column and a row vector in the epilogue, a float32 output
    return jnp.tanh((jnp.einsum("mk,nk->mn", x, w) + b) * s[:, None]).astype(F32)


def two_outputs(x, w):
    h = jnp.einsum("mk,nk->mn", x, w)
    return h, h * jax.nn.sigmoid(h)


CASES = [
    # 8 classes of 64 rows, 201 columns (N = 1 mod 8: every class shifted), ping-pong
    pytest.param(lm_head, [(512, 64), (201, 64)], {**SMALL, "pingpong": 1, "interleave": 8}, id="pingpong-g8-n201"),
    pytest.param(lm_head_kn, [(512, 64), (64, 203)], {**SMALL, "pingpong": 1, "interleave": 8}, id="pingpong-g8-B-kn"),
    # N = 2 mod 8: four shifts (copies of B), each read by two classes
    pytest.param(lm_head, [(512, 64), (202, 64)], {**SMALL, "pingpong": 1, "interleave": 8}, id="pingpong-g8-n202"),
    pytest.param(vectors_tanh, [(1024, 64), (203, 64), (203,), (1024,)], {**SMALL, "interleave": 8}, id="cooperative-g8-vectors"),
    pytest.param(two_outputs, [(1024, 96), (205, 96)], {**SMALL, "epilogue_wg": 1, "interleave": 8}, id="epilogue-wg-g8-two-outputs"),
    # N = 4 mod 8: the view's rows would take a swizzle, which the view's 8-column box starts must not use
    pytest.param(lm_head, [(1024, 64), (204, 64)], {**SMALL, "pingpong": 1, "interleave": 8, "block_n": 128, "epi_tile_n": 64},
                 id="pingpong-g8-n204"),
    pytest.param(lm_head, [(1024, 64), (201, 64)], {**SMALL, "cluster": 2, "interleave": 8}, id="cluster-n-g8"),
]


def _group(fn, shapes, dtype=BF16):
    g = autofuse.capture(fn, *[S(s, dtype) for s in shapes])
    group = Group.of(g, [n.id for n in g.nodes])
    spec = matmul.match(group)
    assert spec is not None and matmul.unaligned_rows(spec)
    return group, spec


def _inputs(group, seed=0):
    keys = jax.random.split(jax.random.key(seed), len(group.inputs))
    return [jax.random.normal(k, a.shape, F32).astype(a.dtype) for k, a in zip(keys, group.input_avals())]


@pytest.mark.parametrize("fn,shapes,config", slow_except(CASES, "pingpong-g8-n201", "cooperative-g8-vectors"))
def test_interpret_matches_xla(fn, shapes, config):
    group, spec = _group(fn, shapes)
    kernel = mgpu_matmul.lower(group, spec, config, interpret=True, num_sms=3)
    xs = _inputs(group)
    outs = jax.block_until_ready(kernel(*xs))
    refs = jax.tree_util.tree_leaves(jax.jit(fn)(*xs))
    for o, r in zip(outs, refs):
        assert o.shape == r.shape and o.dtype == r.dtype
        assert rel_err(o, r) <= 1e-2


def test_the_border_columns_are_xlas_and_the_rest_the_kernels(monkeypatch):
    """Without XLA's border columns the first and last few columns of a shifted class are never written (and only
    they): the kernel's tiles cover the rest."""
    group, spec = _group(lm_head, [(512, 64), (201, 64)])
    xs = _inputs(group)
    monkeypatch.setattr(mgpu_matmul.RowClasses, "fill_borders", lambda self, out, border: jnp.reshape(out, (self.M, self.N)))
    (out,) = mgpu_matmul.lower(group, spec, {**SMALL, "pingpong": 1, "interleave": 8}, interpret=True, num_sms=3)(*xs)
    ref = jax.jit(lm_head)(*xs)
    inner = slice(8, 201 - 8)
    assert rel_err(out[:, inner], ref[:, inner]) <= 1e-2
    assert not bool(jnp.allclose(out[:, :8], ref[:, :8], atol=0.1)) or not bool(jnp.allclose(out[:, -8:], ref[:, -8:], atol=0.1))


@pytest.mark.parametrize("fn,shapes,config", slow_except(CASES, "pingpong-g8-n204"))
def test_lowers_for_cuda(fn, shapes, config):
    group, spec = _group(fn, shapes)
    exp = export_for_cuda(mgpu_matmul.lower(group, spec, config), [S(a.shape, a.dtype) for a in group.input_avals()])
    assert "mosaic_gpu_v2" in exp.mlir_module()
    assert [(o.shape, o.dtype) for o in exp.out_avals] == [(a.shape, a.dtype) for a in group.output_avals()]


@pytest.mark.parametrize("M,N,want", [(16384, 50257, 8), (1024, 50257, 8), (1000, 50257, 0), (16384, 50304, 0)])
def test_the_default_interleaves_only_unaligned_rows_where_the_classes_hold_whole_tiles(M, N, want):
    g = autofuse.capture(lm_head, S((M, 1024), BF16), S((N, 1024), BF16))
    spec = matmul.match(Group.of(g, [n.id for n in g.nodes]))
    cfg = mgpu_matmul.default_config(spec)
    assert cfg["interleave"] == want
    mgpu_matmul.check_config(spec, mgpu_matmul.Config.of(cfg))


def _residual(x, w, r):
    return jnp.einsum("mk,nk->mn", x, w) + r


@pytest.mark.parametrize("fn,shapes,config,why", [
    (lm_head, [(1024, 64), (201, 64)], {**SMALL, "cluster": 1, "interleave": 8}, "cluster along M"),
    (lm_head, [(4096, 64), (201, 64)], {**SMALL, "interleave": 64}, "0 or 8 rows"),
    (lm_head, [(1000, 64), (201, 64)], {**SMALL, "interleave": 8}, "not G x a multiple"),
    (lm_head, [(512, 64), (73, 64)], {**SMALL, "interleave": 8}, "narrower than a tile"),
    (_residual, [(512, 64), (201, 64), (512, 201)], {**SMALL, "interleave": 8}, "of the product's shape"),
])
def test_declines_in_one_line(fn, shapes, config, why):
    group, spec = _group(fn, shapes)
    with pytest.raises(Unsupported, match=why):
        mgpu_matmul.check_config(spec, mgpu_matmul.Config.of(config))


@pytest.mark.slow
def test_gpt2s_lm_head_with_its_layer_norm_runs_as_a_trial():
    """The group the partitioner offers for an LM head at an odd vocabulary (the final layer norm's second half
    folded around the GEMM: row and column vectors in the epilogue) passes its trial's check against XLA with the
    default config, which interleaves the rows."""
    vocab, d = 1001, 64

    def head(x, p):
        return layer_norm(x, p) @ p["wte"].T

    k = jax.random.split(jax.random.key(2), 4)
    p = {"scale": 1 + 0.1 * jax.random.normal(k[0], (d,), BF16), "bias": 0.1 * jax.random.normal(k[1], (d,), BF16),
         "wte": jax.random.normal(k[2], (vocab, d), BF16) / 8}
    graph = autofuse.capture(head, jax.random.normal(k[3], (4, 512, d), BF16), p)
    groups = [c.group for c in enumerate_candidates(graph)
              if c.template == "matmul" and matmul.match(c.group).pro]
    group = max(groups, key=lambda g: len(g.node_ids))
    spec = matmul.match(group)
    cfg = mgpu_matmul.default_config(spec)
    assert cfg["interleave"] == 8
    ev = Evaluator(graph, measure="device", interpret=True, n_input_sets=1, repeats=1, target_ms=1.0)
    res = ev.handle(TrialRequest(group.node_ids, "matmul", {"backend": "mosaic_gpu", **cfg}))
    assert res.status is TrialStatus.OK, res.error


@pytest.mark.parametrize("N,copies", [(50257, 8), (32002, 4), (204, 2)])
def test_b_is_copied_once_per_shift_a_class_needs(N, copies):
    """Class j's tiles read B from a copy shifted by (j N) mod 8 rows: an odd N needs all eight shifts, a vocabulary of
    32002 (N = 2 mod 8) four, N = 4 mod 8 two; each copy is B shifted by its rows, zeros before and after."""
    rc = mgpu_matmul.RowClasses(8, 1024, N, 128)
    assert {(j * N) % 8 for j in range(8)} == set(range(0, 8, rc.step)) and 8 // rc.step == copies
    b = jnp.arange(N * 2, dtype=F32).reshape(N, 2)
    shifted = rc.shifted(b)
    assert shifted.shape[0] == copies and shifted.shape[1] % 8 == 0 and shifted.shape[1] >= N + 8
    for i in range(copies):
        d = i * rc.step
        assert jnp.array_equal(shifted[i, d:d + N], b) and not shifted[i, :d].any() and not shifted[i, d + N:].any()
