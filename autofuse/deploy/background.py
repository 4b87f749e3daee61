"""Tuning a missed shape off the hot path: `autofuse.jit(fn, on_miss="tune")` queues a background tuning job.

This is the caller's side, and the job file's format. `queue` writes the job (the function's ``module:qualname``,
its arguments as shapes, dtypes and static values, the budget) to a file, claims the (store, program) pair with a
lock file so that one job at a time tunes it, and starts ``python -P -m autofuse.tuning.background_entry
MODULE:FUNCTION JOBFILE`` as a separate, low-priority process (`refs.python_command`: it imports as the caller does,
the working directory last); it never waits for it and imports nothing of the tuner: the job's side lives on the
tuning side (`autofuse.tuning.background_entry`), which reads the job file (its arguments in `autofuse.codec`'s wire
format, as a worker's job row) and frees it with `release`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import tempfile
from collections.abc import Sequence
from typing import Any

from ..codec import EncodeError, encode_call
from ..processes import pid_alive
from ..refs import python_command, reference

#: Set in a background job's environment: the job never queues another one.
NO_BACKGROUND_ENV = "AUTOFUSE_NO_BACKGROUND_TUNE"
#: The module the job's process runs (named, never imported here: it imports the tuner).
ENTRY = "autofuse.tuning.background_entry"


@dataclasses.dataclass(frozen=True)
class BackgroundTune:
    """The budget and settings of a background tuning job: `trials` and/or `seconds`, `measure` (``device`` or
    ``model``; default: device where there is a GPU), `isolate` (trials in their own process, as `tune`), `nice` (the
    job's priority increment)."""

    trials: int | None = 16
    seconds: float | None = None
    measure: str | None = None
    isolate: bool = True
    nice: int = 10

    @staticmethod
    def of(budget: BackgroundTune | int | None) -> BackgroundTune:
        """A budget given as a number of trials, or as a `BackgroundTune`."""
        if budget is None:
            return BackgroundTune()
        if isinstance(budget, BackgroundTune):
            return budget
        if isinstance(budget, int) and not isinstance(budget, bool) and budget > 0:
            return BackgroundTune(trials=budget)
        raise ValueError(f"tune_budget must be a positive number of trials or a BackgroundTune, got {budget!r}")


@dataclasses.dataclass
class TuningJob:
    """A background tuning job started by this process: the program and shapes it tunes, its process and its log."""

    function: str
    fingerprint: str
    inputs: list[str]
    process: subprocess.Popen
    log: str

    def done(self) -> bool:
        return self.process.poll() is not None

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the job to end (for tests and scripts; `autofuse.jit` never waits); its exit status."""
        return self.process.wait(timeout)


class NotQueued(Exception):
    """Why a miss could not be queued for background tuning (one line)."""


def queue(fn: Any, fingerprint: str, inputs: list[str], args: Sequence[Any], kwargs: dict[str, Any], static_argnums: Sequence[int],
          static_argnames: Sequence[str], store_url: str, budget: BackgroundTune) -> TuningJob:
    """Start a background job tuning `fn` (importable by name: `refs.reference`) at these arguments (arrays, tracers
    or shape structs; static values as they are) into the store at `store_url`; `NotQueued` saying why not (not
    importable, arguments that cannot be written as data, a job already tuning this program, a background job
    itself)."""
    if os.environ.get(NO_BACKGROUND_ENV):
        raise NotQueued("this is a background tuning job: it queues no other")
    try:
        function = reference(fn)
    except ValueError as e:
        raise NotQueued(str(e)) from None
    try:
        wire_args, wire_kwargs = encode_call(args, kwargs)
    except EncodeError as e:
        raise NotQueued(f"its arguments cannot be handed to a background job ({e})") from None
    data = {
        "function": function,
        "fingerprint": fingerprint,
        "args": wire_args,
        "kwargs": wire_kwargs,
        "static_argnums": sorted(i if i >= 0 else i + len(args) for i in static_argnums),
        "static_argnames": list(static_argnames),
        "budget": dataclasses.asdict(budget),
    }
    base = os.path.join(tempfile.gettempdir(), f"autofuse-tune-{hashlib.sha256(store_url.encode()).hexdigest()[:12]}-{fingerprint[:16]}")
    lock = base + ".lock"
    if not _claim(lock):
        raise NotQueued(f"a background job is already tuning this program ({lock})")
    try:
        log = base + ".log"
        data["lock"], data["log"] = lock, log
        with open(base + ".json", "w") as f:
            json.dump(data, f)
        argv, env = python_command(ENTRY, function, base + ".json")
        env.update(AUTOFUSE_DB=store_url, **{NO_BACKGROUND_ENV: "1"})
        with open(log, "w") as out:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:  # lowered here, before the caller goes on (the job lowering its own left its first moments at the caller's)
            os.setpriority(os.PRIO_PROCESS, proc.pid, min(19, os.getpriority(os.PRIO_PROCESS, 0) + budget.nice))
        except OSError:  # it already ended
            pass
        with open(lock, "w") as f:
            f.write(str(proc.pid))
    except BaseException:
        release(lock)
        raise
    return TuningJob(function, fingerprint, list(inputs), proc, log)


def _claim(lock: str) -> bool:
    """Create `lock` (holding this process's pid until the job's is written); a lock of a dead process is taken over."""
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            try:
                with open(lock) as f:
                    pid = int(f.read().strip() or "0")
            except (OSError, ValueError):
                pid = 0
            if pid > 0 and pid_alive(pid):
                return False
            release(lock)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        return True
    return False


def release(path: str) -> None:
    """Remove a job's file (its lock, job file or log) if it is still there."""
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
