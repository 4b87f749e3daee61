"""What the kernel tests share: the relative error norm of a kernel's output against its reference."""
from __future__ import annotations

import numpy as np


def rel_err(out, ref) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; the shapes must agree and every output be finite."""
    o, r = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert o.shape == r.shape and np.isfinite(o).all()
    return float(np.linalg.norm(o - r) / max(np.linalg.norm(r), 1e-30))
