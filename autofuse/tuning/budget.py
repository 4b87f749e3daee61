"""A job's budget as a person gives it, checked without importing JAX: the command line refuses a bad one at once,
not after the seconds JAX takes to start."""
from __future__ import annotations

DEFAULT_TRIALS = 48  # a job's trial budget when it is given neither trials nor seconds nor an effort
EFFORT_TRIALS = {"quick": 16, "default": DEFAULT_TRIALS, "thorough": 160}  # the trials each named effort buys


def check_budget(trials: int | None, time_budget_s: float | None, *, trials_flag: str = "trials",
                 seconds_flag: str = "time_budget_s") -> None:
    """A budget given must be positive: zero or a negative budget is a mistake, never "unbounded" or "nothing"."""
    if trials is not None and (isinstance(trials, bool) or not isinstance(trials, int) or trials < 1):
        raise ValueError(f"{trials_flag} must be a positive whole number of trials, got {trials!r}")
    if time_budget_s is not None and not (isinstance(time_budget_s, (int, float)) and time_budget_s > 0):
        raise ValueError(f"{seconds_flag} must be a positive number of seconds, got {time_budget_s!r}")


def trials_for(trials: int | None, time_budget_s: float | None, effort: str | None = None, *, effort_flag: str = "effort") -> int | None:
    """The trial budget a job runs with: `trials` as given, else the named `effort`'s (quick 16, default 48,
    thorough 160: Helion's and Inductor's habit of effort levels), else the default where no time budget bounds the
    job (None: the time budget alone)."""
    if effort is not None and effort not in EFFORT_TRIALS:
        raise ValueError(f"{effort_flag} must be one of {', '.join(EFFORT_TRIALS)}, got {effort!r}")
    if trials is not None:
        return trials
    if effort is not None:
        return EFFORT_TRIALS[effort]
    return DEFAULT_TRIALS if time_budget_s is None else None


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int, *, flag: str = "max_memory") -> int:
    """A size as a person writes it (``40GiB``, ``512MiB``, ``8e9``, ``40 GB``) in bytes; ValueError (one line)."""
    if isinstance(text, int) and not isinstance(text, bool):
        size: float = text
    else:
        s = str(text).strip().lower().replace(" ", "")
        num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = s[len(num):]
        try:
            size = float(num) * _UNITS[unit]
        except (ValueError, KeyError):
            raise ValueError(f"{flag} must be a size such as 40GiB, 512MiB or 8e9 (bytes), got {text!r}") from None
    if size <= 0:
        raise ValueError(f"{flag} must be a positive size, got {text!r}")
    return int(size)
