"""What became of a trial: one enum for the trial process, the tuner and the store.

A status says whether the trial spent budget (a config never compiled, or one
whose worker died, did not) and whether another config of the same candidate
may still do better (a failure that depends on the config, not the group).
"""
from __future__ import annotations

from enum import StrEnum


class TrialStatus(StrEnum):
    OK = "ok"
    INFEASIBLE = "infeasible"  # breaks a search-space constraint: never compiled
    PRUNED = "pruned"  # the roofline model puts it far behind the default: never compiled
    COMPILE_ERROR = "compile_error"
    RESOURCE_EXHAUSTED = "resource_exhausted"  # shared memory or registers
    WRONG_RESULT = "wrong_result"
    NAN = "nan"
    TIMEOUT = "timeout"
    CRASHED = "crashed"
    ERROR = "error"
    RUNNING = "running"  # claimed by a worker, not finished yet
    LOST = "lost"  # its worker died; the config is retried elsewhere
    OVER_MEMORY = "over_memory"  # a whole plan whose peak device memory is above the job's cap (`tune(max_memory_bytes=)`)

    @property
    def spends_budget(self) -> bool:
        """Whether the trial counts against the job's trial budget (running ones do: they are being spent)."""
        return self not in (TrialStatus.INFEASIBLE, TrialStatus.PRUNED, TrialStatus.LOST)

    @property
    def compiled(self) -> bool:
        """Whether anything was built for it (infeasible and pruned configs never are)."""
        return self not in (TrialStatus.INFEASIBLE, TrialStatus.PRUNED)

    @property
    def config_failure(self) -> bool:
        """A failure another config of the same group may not have (too much shared memory, a compile error)."""
        return self in (TrialStatus.RESOURCE_EXHAUSTED, TrialStatus.COMPILE_ERROR)


UNCOUNTED = tuple(s.value for s in TrialStatus if not s.spends_budget)
