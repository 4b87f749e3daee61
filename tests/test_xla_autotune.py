"""`import autofuse` points XLA's per-fusion autotune cache at one directory, so that a tuning job's trial processes
and a deployed process compile the same GEMM kernels; a user's own flag, and a process whose JAX already started,
are left alone."""
from __future__ import annotations

import ast
import os
import subprocess
import sys

from autofuse import interpret_cpu, xla_autotune

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPORT = ("import os, autofuse, jax.numpy as jnp; float((jnp.ones((8, 8)) @ jnp.ones((8, 8))).sum()); "
          "print(repr((os.environ.get('XLA_FLAGS', ''), autofuse._xla_autotune.DIR)))")


def _probe(code: str, **env: str) -> tuple[str, str | None]:
    clean = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", xla_autotune.ENV_DIR)}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(clean, PYTHONPATH=ROOT, **env), capture_output=True, text=True,
                         check=False, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    flags, dir_ = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    return " ".join(f for f in flags.split() if f != interpret_cpu.SAFE), dir_  # the scheduler's flag: tests/test_interpret_cpu.py


def test_import_sets_one_autotune_cache_directory_that_xla_accepts(tmp_path):
    where = tmp_path / "autotune"
    flags, dir_ = _probe(REPORT, AUTOFUSE_XLA_AUTOTUNE_DIR=str(where))
    assert flags == f"{xla_autotune.FLAG}={where}" and dir_ == str(where)
    assert where.is_dir()  # made for XLA, which writes its results there
    # other XLA flags are kept, and the cache flag follows them
    flags, _ = _probe(REPORT, AUTOFUSE_XLA_AUTOTUNE_DIR=str(where), XLA_FLAGS="--xla_cpu_enable_fast_math=false")
    assert flags == f"--xla_cpu_enable_fast_math=false {xla_autotune.FLAG}={where}"


def test_a_users_own_flag_and_a_started_jax_are_left_alone(tmp_path):
    mine = f"{xla_autotune.FLAG}={tmp_path / 'mine'}"
    assert _probe(REPORT, XLA_FLAGS=mine, AUTOFUSE_XLA_AUTOTUNE_DIR=str(tmp_path / "ours")) == (mine, str(tmp_path / "mine"))
    assert not (tmp_path / "ours").exists()
    started = "import jax; jax.devices(); " + REPORT  # XLA read its flags when the backends started: too late to add one
    assert _probe(started, AUTOFUSE_XLA_AUTOTUNE_DIR=str(tmp_path / "late")) == ("", None)


def test_no_directory_no_flag(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    environ = {xla_autotune.ENV_DIR: str(blocker / "sub")}  # under a file: cannot be made
    assert xla_autotune.configure(environ) is None and "XLA_FLAGS" not in environ


def test_the_default_directory_is_one_per_jaxlib_version(tmp_path, monkeypatch):
    """XLA does not check that a cached entry came from the same compiler: each jaxlib gets its own directory."""
    import importlib.metadata

    monkeypatch.setenv("HOME", str(tmp_path))
    version = importlib.metadata.version("jaxlib")
    assert xla_autotune.default_dir({}) == os.path.join(str(tmp_path), ".cache", "autofuse", "xla-autotune", f"jaxlib-{version}")
    assert xla_autotune.default_dir({xla_autotune.ENV_DIR: "/x/y"}) == "/x/y"  # the user's directory as given
