"""`matmul` with a bias's gradient in its epilogue: the dgrad GEMM of an MLP's down-projection, GELU' applied on the
way (dy = (dz @ W2^T) * gelu'(h)), and db = Σ dy over batch and sequence written as per-piece partials
(`TileSpec.col_sums`), so XLA need not read dy again for db. Both lowerings in interpret mode at ragged rows and
columns, the Mosaic GPU one through the real CUDA lowering too, and a training step's plan against jax.grad."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import autofuse
from autofuse.graph import bind_node, read_atom
from autofuse.kernels import TEMPLATES
from autofuse.costmodel import H200
from autofuse.plan import build_group, plan_from_choices
from autofuse.runner.evaluator import export_for_cuda
from autofuse.tuning.partition import enumerate_candidates
from autofuse.tuning.space import CandidateSpace
from tests.kernel_checks import assert_plan_matches_jit, rel_err
from tests.quick import slow_except


def mlp_bwd(dz, w2, h):
    dy = (dz @ w2.T) * jax.grad(lambda t: jnp.sum(jax.nn.gelu(t)))(h)
    return dy, jnp.sum(dy.astype(jnp.float32), axis=(0, 1))


def shifted(dz, w2, b):
    """A product with a bias, summed over the rows: past the last row the epilogue of TMA's zeros is b, not 0."""
    y = dz @ w2.T + b
    return y, jnp.sum(y.astype(jnp.float32), axis=(0, 1))


def _args(S=100, F=200, dtype=jnp.bfloat16):
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    return (jax.random.normal(k[0], (2, S, 64), dtype), (0.1 * jax.random.normal(k[1], (F, 64))).astype(dtype),
            jax.random.normal(k[2], (2, S, F), dtype))


def _with_sum(args, fn=mlp_bwd):
    """The program's graph and its matmul candidates that return a [F] sum over the rows beside the product's tile."""
    graph = autofuse.capture(fn, *args)
    F = args[1].shape[0]
    return graph, [c for c in enumerate_candidates(graph) if c.template == "matmul"
                   and any(graph.avals[v].shape == (F,) for v in c.group.outputs)]


def _values(graph, args) -> dict:
    env = dict(zip(graph.inputs, args))
    for n in graph.nodes:
        env.update(zip(n.outputs, bind_node(n, [read_atom(env, a) for a in n.inputs])))
    return env


def test_the_partitioner_offers_a_dgrad_gemm_with_its_bias_gradient():
    graph, cands = _with_sum(_args())
    assert cands
    for c in cands:
        assert c.spec.epi.col_sums and [n.name for n in c.group.nodes][-1] == "reduce_sum"
    graph, plain = _with_sum(_args(dtype=jnp.float32))
    assert plain  # float32 too (no conversion before the sum)


@pytest.mark.parametrize("fn", slow_except([pytest.param(mlp_bwd, id="mlp_bwd"), pytest.param(shifted, id="shifted")], "mlp_bwd"))
@pytest.mark.parametrize("backend", ["triton", "mosaic_gpu"])
@pytest.mark.parametrize("S,F", slow_except([(100, 200), (64, 256), (37, 136)], "100-200"))
def test_dgrad_with_bias_gradient_matches_xla(fn, backend, S, F):
    """Rows (2 x S) and columns F not multiples of the tiles: the partials leave out the rows past the edge
    (`shifted`: the epilogue there gives the bias, not 0)."""
    args = _args(S, F)
    if fn is shifted:
        args = args[:2] + (args[2][0, 0],)
    graph, cands = _with_sum(args, fn)
    env = _values(graph, args)
    c = min(cands, key=lambda c: len(c.group.nodes))
    ins = [env[v] for v in c.group.inputs]
    cfg = TEMPLATES["matmul"].default_config_of(c.spec, backend)
    assert TEMPLATES["matmul"].unsupported(c.spec, backend, cfg) is None
    outs = build_group(c.group, "matmul", cfg, backend=backend, interpret=True)(*ins)
    refs = jax.jit(lambda *a: c.group.evaluate(a))(*ins)
    for o, r in zip(outs, refs):
        assert o.shape == r.shape and o.dtype == r.dtype
        assert rel_err(o, r) < 1e-2


@pytest.mark.parametrize("schedule", slow_except([pytest.param({"epilogue_wg": 0}, id="inline"),
                                                  pytest.param({"epilogue_wg": 1}, id="epilogue-wg"),
                                                  pytest.param({"pingpong": 1, "max_concurrent_steps": 3}, id="pingpong")],
                                                 "pingpong"))
def test_mosaic_gpu_sums_over_rows_in_either_epilogue_race_free_and_lower_for_cuda(schedule):
    """The reduction across a tile's warps goes through Mosaic GPU's one reduction scratch. With the epilogues in the
    two compute warpgroups (`epilogue_wg=0`, the default: one epilogue warpgroup cannot hide GELU's latencies, 0.81 ms
    against 0.28 on an H200) they take turns at it, warpgroup 0 then 1 for each piece, through two barriers. Interpret
    mode runs both (several tiles per CTA, pieces per tile) with its race detector on TMA, SMEM and those barriers,
    and the real lowering for CUDA passes; it does not model the reduction scratch itself (without the turns it
    passes too): that the turns keep the sums right is checked on the GPU (results/models_cudnn_h200.md, section 7).
    Ping-pong's warpgroups run whole tiles: they take turns tile by tile, each after the tile before's epilogue."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from autofuse.kernels.mosaic_gpu import matmul as mgpu_matmul

    args = _args()
    graph, cands = _with_sum(args)
    c = min(cands, key=lambda c: len(c.group.nodes))
    assert TEMPLATES["matmul"].default_config_of(c.spec, "mosaic_gpu")["epilogue_wg"] == 0
    cfg = {**TEMPLATES["matmul"].default_config_of(c.spec, "mosaic_gpu"), "block_m": 64, "block_n": 64, "epi_tile_m": 64, "epi_tile_n": 32, **schedule}
    assert TEMPLATES["matmul"].unsupported(c.spec, "mosaic_gpu", cfg) is None
    space = CandidateSpace.of("matmul", c.group, c.spec, H200, ("mosaic_gpu",)).spaces["mosaic_gpu"]
    assert bool(space.violated(cfg)) == bool(cfg["pingpong"])  # (ping-pong with a sum: lowered, not searched)
    env = _values(graph, args)
    ins = [env[v] for v in c.group.inputs]
    kernel = mgpu_matmul.lower(c.group, c.spec, cfg, interpret=plgpu.InterpretGPUParams(detect_races=True), num_sms=2)
    outs = jax.block_until_ready(kernel(*ins))
    assert not interpret_pallas_call.get_races().races_found
    for o, r in zip(outs, jax.jit(lambda *a: c.group.evaluate(a))(*ins)):
        assert rel_err(o, r) < 1e-2
    structs = [jax.ShapeDtypeStruct(env[v].shape, env[v].dtype) for v in c.group.inputs]
    export_for_cuda(build_group(c.group, "matmul", cfg, backend="mosaic_gpu", interpret=False), structs)


@pytest.mark.parametrize("backend", slow_except(["triton", "mosaic_gpu"], "mosaic_gpu"))
def test_a_training_steps_plan_with_the_fused_bias_gradient_matches_jax_grad(backend):
    """An MLP's loss differentiated: the dgrad GEMM, GELU' and the up-projection bias's gradient run as one kernel
    in the plan, and every gradient is jax.grad's."""
    def loss(w1, b1, w2, x):
        return jnp.sum(jnp.square(jax.nn.gelu(x @ w1 + b1) @ w2).astype(jnp.float32))

    k = jax.random.split(jax.random.PRNGKey(1), 3)
    args = ((0.1 * jax.random.normal(k[0], (64, 136))).astype(jnp.bfloat16), jnp.zeros((136,), jnp.bfloat16) + 0.1,
            (0.1 * jax.random.normal(k[1], (136, 64))).astype(jnp.bfloat16), jax.random.normal(k[2], (2, 40, 64), jnp.bfloat16))
    step = jax.grad(loss, argnums=(0, 1, 2))
    graph = autofuse.capture(step, *args)
    cands = [c for c in enumerate_candidates(graph) if c.template == "matmul" and c.spec.epi.col_sums]
    assert cands, "no dgrad GEMM offered with the bias's gradient"
    c = min(cands, key=lambda c: len(c.group.nodes))
    cfg = {**TEMPLATES["matmul"].default_config_of(c.spec, backend), "backend": backend}
    plan = plan_from_choices(graph, [(c.group, "matmul", cfg)])
    assert_plan_matches_jit(step, plan, args, 2e-2)


@pytest.mark.slow  # a benchmark's smoke run, not the quick subset's
def test_the_probes_dgrad_workloads_are_one_matmul_with_and_without_the_sum():
    """`python -m benchmarks kernels mosaic --only dgrad-` times these two at GPT-2's shapes (the fused sum's cost
    is their difference); at a small shape each whole program is one `matmul` group, and its Mosaic GPU kernel
    computes what XLA does."""
    from benchmarks.mosaic_probe import _group, arg_specs, dgrad_dgamma, dgrad_gelu, dgrad_gelu_dbias

    shapes = [(160, 64), (96, 64), (160, 96)]
    llama = [(160, 96), (64, 96), (160, 64), (160, 64)]
    for fn, sums, sh in ((dgrad_gelu, False, shapes), (dgrad_gelu_dbias, True, shapes), (dgrad_dgamma, True, llama)):
        _, cand = _group(fn, arg_specs(fn.__name__, sh, jnp.bfloat16))
        assert cand.template == "matmul" and bool(cand.spec.epi.col_sums) == sums
        g = cand.group
        ins = [jax.random.normal(jax.random.PRNGKey(i), a.shape, a.dtype) for i, a in enumerate(g.input_avals())]
        cfg = TEMPLATES["matmul"].default_config_of(cand.spec, "mosaic_gpu")
        outs = build_group(g, "matmul", cfg, backend="mosaic_gpu", interpret=True)(*ins)
        for o, r in zip(outs, jax.jit(lambda *a: g.evaluate(a))(*ins)):
            assert rel_err(o, r) < 1e-2



def test_a_gemm_summing_over_its_rows_reduces_each_column_piece_once_per_warpgroup_tile():
    """Each epilogue piece's column sums cross the warpgroup's four warps through Mosaic GPU's reduction scratch, the
    costly part of the sum: by default a piece is as tall as the warpgroup's tile (128 x 32 at GPT-2's dgrad, not
    64 x 64), half the reductions in the same SMEM; a GEMM with no sum keeps the square pieces."""
    from benchmarks.mosaic_probe import _group, arg_specs, dgrad_gelu, dgrad_gelu_dbias

    shapes = [(16384, 1024), (4096, 1024), (16384, 4096)]
    cfgs = {}
    for fn in (dgrad_gelu, dgrad_gelu_dbias):
        _, cand = _group(fn, arg_specs(fn.__name__, shapes, jnp.bfloat16))
        cfgs[fn] = cfg = TEMPLATES["matmul"].default_config_of(cand.spec, "mosaic_gpu")
        assert TEMPLATES["matmul"].unsupported(cand.spec, "mosaic_gpu", cfg) is None
    assert (cfgs[dgrad_gelu_dbias]["epi_tile_m"], cfgs[dgrad_gelu_dbias]["epi_tile_n"]) == (cfgs[dgrad_gelu_dbias]["block_m"], 32) == (128, 32)
    assert (cfgs[dgrad_gelu]["epi_tile_m"], cfgs[dgrad_gelu]["epi_tile_n"]) == (64, 64)


def test_taller_pieces_are_not_bought_with_a_slot_of_the_ring():
    """With more [M, N] inputs and outputs beside the sums (GPT-2's dgrads with a layer norm's sums, its LM head's
    backward) the taller pieces' SMEM would cost the operand ring a slot (0.2552 against 0.2181 ms on an H200): the
    default keeps the pieces that leave the ring 3 deep."""
    from autofuse.kernels.mosaic_gpu import matmul as mgpu_matmul
    from benchmarks.mosaic_probe import _group

    def sums_beside_tiles(dz, w, h, x, y):
        dy = jnp.einsum("mk,nk->mn", dz, w) * h + x
        return dy, dy * y, jnp.sum(dy.astype(jnp.float32), axis=0), jnp.sum((dy * h).astype(jnp.float32), axis=0)

    M, K, N = 16384, 4096, 1024
    bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)  # noqa: E731
    _, cand = _group(sums_beside_tiles, [bf16(M, K), bf16(N, K), bf16(M, N), bf16(M, N), bf16(M, N)])
    assert len(cand.spec.epi.col_sums) == 2
    tall = mgpu_matmul.schedule_config(cand.spec, tall=True)
    cfg = TEMPLATES["matmul"].default_config_of(cand.spec, "mosaic_gpu")
    assert (tall["epi_tile_m"], tall["max_concurrent_steps"]) == (128, 2)  # what the taller pieces would cost
    assert (cfg["epi_tile_m"], cfg["max_concurrent_steps"]) == (64, 3)
    assert TEMPLATES["matmul"].unsupported(cand.spec, "mosaic_gpu", cfg) is None


def test_ping_pong_is_not_searched_for_a_gemm_summing_over_its_rows():
    """It lost every time it was measured with a sum (the warpgroups' turns at the reduction scratch), and one of its
    configs computed a wrong sum on an H200: the space leaves it to GEMMs without one."""
    from benchmarks.mosaic_probe import _group, arg_specs, dgrad_gelu, dgrad_gelu_dbias

    shapes = [(16384, 1024), (4096, 1024), (16384, 4096)]
    for fn, searched in ((dgrad_gelu, True), (dgrad_gelu_dbias, False)):
        _, cand = _group(fn, arg_specs(fn.__name__, shapes, jnp.bfloat16))
        space = CandidateSpace.of("matmul", cand.group, cand.spec, H200, ("mosaic_gpu",)).spaces["mosaic_gpu"]
        pp = {**TEMPLATES["matmul"].default_config_of(cand.spec, "mosaic_gpu"), "pingpong": 1, "max_concurrent_steps": 4}
        assert (space.violated(pp) == []) is searched


def test_the_sums_partials_span_every_piece_the_tiles_cover():
    """No TMA store of a sum's partials goes past its array's edge: on an H200, N = 1024 in 192-column tiles (the
    last tile's pieces past column 1024 stored too) gave column sums 0.29 from jax.jit, right in interpret mode, right
    at N = 1152 (results/lost_regions_h200.md). The partials array spans the tiles' columns; the sums read back to N."""
    from autofuse.kernels.mosaic_gpu import matmul as mgpu_matmul

    args = _args(S=100, F=200)
    graph, cands = _with_sum(args)
    c = min(cands, key=lambda c: len(c.group.nodes))
    cfg = {**TEMPLATES["matmul"].default_config_of(c.spec, "mosaic_gpu"), "block_m": 128, "block_n": 192, "epi_tile_m": 64,
           "epi_tile_n": 32, "max_concurrent_steps": 2, "pingpong": 0}
    assert TEMPLATES["matmul"].unsupported(c.spec, "mosaic_gpu", cfg) is None
    env = _values(graph, args)
    ins = [env[v] for v in c.group.inputs]
    kernel = mgpu_matmul.lower(c.group, c.spec, cfg, interpret=True, num_sms=2)
    eqns = jax.make_jaxpr(kernel)(*ins).jaxpr.eqns  # the kernel's call (in a custom_vmap_call), then XLA's slices and sums
    sums = [v.aval.shape for e in eqns if e.primitive.name.endswith("call") for v in e.outvars if v.aval.dtype == jnp.float32]
    assert sums == [(4, 384)]  # M = 200 rows: 2 tiles of 128, pieces of 64 rows; N = 200 columns: 2 tiles of 192
    for o, r in zip(kernel(*ins), jax.jit(lambda *a: c.group.evaluate(a))(*ins)):
        assert rel_err(o, r) < 1e-2
