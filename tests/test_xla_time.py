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
