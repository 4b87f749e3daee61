"""The XLA:CPU scheduler that Mosaic GPU's interpret mode needs (`autofuse.interpret_cpu`): `import autofuse` sets it
where it still takes effect, honours the user's own value, and a job that cannot have it leaves Mosaic GPU out with
one line. The deadlock itself in a real `autofuse tune` subprocess held to one core."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import autofuse
from autofuse import interpret_cpu
from autofuse.graph import qualified_name
from autofuse.kernels import TEMPLATES
from autofuse.kernels.mosaic_gpu.gemm import interpret_params
from autofuse.plan import plan_from_choices
from autofuse.store import PlanStore
from autofuse.tuning.partition import enumerate_candidates
from benchmarks.workloads import matmul_bias_gelu
from tests.dist_programs import matmul_bias_gelu_inputs
from tests.stored_plans import save_plan_here

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_configure_adds_the_flag_only_where_it_takes_effect_and_the_user_gave_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(interpret_cpu, "backends_initialised", lambda: False)
    env: dict[str, str] = {}
    assert interpret_cpu.configure(env) and env["XLA_FLAGS"] == interpret_cpu.SAFE
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    assert interpret_cpu.configure(env) and env["XLA_FLAGS"] == f"--xla_force_host_platform_device_count=2 {interpret_cpu.SAFE}"
    for own, safe in [("=true", False), ("", False), ("=false", True), ("=0", True), ("=false --x=1 " + interpret_cpu.FLAG + "=true", False)]:
        env = {"XLA_FLAGS": interpret_cpu.FLAG + own}
        assert interpret_cpu.configure(env) is safe and env["XLA_FLAGS"] == interpret_cpu.FLAG + own  # the user's, untouched
    monkeypatch.setattr(interpret_cpu, "backends_initialised", lambda: True)  # JAX started first: too late to set it
    env = {}
    assert not interpret_cpu.configure(env) and env == {}


def test_import_autofuse_sets_it_in_a_fresh_process_and_not_after_jax_started() -> None:
    report = "import os, autofuse; print(autofuse._interpret_cpu.SAFE_HERE, os.environ.get('XLA_FLAGS', ''))"
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(interpret_cpu.FLAG))
    env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS=flags)
    for code, safe in [(report, True), ("import jax; jax.devices(); " + report, False)]:
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split()[0] == str(safe) and (interpret_cpu.SAFE in out.stdout.split()) is safe


def test_without_the_scheduler_a_modelled_job_leaves_mosaic_gpu_out_with_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from autofuse.tuning.job import check_backends

    assert interpret_cpu.SAFE_HERE  # conftest set the flag before JAX started, and import autofuse saw it
    assert check_backends(["mosaic_gpu"], "model") == (("mosaic_gpu",), "")
    monkeypatch.setattr(interpret_cpu, "SAFE_HERE", False)
    reason = f"Mosaic GPU's interpret mode can deadlock XLA:CPU unless JAX starts with XLA_FLAGS={interpret_cpu.SAFE}"
    with pytest.raises(ValueError, match=r"^none of the backends asked for \(mosaic_gpu\) can be tuned here: " + reason):
        check_backends(["mosaic_gpu"], "model")
    kept, note = check_backends(["mosaic_gpu", "triton"], "model")
    assert kept == ("triton",) and note.startswith("autofuse: backend mosaic_gpu left out (" + reason) and "\n" not in note
    assert check_backends(["triton"], "model") == (("triton",), "")  # Triton's interpret mode has no barriers to wait on


def test_without_the_scheduler_a_mosaic_gpu_plan_is_served_by_jax_jit_with_the_reason(monkeypatch: pytest.MonkeyPatch, tmp_path,
                                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """`autofuse.jit` on a CPU runs a plan's kernels in interpret mode: a Mosaic GPU kernel that could hang there is
    never built (one line, from the lowering), and the program runs as jax.jit with that reason logged."""
    specs = matmul_bias_gelu_inputs()
    graph = autofuse.capture(matmul_bias_gelu, *specs)
    (c,) = [c for c in enumerate_candidates(graph) if c.template == "matmul"]
    plan = plan_from_choices(graph, [(c.group, "matmul", {**TEMPLATES["matmul"].default_config_of(c.spec, "mosaic_gpu"), "backend": "mosaic_gpu"})])
    url = f"sqlite:///{tmp_path}/plans.db"
    save_plan_here(PlanStore(url), graph, "mbg", plan.to_dict(), function=qualified_name(matmul_bias_gelu), structure=graph.structure)
    args = [jax.random.normal(jax.random.key(i), s.shape, s.dtype) for i, s in enumerate(specs)]

    monkeypatch.setattr(interpret_cpu, "SAFE_HERE", False)
    with pytest.raises(RuntimeError, match="^Mosaic GPU's interpret mode can deadlock XLA:CPU"):
        interpret_params(True)
    assert interpret_params(False) is None  # compiled for a GPU: nothing to guard
    with caplog.at_level(logging.WARNING, logger="autofuse"):
        out = autofuse.jit(matmul_bias_gelu, store=url)(*args)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(jax.jit(matmul_bias_gelu)(*args), np.float32))
    assert "Mosaic GPU's interpret mode can deadlock XLA:CPU" in caplog.text, caplog.text


@pytest.mark.slow
def test_a_modelled_mosaic_gpu_tune_on_one_core_finishes(tmp_path) -> None:
    """Before `import autofuse` set the flag, this job hung for good in its interpret-mode check of the attention."""
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(interpret_cpu.FLAG))
    env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS=flags)
    one_core = "import os, runpy, sys; os.sched_setaffinity(0, {0}); sys.argv[0] = 'autofuse'; runpy.run_module('autofuse.cli', run_name='__main__')"
    out = subprocess.run([sys.executable, "-c", one_core, "tune", "benchmarks.workloads:attention_bhld", "--inputs",
                          "tests.dist_programs:attention_inputs", "--backends", "mosaic_gpu", "--trials", "1",
                          "--db", f"sqlite:///{tmp_path}/a.db", "--quiet"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "with 1 fused group (attention)" in out.stdout
