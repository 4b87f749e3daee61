"""autofuse: auto-tuned kernel fusion for JAX on NVIDIA GPUs.

`autofuse.jit(fn, plan=...)` runs a fused plan; `autofuse.capture` turns a
function into the graph that plans are made for.
"""
from .api import AutofuseFunction, jit
from .graph import Graph, capture
from .plan import Plan, PlanError

__version__ = "0.1.0"
__all__ = ["AutofuseFunction", "Graph", "Plan", "PlanError", "capture", "jit", "__version__"]
