"""GPU memory of a process that tunes: keep JAX from preallocating 75% of the GPU in the caller's process.

By default JAX's GPU client reserves 75% of the card when it starts. A caller
that creates arrays before `autofuse.tune()` then leaves the trial process a
quarter of the GPU, and big candidates fail out of memory. `import autofuse`
therefore sets ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (the pool grows as
needed) when JAX's backends are not initialised yet and the user has chosen
no allocator setting; JAX reads it when its GPU client starts. Where the GPU
client had already started with preallocation, `tune()` says so up front with
the fix, and its trial processes get a pool capped at what the GPU has free
(`trial_process_env`): on an H100 whose caller held 59 GiB, a trial process
allowed the usual 75% spent its time in failed allocations (1507 in 4
minutes) and ran no trial. Imports nothing from JAX: a backend's state is read
from the module JAX keeps it in, only if JAX was imported already.
"""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable

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
    held = held_pool_fraction(platform, state, environ)
    if held is None:
        return None
    when = "before autofuse was imported" if state.initialised_at_import else "with XLA_PYTHON_CLIENT_PREALLOCATE set"
    return (f"autofuse: JAX preallocated {held:.0%} of the GPU's memory in this process (its GPU client started {when}), "
            "so the trial process gets the rest and large candidates may fail out of memory; fix: set "
            "XLA_PYTHON_CLIENT_PREALLOCATE=false before JAX starts (or import autofuse before creating any array)")


def held_pool_fraction(platform: str, state: AllocatorState, environ: dict[str, str] | os._Environ = os.environ) -> float | None:
    """The fraction of the GPU that this process's JAX client (on `platform`) preallocated; None if it holds no
    preallocated pool. The variables are those of `import autofuse` if the client had started by then, else now's."""
    if platform != "gpu":
        return None
    env = state.env_at_import if state.initialised_at_import else {k: environ[k] for k in ALLOCATOR_VARS if k in environ}
    if not preallocates(env):
        return None
    return float(env.get("XLA_CLIENT_MEM_FRACTION") or env.get("XLA_PYTHON_CLIENT_MEM_FRACTION") or "0.75")


def gpu_free_fraction(environ: dict[str, str] | os._Environ = os.environ) -> float | None:
    """The fraction of this process's first GPU that is free now (nvidia-smi), None if it cannot be read."""
    gpu = (environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip() or "0"
    try:
        out = subprocess.run(["nvidia-smi", "-i", gpu, "--query-gpu=memory.free,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
        free, total = (float(x) for x in out.strip().splitlines()[0].split(","))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
    return free / total if total > 0 else None


TRIAL_POOL_SHARE = 0.9  # of the GPU memory free when a trial process starts: its pool, reserved at once


def trial_process_env(platform: str, state: AllocatorState, environ: dict[str, str] | os._Environ = os.environ,
                      free_fraction: Callable[[], float | None] | None = None) -> dict[str, str]:
    """The allocator variables of a trial process started by this one: no preallocation, and a pool of at most
    `TRIAL_POOL_SHARE` of what the GPU has free now. Where this process holds a preallocated pool, that cap
    makes a candidate too big for what is left fail at once as out of memory rather than each of its allocations
    failing on a full GPU (what the pool leaves stands in where nvidia-smi cannot say). Where it holds none,
    the trial process may have more than JAX's default 75% of the card: the whole-program reference of GPT-2
    medium's training step (B8 S2048) needs 57 GiB of temporaries, which 75% of an H100 (60 GiB) with the job's
    inputs beside it did not hold, and its plan (4.7x on attention) failed validation out of memory. A fraction
    the user set is kept (and the pool then grows as needed).

    A pool of our own fraction is reserved at once, one region: JAX's pool grown region by region let a few small
    outputs split the region of that step's 64.7 GiB of temporaries, and the rounding check's second run of it
    failed out of memory with the pool mostly free (H100). CUDA's stream-ordered pool (`cuda_async`) avoided that
    but made XLA rematerialise jax.jit's step (243 -> 349 ms), which would flatter every plan measured against it."""
    grow = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    held = held_pool_fraction(platform, state, environ)
    if held is None and (platform == "cpu" or any(environ.get(v) for v in ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION"))):
        return grow
    free = (free_fraction or gpu_free_fraction)()
    if free is None:
        if held is None:
            return grow
        free = max(0.0, 1.0 - held)
    return {"XLA_PYTHON_CLIENT_PREALLOCATE": "true", "XLA_PYTHON_CLIENT_MEM_FRACTION": f"{max(0.01, TRIAL_POOL_SHARE * free):.3f}"}


def client_platform() -> str:
    """The platform of this process's JAX client ("gpu", "cpu", ...), "none" if it has not started (nor JAX)."""
    if not backends_initialised():
        return "none"
    return sys.modules["jax"].default_backend()


STATE: AllocatorState | None = None  # set by `import autofuse`
