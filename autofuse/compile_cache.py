"""One persistent JAX compilation cache for a tuning job's processes and the deployed program.

A tuning job compiles the same programs in several processes: each worker's trial process compiles jax.jit's
reference of the whole program (GPT-2 medium's forward: 6 s on an H100, its training step 18 s), the selection
compiles it again with each plan, and a deploy compiles the plan once more. `import autofuse` therefore points
JAX's persistent compilation cache at one directory where the user chose none: ``$AUTOFUSE_COMPILE_CACHE_DIR``
(``off`` for none), else ``~/.cache/autofuse/jax-compile/jaxlib-<version>``, trimmed to `MAX_BYTES` (the least
recently used entries first) by `import autofuse` at most once every `TRIM_EVERY_S`. Not by JAX: its eviction
(`jax_compilation_cache_max_size`) takes one lock file for every read and write of the cache and scans the whole
directory at each write, and a job's 16 compiling threads and processes then waited out its 10 s timeout and
compiled again (five times in one GPT-2 training-step job on an H200, results/models_cudnn_h200.md §14). JAX caches
only compilations that took at least a second (its default); where kernels are built on a GPU,
`keep_short_compiles` keeps those of 0.1 s too. Where JAX is already imported it is configured through
`jax.config`; else through the environment variables JAX reads at import. Imports nothing from JAX itself, but for
`keep_short_compiles` (called on a GPU, where kernels are built).
"""
from __future__ import annotations

import os
import sys
import time

from .xla_autotune import chosen_dir, jaxlib_cache_dir, trim_least_recent

ENV_DIR = "AUTOFUSE_COMPILE_CACHE_DIR"
JAX_DIR = "JAX_COMPILATION_CACHE_DIR"
MAX_BYTES = 8 * 2**30  # a whole model's executables are tens of MB each: thousands of them
TRIM_EVERY_S = 3600.0  # `trim` scans the directory: once an hour is enough for what a job adds
TRIMMED = ".autofuse-trimmed"  # its modification time: when the directory was last trimmed


def default_dir(environ: dict[str, str] | os._Environ = os.environ) -> str | None:
    """``$AUTOFUSE_COMPILE_CACHE_DIR`` as given (None for ``off`` or empty), else one directory per jaxlib version."""
    return chosen_dir(environ, ENV_DIR, jaxlib_cache_dir("jax-compile"))


def configure(environ: dict[str, str] | os._Environ = os.environ) -> str | None:
    """Point JAX's persistent compilation cache at `default_dir` unless the user set one (their environment variable
    or `jax.config`); the directory in use, or None (none, or the directory cannot be made)."""
    jax = sys.modules.get("jax")
    own = environ.get(JAX_DIR) or (jax.config.jax_compilation_cache_dir if jax is not None else None)
    if own:
        return own
    path = default_dir(environ)
    if path is None:
        return None
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:  # a read-only home: every process compiles for itself, as without autofuse
        return None
    if jax is not None:
        jax.config.update("jax_compilation_cache_dir", path)
    else:
        environ[JAX_DIR] = path
    trim_now_and_then(path)
    return path


def trim_now_and_then(path: str, every_s: float = TRIM_EVERY_S, max_bytes: int = MAX_BYTES) -> bool:
    """`trim` the cache at `path` unless it was trimmed less than `every_s` ago; whether it was trimmed now."""
    marker = os.path.join(path, TRIMMED)
    try:
        if time.time() - os.stat(marker).st_mtime < every_s:
            return False
    except OSError:
        pass
    try:
        with open(marker, "a"):
            os.utime(marker)
    except OSError:  # a directory this process cannot write: nothing to trim either
        return False
    trim(path, max_bytes)
    return True


def trim(path: str, max_bytes: int = MAX_BYTES) -> None:
    """Delete JAX's least recently used cache entries (``<key>-cache`` files, with their ``<key>-atime`` files where
    JAX's own eviction wrote them) until the rest hold at most `max_bytes`."""
    try:
        names = os.listdir(path)
    except OSError:
        return
    trim_least_recent([os.path.join(path, n) for n in names if n.endswith("-cache")], max_bytes)
    kept = {n[:-len("-cache")] for n in os.listdir(path) if n.endswith("-cache")}
    for n in names:
        if n.endswith("-atime") and n[:-len("-atime")] not in kept:
            try:
                os.unlink(os.path.join(path, n))
            except OSError:
                pass


DIR: str | None = None  # set by `import autofuse`
MIN_COMPILE_S = 0.1  # what `keep_short_compiles` keeps from
JAX_MIN = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"


def keep_short_compiles(environ: dict[str, str] | os._Environ = os.environ) -> bool:
    """Keep compilations of `MIN_COMPILE_S` or more in the cache autofuse chose (JAX's default keeps those of a second
    or more): on a GPU a kernel's program compiles in 0.2-1.2 s and a job compiles each in several processes
    (results/compile_cost_h200.md). Left alone where the user chose the cache or the threshold; True if set."""
    import jax

    if DIR is None or DIR != default_dir(environ) or JAX_MIN in environ:
        return False
    if jax.config.jax_persistent_cache_min_compile_time_secs > MIN_COMPILE_S:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_S)
    return True
