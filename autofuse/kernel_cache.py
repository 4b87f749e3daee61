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

import contextlib
import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import jax

from . import digests
from .graph import Group
from .xla_autotune import chosen_dir, jaxlib_cache_dir, trim_least_recent

ENV_DIR = "AUTOFUSE_KERNEL_CACHE_DIR"
MAX_BYTES = 2 * 2**30  # an entry is tens of KB: tens of thousands of kernels; the least recently used go first
log = logging.getLogger("autofuse")


def cache_dir(environ: dict[str, str] | os._Environ = os.environ) -> str | None:
    """``$AUTOFUSE_KERNEL_CACHE_DIR`` as given (None for ``off`` or empty), else one directory per jaxlib version."""
    return chosen_dir(environ, ENV_DIR, jaxlib_cache_dir("kernels"))


@dataclass(frozen=True)
class Target:
    """The device a kernel is lowered for: what its lowering reads of the device, and part of its key. A process
    without that device (`runner.lowering_pool`'s helpers) lowers for it as an abstract device."""

    kind: str  # jax's device_kind, "NVIDIA H200"
    cores: int | None  # SMs: a persistent kernel's grid
    platform: str = "cuda"  # jax.export's name of it

    @classmethod
    def here(cls) -> "Target":
        """This process's first device."""
        dev = jax.devices()[0]
        return cls(dev.device_kind, getattr(dev, "core_count", None), "cuda" if dev.platform == "gpu" else dev.platform)

    @contextlib.contextmanager
    def lowering(self) -> Iterator[None]:
        """Lower for this device where it is not this process's own (jax >= 0.11 reads the abstract mesh's device
        for the compute capability; the kernels read its SM count, `mosaic_gpu.gemm.num_sms_default`)."""
        dev = jax.sharding.AbstractDevice(device_kind=self.kind, num_cores=self.cores, platform=self.platform)
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=dev)):
            yield


def kernel_key(group: Group, template: str, backend: str, config: dict, target: Target | None = None) -> str:
    """What decides the lowered kernel: the group's computation (`Group.signature`: its equations, shapes and dtypes),
    the template, backend and config, the device (a Mosaic GPU kernel's grid is its SM count; `target`, default this
    process's), JAX's version and the source of the kernels and of the templates registered now."""
    t = target or Target.here()
    what = {"group": group.signature, "template": template, "backend": backend, "config": config,
            "platform": t.platform, "device": t.kind, "cores": t.cores, "jax": jax.__version__}
    h = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode())
    h.update(digests.sources("graph.py", "ops.py", "kernels/**/*.py").encode())
    digests.templates_digest(h)
    return h.hexdigest()[:32]


def entry_path(root: str, key: str) -> str:
    """Where the cache at `root` keeps the kernel of `key` (a folder per two first hex digits)."""
    return os.path.join(root, key[:2], f"{key}.jaxexp")


def cached(kernel: Callable, group: Group, template: str, backend: str, config: dict, *,
           directory: str | None = None) -> Callable:
    """`kernel` (a function of the group's inputs, in `group.inputs` order) as an exported function read from the
    cache, or exported and kept there now; `kernel` itself where there is no cache or it cannot be exported.
    `directory`: the cache (default `cache_dir()`)."""
    root = directory or cache_dir()
    if root is None:
        return kernel
    path = entry_path(root, kernel_key(group, template, backend, config))
    try:
        with open(path, "rb") as f:
            exp = jax.export.deserialize(bytearray(f.read()))
        os.utime(path)  # used now: the last to be evicted
        return _call(exp, kernel)
    except FileNotFoundError:
        pass
    except Exception as e:  # noqa: BLE001 - a damaged or foreign entry: made again below
        log.debug("autofuse: kernel cache entry %s unreadable (%s: %s); exporting again", path, type(e).__name__, e)
    try:
        exp = export(kernel, group)
    except Exception as e:  # noqa: BLE001 - whatever cannot be exported runs as built (its own errors come from there)
        log.debug("autofuse: kernel of %s (%s, %s) not exported: %s: %s", group.signature, template, backend, type(e).__name__, e)
        return kernel
    _write(path, exp.serialize())
    trim(root)
    return _call(exp, kernel)


def export(kernel: Callable, group: Group, target: Target | None = None) -> Any:
    """`jax.export` of the kernel for `target`'s platform (default: this process's device, as itself)."""
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in group.input_avals()]
    with target.lowering() if target is not None else contextlib.nullcontext():
        return jax.export.export(jax.jit(kernel), platforms=[(target or Target.here()).platform],
                                 disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*structs)


def code(exp: Any) -> str:
    """An export's module as two processes' exports of one kernel for one device share it (`runner.lowering_pool`'s
    helpers and the process on that device): without its source locations (the Python call stack that lowered it),
    and without the number Mosaic GPU appends to a kernel's dump name (how many kernels of that name this process
    lowered before: it names a dump file only) or the kernel hash that covers it. Past nine kernels of one name the
    module's bytes move beyond that, so two exports compare equal only from processes that lowered as few."""
    lines = [ln for ln in exp.mlir_module().splitlines() if not ln.startswith("#loc")]
    text = "\n".join(re.sub(r"\s*loc\((?:[^()]|\([^()]*\))*\)", "", ln) for ln in lines)
    text = re.sub(r'kernel_hash = "(?:[^"\\]|\\.)*"', 'kernel_hash = ""', text)
    return re.sub(r"(dump_basename\\00[A-Za-z0-9_]*?)_[0-9]+\\00", r"\1\\00", text)


def keep(kernel: Callable, group: Group, template: str, backend: str, config: dict, target: Target, directory: str) -> bool:
    """Export `kernel` for `target` (not this process's device) into the cache at `directory`, under the key a
    process on that device looks up; False where it is already there. Raises what the export raises."""
    path = entry_path(directory, kernel_key(group, template, backend, config, target))
    if os.path.exists(path):
        return False
    _write(path, export(kernel, group, target).serialize())
    trim(directory)
    return True


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
        files = [e.path for d in os.scandir(root) if d.is_dir() for e in os.scandir(d.path) if e.name.endswith(".jaxexp")]
    except OSError:
        return
    trim_least_recent(files, max_bytes)
