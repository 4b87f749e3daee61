"""Validation helpers: the selection's plans validated on this host's other GPUs, once their workers are done.

A job with several workers on one host ends with one of them selecting the plan while the others exit, their GPUs
idle. Every plan the selection judges (each distinct group in the program, rivals, compositions) is one whole
program compiled, checked and timed against jax.jit, about 5-8 s on GPT-2 medium, one after another on the
selecting worker's GPU: on 4 H200s, 35 s of a 98 s job. `Helpers` starts a trial process on each free GPU of the
host (a GPU whose worker released its lock) and validates the plans the selection will judge next on them while
the selecting worker validates its own. Each validation is still one process, one GPU, jax.jit and the plan
alternating: a same-process ratio, as every plan's. A helper that fails leaves its plan to the selecting worker.
"""
from __future__ import annotations

import fcntl
import logging
import os
import tempfile
import threading
import time
from collections import deque
from typing import Any, Callable, Sequence

from ..plan import Plan
from ..runner.protocol import ValidateRequest, ValidationResult
from ..status import TrialStatus
from .ahead import compile_batch

LOCK_POLL_S = 0.25
HOST_GPUS_ENV = "AUTOFUSE_HOST_GPUS"  # the GPUs of this host the launcher gave its workers, comma-separated
log = logging.getLogger("autofuse")


def lock_path(gpu: str) -> str:
    """The lock file of `gpu` of this host, which its worker (or helper) holds."""
    return os.path.join(tempfile.gettempdir(), f"autofuse-gpu-{gpu}.lock")


def lock_gpu(gpu: str) -> int | None:
    """A lock file held on `gpu` of this host (its fd; closing it releases the GPU), or None where a worker or
    helper holds it already."""
    fd = os.open(lock_path(gpu), os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def host_gpus(mine: str | None) -> list[str]:
    """The other GPUs the launcher gave this host's workers ($AUTOFUSE_HOST_GPUS), not `mine`."""
    return [g for g in (x.strip() for x in os.environ.get(HOST_GPUS_ENV, "").split(",")) if g and g != mine]


class Helpers:
    """Trial processes on free GPUs of this host that validate queued plans (`submit`) for the selection (`take`).

    One thread per GPU of `gpus` waits up to `wait_s` for the GPU's lock (its worker exits once the trials are
    done), then starts a trial process on it with `make_runner(gpu)` and validates the oldest queued plan, and the
    next. `take(plan)` gives a helper's result of a plan (waiting while a helper is on it), or None: never queued,
    not started yet (withdrawn: the caller validates it itself), or the helper failed."""

    def __init__(self, gpus: Sequence[str], make_runner: Callable[[str], Any], compile_workers: int = 1, wait_s: float = 60.0):
        self.compile_workers, self.wait_s, self.make_runner = compile_workers, wait_s, make_runner
        self.gpus = list(gpus)
        self._queue: deque[Plan] = deque()
        self._results: dict[str, ValidationResult | None] = {}  # plan json -> its result (None: the helper failed)
        self._running: set[str] = set()
        self._cond = threading.Condition()
        self._closed = False
        self._held: list[tuple[Any, int]] = []  # (runner, lock fd) of each helper started
        self.validated: dict[str, str] = {}  # plan json -> the GPU that validated it
        self._threads = [threading.Thread(target=self._serve, args=(gpu,), name=f"autofuse-helper-{gpu}", daemon=True) for gpu in self.gpus]
        for t in self._threads:
            t.start()

    def __bool__(self) -> bool:
        return bool(self.gpus)

    def submit(self, plans: Sequence[Plan]) -> None:
        """Queue `plans` (those not queued or validated yet) for the helpers."""
        with self._cond:
            for p in plans:
                key = p.to_json()
                if key not in self._results and key not in self._running and all(q.to_json() != key for q in self._queue):
                    self._queue.append(p)
            self._cond.notify_all()

    def take(self, plan: Plan) -> ValidationResult | None:
        key = plan.to_json()
        with self._cond:
            for q in list(self._queue):
                if q.to_json() == key:  # not started: the caller is free now, the helpers are not
                    self._queue.remove(q)
                    return None
            while key in self._running:
                self._cond.wait()
            result = self._results.pop(key, None)
        if result is not None and result.status in (TrialStatus.CRASHED, TrialStatus.TIMEOUT, TrialStatus.RESOURCE_EXHAUSTED):
            return None  # the helper's process, not the plan: validated again by the caller
        return result

    def _serve(self, gpu: str) -> None:
        deadline = time.monotonic() + self.wait_s
        fd = lock_gpu(gpu)
        while fd is None and not self._closed and time.monotonic() < deadline:
            time.sleep(LOCK_POLL_S)
            fd = lock_gpu(gpu)
        if fd is None:
            return  # its worker is still there (or another run's): the selecting worker does without it
        try:
            runner = self.make_runner(gpu)
            if hasattr(runner, "start"):
                runner.start()  # jax imported and the program captured while the selection goes on
        except Exception as e:  # noqa: BLE001 - a helper less
            os.close(fd)
            log.warning("autofuse: no validation helper on GPU %s: %s: %s", gpu, type(e).__name__, e)
            return
        with self._cond:
            late = self._closed
            if not late:
                self._held.append((runner, fd))
        if late:  # closed while it started
            runner.close()
            os.close(fd)
            return
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                plan = self._queue.popleft()
                key = plan.to_json()
                self._running.add(key)
            result = None
            try:
                if self.compile_workers > 1:  # jax.jit's reference and the plan compiled at once
                    compile_batch(runner, [ValidateRequest(key)], self.compile_workers, timeout_s=None)
                result = runner.call(ValidateRequest(key))
                self.validated[key] = gpu
            except Exception as e:  # noqa: BLE001 - the selecting worker validates it itself
                if not self._closed:  # else it was killed by `close`: nobody waits for it
                    log.warning("autofuse: validating a plan on GPU %s failed (%s: %s); the selecting worker validates it", gpu, type(e).__name__, e)
            with self._cond:
                self._running.discard(key)
                self._results[key] = result
                self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()
        with self._cond:
            held, self._held = self._held, []
        for runner, fd in held:  # killed, not asked: a helper may be inside a validation nobody will take
            try:
                getattr(runner, "kill", runner.close)()
            finally:
                os.close(fd)
        for t in self._threads:
            t.join(timeout=5.0)

    def __enter__(self) -> "Helpers":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
