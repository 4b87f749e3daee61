"""XLA's own autotuning, the same at tuning time and at deploy.

XLA autotunes every GEMM fusion (cuBLAS algorithms, its Triton GEMM tiles) at each compilation and does not
always pick the same kernels: on an H100 the same HLO compiled in two processes ran 7.05 ms and 7.95 ms. The
parts of a program a plan leaves to XLA, and the jax.jit baseline it was judged against, then drift between
the tuning job and the deployed process. `import autofuse` therefore points XLA's per-fusion autotune cache
(``--xla_gpu_per_fusion_autotune_cache_dir``) at one directory, where the trial processes of a tuning job
write what they chose and a deployed process reads it back, so that both compile the same kernels:
``$AUTOFUSE_XLA_AUTOTUNE_DIR``, else ``~/.cache/autofuse/xla-autotune/jaxlib-<version>`` (XLA leaves checking
that an entry was made by the same compiler to its user: a jaxlib upgrade starts a new directory). Ship that
directory with the plan database to deploy on another machine. Nothing is changed where the user set the flag,
where JAX's backends already started (XLA reads its flags once), or where the directory cannot be made. Imports
nothing from JAX.
"""
from __future__ import annotations

import importlib.metadata
import os

from .gpumem import backends_initialised

FLAG = "--xla_gpu_per_fusion_autotune_cache_dir"
ENV_DIR = "AUTOFUSE_XLA_AUTOTUNE_DIR"


def default_dir(environ: dict[str, str] | os._Environ = os.environ) -> str:
    """``$AUTOFUSE_XLA_AUTOTUNE_DIR`` as given, else one directory per jaxlib version under ``~/.cache/autofuse``."""
    if environ.get(ENV_DIR):
        return environ[ENV_DIR]
    try:
        version = importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return os.path.join(os.path.expanduser("~"), ".cache", "autofuse", "xla-autotune", f"jaxlib-{version}")


def configure(environ: dict[str, str] | os._Environ = os.environ) -> str | None:
    """Add the autotune cache flag to ``XLA_FLAGS`` where it still takes effect and the user set none; the
    directory XLA's autotuning results go to (the user's own where they set the flag), or None."""
    flags = environ.get("XLA_FLAGS", "")
    own = [f.split("=", 1)[1] for f in flags.split() if f.startswith(FLAG + "=")]
    if own:
        return own[-1] or None
    if backends_initialised():
        return None
    path = default_dir(environ)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:  # a read-only home: XLA autotunes as it would without autofuse
        return None
    environ["XLA_FLAGS"] = f"{flags} {FLAG}={path}".strip()
    return path


DIR: str | None = None  # set by `import autofuse`
