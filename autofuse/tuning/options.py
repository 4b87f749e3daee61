"""One tuning job's settings as one object: `tune` checks what it was given once and hands the same `Job` to the
driver that runs it, in this process (`local.tune_here`) or in worker processes (`workers.tune_with_workers`), so
that the two drivers cannot read a setting differently.

`JobOptions` holds how a job runs beyond its budget (crash isolation, timeouts, the program's static arguments, hooks
for `buckets`); `Job` adds what a caller names on `tune` itself. Both are frozen: a driver that needs another setting
makes a copy (`dataclasses.replace`). Imports nothing of JAX: the command line builds them before JAX starts.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .budget import check_budget, parse_bytes, trials_for

if TYPE_CHECKING:
    from ..store import PlanStore
    from .job import Notes

WarmStart = Callable[[dict, list, dict], "dict[str, list[dict]]"]


@dataclasses.dataclass(frozen=True)
class JobOptions:
    """How a job runs, beyond what it tunes and its budget.

    `name` (default ``module:function``): the program's name in the store, as ``autofuse plans --program`` finds it.
    `model`: the GPU model that ranks candidates without a GPU. `isolate`: trials in a child process (a crash is a
    failed trial); `trial_timeout_s`: its limit per trial. `heartbeat_s`: the workers' Optuna heartbeat interval.
    `compile_workers`: threads compiling at once at the job's start (default: $AUTOFUSE_COMPILE_WORKERS, else this
    host's cores shared among its workers, at most 16). `static_argnums`/`static_argnames`: as `jax.jit`.
    `progress`: where progress lines go instead of stderr. `clock`: the job's time (tests). `warm_start(by_sig,
    cands, spaces)`: configs each new study tries first, by candidate signature; `notes`: what the job says even when
    quiet, each line once -- both for a job run by this process (`buckets.tune_buckets`).
    """

    name: str | None = None
    model: str = "h200"
    isolate: bool = True
    trial_timeout_s: float = 300.0
    heartbeat_s: int = 10
    compile_workers: int | None = None
    static_argnums: tuple[int, ...] = ()
    static_argnames: tuple[str, ...] = ()
    progress: Callable[[str], None] | None = None
    clock: Callable[[], float] = time.time
    warm_start: WarmStart | None = None
    notes: Notes | None = None

    #: What a worker process is told (on the run's row, `to_wire`): plain data, never the hooks.
    WIRE = ("model", "isolate", "trial_timeout_s", "heartbeat_s", "compile_workers", "static_argnums", "static_argnames")

    def __post_init__(self) -> None:
        """Static arguments as tuples (an int or a str alone, as jax.jit takes them), and limits that make sense."""
        nums, names = self.static_argnums, self.static_argnames
        object.__setattr__(self, "static_argnums", (nums,) if isinstance(nums, int) else tuple(nums))
        object.__setattr__(self, "static_argnames", (names,) if isinstance(names, str) else tuple(names))
        if not self.trial_timeout_s > 0:
            raise ValueError(f"trial_timeout_s must be a positive number of seconds, got {self.trial_timeout_s!r}")
        if isinstance(self.heartbeat_s, bool) or not isinstance(self.heartbeat_s, int) or self.heartbeat_s < 1:
            raise ValueError(f"the heartbeat interval is a whole number of seconds >= 1, got {self.heartbeat_s!r}")
        if self.compile_workers is not None and self.compile_workers < 1:
            raise ValueError(f"compile_workers must be at least 1, got {self.compile_workers!r}")

    @classmethod
    def fold(cls, options: JobOptions | None, keywords: Mapping[str, Any], caller: str = "tune") -> JobOptions:
        """`options` with `keywords` (a caller's ``tune(..., trial_timeout_s=5)``) folded in; a TypeError in one line
        for a keyword that is no option, as Python says it for a function's own parameters."""
        names = [f.name for f in dataclasses.fields(cls)]
        for k in keywords:
            if k not in names:
                raise TypeError(f"{caller}() got an unexpected keyword argument {k!r} (its options: {', '.join(names)}; "
                                "the function's own keyword arguments go in kwargs=)")
        return dataclasses.replace(options or cls(), **keywords)

    def to_wire(self) -> dict[str, Any]:
        """The options a worker process needs, as JSON data (the run's job row)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in ((k, getattr(self, k)) for k in self.WIRE)}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> JobOptions:
        """The options a worker runs with, from the run's job row (`to_wire`)."""
        return cls(**{k: data[k] for k in cls.WIRE if k in data})


@dataclasses.dataclass(frozen=True)
class Job:
    """A job as `tune` was asked for it, checked: the budget (`trials` resolved from an effort, None for a time
    budget alone), the store (None: store nothing), the plan's memory cap in bytes, and its `options`."""

    trials: int | None = None
    time_budget_s: float | None = None
    seed: int = 0
    store: PlanStore | str | None = None
    measure: str | None = None
    backends: tuple[str, ...] | None = None
    max_memory_bytes: int | None = None
    promote: bool = False
    quiet: bool = False
    verbose: bool = False
    resume: int | None = None
    options: JobOptions = JobOptions()

    @classmethod
    def of(cls, *, trials: int | None = None, time_budget_s: float | None = None, effort: str | None = None,
           max_memory: int | str | None = None, backends: Sequence[str] | None = None, **settings: Any) -> Job:
        """The job a caller asked for, checked: a positive budget (an `effort` names one), a size for `max_memory`."""
        check_budget(trials, time_budget_s)
        return cls(trials=trials_for(trials, time_budget_s, effort), time_budget_s=time_budget_s,
                   max_memory_bytes=None if max_memory is None else parse_bytes(max_memory),
                   backends=None if backends is None else tuple(backends), **settings)
