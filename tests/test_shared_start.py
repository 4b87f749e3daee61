"""The start of a job compiled concurrently and shared among workers (autofuse.tuning.ahead, issue 18): the same
results as the serial start, each candidate's XLA timing done once across workers, a crash while compiling ahead
failing only its own trial, and the device of every measurement recorded."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
import zlib

import jax
import pytest

import autofuse
from autofuse import costmodel
from autofuse.runner.evaluator import Evaluator, _trial_key
from autofuse.runner.in_program import in_program
from autofuse.runner.process import ProcessRunner, ProgramSpec
from autofuse.runner.protocol import (
    CompileRequest,
    CompileResult,
    TrialRequest,
    TrialResult,
    XlaRequest,
)
from autofuse.status import TrialStatus
from autofuse.store import PlanStore
from autofuse.tuning import ahead
from autofuse.tuning.ahead import CompileAhead, compile_workers
from autofuse.tuning.job import (
    distinct_candidates,
    open_run,
    register_candidates,
    search_spaces,
    time_xla,
)
from autofuse.tuning.local import local_loop
from autofuse.tuning.scheduler import Budget, phase1_order
from autofuse.tuning.space import config_key
from autofuse.tuning.workers import share_xla
from benchmarks.workloads import log_relu_bias, rms_norm
from tests.dist_programs import log_relu_bias_inputs, rms_norm_inputs
from tests.quick import slow_except

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _program(fn=rms_norm, inputs=rms_norm_inputs):
    graph = autofuse.capture(fn, *inputs())
    by_sig, cands = distinct_candidates(graph)
    return graph, by_sig, cands, search_spaces(by_sig, cands, costmodel.H200)


class Recorder:
    """A deterministic runner (times depend only on the group and config) that keeps every request it answers."""

    def __init__(self, delay_s: float = 0.0, device: str = "fake:0"):
        self.requests: list = []
        self.delay_s, self.device = delay_s, device

    def call(self, req):
        self.requests.append(req)
        if isinstance(req, CompileRequest):
            return CompileResult(TrialStatus.OK, len(req.items))
        time.sleep(self.delay_s)
        ms = 1.0 + len(req.nodes) / 10 + (0.5 if isinstance(req, TrialRequest) else 0.0)
        return TrialResult(TrialStatus.OK, ms, ms, ms, device=self.device)

    def close(self):
        pass


def test_compile_workers_come_from_the_flag_the_environment_or_the_cores(monkeypatch):
    monkeypatch.delenv(ahead.ENV_VAR, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    assert compile_workers() == ahead.MAX_COMPILE_WORKERS  # capped
    assert compile_workers(share=8) == 8  # a host's cores shared among its workers
    assert compile_workers(share=100) == 1
    monkeypatch.setenv(ahead.ENV_VAR, "3")
    assert compile_workers(share=8) == 3 and compile_workers(5) == 5  # the flag over the environment over the cores
    for bad in (0, -1, True):
        with pytest.raises(ValueError, match="positive whole number"):
            compile_workers(bad)
    monkeypatch.setenv(ahead.ENV_VAR, "many")
    with pytest.raises(ValueError, match=ahead.ENV_VAR):
        compile_workers()


def test_concurrent_start_records_what_the_serial_one_does():
    """time_xla with compile workers: one CompileRequest per chunk naming exactly the chunk's groups, sent before
    their timings; the timings and each candidate's record are those of the serial path."""
    *_, serial_cands, _ = _program()
    *_, cands, _ = _program()
    serial, conc = Recorder(), Recorder()
    serial_res = time_xla(serial_cands, serial)
    conc_res = time_xla(cands, conc, compile_workers=2)
    assert [r.xla_ms for r in cands] == [r.xla_ms for r in serial_cands] and all(r.xla_ms for r in cands)
    assert conc_res == serial_res
    assert not any(isinstance(q, CompileRequest) for q in serial.requests)
    timings = [q for q in conc.requests if isinstance(q, XlaRequest)]
    assert timings == serial.requests  # the same timings, in the same order
    chunk, pos = ahead.chunk_size(2), 0
    for start in range(0, len(cands), chunk):
        part = [XlaRequest(tuple(r.nodes)) for r in cands[start:start + chunk]]
        assert conc.requests[pos] == CompileRequest(tuple(part), 2, ahead.BATCH_TIMEOUT_S) and conc.requests[pos + 1:pos + 1 + len(part)] == part
        pos += 1 + len(part)


class CrashingBatches(Recorder):
    """Every batch compiled ahead kills the trial process."""

    def call(self, req):
        if isinstance(req, CompileRequest):
            self.requests.append(req)
            return CompileResult(TrialStatus.CRASHED, failed=len(req.items), error="trial process died")
        return super().call(req)


def test_after_a_batch_crashes_the_start_compiles_one_at_a_time():
    """A crash that would repeat costs one restart, not one per batch: compiling ahead stops, the timings go on."""
    *_, cands, spaces = _program()
    rec = CrashingBatches()
    time_xla(cands, rec, compile_workers=2)
    assert [type(q) for q in rec.requests].count(CompileRequest) == 1 and all(r.xla_ms for r in cands)
    rec.requests.clear()
    ahead_ = CompileAhead(rec, cands, spaces, "device", 2)
    ahead_.before(0)
    ahead_.before(next(j for j in range(len(cands)) if j not in ahead_.sent))  # would be a batch of its own
    assert [type(q) for q in rec.requests] == [CompileRequest] and ahead_.workers == 1


@pytest.mark.slow
def test_compiling_ahead_gives_the_serial_executables_and_results(caplog):
    """In the trial process (device mode on the CPU): the XLA references compiled on threads are the executables a
    serial compile gives, the kernels compiled ahead give the same check as compiled in their trial, and each
    trial takes its kernel (none is left). The batch also compiled the random inputs' views and the checks'
    comparisons: the timings and checks after it compile none of them."""
    import logging

    from autofuse.runner import measure

    graph, _, cands, spaces = _program()
    xla = tuple(XlaRequest(tuple(r.nodes)) for r in cands)
    trials = tuple(TrialRequest(tuple(r.nodes), r.template, spaces[r.signature].first_configs()[0]) for r in cands)
    serial = Evaluator(graph, measure="device", repeats=2, n_input_sets=1)
    conc = Evaluator(graph, measure="device", repeats=2, n_input_sets=1)
    measure._viewer.cache_clear()  # made afresh, by the batch
    measure._STATS.clear()
    done = conc.handle(CompileRequest(xla + trials + xla[:1], 2))  # a reference asked twice in a batch compiles once
    assert done.ok and (done.compiled, done.failed) == (2 * len(cands), 0)
    assert len(conc._refs) == len(cands) and len(conc._ahead) == len(cands)
    with caplog.at_level(logging.WARNING), jax.log_compiles():
        got = [conc.handle(q) for q in xla + trials]
    compiled = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Compiling jit(")]
    assert not [m for m in compiled if m.startswith(("Compiling jit(view)", "Compiling jit(_float_stats)"))], compiled
    for q, b in zip(xla, got):
        group = autofuse.graph.Group.of(graph, q.nodes)
        view = in_program(group)  # the group as timed alone: with the layout ops that make its inputs
        again = jax.jit(view.around(lambda *a, g=group: g.evaluate(a))).lower(*view.structs()).compile()
        assert _hlo(conc._refs[tuple(group.node_ids)]) == _hlo(again) and "ENTRY" in _hlo(again)
        a = serial.handle(q)
        assert a.status is b.status is TrialStatus.OK and a.device == b.device == "cpu:0 cpu"
    for q, b in zip(trials, got[len(xla):]):
        a = serial.handle(q)
        assert (a.status, a.max_error, a.error) == (b.status, b.max_error, b.error) and b.ok, (a, b)
        assert _trial_key(q.nodes, q.template, q.config) not in conc._ahead
    assert conc._ahead == {}


class _InProcess:
    """The trial process's requests answered by an evaluator in this process (device mode on the CPU)."""

    def __init__(self, ev: Evaluator):
        self.ev, self.requests = ev, []

    def call(self, req):
        self.requests.append(req)
        return self.ev.handle(req)


@pytest.mark.parametrize(("asked", "workers", "ahead"), slow_except([pytest.param(True, 2, True, id="with-the-xla-batch"),
                                                                     pytest.param(False, 2, False, id="not-asked"),
                                                                     pytest.param(True, 1, False, id="one-compile-thread")],
                                                                    "with-the-xla-batch"))
def test_the_whole_program_compiles_beside_the_xla_timings_and_the_first_validation_finds_it(monkeypatch, asked, workers, ahead):
    """jax.jit's whole program, the reference every validation is judged against, compiles in the XLA timings'
    first batch with the first trials' kernels (`CompileAhead.first_compiles`, device mode, several compile
    threads): the first plan's validation then compiles it no more. With phase 1's kernels alone (`first_batch`),
    or one thread, the validation compiles it as before."""
    from autofuse.runner.protocol import ProgramRequest, ValidateRequest
    from autofuse.tuning.select import default_plan

    from autofuse.runner import evaluator

    graph, _, cands, spaces = _program()
    ev = Evaluator(graph, measure="device", repeats=2, n_input_sets=1)
    compiled, checks = [], []
    real = ev._compile_program
    monkeypatch.setattr(ev, "_compile_program", lambda: compiled.append(1) or real())
    builders = evaluator.check_program_builders
    monkeypatch.setattr(evaluator, "check_program_builders", lambda *a: checks.append(1) or builders(*a))
    runner = _InProcess(ev)
    ca = CompileAhead(runner, cands, spaces, "device", workers)
    first = ca.first_compiles() if asked else ca.first_batch()
    assert (ProgramRequest() in first) is ahead
    time_xla(cands, runner, compile_workers=workers, first_trials=first)
    batches = [q for q in runner.requests if isinstance(q, CompileRequest)]
    assert sum(isinstance(it, ProgramRequest) for q in batches for it in q.items) == int(ahead)
    assert (ev._program is not None, len(compiled)) == (ahead, int(ahead)) and all(r.xla_ms for r in cands)
    assert not checks  # a check's small programs compile with the first plan, not beside the XLA references
    plan = default_plan(graph).to_json()
    assert ev.compile_ahead([ValidateRequest(plan)], 2).ok and checks == [1]
    res = ev.handle(ValidateRequest(plan))
    assert res.ok and len(compiled) == 1, res.error
    assert CompileAhead(runner, cands, spaces, "model", 2).first_compiles() == []  # model mode validates in interpret mode


def test_the_selections_lone_dots_compile_with_the_first_batch_of_the_trial_loop():
    """XLA's references of the dots a cover may leave alone (`select.lone_contractions`, timed by the selection)
    ride with the trial loop's next batch, once: compiled on an idle CPU, not on the first plan's critical path."""
    from autofuse.tuning.select import lone_contractions
    from benchmarks.workloads import matmul_bias_gelu
    from tests.dist_programs import matmul_bias_gelu_inputs

    graph, _, cands, spaces = _program(matmul_bias_gelu, matmul_bias_gelu_inputs)
    lone = lone_contractions(graph)
    assert lone
    runner = Recorder()
    ca = CompileAhead(runner, cands, spaces, "device", 4)
    ca.selection_references(graph)
    ca._compile([TrialRequest((0,), "t", {})])
    ca._compile([TrialRequest((1,), "t", {})])
    first, second = [q.items for q in runner.requests if isinstance(q, CompileRequest)]
    assert [it.nodes for it in first if isinstance(it, XlaRequest)] == [(n,) for n in lone]
    assert not any(isinstance(it, XlaRequest) for it in second)
    ca.along, ca.workers = [], 1  # one compile thread: no batches, nothing rides along
    ca.selection_references(graph)
    assert ca.along == []


def _hlo(compiled) -> str:
    """The optimised HLO without source locations (the Python stack that traced it differs between threads)."""
    text = re.sub(r"\nFileNames\n.*?\nStackFrames\n.*?\n\n", "\n", compiled.as_text(), flags=re.DOTALL)
    return re.sub(r",? ?metadata=\{[^}]*\}", "", text)


@pytest.mark.slow
def test_a_kernel_that_crashes_while_compiling_ahead_fails_only_its_trial(monkeypatch):
    """The batch dies with the trial process; the process restarts, and each item compiles in its own request:
    the crashing config is `crashed`, the others are answered as usual."""
    monkeypatch.setenv("AUTOFUSE_TEMPLATE_PLUGINS", "tests.plugins.crashy_template")
    monkeypatch.setenv("PYTHONPATH", ROOT)
    graph, _, cands, _ = _program(log_relu_bias, log_relu_bias_inputs)
    (r,) = cands
    spec = ProgramSpec(log_relu_bias, log_relu_bias_inputs(), fingerprint=graph.fingerprint)
    cfg = {"backend": "triton", "block_rows": 1, "block_cols": 32, "num_warps": 4, "num_stages": 1}
    fine, crash = TrialRequest(tuple(r.nodes), "crashy", cfg), TrialRequest(tuple(r.nodes), "crashy", {**cfg, "block_rows": 2})
    with ProcessRunner(spec, {"measure": "device", "repeats": 2, "n_input_sets": 1}, timeout_s=120) as runner:
        batch = runner.call(CompileRequest((XlaRequest(tuple(r.nodes)), fine, crash), 2))
        assert batch.status is TrialStatus.CRASHED and batch.failed == 3
        assert runner.call(XlaRequest(tuple(r.nodes))).ok
        assert runner.call(crash).status is TrialStatus.CRASHED
        assert runner.call(fine).status is TrialStatus.WRONG_RESULT  # crashy's kernels add 1: checked, not crashed


def test_phase_one_default_configs_are_compiled_ahead_as_their_trials_ask_for_them():
    """The local driver with compile workers: before a phase 1 trial, its candidate's first config goes ahead in a
    CompileRequest with the next ones'; each phase 1 trial then asks for exactly a config compiled ahead."""
    graph, by_sig, cands, spaces = _program()
    rec = Recorder()
    time_xla(cands, rec)
    loop = local_loop(graph, by_sig, cands, spaces, Budget(len(cands)), costmodel.H200, "device", rec, None, None, 0)
    loop.ahead = CompileAhead(rec, cands, spaces, "device", 2)
    loop.run()
    items = [q for c in rec.requests if isinstance(c, CompileRequest) for q in c.items]
    sent = {_trial_key(q.nodes, q.template, q.config) for q in items if isinstance(q, TrialRequest)}
    asked = [_trial_key(q.nodes, q.template, q.config) for q in rec.requests if isinstance(q, TrialRequest)]
    assert len(asked) == len(cands) and set(asked) <= sent
    assert {q.nodes for q in items if isinstance(q, XlaRequest)} == {q[0] for q in sent}  # each with its reference, for its check
    assert loop.ahead.batches and max(loop.ahead.batches) <= 2 * ahead.chunk_size(2)  # a candidate: its reference and one config
    first_batch = next(i for i, q in enumerate(rec.requests) if isinstance(q, CompileRequest))
    first_trial = next(i for i, q in enumerate(rec.requests) if isinstance(q, TrialRequest))
    assert first_batch < first_trial


def _run_with_candidates(tmp_path, fn=rms_norm, inputs=rms_norm_inputs):
    graph, _, cands, _ = _program(fn, inputs)
    pstore = PlanStore(f"sqlite:///{tmp_path}/x.db")
    _, run_id, _ = open_run(pstore, graph, "p", "device", 8, None, 0, None)
    register_candidates(pstore, run_id, cands)
    return pstore, run_id, cands


def test_workers_share_the_xla_timings_each_candidate_timed_once(tmp_path):
    pstore, run_id, cands = _run_with_candidates(tmp_path)
    runners, seen, errors = {}, {}, []

    def worker(name: str) -> None:
        try:
            _, _, mine, _ = _program()
            register_candidates(PlanStore(pstore.url), run_id, mine)
            runners[name] = Recorder(delay_s=0.2, device=f"fake:{name[-1]}")
            share_xla(PlanStore(pstore.url), run_id, mine, runners[name], name, 1, stale_s=600)
            seen[name] = [r.xla_ms for r in mine]
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(f"{socket.gethostname()}:{os.getpid()}-w{k}",)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    timed = [q.nodes for rec in runners.values() for q in rec.requests if isinstance(q, XlaRequest)]
    assert sorted(timed) == sorted(tuple(r.nodes) for r in cands)  # each candidate once, across the workers
    assert all(len(rec.requests) > 0 for rec in runners.values()), "both workers timed some"
    rows = pstore.candidates(run_id)
    assert all(c["xla_status"] == "ok" and c["xla_ms"] for c in rows)
    for name, rec in runners.items():  # who timed it and on which device, as that worker's runner said
        mine = {q.nodes for q in rec.requests if isinstance(q, XlaRequest)}
        by_nodes = {tuple(c["nodes"]): c for c in rows}
        assert {by_nodes[n]["xla_worker"] for n in mine} == {name} and {by_nodes[n]["xla_device"] for n in mine} == {rec.device}
    want = [c["xla_ms"] for c in rows]
    assert all(v == want for v in seen.values())  # every worker ends with every candidate's time


def test_a_dead_workers_xla_claim_is_taken_over_and_a_live_ones_is_not(tmp_path):
    pstore, run_id, _ = _run_with_candidates(tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    here = socket.gethostname()
    live = pstore.claim_xla(run_id, f"{here}:{os.getpid()}", 2, stale_s=600)
    got = pstore.claim_xla(run_id, f"{here}:{dead.pid}", 3, stale_s=600)
    assert len(got) == 3 and len(live) == 2 and not set(got) & set(live)
    again = pstore.claim_xla(run_id, "other-host:1", 100, stale_s=600)
    assert set(got) <= set(again) and not set(live) & set(again)  # the dead one's claims, never the live one's
    assert not pstore.finish_xla(got[0], f"{here}:{dead.pid}", "ok", 1.0, "gpu:0")  # its late result is refused
    assert pstore.finish_xla(got[0], "other-host:1", "ok", 1.0, "gpu:0")
    # a chunk is recorded in one write; where a claim was taken over, that result alone is refused
    assert pstore.finish_xla_many(f"{here}:{dead.pid}", [(got[1], "ok", 2.0, "gpu:0"), (got[2], "ok", 3.0, "gpu:0")]) == [False, False]
    assert pstore.finish_xla_many("other-host:1", [(got[1], "ok", 2.0, "gpu:1"), (live[0], "ok", 9.0, "gpu:1")]) == [True, False]
    rows = {c["id"]: c for c in pstore.candidates(run_id)}
    assert rows[got[1]]["xla_ms"] == 2.0 and rows[got[1]]["xla_device"] == "gpu:1" and rows[live[0]]["xla_ms"] is None
    stale = pstore.claim_xla(run_id, "third:1", 100, stale_s=0.0)  # any claim older than stale_s
    assert set(live) <= set(stale) and got[0] not in stale  # a finished timing is never claimed again


@pytest.mark.slow
def test_workers_record_their_xla_timings_and_the_device_of_every_trial(tmp_path):
    """Two real workers (CPU, model mode) of `autofuse tune --workers 2`: the candidates the 6 trials can reach
    timed in XLA once by one of them (the modelled savings: a budget short of every default reaches no modelled
    loss first), any other only if it got a trial, every measured trial with its worker, device and finish time."""
    url = f"sqlite:///{tmp_path}/rec.db"
    env = dict(os.environ, PYTHONPATH=ROOT, AUTOFUSE_COMPILE_WORKERS="2")
    env.pop("AUTOFUSE_DB", None)
    out = subprocess.run([sys.executable, "-m", "autofuse.cli", "tune", "benchmarks.workloads:rms_norm", "--inputs",
                          "tests.dist_programs:rms_norm_inputs", "--trials", "6", "--db", url, "--workers", "2", "--heartbeat", "1",
                          "--quiet"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-4000:]
    store = PlanStore(url)
    (run,) = store.runs()
    assert run["status"] == "finished"
    cands = store.candidates(run["id"])
    timed = [c for c in cands if c["xla_status"] is not None]
    assert len(cands) == 8 and all(c["xla_status"] == "ok" and c["xla_ms"] and c["xla_device"] == "cpu:0 cpu" for c in timed)
    trials = [t for t in store.trials(run["id"]) if t["status"] not in ("infeasible", "pruned")]
    assert len(trials) == 6
    tried = {t["candidate_id"] for t in trials}
    assert 1 <= len(timed) < 8 and tried <= {c["id"] for c in timed}, (len(timed), tried)
    for t in trials:
        assert t["device"] == "cpu:0 cpu" and t["finished_at"] >= t["created_at"], t
        assert t["worker"].rpartition(":")[0] == socket.gethostname()
    workers = {t["worker"] for t in trials} | {c["xla_worker"] for c in timed}
    assert len(workers) <= 2 and all(w.rpartition(":")[2].isdigit() for w in workers)


def test_each_worker_is_pinned_to_its_gpu_and_its_trial_process_records_it(monkeypatch):
    """start_workers gives worker i GPU i alone, no memory preallocation and its share of the cores for compiling;
    a trial process started under such a worker records that CUDA_VISIBLE_DEVICES with every result."""
    import autofuse.tuning.workers as dist

    envs, argvs = [], []
    monkeypatch.setattr(dist.subprocess, "Popen", lambda argv, env: (argvs.append(argv), envs.append(env)))
    monkeypatch.delenv(ahead.ENV_VAR, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    dist.start_workers(3, "benchmarks.workloads:log_relu_bias", "sqlite:///x.db", 2, ["2", "5"], True, indexed=True)
    assert [a[1:] for a in argvs] == [["-P", "-m", "autofuse.tuning.workers", "3", "benchmarks.workloads:log_relu_bias", "--index", str(i),
                                      "--quiet"] for i in (0, 1)]  # the program on its command line; no working directory first
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["2", "5"]
    assert all(e["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false" and e[ahead.ENV_VAR] == "8" for e in envs)
    monkeypatch.undo()

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")  # as a worker pinned to GPU 5 has it (the CPU backend ignores it)
    graph, _, cands, _ = _program(log_relu_bias, log_relu_bias_inputs)
    spec = ProgramSpec(log_relu_bias, log_relu_bias_inputs(), fingerprint=graph.fingerprint)
    with ProcessRunner(spec, {"measure": "model"}, timeout_s=120) as runner:
        res = runner.call(XlaRequest(tuple(cands[0].nodes)))
    assert res.ok and res.device == "cpu:0 cpu (CUDA_VISIBLE_DEVICES=5)"


def test_compiling_ahead_stops_at_this_workers_part_of_the_budget():
    """Two workers with 9 trials left (a default each for the 8 candidates): a batch holds this worker's part of
    phase 1's 8 visits, 4 candidates, the next of phase 1 (the workers go through it in step), each with its XLA
    reference (its trial's check needs it) and every default config (a worker takes whichever is enqueued next).
    With 6 trials, short of the candidates, phase 1 visits 3 of them: this worker's batch holds 2; with 3 trials it
    visits 1."""
    *_, cands, spaces = _program()
    time_xla(cands, Recorder())
    order = phase1_order(cands, spaces)
    for budget, n in ((9, 4), (6, 2), (3, 1)):
        rec = Recorder()
        CompileAhead(rec, cands, spaces, "device", 8, share=2, budget=budget).before(order[0])
        (batch,) = rec.requests
        want = [(tuple(cands[j].nodes), cfg) for j in order[:n] for cfg in [None] + spaces[cands[j].signature].defaults()]
        assert [(q.nodes, getattr(q, "config", None)) for q in batch.items] == want
    ca1 = CompileAhead(Recorder(), cands, spaces, "device", 8, share=1, budget=5)
    first = ca1.first_requests(order[0])
    assert [q.config for q in first[1:]] == [spaces[cands[order[0]].signature].default] and isinstance(first[0], XlaRequest)  # one worker: its first


def test_the_first_trials_compile_with_the_first_xla_references():
    """The batch `before` would send for phase 1's first candidate (`first_batch`: GPT-2's Mosaic GPU attention,
    4-5 s) compiles in the XLA phase's first chunk, beside the references, and the phase records its longest compile
    of each kind; marked sent, so the first trial finds it and sends nothing. A worker that claims no chunk compiles
    it alone. One worker compiling alone: no batch."""
    *_, cands, spaces = _program()
    rec = Recorder()
    ca = CompileAhead(rec, cands, spaces, "device", 2, budget=8)
    batch = ca.first_batch()
    order = phase1_order(cands, spaces)
    assert batch and batch[0] == XlaRequest(tuple(cands[order[0]].nodes)) and order[0] in ca.sent
    assert any(isinstance(q, TrialRequest) for q in batch)
    spent: dict = {}
    part = cands[:3]

    class Timed(Recorder):  # the longest compile of each kind, as the evaluator reports it
        def call(self, req):
            res = super().call(req)
            if isinstance(req, CompileRequest):
                res = CompileResult(TrialStatus.OK, len(req.items), longest={"xla": 0.4, "trial": 4.5})
            return res

    rec = Timed()
    time_xla(part, rec, compile_workers=2, spent=spent, first_trials=batch)
    compiles = [q for q in rec.requests if isinstance(q, CompileRequest)]
    refs = [XlaRequest(tuple(r.nodes)) for r in part]
    assert compiles[0].items == tuple(refs + batch) and len(compiles) == 1
    assert spent["trials"] == sum(isinstance(q, TrialRequest) for q in batch)
    assert spent["longest_trial"] == 4.5 and spent["longest_xla"] == 0.4  # what the XLA phase waited for
    rec.requests.clear()
    ca.before(order[0])
    assert rec.requests == []  # sent already
    time_xla([], rec, compile_workers=2, first_trials=batch)  # no chunk of its own: the batch alone
    assert rec.requests == [CompileRequest(tuple(batch), 2, ahead.BATCH_TIMEOUT_S)]
    assert CompileAhead(Recorder(), cands, spaces, "device", 1).first_batch() == []


class _Faster(Recorder):
    """Kernels that beat XLA by an amount each config sets (so phase 2 has contenders and TPE something to learn)."""

    def call(self, req):
        if not isinstance(req, TrialRequest):
            return super().call(req)
        self.requests.append(req)
        ms = 0.5 + zlib.crc32(repr(sorted(req.config.items())).encode()) % 100 / 1000
        return TrialResult(TrialStatus.OK, ms, ms, ms, device=self.device)


def _keys(reqs):
    return [_trial_key(q.nodes, q.template, q.config) for q in reqs if isinstance(q, TrialRequest)]


def test_phase_two_configs_are_asked_ahead_and_compiled_together_before_their_trials():
    """Past phase 1, the configs the contenders' next trials will take (each one's part of its due trials, asked of
    its sampler at once and queued in its study) are compiled in batches that span candidates; the trials take
    them in each candidate's order, finding them compiled. The asking leaves no trial in the store (it asks a copy
    in memory), and the budget is spent as before. One compile thread: nothing is asked."""
    graph, by_sig, cands, spaces = _program()
    rec = _Faster()
    time_xla(cands, rec)
    budget = len(cands) + 32
    loop = local_loop(graph, by_sig, cands, spaces, Budget(budget), costmodel.H200, "device", rec, None, None, 0)
    loop.ahead = CompileAhead(rec, cands, spaces, "device", 4)
    loop.run()
    phase1_end = [i for i, q in enumerate(rec.requests) if isinstance(q, TrialRequest)][len(cands) - 1]
    later = rec.requests[phase1_end + 1:]
    batches = [q for q in later if isinstance(q, CompileRequest)]
    assert batches and max(len({q.nodes for q in b.items}) for b in batches) > 1  # a batch of several candidates' configs
    assert all(len(b.items) <= ahead.MAX_BATCH_AHEAD for b in batches)
    trials = _keys(later)
    for b in batches:  # each candidate's configs are asked for in the order they were compiled
        after = _keys(later[later.index(b) + 1:])
        for nodes in {q.nodes for q in b.items}:
            used = [key for key in _keys(b.items) if key[0] == nodes and key in after]
            assert sorted(used, key=after.index) == used
    compiled = [key for b in batches for key in _keys(b.items)]
    assert sum(key in trials for key in compiled) >= 0.8 * len(compiled)  # few guesses wasted
    assert sum(key in set(compiled) for key in trials) >= len(trials) // 2
    assert sum(len(c.spent()) for c in cands) == budget
    from optuna.trial import TrialState

    studies = [loop.study(i) for i in range(len(cands))]
    ran = [t for s in studies for t in s.get_trials(deepcopy=False) if t.state is not TrialState.WAITING]
    assert len(ran) == len(loop.order) and TrialState.RUNNING not in {t.state for t in ran}  # the asking left nothing behind

    serial = _Faster()
    time_xla(cands, serial)
    loop = local_loop(graph, by_sig, cands, spaces, Budget(budget), costmodel.H200, "device", serial, None, None, 0)
    loop.ahead = CompileAhead(serial, cands, spaces, "device", 1)
    loop.run()
    assert not [q for q in serial.requests if isinstance(q, CompileRequest)]


def test_contenders_due_one_trial_each_are_compiled_ahead_together():
    """Past phase 1, contenders each due a single trial still have their next configs asked of their samplers and
    compiled in one batch, side by side. Where one trial was due, nothing was asked and each kernel was built in its
    own trial, one after another (GPT-2's forward on an H200: 44 of 96 trials, 17 s of compiling)."""
    from optuna.trial import TrialState

    graph, by_sig, cands, spaces = _program()
    rec = _Faster()
    time_xla(cands, rec)
    loop = local_loop(graph, by_sig, cands, spaces, Budget(10 * len(cands)), costmodel.H200, "device", rec, None, None, 0)

    def waiting(i: int) -> list:
        return loop.study(i).get_trials(deepcopy=False, states=(TrialState.WAITING,))

    while not all(r.trials for r in cands) or any(waiting(i) for i in range(len(cands))):  # the queued configs taken
        loop.step()
    before = len(rec.requests)
    CompileAhead(rec, cands, spaces, "device", 4).ask([(i, 1) for i in range(3)], loop.study)
    (batch,) = [q for q in rec.requests[before:] if isinstance(q, CompileRequest)]
    assert len({q.nodes for q in batch.items}) == 3 and len(batch.items) == 3


def test_configs_asked_ahead_wait_in_the_study_for_whichever_worker_comes_next(tmp_path):
    """The configs a worker asked ahead are waiting trials of the candidate's study in the shared store: another
    worker's next trial of it (this one dead, say) takes the first of them, as it would a default."""
    from optuna.trial import TrialState

    from autofuse.store.optuna_storage import optuna_storage
    from autofuse.tuning.job import create_study, load_study
    from autofuse.tuning.ledger import StoreLedger
    from autofuse.tuning.trial import TrialContext, run_trial

    *_, spaces = _program()
    pstore, run_id, cands = _run_with_candidates(tmp_path)
    r, space = cands[0], spaces[cands[0].signature]
    storage = optuna_storage(pstore.url)
    create_study(storage, run_id, space, r.signature)
    ledger = StoreLedger(pstore, run_id, "a")
    ctx = TrialContext(ledger, _Faster(), "device", 100, "a")
    study = load_study(storage, run_id, r.signature, 1)
    for _ in space.defaults():
        assert run_trial(study, r, space, ctx) == "measured"
    while study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):  # the model's best, queued by the first
        run_trial(study, r, space, ctx)
    rec = Recorder()
    asker = CompileAhead(rec, cands, spaces, "device", 4)
    r.update_best()
    asker.ask([(0, 8)], lambda i: study)
    waiting = load_study(storage, run_id, r.signature, 2).get_trials(deepcopy=False, states=(TrialState.WAITING,))
    assert len(waiting) >= 2 and all(t.user_attrs == {ahead.ASKED_BY: asker.tag} for t in waiting)
    compiled = [space.optuna_params(q.config) for b in rec.requests for q in b.items]  # those worth timing, in the queue's order
    tried = [t.config for t in r.trials]
    near = [space.optuna_params(c) for c in space.neighbours(r.best_config, "device") if c not in tried]
    assert compiled[:2] == near[:2]  # the best config's neighbours first (`queue_neighbours`), then the sampler's
    assert [t.system_attrs["fixed_params"] for t in waiting if t.system_attrs["fixed_params"] in compiled] == compiled
    other = TrialContext(StoreLedger(pstore, run_id, "b"), _Faster(), "device", 100, "b")
    before = len(r.trials)
    run_trial(load_study(storage, run_id, r.signature, 2), r, space, other)
    ledger.refresh(cands)
    assert len(r.trials) == before + 1 and space.optuna_params(r.trials[-1].config) == waiting[0].system_attrs["fixed_params"]
    study = load_study(storage, run_id, r.signature, 3)
    left = [t.system_attrs["fixed_params"] for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,))]
    alone = CompileAhead(Recorder(), cands, spaces, "device", 4)  # the job alone, resumed in another process
    alone.tag = "elsewhere:1"
    assert [space.optuna_params(c) for c in alone._queue(0, study, len(left))] == left  # its own to compile
    other = CompileAhead(Recorder(), cands, spaces, "device", 4, share=2, index=1)  # a second worker of the host
    assert not [c for c in other._queue(0, study, len(left)) if space.optuna_params(c) in left]  # the asker's to compile


def _two_workers_taking_turns(tmp_path, indexed: bool, fn=rms_norm, inputs=rms_norm_inputs, extra: int = 24):
    """Two workers of one store (numbered 0 and 1 where `indexed`) taking turns at trials until the budget (every
    candidate once and `extra` more) is spent, each compiling ahead. Returns the candidates as the store has them, their
    spaces, each worker's runner and loop, and the budget."""
    import copy

    from autofuse.store.optuna_storage import optuna_storage
    from autofuse.tuning.job import create_study
    from autofuse.tuning.ledger import StoreLedger
    from autofuse.tuning.loop import TrialLoop
    from autofuse.tuning.scheduler import Scheduler
    from autofuse.tuning.trial import TrialContext

    graph, by_sig, _, spaces = _program(fn, inputs)
    pstore, run_id, cands = _run_with_candidates(tmp_path, fn, inputs)
    time_xla(cands, _Faster())
    for r in cands:
        pstore.update_candidate(r.candidate_id, xla_ms=r.xla_ms)
        create_study(optuna_storage(pstore.url), run_id, spaces[r.signature], r.signature)
    budget = len(cands) + extra
    loops, runners = [], []
    for w in range(2):
        mine = copy.deepcopy(cands)
        rec = _Faster(device=f"fake:{w}")
        scheduler = Scheduler(graph, by_sig, mine, spaces, Budget(budget), costmodel.H200)
        ctx = TrialContext(StoreLedger(pstore, run_id, f"w{w}"), rec, "device", scheduler.total, f"w{w}")
        loop = TrialLoop(mine, spaces, scheduler, ctx, optuna_storage(pstore.url), run_id, 0, worker_seed=w)
        loop.ahead = CompileAhead(rec, mine, spaces, "device", 4, share=2, budget=scheduler.total, index=w if indexed else None)
        loops.append(loop)
        runners.append(rec)
    active = [0, 1]
    while active:
        for w in list(active):
            if loops[w].step() in (None, "closed"):
                active.remove(w)
    StoreLedger(pstore, run_id).refresh(cands)
    return cands, spaces, runners, loops, budget


def _ahead(rec) -> list[tuple]:
    return [key for b in rec.requests if isinstance(b, CompileRequest) for key in _keys(b.items)]


@pytest.mark.slow
def test_two_workers_asking_ahead_share_the_queues_and_measure_no_config_twice(tmp_path):
    """Two workers of one store taking turns, each asking its part of phase 2 ahead: a config one queued is
    measured once (by whichever comes first), the budget is spent exactly, and nothing is left running."""
    from optuna.trial import TrialState

    cands, spaces, runners, loops, budget = _two_workers_taking_turns(tmp_path, indexed=False)
    measured = [(r.signature, config_key(t.config)) for r in cands for t in r.trials if t.status is TrialStatus.OK]
    assert len(measured) == len(set(measured)) == budget
    defaults = {tuple(r.nodes): [config_key(c) for c in spaces[r.signature].defaults()] for r in cands}
    asked = {key for rec in runners for key in _keys(rec.requests)}
    for rec in runners:  # each compiled configs past the defaults ahead, as the trials (through the store) asked for them
        ahead_ = [key for key in _ahead(rec) if key[2] not in defaults[key[0]]]
        assert ahead_ and sum(key in asked for key in ahead_) >= 0.8 * len(ahead_)
    studies = [loops[0].study(i) for i in range(len(cands))]
    assert not [t for s in studies for t in s.get_trials(deepcopy=False, states=(TrialState.RUNNING,))]


@pytest.mark.slow  # two workers' whole jobs in turn
def test_the_workers_of_a_host_compile_ahead_their_own_parts_not_each_others(tmp_path):
    """Two numbered workers of one host taking turns: each compiles ahead its part of phase 1's defaults (and its own
    next trial's) and only the phase 2 configs it queued itself, the other's being the other's to compile (its trials
    find them in the host's caches): no config the samplers proposed is compiled by both, and few defaults. Each compiling all the other did, two workers on 2 H200s were 1.04x one. The
    budget is spent exactly, each config measured once."""
    cands, spaces, runners, _, budget = _two_workers_taking_turns(tmp_path, indexed=True)
    measured = [(r.signature, config_key(t.config)) for r in cands for t in r.trials if t.status is TrialStatus.OK]
    assert len(measured) == len(set(measured)) == budget
    firsts = {tuple(r.nodes): [config_key(c) for c in spaces[r.signature].defaults()] + [config_key(spaces[r.signature].model_best())]
              for r in cands}
    a, b = (_ahead(rec) for rec in runners)
    both = set(a) & set(b)
    proposed = {key for key in set(a) | set(b) if key[2] not in firsts[key[0]]}
    assert proposed and not both & proposed  # phase 2's proposals: each compiled once
    defaults = {key for key in set(a) | set(b) if key[2] in firsts[key[0]]}
    assert len(both) <= len(defaults) // 4  # in step, each compiled every default of its chunk: 11 of 16 twice


def test_the_workers_of_a_host_share_the_first_batch_between_them():
    """Numbered workers (`index`) starting together each compile every `share`-th candidate of the first batch, the
    others' kernels coming from the kernel and compilation caches: together they compile the batch once, where each
    compiled it whole. Every candidate of it is marked sent in each (its trial compiles what it does not find)."""
    *_, cands, spaces = _program()
    whole = CompileAhead(Recorder(), cands, spaces, "device", 2, share=3, budget=30)
    batch = whole.first_batch()
    parts = []
    for w in range(3):
        ca = CompileAhead(Recorder(), cands, spaces, "device", 2, share=3, budget=30, index=w)
        parts.append(ca.first_batch())
        assert ca.sent == whole.sent and len(ca.sent) >= 3
    assert all(parts) and sorted(map(repr, (q for p in parts for q in p))) == sorted(map(repr, batch))
    assert not set(map(repr, parts[0])) & set(map(repr, parts[1]))


def test_finding_model_bests_ahead_keeps_the_main_threads_gil_waits_short(monkeypatch):
    """The model's bests are found on a background thread (pure Python, ~14 s for GPT-2) while the main thread talks
    to the store and the trial process; at the default 5 ms switch interval every return from I/O waited for the GIL
    (four GPT-2 workers on 4 H100s spent 9-11 s of their 26 s XLA phase in store calls). While it runs the interval
    is PREFETCH_SWITCH_S, and the caller's comes back when the last of two overlapping ones ends."""
    from autofuse.tuning.space import CandidateSpace

    _, _, cands, spaces = _program()
    before = sys.getswitchinterval()
    seen: list[float] = []
    real = CandidateSpace.model_best
    both_in, mine = threading.Barrier(2, timeout=30), threading.local()

    def model_best(self):
        if not getattr(mine, "met", False):  # each prefetch thread waits here once, so that the two overlap
            mine.met = True
            both_in.wait()
        seen.append(sys.getswitchinterval())
        return real(self)

    monkeypatch.setattr(CandidateSpace, "model_best", model_best)
    _, _, again, spaces_again = _program()
    ahead.prefetch_model_bests(cands, spaces)
    ahead.prefetch_model_bests(again, spaces_again)
    deadline = time.monotonic() + 60
    while (len(seen) < 2 * len(cands) or sys.getswitchinterval() != before) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(seen) == 2 * len(cands) and all(abs(v - min(before, ahead.PREFETCH_SWITCH_S)) < 1e-9 for v in seen)
    assert sys.getswitchinterval() == before


def test_model_bests_are_found_ahead_only_for_the_candidates_the_budget_reaches(monkeypatch):
    """Given the candidates timed first (`scheduler.timed_first`), the prefetch thread enumerates only their spaces,
    in that order: GPT-2's 158 took ~14 s of a Python thread that was still busy when phase 2 began."""
    from autofuse.tuning.space import CandidateSpace

    _, _, cands, spaces = _program()
    order = phase1_order(cands, spaces)[:3]  # as `timed_first` gives them (this program's are all modelled losses: none)
    assert len(order) == 3 < len(cands)
    seen: list[int] = []
    by_space = {id(spaces[r.signature]): k for k, r in enumerate(cands)}
    real = CandidateSpace.model_best
    monkeypatch.setattr(CandidateSpace, "model_best", lambda self: (seen.append(by_space[id(self)]), real(self))[1])
    ahead.prefetch_model_bests(cands, spaces, order)
    deadline = time.monotonic() + 30
    while len(seen) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    assert seen == order


@pytest.mark.slow
def test_a_restarted_trial_process_is_a_fresh_one_that_answers():
    """`ProcessRunner.restart` (a validation out of GPU memory is made again in a fresh process): the old child is
    gone, a new one is started at once and answers the next request."""
    graph, _, cands, _ = _program(log_relu_bias, log_relu_bias_inputs)
    spec = ProgramSpec(log_relu_bias, log_relu_bias_inputs(), fingerprint=graph.fingerprint)
    with ProcessRunner(spec, {"measure": "model"}, timeout_s=120) as runner:
        assert runner.call(XlaRequest(tuple(cands[0].nodes))).ok
        old = runner._proc
        runner.restart()
        assert old.poll() is not None and runner._proc is not None and runner._proc.pid != old.pid
        assert runner.call(XlaRequest(tuple(cands[0].nodes))).ok

