"""What the kernel tests share: the relative error norm of a kernel's output against its reference, and a plan's
program against jax.jit's."""
from __future__ import annotations

import numpy as np


def rel_err(out, ref) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; the shapes must agree and every output be finite."""
    o, r = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert o.shape == r.shape and np.isfinite(o).all()
    return float(np.linalg.norm(o - r) / max(np.linalg.norm(r), 1e-30))


def assert_plan_matches_jit(fn, plan, args, tol: float) -> None:
    """`autofuse.jit(fn, plan)` runs the plan (not a fallback) and every output is within `tol` of jax.jit's."""
    import autofuse
    import jax
    from autofuse.runner.measure import compare

    fused = autofuse.jit(fn, plan=plan, on_miss="error")
    for o, r in zip(jax.tree_util.tree_leaves(fused(*args)), jax.tree_util.tree_leaves(jax.jit(fn)(*args))):
        ok, _, why = compare(o, r, tol)
        assert ok, why
    assert fused.last_status.startswith("plan:"), fused.last_status
