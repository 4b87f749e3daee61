"""Deploy time: what a traced signature of `autofuse.jit` runs, decided apart from the face (`autofuse.api`).

`resolve` (in `lookup`) finds the plan: given, the store's for this device and software, or one of the same
structure tuned at other sizes; `serve` builds it, re-verifies it where it was made elsewhere, and applies the miss
policy, which may start a background tuning job (`background`: a process, never an import of the tuner). `stores`
opens the plan store read-only and records what a trace learned; `traces` tells which signature a call ran.
Nothing here imports `autofuse.tuning`, scipy or Optuna.
"""
from __future__ import annotations

from .background import BackgroundTune, TuningJob
from .lookup import resolve
from .resolution import Resolution
from .serve import Served, serve
from .settings import Deployment

__all__ = ["BackgroundTune", "Deployment", "Resolution", "Served", "TuningJob", "resolve", "serve"]
