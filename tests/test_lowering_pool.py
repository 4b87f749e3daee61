"""Kernels lowered in CPU-only helper processes (`runner.lowering_pool`): a helper keeps, under the key a process
on the target GPU looks up, the very export that process would make; a helper that cannot start or fails a kernel
leaves it to the trial process (a False future, never a hang), and no helpers means none are started."""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import pytest

import autofuse
from autofuse import kernel_cache
from autofuse.graph import Group
from autofuse.kernel_cache import Target
from autofuse.kernels import TEMPLATES
from autofuse.runner import lowering_pool
from autofuse.runner.lowering_pool import LoweringPool
from autofuse.runner.process import ProgramSpec
from tests.quick import slow_except

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
S = jax.ShapeDtypeStruct
H100 = Target("NVIDIA H100", 132)


def gemm_tanh(x, w, b):
    return jnp.tanh(x @ w + b)


def gemm_tanh_inputs():
    return (S((256, 128), jnp.bfloat16), S((128, 256), jnp.bfloat16), S((256,), jnp.bfloat16))


def _program(inputs=None):
    graph = autofuse.capture(gemm_tanh, *(inputs or gemm_tanh_inputs()))
    group = Group.of(graph, [n.id for n in graph.nodes])
    return graph, group, ProgramSpec(gemm_tanh, gemm_tanh_inputs(), fingerprint=graph.fingerprint)


def _config(group, backend):
    mod = TEMPLATES["matmul"]
    return {"backend": backend, **mod.default_config_of(mod.match(group), backend)}


def _codes_in_a_fresh_process(config: dict, target: Target, times: int = 1) -> list[str]:
    """`kernel_cache.code` of `_program`'s kernel exported `times` times by a new process: Mosaic GPU numbers a kernel's
    dump name by how many of that name its process lowered, and past nine lowerings the module's bytes move beyond
    what `code` leaves out, so an export is compared with one from a process that lowered as few (a test process has
    lowered any number)."""
    script = ("import json, sys\nfrom autofuse import kernel_cache\nfrom autofuse.kernel_cache import Target\n"
              "from tests.test_lowering_pool import _exported_here, _program\n"
              "config, kind, cores, times = json.loads(sys.argv[1])\n_, group, _ = _program()\n"
              "print(json.dumps([kernel_cache.code(_exported_here(group, config, Target(kind, cores))[1]) for _ in range(times)]))\n")
    done = subprocess.run([sys.executable, "-c", script, json.dumps([config, target.kind, target.cores, times])], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


def _exported_here(group, config, target):
    """The export this process makes of the kernel for `target`: what a process on that GPU would make."""
    mod = TEMPLATES["matmul"]
    backend, params = config["backend"], {k: v for k, v in config.items() if k != "backend"}
    with target.lowering():
        kernel = mod.build(group, params, backend=backend, interpret=False, spec=mod.match(group))
        return params, kernel_cache.export(kernel, group, target)


@pytest.mark.parametrize("backend", slow_except(["mosaic_gpu", "triton"], "mosaic_gpu"))
def test_a_helper_keeps_the_export_the_target_process_would_make(tmp_path, monkeypatch, backend):
    monkeypatch.setenv("PYTHONPATH", ROOT)
    graph, group, spec = _program()
    config = _config(group, backend)
    pool = LoweringPool(pickle.dumps(spec), [ROOT], str(tmp_path), processes=1)
    try:
        fut = pool.submit(tuple(group.node_ids), "matmul", config, H100)
        assert fut.result(timeout=300) is True
        assert pool.submit(tuple(group.node_ids), "matmul", dict(config), H100) is fut  # asked again: the same lowering
    finally:
        pool.close()
    assert pool.lowered == 1 and pool.seconds > 0
    params = {k: v for k, v in config.items() if k != "backend"}
    (here,) = _codes_in_a_fresh_process(config, H100)
    path = kernel_cache.entry_path(str(tmp_path), kernel_cache.kernel_key(group, "matmul", backend, params, H100))
    with open(path, "rb") as f:
        kept = jax.export.deserialize(bytearray(f.read()))
    assert kernel_cache.code(kept) == here and "custom_call" in here
    assert kept.platforms == ("cuda",)
    other = kernel_cache.kernel_key(group, "matmul", backend, params, Target("NVIDIA H100", 114))
    assert other != kernel_cache.kernel_key(group, "matmul", backend, params, H100)  # the SM count is part of the key


def test_the_target_decides_a_persistent_kernels_grid():
    """A Mosaic GPU GEMM's persistent grid is the target's SM count, not this process's device's (more tiles than
    SMs: 32 x 16 of 128 x 128)."""
    _, group, _ = _program((S((4096, 256), jnp.bfloat16), S((256, 2048), jnp.bfloat16), S((2048,), jnp.bfloat16)))
    config = _config(group, "mosaic_gpu")
    _, on_132 = _exported_here(group, config, H100)
    _, on_114 = _exported_here(group, config, Target("NVIDIA H100", 114))
    assert kernel_cache.code(on_132) != kernel_cache.code(on_114)


def test_the_same_kernel_lowered_twice_in_one_process_is_the_same_code():
    """Mosaic GPU numbers a kernel's dump name by how many of that name the process lowered before (and hashes the
    module with it): the one difference between a helper's export and the trial process's, which `code` leaves out."""
    _, group, _ = _program()
    config = _config(group, "mosaic_gpu")
    (_, first), (_, second) = _exported_here(group, config, H100), _exported_here(group, config, H100)
    assert first.mlir_module_serialized != second.mlir_module_serialized
    codes = _codes_in_a_fresh_process(config, H100, times=2)
    assert codes[0] == codes[1]


def test_a_helper_that_cannot_start_leaves_the_kernels_to_the_trial_process(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", ROOT)
    _, group, spec = _program()
    spec.fingerprint = "not-this-program"
    pool = LoweringPool(pickle.dumps(spec), [ROOT], str(tmp_path), processes=2)
    futures = [pool.submit(tuple(group.node_ids), "matmul", _config(group, b), H100) for b in ("triton", "mosaic_gpu")]
    assert [f.result(timeout=300) for f in futures] == [False, False]
    assert pool.broken and pool.submit(tuple(group.node_ids), "matmul", {"backend": "triton", "block_m": 64}, H100) is None
    assert not any(tmp_path.rglob("*.jaxexp"))


@pytest.mark.slow
def test_a_kernel_that_fails_to_lower_is_false_and_the_helper_goes_on(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", ROOT)
    _, group, spec = _program()
    pool = LoweringPool(pickle.dumps(spec), [ROOT], str(tmp_path), processes=1)
    try:
        bad = pool.submit(tuple(group.node_ids), "row_reduce", {"backend": "triton"}, H100)  # a template that does not match
        good = pool.submit(tuple(group.node_ids), "matmul", _config(group, "triton"), H100)
        assert bad.result(timeout=300) is False and good.result(timeout=300) is True
    finally:
        pool.close()
    assert pool.lowered == 1 and len(list(tmp_path.rglob("*.jaxexp"))) == 1


def test_how_many_helpers(monkeypatch):
    monkeypatch.delenv(lowering_pool.ENV_VAR, raising=False)
    assert [lowering_pool.helpers(n) for n in (1, 3, 4, 8, 16, 64)] == [0, 0, 1, 2, 4, 4]
    assert lowering_pool.helpers(16, {lowering_pool.ENV_VAR: "0"}) == 0
    assert lowering_pool.helpers(2, {lowering_pool.ENV_VAR: "3"}) == 3
    with pytest.raises(ValueError, match="AUTOFUSE_LOWERING_HELPERS"):
        lowering_pool.helpers(16, {lowering_pool.ENV_VAR: "many"})
    assert LoweringPool(b"", [], "/nonexistent", processes=0).submit((0,), "matmul", {}, H100) is None
    assert lowering_pool.helpers_for("device", 16) == 0  # no GPU here: nothing is lowered for a device
    assert lowering_pool.helpers_for("model", 16) == 0


@pytest.mark.slow
def test_a_trial_process_starts_the_helpers_its_options_ask_for_and_stops_them_off_the_gpu(tmp_path, monkeypatch):
    """The helpers start with the trial process (before it captures the program); one that builds no kernels for a
    GPU (this CPU) stops them, and the process answers as without them."""
    from autofuse.runner.process import HELPERS, ProcessRunner
    from autofuse.runner.protocol import XlaRequest

    monkeypatch.setenv("PYTHONPATH", ROOT)
    monkeypatch.setenv("AUTOFUSE_KERNEL_CACHE_DIR", str(tmp_path))
    _, group, spec = _program()
    with ProcessRunner(spec, {"measure": "device", HELPERS: 2, "repeats": 2, "n_input_sets": 1}, timeout_s=120) as runner:
        runner.start()
        kids: dict[int, str] = {}
        deadline = time.time() + 120
        while len(kids) < 2 and time.time() < deadline:  # seen while they run: they may have stopped by the first answer
            kids.update(_children(runner._proc.pid))
            time.sleep(0.02)
        assert len(kids) == 2 and all("autofuse.runner.lowering_pool" in cmd for cmd in kids.values())
        assert runner.call(XlaRequest(tuple(group.node_ids))).ok
        deadline = time.time() + 120
        while _children(runner._proc.pid) and time.time() < deadline:  # told to stop: they exit once started
            time.sleep(0.2)
        assert not _children(runner._proc.pid)
    with ProcessRunner(spec, {"measure": "model", HELPERS: 2}, timeout_s=120) as runner:
        assert runner.call(XlaRequest(tuple(group.node_ids))).ok
        assert not _children(runner._proc.pid)


def _children(pid: int) -> dict[int, str]:
    """The live child processes of `pid` and their command lines (from /proc)."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
            with open(f"/proc/{d}/cmdline") as f:
                cmd = f.read().replace("\0", " ")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            out[int(d)] = cmd
    return out
