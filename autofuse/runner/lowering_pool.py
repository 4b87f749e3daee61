"""Kernels lowered in CPU-only helper processes while the trial process compiles (`Evaluator.compile_ahead`).

Lowering a Pallas kernel is Python work and holds the GIL, so a trial process's compile threads lower one at a
time: in the first batch of a job (24 XLA references, 12 kernels, the whole program) GPT-2's attention kernel,
3.0 s alone, was ready after 16.6-18.9 s whatever the number of threads (results/tuning_h200_run26.md). A helper
is a process without a GPU client: it captures the same program, lowers each kernel it is sent for the trial
process's device as an abstract device (`kernel_cache.Target`) and keeps the export in the kernel cache, under the
key the trial process looks up. The trial process's thread for that kernel waits for its helper, reads the export
(milliseconds) and compiles it (XLA, without the GIL). A helper that cannot start (a program that captures
otherwise without a GPU) or dies (a lowering that crashes) leaves its kernels to the trial process, which lowers
them itself, as without helpers.

How many: ``$AUTOFUSE_LOWERING_HELPERS`` (0: none), else one per `THREADS_PER_HELPER` compile threads, at most
`MAX_HELPERS` (a 16-core host with one GPU: 4); the job tells its trial process (`process.HELPERS`), which starts them
as it starts.
"""
from __future__ import annotations

import logging
import os
import queue
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any, Sequence

from ..kernel_cache import Target
from ..refs import python_command

ENV_VAR = "AUTOFUSE_LOWERING_HELPERS"
MAX_HELPERS = 4
THREADS_PER_HELPER = 4  # a helper per this many compile threads: the rest compile (XLA, many threads) what helpers lowered
START_TIMEOUT_S = 120.0  # a helper imports JAX and captures the program (GPT-2 medium: a few seconds)
LOWER_TIMEOUT_S = 120.0  # one kernel's lowering; past it the helper is stopped and the kernel left to the trial process
log = logging.getLogger("autofuse")


def helpers(compile_threads: int, environ: dict[str, str] | os._Environ = os.environ) -> int:
    """Helper processes beside a trial process compiling on `compile_threads` threads."""
    raw = environ.get(ENV_VAR, "").strip()
    if raw:
        try:
            n = int(raw)
        except ValueError:
            raise ValueError(f"${ENV_VAR} must be a whole number of processes, got {raw!r}") from None
        return max(0, n)
    return min(MAX_HELPERS, compile_threads // THREADS_PER_HELPER)


def helpers_for(measure: str, compile_threads: int) -> int:
    """`helpers` where a job's trials build kernels for a GPU of this host, else 0 (nothing is lowered for a device
    there: modelled, or interpret mode on the CPU)."""
    import jax

    return helpers(compile_threads) if measure == "device" and jax.default_backend() == "gpu" else 0


class LoweringPool:
    """`processes` helpers, each serving the kernels queued in turn. `start` them early: a helper takes seconds to
    import JAX and capture the program, best spent while the trial process does the same (it starts with it)."""

    def __init__(self, spec_blob: bytes, sys_path: Sequence[str], directory: str, processes: int):
        self.spec_blob, self.sys_path, self.directory = spec_blob, list(sys_path), directory
        self.processes = processes
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._futures: dict[tuple, Future] = {}
        self._lock = threading.Lock()
        self._alive = 0
        self._started = False
        self.broken = processes < 1
        self.lowered = 0  # kernels a helper exported
        self.seconds = 0.0  # the helpers' seconds lowering them

    def start(self) -> "LoweringPool":
        """Start the helpers now (else at the first `submit`)."""
        with self._lock:
            if not self._started and not self.broken:
                self._started, self._alive = True, self.processes
                for i in range(self.processes):
                    threading.Thread(target=self._serve, name=f"autofuse-lowering-{i}", daemon=True).start()
        return self

    def submit(self, nodes: Sequence[int], template: str, config: dict, target: Target) -> Future | None:
        """A future that is True once a helper has kept this kernel's export for `target` (False: it did not; the
        trial process lowers it); None where there are no helpers (none asked for, or all of them failed)."""
        key = (tuple(nodes), template, tuple(sorted(config.items())), target)
        self.start()
        with self._lock:
            if self.broken:
                return None
            if key in self._futures:
                return self._futures[key]
            fut: Future = Future()
            self._futures[key] = fut
        self._queue.put((key, fut))
        return fut

    def _serve(self) -> None:
        """One helper: started, then sent the queued kernels one at a time until the queue closes or it fails."""
        proc = current = None
        try:
            argv, env = python_command("autofuse.runner.lowering_pool")
            env.update(JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
            to = Connection(os.dup(proc.stdin.fileno()), readable=False)
            src = Connection(os.dup(proc.stdout.fileno()), writable=False)
            to.send({"sys_path": self.sys_path, "spec": self.spec_blob, "directory": self.directory})
            hello = src.recv() if src.poll(START_TIMEOUT_S) else "no answer"
            if hello != "ready":
                log.debug("autofuse: lowering helper did not start: %s", hello)
                return
            while True:
                item = self._queue.get()
                if item is None:
                    return
                key, current = item
                if not current.set_running_or_notify_cancel():
                    continue
                to.send(key)
                if not src.poll(LOWER_TIMEOUT_S):
                    log.debug("autofuse: lowering helper took over %.0f s on %s; stopped", LOWER_TIMEOUT_S, key)
                    return
                status, secs = src.recv()
                with self._lock:
                    self.lowered += status == "ok"
                    self.seconds += secs
                current.set_result(status == "ok")
                current = None
        except (EOFError, OSError) as e:
            log.debug("autofuse: lowering helper died: %s", e)
        finally:
            if current is not None and not current.done():
                current.set_result(False)
            if proc is not None:
                proc.kill()
                proc.wait()
            self._retire()

    def _retire(self) -> None:
        """One helper fewer; the last one out answers False for whatever is still queued."""
        with self._lock:
            self._alive -= 1
            if self._alive > 0:
                return
            self.broken = True
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None and item[1].set_running_or_notify_cancel():
                item[1].set_result(False)

    def close(self) -> None:
        """Stop the helpers once they finish the kernel in hand."""
        with self._lock:
            started, self.broken = self._started, True
        for _ in range(self.processes if started else 0):
            self._queue.put(None)


def helper_main() -> None:
    """A helper (`python -m autofuse.runner.lowering_pool`): kernels (nodes, template, config, target) on stdin, one
    ("ok" | "error", seconds) per kernel on a private descriptor."""
    out = Connection(os.dup(1), readable=False)
    os.dup2(2, 1)  # anything a library prints goes to stderr, not into the protocol
    inp = Connection(os.dup(0), writable=False)
    boot = inp.recv()
    sys.path[:] = [*boot["sys_path"], *(p for p in sys.path if p not in boot["sys_path"])]
    try:
        import pickle

        from ..plan import preload_pallas_lowerings

        graph = pickle.loads(boot["spec"]).capture()
        preload_pallas_lowerings(interpret=False)
        out.send("ready")
    except Exception as e:  # noqa: BLE001 - told to the pool, which leaves the kernels to the trial process
        out.send(f"{type(e).__name__}: {e}")
        return
    while True:
        try:
            nodes, template, config, target = inp.recv()
        except EOFError:
            os._exit(0)
        t = time.perf_counter()
        try:
            lower(graph, nodes, template, dict(config), target, boot["directory"])
            out.send(("ok", time.perf_counter() - t))
        except Exception as e:  # noqa: BLE001 - the trial process lowers it and meets the error itself
            log.debug("autofuse: lowering helper: %s: %s", type(e).__name__, e)
            out.send(("error", time.perf_counter() - t))


def lower(graph: Any, nodes: Sequence[int], template: str, config: dict, target: Target, directory: str) -> bool:
    """Build the group's kernel for `config` as the trial process on `target` would (`plan.build_group`) and keep
    its export in the kernel cache at `directory`; False where it was there already."""
    from .. import kernel_cache
    from ..graph import Group
    from ..kernels import TEMPLATES

    group = Group.of(graph, nodes)
    backend, params = config.get("backend", "triton"), {k: v for k, v in config.items() if k != "backend"}
    mod = TEMPLATES[template]
    spec = mod.match(group)
    if spec is None:
        raise ValueError(f"template {template} does not match group {list(nodes)}")
    with target.lowering():
        kernel = mod.build(group, params, backend=backend, interpret=False, spec=spec)
        return kernel_cache.keep(kernel, group, template, backend, params, target, directory)


if __name__ == "__main__":
    helper_main()
