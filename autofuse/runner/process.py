"""Trials in a child process: a kernel that crashes or hangs fails its trial, not the job.

The child re-captures the program from a picklable description (the function
by reference and the argument shapes), checks that the fingerprint matches,
and answers requests: time a group in XLA, run a trial (build, check,
time), or validate a whole plan. A child that dies is restarted for the next
request; one that passes the time limit is killed and the trial is a timeout.
Where the function cannot be pickled (a lambda, a closure), the same
requests run in this process instead.
"""
from __future__ import annotations

import os
import pickle
import select
import struct
import subprocess
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from .evaluate import Evaluator



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


def _make_evaluator(spec: ProgramSpec, options: dict) -> Evaluator:
    from .graph import capture

    graph = capture(spec.fn, *spec.args, static_argnums=spec.static_argnums, static_argnames=spec.static_argnames, **spec.kwargs)
    if spec.fingerprint and graph.fingerprint != spec.fingerprint:
        raise RuntimeError(f"worker captured program {graph.fingerprint}, expected {spec.fingerprint}")
    return Evaluator(graph, **options)


def _send(fd: int, obj: Any) -> None:
    data = pickle.dumps(obj)
    os.write(fd, struct.pack("<Q", len(data)))
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _recv(fd: int, timeout_s: float | None = None) -> Any:
    """One framed message; TimeoutError when none arrives in time, EOFError when the peer is gone."""
    def read(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            if timeout_s is not None:
                ready, _, _ = select.select([fd], [], [], timeout_s)
                if not ready:
                    raise TimeoutError
            chunk = os.read(fd, n - len(buf))
            if not chunk:
                raise EOFError
            buf += chunk
        return buf

    (n,) = struct.unpack("<Q", read(8))
    return pickle.loads(read(n))


def child_main() -> None:
    """Entry point of the worker process (`python -m autofuse.worker`): requests on stdin, answers on a private fd."""
    proto_out = os.dup(1)
    os.dup2(2, 1)  # anything a library prints goes to stderr, not into the protocol
    inp = sys.stdin.fileno()
    boot = _recv(inp)
    sys.path[:0] = [p for p in boot["sys_path"] if p not in sys.path]
    os.environ.update(boot["env"])
    try:
        ev = _make_evaluator(pickle.loads(boot["spec"]), boot["options"])
        _send(proto_out, {"status": "ready"})
    except Exception as e:
        _send(proto_out, {"status": "error", "error": f"{type(e).__name__}: {e}"})
        return
    while True:
        try:
            req = _recv(inp)
        except EOFError:
            return
        if req is None:
            return
        try:
            resp = ev.handle(req)
        except Exception as e:  # an unexpected error fails the request, not the worker
            resp = {"status": "error", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=5)}
        _send(proto_out, resp)


class TrialRunner:
    """Sends requests to an isolated child (restarted when it dies), or runs them inline."""

    def __init__(self, spec: ProgramSpec, options: dict, *, isolate: bool = True, timeout_s: float = 300.0, start_timeout_s: float = 300.0):
        self.spec, self.options = spec, options
        self.isolate = isolate and spec.picklable()
        self.timeout_s, self.start_timeout_s = timeout_s, start_timeout_s
        self._proc: Any = None
        self._in = self._out = -1
        self._inline: Evaluator | None = None

    # lifecycle -------------------------------------------------------------
    def _start(self) -> None:
        env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONUNBUFFERED="1")
        self._proc = subprocess.Popen([sys.executable, "-m", "autofuse.worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self._in, self._out = self._proc.stdin.fileno(), self._proc.stdout.fileno()
        _send(self._in, {"sys_path": list(sys.path), "env": {}, "spec": pickle.dumps(self.spec), "options": self.options})
        try:
            hello = _recv(self._out, self.start_timeout_s)
        except (TimeoutError, EOFError) as e:
            self._kill()
            raise RuntimeError(f"trial worker did not start ({type(e).__name__})") from None
        if hello.get("status") != "ready":
            self._kill()
            raise RuntimeError(f"trial worker failed to start: {hello.get('error')}")

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(10)
            for f in (self._proc.stdin, self._proc.stdout):
                try:
                    f.close()
                except OSError:
                    pass
        self._proc = None

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            try:
                _send(self._in, None)
                self._proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self._kill()

    def __enter__(self) -> "TrialRunner":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # requests ----------------------------------------------------------------
    def call(self, req: dict) -> dict:
        if not self.isolate:
            if self._inline is None:
                self._inline = _make_evaluator(self.spec, self.options)
            try:
                return self._inline.handle(req)
            except Exception as e:
                return {"status": "error", "error": f"{type(e).__name__}: {e}"}
        if self._proc is None or self._proc.poll() is not None:
            if self._proc is not None:
                self._kill()
            self._start()
        try:
            _send(self._in, req)
            return _recv(self._out, self.timeout_s)
        except TimeoutError:
            self._kill()
            return {"status": "timeout", "error": f"no answer within {self.timeout_s:.0f} s; worker restarted"}
        except (EOFError, OSError):
            code = self._proc.wait(10) if self._proc is not None else None
            self._kill()
            return {"status": "crashed", "error": f"worker died (exit code {code}); restarted for the next trial"}


if __name__ == "__main__":
    child_main()
