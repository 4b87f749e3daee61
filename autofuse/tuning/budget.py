"""A job's budget as a person gives it, checked without importing JAX: the command line refuses a bad one at once,
not after the seconds JAX takes to start."""
from __future__ import annotations


def check_budget(trials: int | None, time_budget_s: float | None, *, trials_flag: str = "trials",
                 seconds_flag: str = "time_budget_s") -> None:
    """A budget given must be positive: zero or a negative budget is a mistake, never "unbounded" or "nothing"."""
    if trials is not None and (isinstance(trials, bool) or not isinstance(trials, int) or trials < 1):
        raise ValueError(f"{trials_flag} must be a positive whole number of trials, got {trials!r}")
    if time_budget_s is not None and not (isinstance(time_budget_s, (int, float)) and time_budget_s > 0):
        raise ValueError(f"{seconds_flag} must be a positive number of seconds, got {time_budget_s!r}")
