"""What machine and software a plan is made for: part of every plan's lookup key."""
from __future__ import annotations

import os

import jax

from . import interpret_cpu


def device_info() -> dict:
    """The first device: its name (GPU model, or the platform), compute capability, SM count, memory."""
    d = jax.devices()[0]
    info = {"name": d.device_kind if d.platform == "gpu" else d.platform,
            "compute_capability": getattr(d, "compute_capability", None),
            "sm_count": getattr(d, "core_count", None), "memory_bytes": None}
    try:
        info["memory_bytes"] = (d.memory_stats() or {}).get("bytes_limit")
    except Exception:  # not every backend reports memory
        pass
    if info["compute_capability"] is not None:
        info["compute_capability"] = str(info["compute_capability"])
    return info


def device_label() -> str:
    """The device this process runs on, as recorded with each trial: platform:id, kind, and the
    CUDA_VISIBLE_DEVICES it was given (on a host with several GPUs, what tells the physical card)."""
    d = jax.devices()[0]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return f"{d.platform}:{d.id} {d.device_kind}" + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else "")


#: The code generator a plan is keyed by: Pallas for GPUs, whichever lowering each group uses (Triton or Mosaic GPU;
#: the plan names it per group). Plans of autofuse < 0.2 were keyed "triton".
CODEGEN = "pallas"


def software(backend: str = CODEGEN) -> dict:
    import jaxlib

    from . import __version__

    return {"jax": jax.__version__, "jaxlib": getattr(jaxlib, "__version__", jax.__version__), "autofuse": __version__, "backend": backend}


def hopper() -> bool:
    """Whether this process's first device is a Hopper GPU (compute capability 9.x): what Mosaic GPU's kernels need."""
    d = jax.devices()[0]
    return d.platform == "gpu" and str(getattr(d, "compute_capability", "") or "").startswith("9")


def default_backends() -> tuple[str, ...]:
    """The lowerings worth trying here, the preferred first: Mosaic GPU (TMA, wgmma) on a Hopper GPU, Triton, and XLA's
    own operations on a changed layout (`aligned_dot`: no Pallas kernel, what Pallas cannot do faster)."""
    return ("mosaic_gpu", "triton", "xla_ops") if hopper() else ("triton", "xla_ops")


def backend_unavailable(backend: str, measure: str) -> str | None:
    """Why a job cannot tune `backend` here, or None. A modelled job builds and checks every backend's kernels in
    interpret mode and times them on the model of a Hopper GPU, so only measuring Mosaic GPU's needs the hardware;
    checking them in interpret mode needs XLA:CPU's plain scheduler (`interpret_cpu`)."""
    if backend != "mosaic_gpu" or hopper():
        return None
    if measure == "model":
        return interpret_cpu.unsafe_reason()
    d = jax.devices()[0]
    cc = getattr(d, "compute_capability", None)
    return f"mosaic_gpu needs a Hopper GPU (compute capability 9.x) to be measured; this is {d.device_kind}" + (f" ({cc})" if cc else "")
