"""What the kernel tests share: the relative error norm of a kernel's output against its reference, and a plan's
program against jax.jit's."""
from __future__ import annotations

import numpy as np


def rel_err(out, ref) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; the shapes must agree and every output be finite."""
    o, r = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert o.shape == r.shape and np.isfinite(o).all()
    return float(np.linalg.norm(o - r) / max(np.linalg.norm(r), 1e-30))


def assert_plan_matches_jit(fn, plan, args, tol: float, *, noise: bool = False) -> None:
    """`autofuse.jit(fn, plan)` runs the plan (not a fallback; XLA's where the plan has no group) and every output
    is within `tol` of jax.jit's. `noise`: or within twice XLA's own spread (jax.jit against op-by-op XLA) where
    XLA itself is undecided: the gradient of attention's key bias is exactly zero in exact arithmetic (softmax
    ignores a shift of a row), and jax.jit and op-by-op XLA (jax 0.11.2) disagree on it by 50-140% relative."""
    import autofuse
    import jax
    from autofuse.runner.measure import compare

    fused = autofuse.jit(fn, plan=plan, on_miss="error")
    outs = jax.tree_util.tree_leaves(fused(*args))
    assert fused.last_status.startswith("plan:" if plan.groups else "xla-plan:"), fused.last_status
    refs = jax.tree_util.tree_leaves(jax.jit(fn)(*args))
    if noise:
        with jax.disable_jit():
            eager = jax.tree_util.tree_leaves(fn(*args))
    assert len(outs) == len(refs)
    for i, (o, r) in enumerate(zip(outs, refs)):
        ok, _, why = compare(o, r, max(tol, 2 * compare(eager[i], r, 0.0)[1]) if noise else tol)
        assert ok, why
