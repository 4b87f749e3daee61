"""One persistent JAX compilation cache for a tuning job's processes and the deployed program.

A tuning job compiles the same programs in several processes: each worker's trial process compiles jax.jit's
reference of the whole program (GPT-2 medium's forward: 6 s on an H100, its training step 18 s), the selection
compiles it again with each plan, and a deploy compiles the plan once more. `import autofuse` therefore points
JAX's persistent compilation cache at one directory where the user chose none: ``$AUTOFUSE_COMPILE_CACHE_DIR``
(``off`` for none), else ``~/.cache/autofuse/jax-compile/jaxlib-<version>``, capped at `MAX_BYTES` (JAX evicts
the least recently used entries). JAX caches only compilations that took at least a second (its default); where
kernels are built on a GPU, `keep_short_compiles` keeps those of 0.1 s too. Where JAX is already imported it is configured through
`jax.config`; else through the environment variables JAX reads at import. Imports nothing from JAX itself, but for
`keep_short_compiles` (called on a GPU, where kernels are built).
"""
from __future__ import annotations

import os
import sys

from .xla_autotune import chosen_dir, jaxlib_cache_dir

ENV_DIR = "AUTOFUSE_COMPILE_CACHE_DIR"
JAX_DIR = "JAX_COMPILATION_CACHE_DIR"
JAX_MAX = "JAX_COMPILATION_CACHE_MAX_SIZE"
MAX_BYTES = 8 * 2**30  # a whole model's executables are tens of MB each: thousands of them


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
        if jax.config.jax_compilation_cache_max_size in (-1, None):
            jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    else:
        environ[JAX_DIR] = path
        environ.setdefault(JAX_MAX, str(MAX_BYTES))
    return path


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
