"""CPU-side CUDA lowering guard (GPU_NOTES.md): every generated kernel lowers through the real Pallas Triton path.

`jax.export` for platform "cuda" runs the Pallas -> Triton lowering on this
CPU-only machine; it rejects unsupported primitives and non-power-of-two
arrays. Only the Triton custom call's safety check is disabled.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import autofuse
from autofuse.graph import Group
from autofuse.runner.evaluator import export_for_cuda
from autofuse.kernels import TEMPLATES
from autofuse.runner.measure import check, random_inputs
from autofuse.plan import bind_plan
from autofuse.tuning.select import default_plan
from benchmarks.workloads import SMALL, WORKLOADS
from tests.quick import slow_except

S = jax.ShapeDtypeStruct
TRITON = "__gpu$xla.gpu.triton"
FNS = {w.name: w.fn for w in WORKLOADS}  # every suite workload, at its SMALL shape below
DTYPES = [pytest.param(jnp.float32, id="f32"), pytest.param(jnp.bfloat16, id="bf16")]


def export_cuda(fn, specs):
    return export_for_cuda(fn, specs)


def _input_specs(group: Group) -> list:
    return [S(a.shape, a.dtype) for a in group.input_avals()]


def _groups(fn, shapes, dtype):
    graph = autofuse.capture(fn, *[S(s, dtype) for s in shapes])
    bound = bind_plan(graph, default_plan(graph))
    assert bound, "the workload has no fused group"
    return bound


def _assert_exports(group: Group, template: str, config: dict, backend: str = "triton"):
    kernel = TEMPLATES[template].build(group, config, backend=backend, interpret=False)
    exp = export_cuda(kernel, _input_specs(group))
    text = exp.mlir_module()
    assert (TRITON in text) == (backend == "triton")  # the kernel really went through the Triton lowering (xla_ops: XLA's own)
    assert exp.platforms == ("cuda",)
    assert [o.shape for o in exp.out_avals] == [a.shape for a in group.output_avals()]
    assert [o.dtype for o in exp.out_avals] == [a.dtype for a in group.output_avals()]


CASES = [pytest.param(name, shapes, id=f"{name}-{'x'.join(map(str, shapes[0]))}") for name, shapes in SMALL.items()]
CASES += [
    pytest.param("softmax", ((37, 300),), id="softmax-37x300"),
    pytest.param("layer_norm", ((2, 9, 300), (300,), (300,)), id="layer_norm-2x9x300"),
    pytest.param("log_relu_bias", ((1000, 777), (777,)), id="log_relu_bias-1000x777"),
]


@pytest.mark.parametrize("dtype", slow_except(DTYPES, "bf16"))  # float32's exports: the full suite
@pytest.mark.parametrize("name,shapes", CASES)
def test_default_config_kernels_lower_for_cuda(name, shapes, dtype):
    for group, fg in _groups(FNS[name], shapes, dtype):
        _assert_exports(group, fg.template, fg.config, fg.backend)


MULTI = [(4, 64), (1, 128), (16, 32)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["softmax", "layer_norm", "rms_norm", "logsumexp"])
def test_multi_chunk_row_reduce_kernels_lower_for_cuda(name, dtype):
    for group, fg in _groups(FNS[name], SMALL[name], dtype):
        assert fg.template == "row_reduce"
        C = TEMPLATES["row_reduce"].match(group).C
        for bm, bn in MULTI:
            assert bn < C and C % bn  # several column blocks, the last partial
            _assert_exports(group, "row_reduce", {**fg.config, "block_rows": bm, "block_cols": bn})


@pytest.mark.parametrize("dtype", DTYPES)
def test_elementwise_small_blocks_lower_for_cuda(dtype):
    for group, fg in _groups(FNS["log_relu_bias"], SMALL["log_relu_bias"], dtype):
        for bm, bn in MULTI:
            _assert_exports(group, "elementwise", {**fg.config, "block_rows": bm, "block_cols": bn})


def test_every_search_space_choice_lowers_for_one_group():
    # The tuner only proposes configs from the template's space: each block choice must lower.
    for group, fg in _groups(FNS["softmax"], ((37, 300),), jnp.bfloat16):
        params = TEMPLATES[fg.template].space(group)["params"]
        for bn in params["block_cols"]:
            for bm in params["block_rows"][:3]:
                _assert_exports(group, fg.template, {**fg.config, "block_rows": bm, "block_cols": bn})


# ---------------------------------------------------------------------------
# The guard catches problems.
@pytest.mark.parametrize("name", slow_except(["log_relu_bias", "softmax", "rms_norm"], "softmax"))
@pytest.mark.parametrize("bad", [{"block_cols": 100}, {"block_rows": 3}], ids=["block_cols=100", "block_rows=3"])
def test_non_power_of_two_block_fails_to_lower(name, bad):
    for group, fg in _groups(FNS[name], SMALL[name], jnp.float32):
        kernel = TEMPLATES[fg.template].build(group, {**fg.config, **bad}, interpret=False)
        with pytest.raises(Exception, match="power of 2"):
            export_cuda(kernel, _input_specs(group))
        # ... while the same kernel runs, and is right, in interpret mode: only the lowering guard sees the problem.
        interp = TEMPLATES[fg.template].build(group, {**fg.config, **bad}, interpret=True)
        args = [jnp.asarray(x) for x in random_inputs(group.input_avals(), seed=0)]
        res = check(lambda *a: interp(*a), lambda *a: group.evaluate(a), group.input_avals(), seeds=(0,))
        assert res.ok, res.reason
        assert len(interp(*args)) == len(group.outputs)


def test_unsupported_primitive_fails_to_lower():
    # erf has no Triton lowering (GPU_NOTES.md): a hand-written Pallas kernel using it must be caught.
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    def body(x_ref, o_ref):
        o_ref[...] = jax.lax.erf(x_ref[...])

    call = pl.pallas_call(body, out_shape=S((16, 128), jnp.float32), grid=(1,),
                          compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1))
    with pytest.raises(NotImplementedError, match="erf"):
        export_cuda(call, [S((16, 128), jnp.float32)])

    def ok_body(x_ref, o_ref):
        o_ref[...] = jnp.tanh(x_ref[...])

    ok = pl.pallas_call(ok_body, out_shape=S((16, 128), jnp.float32), grid=(1,),
                        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1))
    export_cuda(ok, [S((16, 128), jnp.float32)])  # the same kernel with a supported op lowers
