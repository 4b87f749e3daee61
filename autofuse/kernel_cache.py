"""Lowered kernels kept between processes and jobs (`jax.export`), so that each is lowered once.

Lowering a Pallas kernel is Python work: 0.3-2.3 s for a Mosaic GPU kernel on an H200, about as long as compiling
it (results/compile_cost_h200.md). JAX's persistent compilation cache (`autofuse.compile_cache`) cannot skip it, as
it is keyed by the lowered program. A tuning job lowers the same kernel in several processes: each worker's trial
process for its first trials, the selection for every plan it validates, a deploy once more. Here a group's kernel,
built for a config on a GPU, is exported (the lowered StableHLO, the Pallas kernel inside it as its custom call)
and serialized into a directory, keyed by the group's computation, template, backend and config, the device, JAX's
version and the source of the kernels; a process asking for the same kernel deserializes it (milliseconds) and calls
it, and JAX's compilation cache then finds its executable. A kernel that cannot be exported runs as built and is
not kept; an entry that cannot be read is made again; past `MAX_BYTES` the least recently used entries go.

``$AUTOFUSE_KERNEL_CACHE_DIR`` (``off``: none), else ``~/.cache/autofuse/kernels/jaxlib-<version>``.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any, Callable

import jax

from . import digests
from .graph import Group
from .xla_autotune import chosen_dir, jaxlib_cache_dir

ENV_DIR = "AUTOFUSE_KERNEL_CACHE_DIR"
MAX_BYTES = 2 * 2**30  # an entry is tens of KB: tens of thousands of kernels; the least recently used go first
log = logging.getLogger("autofuse")


def cache_dir(environ: dict[str, str] | os._Environ = os.environ) -> str | None:
    """``$AUTOFUSE_KERNEL_CACHE_DIR`` as given (None for ``off`` or empty), else one directory per jaxlib version."""
    return chosen_dir(environ, ENV_DIR, jaxlib_cache_dir("kernels"))


def _platform() -> str:
    """The `jax.export` platform of the default device ("cuda" for an NVIDIA GPU)."""
    p = jax.devices()[0].platform
    return "cuda" if p == "gpu" else p


def kernel_key(group: Group, template: str, backend: str, config: dict) -> str:
    """What decides the lowered kernel: the group's computation (`Group.signature`: its equations, shapes and dtypes),
    the template, backend and config, the device (a Mosaic GPU kernel's grid is its SM count), JAX's version and the
    source of the kernels and of the templates registered now."""
    dev = jax.devices()[0]
    what = {"group": group.signature, "template": template, "backend": backend, "config": config,
            "platform": _platform(), "device": dev.device_kind, "cores": getattr(dev, "core_count", None), "jax": jax.__version__}
    h = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode())
    h.update(digests.sources("graph.py", "ops.py", "kernels/**/*.py").encode())
    digests.templates_digest(h)
    return h.hexdigest()[:32]


def cached(kernel: Callable, group: Group, template: str, backend: str, config: dict, *,
           directory: str | None = None) -> Callable:
    """`kernel` (a function of the group's inputs, in `group.inputs` order) as an exported function read from the
    cache, or exported and kept there now; `kernel` itself where there is no cache or it cannot be exported.
    `directory`: the cache (default `cache_dir()`)."""
    root = directory or cache_dir()
    if root is None:
        return kernel
    key = kernel_key(group, template, backend, config)
    path = os.path.join(root, key[:2], f"{key}.jaxexp")
    try:
        with open(path, "rb") as f:
            exp = jax.export.deserialize(bytearray(f.read()))
        os.utime(path)  # used now: the last to be evicted
        return _call(exp, kernel)
    except FileNotFoundError:
        pass
    except Exception as e:  # noqa: BLE001 - a damaged or foreign entry: made again below
        log.debug("autofuse: kernel cache entry %s unreadable (%s: %s); exporting again", path, type(e).__name__, e)
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in group.input_avals()]
    try:
        exp = jax.export.export(jax.jit(kernel), platforms=[_platform()],
                                disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*structs)
        blob = exp.serialize()
    except Exception as e:  # noqa: BLE001 - whatever cannot be exported runs as built (its own errors come from there)
        log.debug("autofuse: kernel of %s (%s, %s) not exported: %s: %s", group.signature, template, backend, type(e).__name__, e)
        return kernel
    _write(path, blob)
    trim(root)
    return _call(exp, kernel)


def _call(exp: Any, kernel: Callable) -> Callable:
    """The exported kernel as a function of the group's inputs; under `jax.vmap` (which an exported function has no
    rule for) the kernel as built, batched as JAX batches it."""
    @jax.custom_batching.custom_vmap
    def run(*xs):
        return exp.call(*xs)

    @run.def_vmap
    def _batched(axis_size, in_batched, *xs):
        outs = jax.vmap(kernel, in_axes=tuple(0 if b else None for b in in_batched), axis_size=axis_size)(*xs)
        return outs, jax.tree_util.tree_map(lambda _: True, outs)

    return run


def _write(path: str, blob: bytes) -> None:
    """Atomically (a reader sees the whole entry or none); a cache that cannot be written is left as it is."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)
    except OSError as e:
        log.debug("autofuse: could not keep a kernel in %s: %s", path, e)
        try:
            os.unlink(tmp)
        except OSError:
            pass


def trim(root: str, max_bytes: int = MAX_BYTES) -> None:
    """Delete the least recently used entries until the cache holds at most `max_bytes`."""
    try:
        entries = [(e.stat().st_mtime, e.stat().st_size, e.path) for d in os.scandir(root) if d.is_dir()
                   for e in os.scandir(d.path) if e.name.endswith(".jaxexp")]
    except OSError:
        return
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):
        if total <= max_bytes:
            return
        try:
            os.unlink(path)
            total -= size
        except OSError:
            pass
