"""The XLA:CPU setting that Mosaic GPU's interpret mode needs, made by `import autofuse`.

Mosaic GPU interpret mode runs each warpgroup as its own XLA:CPU executable whose callbacks block on the simulated
barriers. XLA's concurrency-optimised scheduler lets those executables' work wait for the threads of the intra-op
pool that the blocked callbacks hold: a deadlock, certain on one core (a modelled `autofuse tune --backends
mosaic_gpu` of an attention hung in its interpret-mode check) and at random on two. The plain scheduler only orders
independent work differently: a CPU program computes the same, and a GPU's programs are untouched. So `import
autofuse` adds the flag to ``XLA_FLAGS`` where it still takes effect and the user gave it no value of their own;
where it cannot (JAX's backends started first, or the user turned the scheduler on), `SAFE_HERE` says so and a job
on a machine without a Hopper GPU leaves Mosaic GPU out with a line saying why (`device.backend_unavailable`).
Imports nothing from JAX.
"""
from __future__ import annotations

import os

from .gpumem import backends_initialised

FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler"
SAFE = f"{FLAG}=false"


def configure(environ: dict[str, str] | os._Environ = os.environ) -> bool:
    """Add `SAFE` to ``XLA_FLAGS`` where it still takes effect and the user set no value for the flag; whether this
    process's XLA:CPU runs with the plain scheduler (the user's own value where they gave one)."""
    flags = environ.get("XLA_FLAGS", "")
    own = _own_value(flags)
    if own is not None:
        return own.lower() in ("false", "0")
    if backends_initialised():
        return False
    environ["XLA_FLAGS"] = f"{flags} {SAFE}".strip()
    return True


SAFE_HERE = False  # set by `import autofuse`


def unsafe_reason() -> str | None:
    """Why Mosaic GPU kernels cannot run in interpret mode in this process (one line), or None."""
    if SAFE_HERE:
        return None
    return (f"Mosaic GPU's interpret mode can deadlock XLA:CPU unless JAX starts with XLA_FLAGS={SAFE} "
            "(import autofuse before JAX runs anything, or set it)")


def _own_value(flags: str) -> str | None:
    """The value ``XLA_FLAGS`` gives the flag (the last one; a bare flag means true), or None where it is absent."""
    values = [f.partition("=")[2] or "true" for f in flags.split() if f.partition("=")[0] == FLAG]
    return values[-1] if values else None
