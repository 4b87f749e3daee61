"""benchmarks/xla_time.py: jax.jit's compiled module read back instruction by instruction (what each computes, the
bytes it moves, the line that made it), and its table of device times."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks.xla_time import op_times, parse_hlo, shape_bytes, table


def _program(x, w, b):
    y = jnp.tanh(x @ w + b)
    return (y * y).sum(-1), y.astype(jnp.bfloat16)


def _compiled():
    x, w, b = jnp.ones((64, 32)), jnp.ones((32, 16)), jnp.ones((16,))
    return jax.jit(_program), (x, w, b), jax.jit(_program).lower(x, w, b).compile().as_text()


def test_shapes_count_every_array_of_a_tuple() -> None:
    assert shape_bytes("(f32[64]{0}, bf16[64,16]{1,0})") == 64 * 4 + 64 * 16 * 2
    assert shape_bytes("pred[]") == 1


def test_each_instruction_has_its_bytes_ops_and_source_line() -> None:
    _, _, text = _compiled()
    instrs = parse_hlo(text)
    sums = [i for i in instrs.values() if i.fused_ops.get("reduce")]
    assert len(sums) == 1
    s = sums[0]
    assert (s.in_bytes, s.out_bytes) == (64 * 16 * 4, 64 * 4)  # reads y (f32) and writes its row sums
    assert s.category == "XLA fusion with a reduction" and s.fused_ops["multiply"] == 1
    assert s.source.startswith("_program:")
    gemms = [i for i in instrs.values() if i.category == "GEMM"]
    assert len(gemms) == 1 and gemms[0].in_bytes == (64 * 32 + 32 * 16) * 4
    assert all(i.opcode not in ("parameter", "tuple") for i in instrs.values())


def test_the_table_sums_time_by_kind_and_line_and_gives_each_kernels_bandwidth() -> None:
    fn, args, text = _compiled()
    instrs = parse_hlo(text)
    s = next(i for i in instrs.values() if i.fused_ops.get("reduce"))
    times = {s.name: (0.001, 1.0), "not_an_instruction": (0.002, 1.0), "nvjet_sm90_tst_128x128": (0.003, 2.0)}
    lines = table(instrs, times, top=3, bandwidth_gbs=1000.0)
    row = next(ln for ln in lines if ln.startswith("| XLA fusion with a reduction"))
    assert "| 0.001 | 16.7% | 1 |" in row  # a sixth of all the time traced
    assert any(ln.startswith("| GEMM | 0.003 | 50.0% | 2 |") for ln in lines)  # cuBLAS's kernel, named by itself
    assert any(ln.startswith("| other kernel | 0.002") for ln in lines)  # a kernel of no instruction, by its own name
    mine = next(ln for ln in lines if ln.startswith(f"| `{s.name}`"))
    assert f"| {(64 * 16 * 4 + 64 * 4) / 1e-6 / 1e9:.0f} |" in mine  # its bytes in 1 µs, in GB/s
    if jax.default_backend() != "gpu":
        assert op_times(fn, args, instrs) == {}  # traced on the CPU: no device line


def test_a_plans_program_is_read_in_place_of_jax_jits(tmp_path) -> None:
    """`--plan FILE`: the program read is the plan's (GPT-2's training step with its QKV gradient's concatenation
    written once, behind an optimisation barrier: in its module, not in jax.jit's), its Pallas calls a kind of their
    own."""
    import autofuse
    import examples.gpt2 as gpt2
    from autofuse.kernels import TEMPLATES
    from autofuse.plan import plan_from_choices
    from benchmarks.xla_time import Instruction, main, program

    args = gpt2.small_inputs()
    graph = autofuse.capture(gpt2.grad_step_cudnn, *args)
    group = TEMPLATES["concat_sink"].candidate_groups(graph, lambda i: True)[0][0]  # one layer's
    path = tmp_path / "plan.json"
    path.write_text(plan_from_choices(graph, [(group, "concat_sink", {"accumulate": 0, "contracted": 0, "kept": 1, "backend": "xla_ops"})]).to_json())
    texts = {}
    for plan_file in ("", str(path)):
        fn, whose = program(gpt2.grad_step_cudnn, plan_file)
        texts[whose] = fn.lower(*args).as_text()  # (XLA drops the barrier once it has fused around it)
    assert "optimization_barrier" in texts["the plan's"] and "optimization_barrier" not in texts["jax.jit's"]
    out = tmp_path / "t.md"
    main(["--model", "gpt2", "--step", "grad_step_cudnn", "--small", "--plan", str(path), "--top", "5", "--out", str(out)])
    assert out.read_text().startswith("## the plan's time by kernel: gpt2:grad_step_cudnn")
    pallas = Instruction("custom-call.1", "custom-call", 0, 0, "mosaic_gpu_v2", "", "")
    assert pallas.category == "Pallas kernel (the plan's)"


def test_the_plans_kernels_are_joined_with_their_calls_by_the_name_the_profiler_gives_them() -> None:
    """A Pallas call's kernel is traced by its own name, not by its custom call's (one per layer): the table puts it
    among the plan's kernels with the call's bytes and line, and lists the calls no more."""
    from benchmarks.xla_time import Instruction

    def call(n: int, stem: str, target: str) -> Instruction:
        return Instruction(f"mpmd_map.{n}", "custom-call", 2_000_000, 6_000_000, target,
                           f"jit(step)/jit(run)/{stem}/mpmd_map", "lower.<locals>.run:1205")

    instrs = {i.name: i for i in (call(1, "autofuse_matmul_mgpu_8b626235", "mosaic_gpu_v2"),
                                  call(2, "autofuse_matmul_mgpu_8b626235", "mosaic_gpu_v2"),
                                  call(3, "autofuse_row_reduce_dd41066a", "__gpu$xla.gpu.triton"))}
    times = {"autofuse_matmul_mgpu_8b626235_mosaic_gpu_kernel": (0.004, 2.0), "autofuse_row_reduce_dd41066a": (0.001, 1.0)}
    lines = table(instrs, times, top=5, bandwidth_gbs=1000.0)
    assert any(ln.startswith("| Pallas kernel (the plan's) | 0.005 | 100.0% | 3 |") for ln in lines)
    gemm = next(ln for ln in lines if ln.startswith("| `autofuse_matmul_mgpu_8b626235_mosaic_gpu_kernel`"))
    assert "| 6.0 / 2.0 |" in gemm and f"| {8e6 * 2 / 0.004e6:.0f} |" in gemm and "lower.<locals>.run:1205" in gemm
    assert not any("mpmd_map" in ln.split("|")[1] for ln in lines if ln.startswith("| `"))
    assert not any(ln.startswith("| other kernel") for ln in lines)
