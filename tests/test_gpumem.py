"""`import autofuse` keeps JAX from preallocating the GPU where that still takes effect; tune() says so where it did not."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from autofuse import gpumem

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _probe(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in gpumem.ALLOCATOR_VARS}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(clean, PYTHONPATH=ROOT, **env), capture_output=True, text=True, check=False,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


REPORT = "import os, autofuse; print(os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE'), autofuse.gpumem.STATE.set_by_autofuse)"


def test_import_turns_preallocation_off_before_jax_starts():
    assert _probe(REPORT) == "false True"
    assert _probe("import jax; " + REPORT) == "false True"  # jax imported, but its backends not started yet


def test_import_leaves_a_users_choice_alone():
    assert _probe(REPORT, XLA_PYTHON_CLIENT_MEM_FRACTION=".5") == "None False"
    assert _probe(REPORT, XLA_PYTHON_CLIENT_PREALLOCATE="true") == "true False"


def test_import_after_jax_started_changes_nothing_and_says_so():
    code = ("import jax; jax.devices(); import os, autofuse; s = autofuse.gpumem.STATE; "
            "print(os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE'), s.initialised_at_import, s.set_by_autofuse)")
    assert _probe(code) == "None True False"


def test_warning_only_for_a_preallocated_gpu_client():
    """No GPU here: the rule is checked on the states `import autofuse` records (the real ones above)."""
    started_before = gpumem.AllocatorState(True, {}, False)
    line = gpumem.preallocation_warning("gpu", started_before, {})
    assert line is not None and "75%" in line and "XLA_PYTHON_CLIENT_PREALLOCATE=false" in line and "\n" not in line
    assert gpumem.preallocation_warning("cpu", started_before, {}) is None
    assert "50%" in gpumem.preallocation_warning("gpu", gpumem.AllocatorState(True, {"XLA_PYTHON_CLIENT_MEM_FRACTION": ".5"}, False), {})
    assert gpumem.preallocation_warning("gpu", gpumem.AllocatorState(True, {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}, False), {}) is None
    after_import = gpumem.AllocatorState(False, {}, True)  # the client started after autofuse set the variable
    assert gpumem.preallocation_warning("gpu", after_import, {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}) is None
    assert gpumem.preallocation_warning("gpu", after_import, {"XLA_PYTHON_CLIENT_PREALLOCATE": "true"}) is not None


def test_trial_process_gets_host_copies_of_the_callers_arrays():
    """The caller's arrays reach the trial process as host (numpy) copies in a file: its own device memory holds them,
    whatever the caller's pool."""
    from autofuse.graph import capture
    from autofuse.tuning.job import save_example_inputs

    def f(x, y):
        return jnp.tanh(x) + y

    x, y = jnp.ones((4, 8), jnp.float32), jnp.zeros((8,), jnp.float32)
    g = capture(f, x, y)
    path = save_example_inputs(g, f, (x, y), {}, (), ())
    try:
        with open(path, "rb") as fh:
            leaves = pickle.load(fh)
    finally:
        os.unlink(path)
    assert [type(a) for a in leaves] == [np.ndarray, np.ndarray] and not any(isinstance(a, jax.Array) for a in leaves)
    np.testing.assert_array_equal(leaves[0], np.ones((4, 8), np.float32))


def test_a_trial_process_of_a_preallocated_caller_gets_a_pool_capped_at_what_is_free():
    """No GPU here: the rule on the states `import autofuse` records. The trial process's pool is 90% of what the GPU has free (nvidia-smi), reserved at once as one region: more than JAX's
    default 75% where this process holds no pool, a cap where it does (of what the caller's pool leaves when
    nvidia-smi cannot say). A fraction the user set, or no nvidia-smi, leaves the pool to grow as needed."""
    grow = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    started_before = gpumem.AllocatorState(True, {}, False)
    assert gpumem.trial_process_env("cpu", started_before, {}) == grow
    no_pool = gpumem.AllocatorState(False, {}, True)
    assert gpumem.trial_process_env("gpu", no_pool, {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}, lambda: 0.9) == \
        {"XLA_PYTHON_CLIENT_PREALLOCATE": "true", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.810"}  # more than JAX's 75% of the card
    assert gpumem.trial_process_env("none", no_pool, {}, lambda: None) == grow  # no nvidia-smi
    own = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}
    assert gpumem.trial_process_env("gpu", no_pool, own, lambda: 0.9) == grow  # the user's own fraction reaches the trial process unchanged
    capped = gpumem.trial_process_env("gpu", started_before, {}, lambda: 0.24)
    assert capped == {"XLA_PYTHON_CLIENT_PREALLOCATE": "true", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.216"}
    half = gpumem.AllocatorState(True, {"XLA_PYTHON_CLIENT_MEM_FRACTION": ".5"}, False)
    assert gpumem.trial_process_env("gpu", half, {}, lambda: None)["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.450"
    assert gpumem.gpu_free_fraction({"CUDA_VISIBLE_DEVICES": "0"}) is None or 0 <= gpumem.gpu_free_fraction() <= 1


def test_the_runner_starts_its_trial_process_with_that_environment(monkeypatch):
    """The trial process is started with `trial_process_env`'s variables (here: as if this process held a pool)."""
    from autofuse.runner import process

    seen = {}
    monkeypatch.setattr(gpumem, "client_platform", lambda: "gpu")
    monkeypatch.setattr(gpumem, "STATE", gpumem.AllocatorState(True, {}, False))
    monkeypatch.setattr(gpumem, "gpu_free_fraction", lambda environ=None: 0.5)
    monkeypatch.setattr(process.subprocess, "Popen", lambda *a, **kw: seen.update(kw) or (_ for _ in ()).throw(RuntimeError("stop")))
    runner = process.ProcessRunner(None, {})
    try:
        runner._spawn()
    except RuntimeError:
        pass
    assert seen["env"]["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.450" and seen["env"]["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"
