"""Where a benchmark's numbers come from: the card, JAX version, date, commit and command that made a table, so that
a number in `results/` can be compared only with numbers of its own card and code."""
from __future__ import annotations

import datetime
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRY = "python -m benchmarks"  # the suites' entry (benchmarks/__main__.py) names a part's process after its suite


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


def command(argv: list[str] | None = None) -> str:
    """The command that ran this benchmark, as a reader would type it again: `python -m benchmarks SUITE PART ...`
    through the suites' entry, else the module (or file) that was run and its arguments."""
    args = list(sys.argv[1:] if argv is None else argv)
    prog = sys.argv[0]
    if not prog.startswith(ENTRY):
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        inside = os.path.abspath(prog).startswith(ROOT + os.sep)
        prog = f"python -m {spec.name}" if spec else f"python {os.path.relpath(prog, ROOT) if inside else prog}"
    return " ".join([prog, *args])


def header(argv: list[str] | None = None, given_commit: str | None = None) -> str:
    """A table's first line: card, jax version, date, commit and command."""
    import jax  # here, not at import: a parent process that only launches children keeps JAX's backends unstarted

    return (f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}; date {datetime.date.today()}; "
            f"commit {commit(given_commit)}; command: {command(argv)}")
