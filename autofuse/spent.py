"""Where a job's seconds went: named parts added up in a dict, which the run's phases record (`xla_parts`,
`trial_parts`, shown by `autofuse show run`)."""
from __future__ import annotations

import time


def add_since(spent: dict, part: str, t0: float) -> float:
    """Add the seconds since `t0` (`time.perf_counter`) to `spent[part]`, rounded to milliseconds; returns now."""
    now = time.perf_counter()
    spent[part] = round(spent.get(part, 0.0) + now - t0, 3)
    return now


def add_parts(spent: dict, parts: dict | None, prefix: str) -> None:
    """Add another process's parts (seconds, e.g. a trial's `TrialResult.seconds`) to `spent`, each named `prefix` + its name."""
    for part, secs in (parts or {}).items():
        spent[prefix + part] = round(spent.get(prefix + part, 0.0) + secs, 3)
