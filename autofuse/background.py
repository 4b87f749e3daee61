"""Tuning a missed shape off the hot path: `autofuse.jit(fn, on_miss="tune")` queues a background tuning job.

The caller's side (`queue`) writes the job (the function's ``module:qualname``, its arguments as shapes, dtypes
and static values, the budget) to a file, claims the (store, program) pair with a lock file so that one job at a
time tunes it, and starts ``python -P -m autofuse.background MODULE:FUNCTION JOBFILE`` as a separate, low-priority
process (`refs.python_command`: it imports as the caller does, the working directory last); it never waits for it and
imports nothing of the tuner. The job's side (`main`) lowers its priority, imports the function its command line
names (and refuses a job file that names another), tunes it with `autofuse.tuning.local.tune` into the store (its URL
reaches it through ``$AUTOFUSE_DB``, never on a command line) and removes its job file and lock, and its log when it
succeeded (the plan is in the store; a failed job's log stays, for the caller's warning to point at). A later trace
of that shape finds the plan.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from .processes import pid_alive
from .refs import python_command, reference, resolve

#: Set in a background job's environment: the job never queues another one.
NO_BACKGROUND_ENV = "AUTOFUSE_NO_BACKGROUND_TUNE"


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


# ---------------------------------------------------------------- the caller's side


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
    statics = {i if i >= 0 else i + len(args) for i in static_argnums}
    try:
        data = {
            "function": function,
            "fingerprint": fingerprint,
            "args": [_encode(a, static=i in statics) for i, a in enumerate(args)],
            "kwargs": {k: _encode(v, static=k in static_argnames) for k, v in kwargs.items()},
            "static_argnums": sorted(statics),
            "static_argnames": list(static_argnames),
            "budget": dataclasses.asdict(budget),
        }
    except TypeError as e:
        raise NotQueued(f"its arguments cannot be handed to a background job ({e})") from None
    base = os.path.join(tempfile.gettempdir(), f"autofuse-tune-{hashlib.sha256(store_url.encode()).hexdigest()[:12]}-{fingerprint[:16]}")
    lock = base + ".lock"
    if not _claim(lock):
        raise NotQueued(f"a background job is already tuning this program ({lock})")
    try:
        log = base + ".log"
        data["lock"], data["log"] = lock, log
        with open(base + ".json", "w") as f:
            json.dump(data, f)
        argv, env = python_command("autofuse.background", function, base + ".json")
        env.update(AUTOFUSE_DB=store_url, **{NO_BACKGROUND_ENV: "1"})
        with open(log, "w") as out:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        with open(lock, "w") as f:
            f.write(str(proc.pid))
    except BaseException:
        _release(lock)
        raise
    return TuningJob(function, fingerprint, list(inputs), proc, log)


def _encode(x: Any, *, static: bool) -> Any:
    """A JSON form of an argument: arrays (and tracers) as shape and dtype, static values as they are; TypeError for
    what JSON cannot hold."""
    if static:
        json.dumps(x)  # TypeError if not plain data
        return {"value": x}
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        import numpy as np

        return {"array": [list(map(int, x.shape)), np.dtype(x.dtype).name]}
    if isinstance(x, tuple):
        return {"tuple": [_encode(v, static=False) for v in x]}
    if isinstance(x, list):
        return {"list": [_encode(v, static=False) for v in x]}
    if isinstance(x, dict) and all(isinstance(k, str) for k in x):
        return {"dict": {k: _encode(v, static=False) for k, v in x.items()}}
    if x is None or isinstance(x, (bool, int, float)):
        return {"value": x}
    raise TypeError(f"an argument of type {type(x).__name__}: tuples, lists, dicts, arrays and scalars only")


def _decode(x: dict) -> Any:
    (kind, v), = x.items()
    if kind == "array":
        import jax
        import numpy as np

        return jax.ShapeDtypeStruct(tuple(v[0]), np.dtype(jax.numpy.dtype(v[1])))
    if kind == "tuple":
        return tuple(_decode(e) for e in v)
    if kind == "list":
        return [_decode(e) for e in v]
    if kind == "dict":
        return {k: _decode(e) for k, e in v.items()}
    return v


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
            _release(lock)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        return True
    return False


def _release(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


# ---------------------------------------------------------------- the job's side


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m autofuse.background MODULE:FUNCTION JOBFILE``: tune the function at the job's shapes into
    ``$AUTOFUSE_DB``. Only the function named here is imported; a job file naming another is refused (exit 2)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 2:
        print("usage: python -m autofuse.background MODULE:FUNCTION JOBFILE", file=sys.stderr)
        return 2
    function, path = argv
    with open(path) as f:
        job = json.load(f)
    ok = False
    try:
        if job["function"] != function:
            print(f"autofuse: the job file {path} tunes {job['function']}, not {function}: refused", file=sys.stderr)
            return 2
        budget = BackgroundTune(**job["budget"])
        os.nice(budget.nice)
        fn = resolve(function)
        fn = getattr(fn, "fn", fn)  # an autofuse.jit of the function: tune the function itself
        from autofuse.tuning.local import tune

        report = tune(fn, *[_decode(a) for a in job["args"]], kwargs={k: _decode(v) for k, v in job["kwargs"].items()} or None,
                      trials=budget.trials, time_budget_s=budget.seconds, store=os.environ.get("AUTOFUSE_DB"), name=function,
                      measure=budget.measure, quiet=True, isolate=budget.isolate, static_argnums=job["static_argnums"],
                      static_argnames=job["static_argnames"])
        print(report.summary(), flush=True)
        if report.fingerprint != job["fingerprint"]:
            print(f"autofuse: the background job tuned program {report.fingerprint}, not the missed {job['fingerprint']}", flush=True)
            return 1
        ok = True
        return 0
    finally:
        _release(job["lock"])
        _release(path)
        if ok:
            _release(job["log"])


if __name__ == "__main__":
    sys.exit(main())
