"""Runners: trials in an isolated child process (a kernel that crashes or hangs fails its trial, not the job),
or in this process where the function cannot be rebuilt elsewhere.

The child re-captures the program from a picklable description (the function
by reference and the argument shapes), checks that the fingerprint matches,
and answers requests (`protocol.py`) over `multiprocessing.connection`
connections on its stdin and a private descriptor. A child that dies is
restarted for the next request; one that passes the time limit is killed and
the request is a timeout.
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Callable

from ..refs import python_command
from ..status import TrialStatus
from .protocol import Request, Result, failed


@dataclass
class ProgramSpec:
    """What a child needs to capture the same program again."""

    fn: Callable
    args: tuple
    kwargs: dict = field(default_factory=dict)
    static_argnums: tuple = ()
    static_argnames: tuple = ()
    fingerprint: str = ""

    def picklable(self) -> bool:
        """Whether a fresh process can rebuild it (the function importable by reference)."""
        if getattr(self.fn, "__module__", "__main__") == "__main__":
            return False
        try:
            pickle.dumps(self)
            return True
        except Exception:
            return False

    def capture(self) -> Any:
        """The program's `Graph`, captured here; raises where it is not the program the parent captured."""
        from ..graph import capture

        graph = capture(self.fn, *self.args, static_argnums=self.static_argnums, static_argnames=self.static_argnames, **self.kwargs)
        if self.fingerprint and graph.fingerprint != self.fingerprint:
            raise RuntimeError(f"captured program {graph.fingerprint} here, expected {self.fingerprint}")
        return graph


HELPERS = "lowering_helpers"  # an option of the trial process, not of its evaluator: helpers lowering its kernels


def _make_evaluator(spec: ProgramSpec, options: dict) -> Any:
    from .evaluator import Evaluator

    return Evaluator(spec.capture(), **{k: v for k, v in options.items() if k != HELPERS})


def _start_helpers(boot: dict) -> Any:
    """The lowering helpers the options ask for (`lowering_pool`), started before this process captures the program
    and starts its GPU client, so that they are ready as early as it is; None where none are asked for."""
    from .. import kernel_cache
    from .lowering_pool import LoweringPool

    n, directory = boot["options"].get(HELPERS, 0), kernel_cache.cache_dir()
    if n < 1 or boot["options"].get("measure", "device") != "device" or directory is None:
        return None
    return LoweringPool(boot["spec"], boot["sys_path"], directory, n).start()


def child_main() -> None:
    """Entry point of the trial process (`python -m autofuse.runner.process`): requests on stdin, answers on a private fd."""
    out = Connection(os.dup(1), readable=False)
    os.dup2(2, 1)  # anything a library prints goes to stderr, not into the protocol
    inp = Connection(os.dup(0), writable=False)
    boot = inp.recv()
    sys.path[:] = [*boot["sys_path"], *(p for p in sys.path if p not in boot["sys_path"])]  # imports as its parent, in its order
    try:
        helpers = _start_helpers(boot)
        ev = _make_evaluator(pickle.loads(boot["spec"]), boot["options"])
        if helpers is not None:
            ev.lower_apart(helpers)
        out.send("ready")
    except Exception as e:
        out.send(f"{type(e).__name__}: {e}")
        return
    while True:
        try:
            req = inp.recv()
        except EOFError:
            return
        if req is None:  # done: nothing left to write (the compilation and autotune caches are written as they fill)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)  # not the interpreter's teardown of every executable and buffer: 10 s on GPT-2 medium's trials
        try:
            resp = ev.handle(req)
        except Exception as e:  # an unexpected error fails the request, not the process
            resp = failed(req, TrialStatus.ERROR, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=5)}")
        out.send(resp)


class InlineRunner:
    """Answers requests in this process (no crash isolation): for functions a child cannot import."""

    def __init__(self, spec: ProgramSpec, options: dict):
        self.spec, self.options = spec, options
        self._ev: Any = None

    def call(self, req: Request) -> Result:
        if self._ev is None:
            self._ev = _make_evaluator(self.spec, self.options)
        try:
            return self._ev.handle(req)
        except Exception as e:
            return failed(req, TrialStatus.ERROR, f"{type(e).__name__}: {e}")

    def close(self) -> None:
        self._ev = None

    def restart(self) -> None:
        """A fresh evaluator for the next request (this process's compiled functions and arrays let go)."""
        self._ev = None

    def __enter__(self) -> "InlineRunner":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class ProcessRunner:
    """Sends requests to an isolated child process, restarted when it dies or hangs."""

    gpu: str | None = None  # the one GPU of this host its child sees (a validation helper's), None: this process's

    def __init__(self, spec: ProgramSpec, options: dict, *, timeout_s: float = 300.0, start_timeout_s: float = 300.0,
                 gpu: str | None = None):
        self.spec, self.options, self.gpu = spec, options, gpu
        self.timeout_s, self.start_timeout_s = timeout_s, start_timeout_s
        self._proc: subprocess.Popen | None = None
        self._to: Connection | None = None
        self._from: Connection | None = None
        self._ready = False
        self._killed = False  # by `kill`: for good, no process is started again
        self._spawning = threading.Lock()

    def start(self) -> None:
        """Start the trial process now without waiting for it: it imports jax and captures the program while
        this process goes on (the first request waits for it to be ready)."""
        if self._proc is None:
            self._spawn()

    def _spawn(self) -> None:
        from .. import gpumem

        state = gpumem.STATE or gpumem.AllocatorState(True, {}, False)
        argv, env = python_command("autofuse.runner.process")  # not the working directory first (`refs`) until the parent's path
        env.update(gpumem.trial_process_env(gpumem.client_platform(), state), PYTHONUNBUFFERED="1")
        if self.gpu is not None:  # a validation helper on another GPU of this host (`tuning.helpers`)
            env["CUDA_VISIBLE_DEVICES"] = self.gpu
        with self._spawning:
            if self._killed:
                raise RuntimeError("trial process failed to start: its runner was killed")
            self._proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
            self._to = Connection(os.dup(self._proc.stdin.fileno()), readable=False)  # before a kill can take them
            self._from = Connection(os.dup(self._proc.stdout.fileno()), writable=False)
        self._to.send({"sys_path": list(sys.path), "spec": pickle.dumps(self.spec), "options": self.options})
        self._ready = False

    def _start(self) -> None:
        if self._proc is None:
            self._spawn()
        hello = self._recv(self.start_timeout_s)
        if hello != "ready":
            self._kill()
            raise RuntimeError(f"trial process failed to start: {hello}")
        self._ready = True

    def _recv(self, timeout_s: float) -> Any:
        """The child's next message; "timeout" or "died" when none comes (or the process was killed meanwhile)."""
        src = self._from
        if src is None:
            return "died"
        try:
            if not src.poll(timeout_s):
                return "timeout"
            return src.recv()
        except (EOFError, OSError):
            return "died"

    def _kill(self) -> int | None:
        """Kill the trial process and forget it. Safe from another thread while one waits in `call` (the selection
        kills a validation helper mid-validation): the process and its pipes are taken here first, so the waiting
        call finds them gone ("died") rather than half closed."""
        proc, conns = self._proc, (self._to, self._from)
        self._proc = self._to = self._from = None
        self._ready = False
        if proc is None:
            return None
        proc.kill()
        code = proc.wait(10)
        for c in (*conns, proc.stdin, proc.stdout):
            try:
                if c is not None:
                    c.close()
            except OSError:
                pass
        return code

    def restart(self) -> None:
        """A fresh trial process for the next request, started now: nothing of this one's GPU memory (its pool,
        fragmented by the trials' buffers) carries over."""
        self.close()
        self._spawn()

    def kill(self) -> None:
        """Stop the trial process now, whatever it is doing, and for good (a validation helper the selection no longer
        needs): a call waiting on it, or one that comes later, fails instead of starting another, which nobody would
        stop (a call between the kill and its own start once did, the process outliving the job)."""
        with self._spawning:
            self._killed = True
        self._kill()

    def close(self) -> None:
        proc, to = self._proc, self._to
        if proc is not None and to is not None and proc.poll() is None:
            try:
                to.send(None)
                proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self._kill()

    def __enter__(self) -> "ProcessRunner":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def call(self, req: Request) -> Result:
        if self._proc is None or self._proc.poll() is not None or not self._ready:
            if self._proc is not None and self._proc.poll() is not None:
                self._kill()
            self._start()
        proc, to = self._proc, self._to
        try:
            to.send(req)
        except (OSError, AttributeError):
            pass  # the child is gone (or was killed meanwhile): _recv says so
        limit = getattr(req, "timeout_s", None) or self.timeout_s  # a batch of compilations brings its own
        resp = self._recv(limit)
        if resp == "timeout":
            self._kill()
            return failed(req, TrialStatus.TIMEOUT, f"no answer within {limit:.0f} s; trial process restarted")
        if resp == "died":
            code = proc.wait(10) if proc is not None else None
            self._kill()
            return failed(req, TrialStatus.CRASHED, f"trial process died (exit code {code}); restarted for the next trial")
        return resp


def make_runner(spec: ProgramSpec, options: dict, *, isolate: bool = True, timeout_s: float = 300.0,
                gpu: str | None = None) -> InlineRunner | ProcessRunner:
    """A child-process runner where the function can be rebuilt in a child (and `isolate`), else an inline one.
    `gpu`: the child sees only that GPU of this host (its CUDA_VISIBLE_DEVICES)."""
    if isolate and spec.picklable():
        return ProcessRunner(spec, options, timeout_s=timeout_s, gpu=gpu)
    return InlineRunner(spec, options)


if __name__ == "__main__":
    child_main()
