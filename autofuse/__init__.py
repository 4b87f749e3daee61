"""autofuse: auto-tuned kernel fusion for JAX on NVIDIA GPUs.

`autofuse.tune(fn, *args)` searches fused plans; `autofuse.jit(fn)` runs the
tuned plan (or plain `jax.jit`); `autofuse.PlanStore(url)` answers questions
about past runs. Attributes load lazily so that the store and the CLI's
query commands start without importing JAX. Importing it keeps JAX from
preallocating most of the GPU in this process where that is still possible
(`autofuse.gpumem`): the trial processes of `tune()` need the memory; and it
points XLA's autotune cache at one directory (`autofuse.xla_autotune`), so that
a deployed process compiles the GEMMs a tuning job measured, and JAX's persistent
compilation cache at another (`autofuse.compile_cache`), so that a program one
process compiled is not compiled again by the next; and it gives XLA:CPU the scheduler that Mosaic GPU's interpret
mode needs (`autofuse.interpret_cpu`).
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

from . import gpumem as _gpumem  # noqa: E402 -- before anything starts JAX's GPU client

_gpumem.STATE = _gpumem.configure()  # XLA_PYTHON_CLIENT_PREALLOCATE=false where it still takes effect and nothing was chosen

from . import xla_autotune as _xla_autotune  # noqa: E402 -- before anything starts JAX's backends

_xla_autotune.DIR = _xla_autotune.configure()  # one XLA autotune cache for tuning jobs and deployed processes

from . import compile_cache as _compile_cache  # noqa: E402

_compile_cache.DIR = _compile_cache.configure()  # one persistent compilation cache for a job's processes and deploys

from . import interpret_cpu as _interpret_cpu  # noqa: E402

_interpret_cpu.SAFE_HERE = _interpret_cpu.configure()  # XLA:CPU's plain scheduler, without which Mosaic GPU interpret mode can hang

_LAZY = {
    "jit": "autofuse.api",
    "AutofuseFunction": "autofuse.api",
    "tune": "autofuse.tuning.local",
    "JobOptions": "autofuse.tuning.options",
    "TuneReport": "autofuse.tuning.report",
    "capture": "autofuse.graph",
    "Graph": "autofuse.graph",
    "Plan": "autofuse.plan",
    "PlanError": "autofuse.plan",
    "PlanStore": "autofuse.store",
    "StoreError": "autofuse.store",
}
__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'autofuse' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
