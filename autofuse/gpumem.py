"""GPU memory of a process that tunes: keep JAX from preallocating 75% of the GPU in the caller's process.

By default JAX's GPU client reserves 75% of the card when it starts. A caller
that creates arrays before `autofuse.tune()` then leaves the trial process a
quarter of the GPU, and big candidates fail out of memory. `import autofuse`
therefore sets ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (the pool grows as
needed) when JAX's backends are not initialised yet and the user has chosen
no allocator setting; JAX reads it when its GPU client starts. Where the GPU
client had already started with preallocation, `tune()` says so up front with
the fix. Imports nothing from JAX: a backend's state is read from the module
JAX keeps it in, only if JAX was imported already.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

#: The variables through which a user chooses how JAX's GPU client allocates (jaxlib's xla_client reads them).
ALLOCATOR_VARS = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION",
                  "XLA_PYTHON_CLIENT_ALLOCATOR")


@dataclass(frozen=True)
class AllocatorState:
    """What `import autofuse` found: whether JAX's backends were already initialised, the allocator variables
    then, and whether autofuse set ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` itself."""

    initialised_at_import: bool
    env_at_import: dict[str, str]
    set_by_autofuse: bool


def backends_initialised() -> bool:
    """Whether JAX has created its backends (its GPU client among them), without initialising them (or importing JAX)."""
    xb = sys.modules.get("jax._src.xla_bridge")
    probe = getattr(xb, "backends_are_initialized", None)
    return bool(probe()) if callable(probe) else False


def configure(environ: dict[str, str] | os._Environ = os.environ) -> AllocatorState:
    """Set ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` where it still takes effect and the user chose nothing."""
    initialised = backends_initialised()
    env = {k: environ[k] for k in ALLOCATOR_VARS if k in environ}
    set_here = not initialised and not env
    if set_here:
        environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    return AllocatorState(initialised, env, set_here)


def preallocates(env: dict[str, str]) -> bool:
    """Whether JAX's GPU client started with these variables reserves its pool up front (jaxlib's rules)."""
    if env.get("XLA_PYTHON_CLIENT_ALLOCATOR", "default").lower() not in ("default", "bfc"):
        return False
    return env.get("XLA_PYTHON_CLIENT_PREALLOCATE", "") not in ("false", "False", "0")


def preallocation_warning(platform: str, state: AllocatorState, environ: dict[str, str] | os._Environ = os.environ) -> str | None:
    """One line for `tune()` when this process's GPU client holds a preallocated pool, else None.

    The client started either before `import autofuse` (the variables then are
    those autofuse found) or after it (the variables now)."""
    if platform != "gpu":
        return None
    env = state.env_at_import if state.initialised_at_import else {k: environ[k] for k in ALLOCATOR_VARS if k in environ}
    if not preallocates(env):
        return None
    frac = env.get("XLA_CLIENT_MEM_FRACTION") or env.get("XLA_PYTHON_CLIENT_MEM_FRACTION") or "0.75"
    when = "before autofuse was imported" if state.initialised_at_import else "with XLA_PYTHON_CLIENT_PREALLOCATE set"
    return (f"autofuse: JAX preallocated {float(frac):.0%} of the GPU's memory in this process (its GPU client started {when}), "
            "so the trial process gets the rest and large candidates may fail out of memory; fix: set "
            "XLA_PYTHON_CLIENT_PREALLOCATE=false before JAX starts (or import autofuse before creating any array)")


STATE: AllocatorState | None = None  # set by `import autofuse`
