"""The kernel cache (`autofuse.kernel_cache`): a group's kernel exported once and read back by any process.

Real exports on this machine's CPU platform with a plain-JAX kernel (a Pallas GPU kernel exports the same way on a
GPU, where `plan.build_group` uses the cache; the CPU runs kernels interpreted and keeps none)."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

import autofuse
from autofuse import kernel_cache
from autofuse.graph import Group
from autofuse.plan import build_group

S = jax.ShapeDtypeStruct


def _group():
    g = autofuse.capture(lambda x, w: [jnp.tanh(x @ w) * 2.0], S((8, 16), jnp.float32), S((16, 4), jnp.float32))
    return Group.of(g, [n.id for n in g.nodes])


def _kernel(calls: list):
    def k(x, w):
        calls.append(1)  # traced (lowered) once per export
        return [jnp.tanh(x @ w) * 2.0]
    return k


def _args():
    kx, kw = jax.random.split(jax.random.key(0))
    return jax.random.normal(kx, (8, 16)), jax.random.normal(kw, (16, 4))


def test_a_kernel_is_lowered_once_and_read_back_by_the_next_build(tmp_path):
    group, xs = _group(), _args()
    calls: list = []
    first = kernel_cache.cached(_kernel(calls), group, "matmul", "triton", {"block_m": 64}, directory=str(tmp_path))
    assert len(calls) == 1 and len(list(tmp_path.rglob("*.jaxexp"))) == 1
    (out,) = jax.jit(first)(*xs)
    np.testing.assert_allclose(out, jnp.tanh(xs[0] @ xs[1]) * 2.0, rtol=1e-6)

    again: list = []
    second = kernel_cache.cached(_kernel(again), group, "matmul", "triton", {"block_m": 64}, directory=str(tmp_path))
    (out2,) = jax.jit(second)(*xs)
    assert again == []  # read back: the kernel was not traced
    np.testing.assert_array_equal(out2, out)


def test_the_key_is_the_group_template_backend_and_config():
    group = _group()
    base = kernel_cache.kernel_key(group, "matmul", "triton", {"block_m": 64, "block_n": 32})
    assert base == kernel_cache.kernel_key(group, "matmul", "triton", {"block_n": 32, "block_m": 64})
    others = {kernel_cache.kernel_key(group, "matmul", "triton", {"block_m": 128, "block_n": 32}),
              kernel_cache.kernel_key(group, "matmul", "mosaic_gpu", {"block_m": 64, "block_n": 32}),
              kernel_cache.kernel_key(group, "elementwise", "triton", {"block_m": 64, "block_n": 32})}
    g2 = autofuse.capture(lambda x, w: [jnp.tanh(x @ w) * 3.0], S((8, 16), jnp.float32), S((16, 4), jnp.float32))
    others.add(kernel_cache.kernel_key(Group.of(g2, [n.id for n in g2.nodes]), "matmul", "triton", {"block_m": 64, "block_n": 32}))
    assert base not in others and len(others) == 4


def test_a_damaged_entry_is_made_again(tmp_path):
    group, xs = _group(), _args()
    kernel_cache.cached(_kernel([]), group, "matmul", "triton", {}, directory=str(tmp_path))
    (entry,) = tmp_path.rglob("*.jaxexp")
    entry.write_bytes(b"not an export")
    calls: list = []
    k = kernel_cache.cached(_kernel(calls), group, "matmul", "triton", {}, directory=str(tmp_path))
    assert calls == [1] and entry.read_bytes() != b"not an export"
    np.testing.assert_allclose(jax.jit(k)(*xs)[0], jnp.tanh(xs[0] @ xs[1]) * 2.0, rtol=1e-6)


def test_what_cannot_be_exported_runs_as_built_and_is_not_kept(tmp_path):
    group, xs = _group(), _args()

    def host(x, w):  # a host callback has no exported form
        return [jax.pure_callback(lambda a, b: np.tanh(a @ b) * 2.0, S((8, 4), jnp.float32), x, w)]
    k = kernel_cache.cached(host, group, "matmul", "triton", {}, directory=str(tmp_path))
    assert k is host and list(tmp_path.rglob("*.jaxexp")) == []
    np.testing.assert_allclose(jax.jit(k)(*xs)[0], jnp.tanh(xs[0] @ xs[1]) * 2.0, rtol=1e-5)


def test_no_cache_when_turned_off_and_none_for_interpreted_kernels(tmp_path, monkeypatch):
    monkeypatch.setenv(kernel_cache.ENV_DIR, "off")
    assert kernel_cache.cache_dir() is None
    k = _kernel([])
    assert kernel_cache.cached(k, _group(), "matmul", "triton", {}) is k
    monkeypatch.setenv(kernel_cache.ENV_DIR, str(tmp_path))
    assert kernel_cache.cache_dir() == str(tmp_path)
    g = autofuse.capture(lambda x: [jnp.exp(x) + 1.0], S((64, 32), jnp.float32))
    build_group(Group.of(g, [n.id for n in g.nodes]), "elementwise", {"block_rows": 32, "block_cols": 32, "num_warps": 4, "num_stages": 1, "col_major": 0},
                interpret=True)
    assert not any(os.scandir(tmp_path))  # an interpreted kernel (the CPU's) is never kept


def test_past_its_size_the_least_recently_used_entries_go(tmp_path):
    group = _group()
    for bm in (16, 32, 64):
        kernel_cache.cached(_kernel([]), group, "matmul", "triton", {"block_m": bm}, directory=str(tmp_path))
    entries = {p: p.stat().st_size for p in tmp_path.rglob("*.jaxexp")}
    assert len(entries) == 3
    oldest = kernel_cache.kernel_key(group, "matmul", "triton", {"block_m": 16})
    os.utime(next(p for p in entries if p.stem == oldest), (1, 1))  # not read for a long time
    kernel_cache.trim(str(tmp_path), max_bytes=sum(entries.values()) - 1)
    assert sorted(p.stem for p in tmp_path.rglob("*.jaxexp")) == sorted(p.stem for p in entries if p.stem != oldest)


def test_a_cached_kernel_batches_under_vmap_as_the_kernel_built(tmp_path):
    """An exported function has no batching rule: under `jax.vmap` the kernel as built runs, batched by JAX (a
    Pallas kernel by pallas_call's own rule), so a vmapped plan keeps working where it did without the cache."""
    group, (x, w) = _group(), _args()
    k = kernel_cache.cached(_kernel([]), group, "matmul", "triton", {}, directory=str(tmp_path))
    xs = jnp.stack([x, 2 * x, -x])
    (out,) = jax.jit(jax.vmap(k, in_axes=(0, None)))(xs, w)
    np.testing.assert_allclose(out, jnp.tanh(xs @ w) * 2.0, rtol=1e-6)
    (one,) = jax.jit(k)(x, w)  # unbatched: the export
    np.testing.assert_allclose(one, out[0], rtol=1e-6)
