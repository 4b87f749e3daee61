"""benchmarks/kernel_profile.py: the traced kernels' table, and a trace on a machine without a GPU."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks.kernel_profile import KernelTime, as_json, from_json, kernel_table, kernel_times


def test_table_lists_the_longest_kernels_and_sums_the_rest():
    rows = [KernelTime("gemm_big", 6.0, 2), KernelTime("fusion.7", 3.0, 1), KernelTime("fusion.8", 0.5, 4), KernelTime("copy", 0.5, 1)]
    lines = kernel_table(rows, top=2, title="step")
    assert lines[0] == "step"
    assert "| `gemm_big` | 6.000 | 60.0% | 2 |" in lines and "| `fusion.7` | 3.000 | 30.0% | 1 |" in lines
    assert "| 2 others | 1.000 | 10.0% | |" in lines and lines[-1] == "| all kernels | 10.000 | 100% | 8 |"
    assert from_json(as_json(rows)) == rows


def test_a_trace_without_a_device_plane_finds_no_kernels():
    """On the CPU the profiler runs (the program is traced for real) and no GPU kernel is reported."""
    if jax.default_backend() == "gpu":
        rows = kernel_times(jax.jit(lambda x: jnp.sin(x) @ x), (jnp.ones((512, 512)),))
        assert rows and all(r.ms_per_call > 0 for r in rows)
    else:
        assert kernel_times(jax.jit(lambda x: jnp.sin(x) @ x), (jnp.ones((64, 64)),)) == []
