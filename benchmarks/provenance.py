"""Where a benchmark's numbers come from: the commit of the code that ran them."""
from __future__ import annotations

import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def commit(given: str | None = None) -> str:
    """`given` (a benchmark's ``--commit``), else ``$AUTOFUSE_COMMIT``, else git's HEAD of this checkout. A GPU
    machine's copy of the tree may carry a stale ``.git``, so runs there pass one of the first two."""
    if given:
        return given
    if os.environ.get("AUTOFUSE_COMMIT"):
        return os.environ["AUTOFUSE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True, cwd=ROOT).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git here: pass --commit)"
