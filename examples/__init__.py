"""Example programs to tune with autofuse."""
from __future__ import annotations

import jax


def library_attention() -> str | None:
    """The implementation the examples' library-attention variants ask `jax.nn.dot_product_attention` for: cuDNN's
    fused kernels on a GPU, as a careful JAX user writes attention there; XLA's elsewhere (cuDNN cannot even be
    traced without a GPU), so that the same variants run in the CPU tests."""
    return "cudnn" if jax.default_backend() == "gpu" else None
