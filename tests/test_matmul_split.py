"""A matmul whose epilogue's value a `split` along N cuts into parts (a fused QKV projection split into queries, keys
and values): one candidate, the Mosaic GPU kernel writing each part as its own array (interpret mode and the real
CUDA lowering), where XLA writes the product and then copies each part out of it."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

import autofuse
from autofuse.kernels import matmul
from autofuse.kernels.mosaic_gpu import matmul as mgpu_matmul
from autofuse.kernels.mosaic_gpu.tiles import Unsupported
from autofuse.runner.evaluator import export_for_cuda
from tests.kernel_checks import rel_err
from tests.quick import slow_except

S = jax.ShapeDtypeStruct
BF16 = jnp.bfloat16
SMALL = {"block_m": 64, "block_n": 64, "block_k": 32, "max_concurrent_steps": 2, "epi_tile_m": 64, "epi_tile_n": 32,
         "grid_tile_width": 2, "grid_minor_dim": 0, "wg_dimension": 1, "epilogue_wg": 0, "cluster": 0}


def qkv_gelu(x, w, b):  # rows ragged against the tiles (200), parts of 96 columns: three 32-column pieces each
    return tuple(t.reshape(2, 100, 3, 32) for t in jnp.split(jax.nn.gelu(x @ w + b), 3, axis=-1))


def uneven(x, w):  # parts of 64, 160 and 64 columns, the middle one read twice outside
    a, b, c = jnp.split(x @ w, [64, 224], axis=-1)
    return a, b * 2.0, c, b


def _candidate(fn, *specs):
    g = autofuse.capture(fn, *specs)
    found = matmul.TEMPLATE.candidate_groups(g, lambda i: True)
    assert len(found) == 1, found
    group, spec, stages = found[0]
    assert stages == () and matmul.match(group) is not None
    return group, spec


QKV = (qkv_gelu, S((2, 100, 64), BF16), S((64, 288), BF16), S((288,), BF16))
UNEVEN = (uneven, S((200, 64), BF16), S((64, 288), BF16))


def test_the_split_is_read_as_column_windows_and_triton_declines_it() -> None:
    group, spec = _candidate(*QKV[:1], *QKV[1:])
    (u, parts), = spec.windows.items()
    assert [(first, cols) for _, first, cols in parts] == [(0, 96), (96, 96), (192, 96)]
    assert [p for p, _, _ in parts] == list(group.outputs)  # the parts are what the group returns
    assert "split" in matmul.TEMPLATE.unsupported(spec, "triton")
    assert matmul.TEMPLATE.unsupported(spec, "mosaic_gpu", SMALL) is None
    g = autofuse.capture(lambda x, w: jnp.split(x @ w, 2, axis=0), S((64, 32), BF16), S((32, 64), BF16))
    assert matmul.TEMPLATE.candidate_groups(g, lambda i: True) == []  # along the rows: no window of N


def test_gpt2s_fused_qkv_projection_is_a_candidate_with_its_split() -> None:
    from autofuse.tuning.job import distinct_candidates
    from examples import gpt2

    graph = autofuse.capture(gpt2.forward_cudnn, *gpt2.small_inputs())
    by_sig, cands = distinct_candidates(graph)
    split = [r for r in cands if any(n.name == "split" for n in by_sig[r.signature][0].group.nodes)]
    # the GEMM with its split, and the same with the layer norm's half before it (`prologue_fold`), once reading its
    # scale, shift and statistics as XLA broadcasts them and once with those broadcasts made inside (absorbed)
    assert len(split) == 3 and all(r.template == "matmul" for r in split)
    assert sorted(any(n.name == "rsqrt" for n in by_sig[r.signature][0].group.nodes) for r in split) == [False, True, True]
    assert not any(n.name.startswith("reduce") for r in split for n in by_sig[r.signature][0].group.nodes)  # XLA's statistics
    assert all(len(by_sig[r.signature]) == len(gpt2.small_inputs()[0]["blocks"]) for r in split)  # one per layer


def _inputs(group):
    keys = jax.random.split(jax.random.key(0), len(group.inputs))
    return [jax.random.normal(k, a.shape, jnp.float32).astype(a.dtype) for k, a in zip(keys, group.input_avals())]


@pytest.mark.parametrize("program,extra", slow_except([pytest.param(QKV, {}, id="qkv-gelu"),
                                                      pytest.param(QKV, {"epilogue_wg": 1}, id="qkv-gelu-epilogue-wg"),
                                                      pytest.param(UNEVEN, {"grid_minor_dim": 1}, id="uneven-parts")], "uneven-parts"))
def test_each_part_is_written_where_the_program_reads_it(program, extra) -> None:
    """Interpret mode with the race detector, against the group's own jaxpr under jax.jit."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

    group, spec = _candidate(program[0], *program[1:])
    kernel = mgpu_matmul.lower(group, spec, {**SMALL, **extra}, interpret=plgpu.InterpretGPUParams(detect_races=True), num_sms=2)
    xs = _inputs(group)
    outs = jax.block_until_ready(kernel(*xs))
    assert not interpret_pallas_call.get_races().races_found
    refs = jax.jit(lambda *a: group.evaluate(a))(*xs)
    assert len(outs) == len(refs) == len(group.outputs)
    for o, r, a in zip(outs, refs, group.output_avals()):
        assert o.shape == r.shape == a.shape and o.dtype == r.dtype
        assert rel_err(o, r) <= 2e-2


def test_the_cuda_lowering_writes_one_array_per_part() -> None:
    group, spec = _candidate(*QKV[:1], *QKV[1:])
    for cfg in (SMALL, {**SMALL, "epilogue_wg": 1}, mgpu_matmul.default_config(spec)):
        exp = export_for_cuda(mgpu_matmul.lower(group, spec, cfg), [S(a.shape, a.dtype) for a in group.input_avals()])
        assert [(o.shape, o.dtype) for o in exp.out_avals] == [(a.shape, a.dtype) for a in group.output_avals()]


def test_a_piece_straddling_two_parts_is_declined() -> None:
    group, spec = _candidate(*QKV[:1], *QKV[1:])
    with pytest.raises(Unsupported, match="straddle"):
        mgpu_matmul.check_config(spec, mgpu_matmul.Config.of({**SMALL, "epi_tile_n": 64}))  # the second part starts at 96
    assert np.all([first % mgpu_matmul.default_config(spec)["epi_tile_n"] == 0 for _, first, _ in spec.windows[next(iter(spec.windows))]])


def test_xla_is_modelled_with_its_copies_of_the_parts_and_the_parts_cost_no_neighbour() -> None:
    """XLA writes the product, then copies each part out (an op no fusion takes); the kernel writes the parts, which
    their readers behind a reshape (here attention's dots, in a GPU program cuDNN's call) read from memory anyway: no
    fusion of XLA's is cut."""
    from autofuse import costmodel

    def program(x, w, b):
        q, k, v = jnp.split(x @ w + b, 3, axis=-1)
        heads = lambda t: t.reshape(4, 256, 8, 64)  # noqa: E731
        return jax.nn.dot_product_attention(heads(q), heads(k), heads(v), implementation="xla")

    graph = autofuse.capture(program, S((4, 256, 512), BF16), S((512, 1536), BF16), S((1536,), BF16))
    (group, spec), = [(g, s) for g, s, _ in matmul.TEMPLATE.candidate_groups(graph, lambda i: True)]
    whole = autofuse.graph.Group.of(graph, [n.id for n in group.nodes if n.name != "split"])
    product = 4 * 256 * 1536 * 2
    extra = costmodel.xla_group_time_ms(group) - costmodel.xla_group_time_ms(whole)
    assert extra >= 1e3 * 2 * product / costmodel.H200.bandwidth_Bps  # written and read back by the copies
    assert costmodel.cut_outputs_ms(group) == 0.0


def test_the_cover_counts_the_split_that_xla_copies_and_takes_the_group_that_writes_the_parts() -> None:
    """The cover's options for GPT-2 medium's QKV projection, as its training step measured them on an H200: the
    group with its split 0.2227 ms in XLA (the GEMM, then three copies), 0.1602 fused; the GEMM with its bias alone
    0.1542 ms in XLA. Left to XLA the split is its copies, which the fused group saves; priced at nothing (as an op
    no candidate takes is: every cover pays it alike), the GEMM beside a free split won every cover."""
    from autofuse.tuning.job import distinct_candidates
    from autofuse.tuning.select import best_cover, single_node_costs

    def program(x, w, b):
        return tuple(t.reshape(8, 2048, 16, 64) for t in jnp.split(x @ w + b, 3, axis=-1))

    graph = autofuse.capture(program, S((8, 2048, 1024), BF16), S((1024, 3072), BF16), S((3072,), BF16))
    by_sig, cands = distinct_candidates(graph)
    split_node = next(n.id for n in graph.nodes if n.name == "split")
    for r in cands:
        names = {graph.node_index[i].name for i in r.nodes}
        if "split" in names:
            r.xla_ms, r.best_ms, r.best_config = 0.2227, 0.1602, {**SMALL, "backend": "mosaic_gpu"}
        elif names >= {"dot_general", "add"}:
            r.xla_ms = 0.1542
    plan = best_cover(graph, by_sig, cands, autofuse.costmodel.H200, "device").plan
    assert [g.template for g in plan.groups] == ["matmul"] and split_node in plan.groups[0].nodes
    assert single_node_costs(graph, autofuse.costmodel.H200)[split_node] == 0.0  # taken by no candidate: alike in every cover
    assert single_node_costs(graph, autofuse.costmodel.H200, {split_node})[split_node] > 0.04  # 100 MB read, 100 MB written
