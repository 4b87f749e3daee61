"""tuning/helpers.py: the selection's plans validated on this host's other GPUs (trial processes of their own) once
their workers are done; the selection's outcome is the one it has validating every plan itself."""
from __future__ import annotations

import os
import threading
import time

import jax
import jax.numpy as jnp
import pytest

import autofuse
from autofuse.plan import Plan
from autofuse.runner.process import ProcessRunner
from autofuse.runner.protocol import Timing, ValidationResult
from autofuse.status import TrialStatus
from autofuse.tuning.helpers import HOST_GPUS_ENV, Helpers, host_gpus, lock_gpu

t = lambda v: Timing(v, v * 0.99, v * 1.01, v * 0.995, v * 1.005)  # noqa: E731

if os.environ.get("AUTOFUSE_TEST_SLOW_TEARDOWN"):  # in a trial process of the test below: a teardown that takes 30 s
    import atexit

    atexit.register(time.sleep, 30)


def _gpu(name: str) -> str:
    return f"test-{os.getpid()}-{name}"  # a lock file of its own: tests in parallel share the temp directory


def _plan(k: int) -> Plan:
    return Plan(f"{k:032x}", (), {})


class _Device:
    """A helper's trial process: records which plans it validated; `gate` holds each validation until set."""

    def __init__(self, gpu: str, log: list, gate: threading.Event | None = None, status: TrialStatus = TrialStatus.OK):
        self.gpu, self.log, self.gate, self.status, self.closed = gpu, log, gate, status, False

    def call(self, req):
        if self.gate is not None:
            self.gate.wait(10)
        self.log.append((self.gpu, Plan.from_json(req.plan_json).fingerprint))
        return ValidationResult(self.status, 0.0, baseline=t(10.0), plan=t(9.0), ratio=t(0.9))

    def close(self):
        self.closed = True


def test_plans_go_to_free_gpus_and_a_queued_one_is_taken_back() -> None:
    log, gate, made = [], threading.Event(), []
    busy = lock_gpu(_gpu("busy"))  # another worker's GPU: never a helper
    assert busy is not None and lock_gpu(_gpu("busy")) is None

    def make(gpu):
        made.append(_Device(gpu, log, gate))
        return made[-1]

    try:
        with Helpers([_gpu("a"), _gpu("busy")], make, wait_s=0.5) as helpers:
            helpers.submit([_plan(1), _plan(2)])
            deadline = time.monotonic() + 5
            while not helpers._running and time.monotonic() < deadline:  # the one free helper starts on plan 1
                time.sleep(0.01)
            assert helpers.take(_plan(2)) is None  # still queued: the caller validates it itself, now
            gate.set()
            v = helpers.take(_plan(1))
            assert v is not None and v.ok and v.ratio.median_ms == 0.9
            assert helpers.validated[_plan(1).to_json()] == _gpu("a")
            assert helpers.take(_plan(3)) is None  # never queued
        assert [d.gpu for d in made] == [_gpu("a")] and made[0].closed
        assert log == [(_gpu("a"), _plan(1).fingerprint)]
        assert lock_gpu(_gpu("a")) is not None  # released on close
    finally:
        os.close(busy)


def test_a_helper_whose_process_crashed_leaves_the_plan_to_the_caller() -> None:
    with Helpers([_gpu("c")], lambda gpu: _Device(gpu, [], status=TrialStatus.CRASHED)) as helpers:
        helpers.submit([_plan(5)])
        deadline = time.monotonic() + 5
        while _plan(5).to_json() not in helpers.validated and time.monotonic() < deadline:
            time.sleep(0.01)
        assert helpers.take(_plan(5)) is None


def test_the_host_gpus_are_the_launchers_but_this_workers(monkeypatch) -> None:
    monkeypatch.setenv(HOST_GPUS_ENV, "0, 1,2,3")
    assert host_gpus("2") == ["0", "1", "3"]
    monkeypatch.delenv(HOST_GPUS_ENV)
    assert host_gpus("0") == []


def test_a_helpers_trial_process_sees_only_its_gpu(monkeypatch) -> None:
    """The child's environment names the helper's GPU, whatever this process's."""
    import subprocess

    seen = {}
    real = subprocess.Popen

    def spy(argv, **kw):
        if "autofuse.runner.process" not in argv:  # another child (a probe of the platform)
            return real(argv, **kw)
        seen.update(kw["env"])
        return real(["true"], **{k: v for k, v in kw.items() if k != "env"})

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr(subprocess, "Popen", spy)
    runner = ProcessRunner(None, {}, gpu="3")
    try:
        runner.start()
    except Exception:  # noqa: BLE001 - `true` is no trial process: only its environment matters here
        pass
    assert seen["CUDA_VISIBLE_DEVICES"] == "3"


def _ln(x, g, b):
    xf = x.astype(jnp.float32)
    mu = xf.mean(-1, keepdims=True)
    y = (xf - mu) * jax.lax.rsqrt(((xf - mu) ** 2).mean(-1, keepdims=True) + 1e-5)
    return y * g + b


def _head(y, c):
    return jnp.log1p(jax.nn.relu(y + c))


def two_parts(x, g, b, y, c):
    """Two independent groups: a layer norm and a head."""
    return _ln(x, g, b), _head(y, c)


TWO_PARTS_ARGS = (jax.ShapeDtypeStruct((512, 1024), jnp.float32), jax.ShapeDtypeStruct((1024,), jnp.float32),
                  jax.ShapeDtypeStruct((1024,), jnp.float32), jax.ShapeDtypeStruct((512, 4096), jnp.float32),
                  jax.ShapeDtypeStruct((4096,), jnp.float32))


@pytest.mark.slow  # a tuning job (model mode) and its selection, twice
def test_the_selection_with_helpers_keeps_what_it_keeps_alone() -> None:
    """GPU validation of a chosen plan that lost its savings in the program (its groups then each judged in the
    program, then those that saved time composed), with and without helpers: the same plans judged in the same
    order with the same results, and with helpers the groups' own plans validated on the helpers' GPUs."""
    from autofuse.tuning.job import distinct_candidates
    from autofuse.tuning.select import Cover
    from autofuse.tuning.validate import validate

    args = TWO_PARTS_ARGS
    rep = autofuse.tune(two_parts, *args, trials=30, seed=0, quiet=True, store=False, isolate=False)
    assert len({g.signature for g in rep.plan.groups}) == 2
    a, b = sorted({g.signature for g in rep.plan.groups})
    ms = {frozenset({a, b}): 9.7, frozenset({a}): 9.2, frozenset({b}): 9.6}
    for r in rep.candidates:  # alone they saved 1.0 and 0.8 ms: the chosen plan keeps 0.3 of 1.8 in the program
        if r.signature in (a, b):
            r.xla_ms = r.best_ms + (1.0 if r.signature == a else 0.8)
    graph = autofuse.capture(two_parts, *args)
    distinct_candidates(graph)

    class Device:
        def __init__(self, where, log, wait_for_helpers=False):
            self.where, self.log, self.wait = where, log, wait_for_helpers

        def call(self, req):
            sigs = frozenset(g.signature for g in Plan.from_json(req.plan_json).groups)
            deadline = time.monotonic() + 10
            while self.wait and len(sigs) == 2 and sum(w != "here" for w, _ in self.log) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)  # the chosen plan takes as long as the helpers need for theirs (as on a GPU it would)
            self.log.append((self.where, sigs))
            v = ms.get(sigs, 10.0)
            return ValidationResult(TrialStatus.OK, 0.0, baseline=t(10.0), plan=t(v), ratio=t(v / 10.0))

        def close(self):
            pass

    def run(gpus):
        log, timings = [], {}
        with Helpers(gpus, lambda gpu: Device(gpu, log)) as helpers:
            out = validate(graph, Cover(rep.plan, 1.0, 0.5), Device("here", log, bool(gpus)), "device", "two_parts", rep.candidates,
                           0, 0.0, timings=timings, helpers=helpers)
        return out, log, timings

    alone_out, alone_log, alone_t = run([])
    out, log, timings = run([_gpu("h1"), _gpu("h2")])
    assert [r["what"] for r in timings["composition"]] == [r["what"] for r in alone_t["composition"]]
    assert [r["realised_ms"] for r in timings["composition"]] == [r["realised_ms"] for r in alone_t["composition"]]
    assert {g.signature for g in out.plan.groups} == {g.signature for g in alone_out.plan.groups} and out.tuned_ms == alone_out.tuned_ms
    assert sorted(s for _, s in log) == sorted(s for _, s in alone_log)  # each plan validated once, somewhere
    singles = [(w, s) for w, s in log if len(s) == 1]
    assert len(singles) == 2 and all(w != "here" for w, _ in singles)  # queued before the chosen plan: on the helpers
    assert all(p.get("gpu") in (_gpu("h1"), _gpu("h2")) for p, r in zip(timings["plans"], timings["composition"])
               if r["what"] == "one group in context")


def test_a_closed_trial_process_exits_at_once_and_cleanly(monkeypatch) -> None:
    """Told it is done, the trial process leaves without tearing its interpreter down (seconds for a process full of
    compiled programs: the job waited 10 s for it, then killed it), and exits 0. Its interpreter's teardown here
    takes 30 s (an exit handler that this module registers in the trial process, which imports it for `_ln`)."""
    from autofuse.runner.process import ProgramSpec

    monkeypatch.setenv("AUTOFUSE_TEST_SLOW_TEARDOWN", "1")
    runner = ProcessRunner(ProgramSpec(_ln, (jax.ShapeDtypeStruct((8, 16), jnp.float32),) * 1 + (jax.ShapeDtypeStruct((16,), jnp.float32),) * 2),
                           {"measure": "model"})
    runner._start()  # ready: jax imported, the program captured
    proc = runner._proc
    t0 = time.monotonic()
    runner.close()
    assert proc.returncode == 0 and time.monotonic() - t0 < 5.0


def test_a_trial_process_killed_from_another_thread_while_a_call_waits_on_it() -> None:
    """The selection kills a validation helper's trial process (`Helpers.close`) while the helper's thread waits in
    `call` for it: neither side may fail on the other's half-torn-down state (on 4 H200s every 4-worker job failed
    at its end: `'NoneType' object has no attribute 'stdin'` in the kill, the waiting call having cleared it)."""
    from autofuse.runner.process import ProgramSpec
    from autofuse.runner.protocol import ValidateRequest

    spec = ProgramSpec(_ln, (jax.ShapeDtypeStruct((8, 16), jnp.float32),) + (jax.ShapeDtypeStruct((16,), jnp.float32),) * 2)
    for delay in (0.0, 0.05, 0.2, 0.5, 1.0):
        runner = ProcessRunner(spec, {"measure": "model"})
        runner.start()
        outcome: list = []

        def wait_in_call():
            try:
                outcome.append(runner.call(ValidateRequest(_plan(1).to_json())))
            except RuntimeError as e:  # the trial process died before it was ready
                outcome.append(e)

        th = threading.Thread(target=wait_in_call)
        th.start()
        time.sleep(delay)
        runner.kill()
        th.join(30)
        assert not th.is_alive() and len(outcome) == 1, delay
        res = outcome[0]
        assert isinstance(res, RuntimeError) and "failed to start" in str(res) or not res.ok, (delay, res)
        assert runner._proc is None
    # a call that comes after the kill (its thread scheduled late) starts no process that nobody would stop
    with pytest.raises(RuntimeError, match="failed to start: its runner was killed"):
        runner.call(ValidateRequest(_plan(1).to_json()))
    assert runner._proc is None
