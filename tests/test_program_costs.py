"""XLA's kernels in the program as the selection's prices: the node scopes read back from a compiled module, kernels
summed by instruction, the prices per node and per group, and the cover they give (issue 32, item 2)."""
from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp
import pytest

from autofuse import costmodel
from autofuse.graph import Group, capture
from autofuse.runner.evaluator import Evaluator
from autofuse.runner.profile import KernelEvent, fusion_kinds, instruction_nodes, profile_program, program_kernels, scoped
from autofuse.runner.protocol import ProfileRequest, XlaKernel
from autofuse.tables import format_phases
from autofuse.tuning.job import distinct_candidates, search_spaces
from autofuse.tuning.partition import Candidate
from autofuse.tuning.program_costs import ProgramCosts, take_profile
from autofuse.tuning.scheduler import contenders, modelled_saving, phase1_order, time_at_stake
from autofuse.tuning.select import best_cover, group_savings, savings_plan


def _norm_matmul_gelu(x, w, g):
    xf = x.astype(jnp.float32)
    mean = xf.mean(-1, keepdims=True)
    h = ((xf - mean) * jax.lax.rsqrt(((xf - mean) ** 2).mean(-1, keepdims=True) + 1e-5) * g).astype(jnp.bfloat16)
    return jax.nn.gelu(h @ w, approximate=True)


def _inputs():
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    return (jax.random.normal(k[0], (64, 32), jnp.bfloat16), jax.random.normal(k[1], (32, 48), jnp.bfloat16),
            jax.random.normal(k[2], (32,), jnp.float32))


def test_each_compiled_instruction_names_the_program_nodes_it_computes():
    """The program compiled with a name scope per node: every instruction XLA launches says which nodes it computes,
    through the computations it calls (a fusion's body), and the scoped program computes what the program does."""
    args = _inputs()
    g = capture(_norm_matmul_gelu, *args)
    compiled = jax.jit(scoped(g)).lower(*args).compile()
    nodes = instruction_nodes(compiled.as_text())
    seen = set().union(*nodes.values())
    assert seen <= {n.id for n in g.nodes}
    for prim in ("dot_general", "tanh", "reduce_sum", "rsqrt"):  # the compute of every kind reaches some instruction
        assert {n.id for n in g.nodes if n.name == prim} <= seen, prim
    (dot,) = [n.id for n in g.nodes if n.name == "dot_general"]
    assert any(dot in ids for ids in nodes.values())
    assert any(len(ids) > 2 for ids in nodes.values())  # a fusion: several nodes in one launch
    assert jnp.allclose(compiled(*args)[0].astype(jnp.float32), jax.jit(_norm_matmul_gelu)(*args).astype(jnp.float32))


def test_an_instruction_holds_the_nodes_of_the_computations_it_calls_transitively():
    text = """HloModule m

%add_comp (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b), metadata={op_name="jit(run)/autofuse_n7/reduce_sum"}
}

%fused_computation (p: f32[8,4]) -> f32[8] {
  %p = f32[8,4]{1,0} parameter(0)
  %m = f32[8,4]{1,0} multiply(%p, %p), metadata={op_name="jit(run)/autofuse_n5/integer_pow"}
  %z = f32[] constant(0)
  ROOT %r = f32[8]{0} reduce(%m, %z), dimensions={1}, to_apply=%add_comp
}

ENTRY %main (x: f32[8,4]) -> f32[8] {
  %x = f32[8,4]{1,0} parameter(0)
  %cp = f32[8,4]{1,0} copy(%x)
  ROOT %fusion.3 = f32[8]{0} fusion(%cp), kind=kLoop, calls=%fused_computation, metadata={op_name="jit(run)/autofuse_n12/x"}
}
"""
    nodes = instruction_nodes(text)
    assert nodes["fusion.3"] == frozenset({5, 7, 12})
    assert nodes["cp"] == frozenset() and nodes["m"] == frozenset({5})


def test_kernel_launches_are_summed_per_call_by_the_instruction_that_launched_them():
    """Two calls traced: a fusion launched once a call, a library GEMM whose instruction the module's text does not
    name (its event's own scope does), a memset of no instruction; each kernel's time is per call, longest first."""
    ev = lambda kernel, ns, **stats: KernelEvent(kernel, 0.0, ns, stats)  # noqa: E731
    events = [ev("loop_add_fusion_3", 2e6, hlo_op="loop_add_fusion.3"), ev("loop_add_fusion_3", 4e6, hlo_op="loop_add_fusion.3"),
              ev("nvjet_sm90_gemm", 10e6, hlo_op="cublas-lt-matmul.2", name="jit(run)/autofuse_n7/dot_general"),
              ev("nvjet_sm90_gemm", 10e6, hlo_op="cublas-lt-matmul.2", name="jit(run)/autofuse_n7/dot_general"),
              ev("Memset 0", 1e6), ev("Memset 0", 1e6)]
    kernels = program_kernels(events, {"loop_add_fusion.3": frozenset({3, 4})}, calls=2)
    assert kernels == [XlaKernel("cublas-lt-matmul.2", 10.0, frozenset({7})), XlaKernel("loop_add_fusion.3", 3.0, frozenset({3, 4})),
                       XlaKernel("Memset 0", 1.0, frozenset())]


def test_a_group_is_credited_the_kernels_it_holds_and_what_it_saves_of_those_it_cuts():
    """At GPT-2's MLP shapes, XLA running the GEMM with GELU as one kernel (a Triton GEMM fusion, 1.5 ms) and the
    norm as another: a group holding every node of a kernel is credited its time; one holding the GEMM alone most
    of the fusion's (what is left reads and writes [4096, 4096] once, a fraction of the GEMM's roofline); one holding
    some of GELU's ops next to nothing (what is left still runs the GEMM and now reads what the group wrote); one
    holding the norm's first half less than nothing."""
    args = (jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16), jax.ShapeDtypeStruct((1024, 4096), jnp.bfloat16),
            jax.ShapeDtypeStruct((1024,), jnp.float32))
    g = capture(_norm_matmul_gelu, *args)
    (dot,) = [n.id for n in g.nodes if n.name == "dot_general"]
    before = frozenset(n.id for n in g.nodes if n.id < dot)
    after = frozenset(n.id for n in g.nodes if n.id > dot)
    costs = ProgramCosts((XlaKernel("gemm_fusion", 1.5, after | {dot}), XlaKernel("norm", 0.4, before),
                          XlaKernel("memset", 0.01, frozenset())), g)
    assert costs.node_ms[dot] == pytest.approx(1.5 / (len(after) + 1))
    assert costs.credit_ms(after | {dot}) == pytest.approx(1.5) and costs.credit_ms(before | after | {dot}) == pytest.approx(1.9)
    assert 0.5 * 1.5 < costs.credit_ms({dot}) < 1.5
    some = sorted(after)[1:4]
    assert costs.credit_ms(some) < 0.01 * 1.5
    (rsqrt,) = [n.id for n in g.nodes if n.name == "rsqrt"]
    first_half = {n for n in before if n < rsqrt}
    assert costs.credit_ms(first_half) < 0  # the norm's first half: the rest reads float32 x - mean
    # XLA's time of a group alone bounds what it is credited of the kernels it cuts, never of those it holds whole
    assert costs.credit_ms({dot}, alone_ms=0.2) == pytest.approx(0.2)
    assert costs.credit_ms(after | {dot}, alone_ms=0.1) == pytest.approx(1.5)
    assert costs.credit_ms(first_half, alone_ms=5.0) == costs.credit_ms(first_half)
    assert costs.fused_ms(after | {dot}, 1.2) == pytest.approx(1.2)
    assert costs.fused_ms(some, 0.1) == pytest.approx(0.1 + costs.xla_ms(some) - costs.credit_ms(some))
    assert costs.saving_ms([after | {dot}, {dot}], 1.0) == pytest.approx((1.5 + costs.credit_ms({dot})) / 2 - 1.0)
    assert (costs.total_ms, costs.attributed_ms) == (pytest.approx(1.91), pytest.approx(1.9))


def test_a_contraction_an_xla_loop_or_reduction_fusion_names_is_read_there_not_computed():
    """XLA's cuBLAS GEMM (1.0 ms) and an input fusion of GELU after it (0.5 ms) whose metadata names the dot too (an
    instruction in it carries the dot's scope, as the GELU backward's fusion does in GPT-2's step): the fusion only
    reads the product, so a group of GELU's ops holds the whole fusion (credited 0.5, not a cut whose remainder the
    model prices as running the GEMM). A Triton GEMM fusion (kCustom) computes its dot."""
    args = (jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16), jax.ShapeDtypeStruct((1024, 4096), jnp.bfloat16),
            jax.ShapeDtypeStruct((1024,), jnp.float32))
    g = capture(_norm_matmul_gelu, *args)
    (dot,) = [n.id for n in g.nodes if n.name == "dot_general"]
    after = frozenset(n.id for n in g.nodes if n.id > dot)
    costs = ProgramCosts((XlaKernel("custom-call.11", 1.0, frozenset({dot})),
                          XlaKernel("input_add_reduce_fusion.1", 0.5, after | {dot}, "kInput")), g)
    assert costs.computed == (frozenset({dot}), after)
    assert costs.node_ms[dot] == pytest.approx(1.0) and costs.xla_ms(after) == pytest.approx(0.5)
    assert costs.credit_ms(after) == pytest.approx(0.5) and costs.credit_ms(after | {dot}) == pytest.approx(1.5)
    assert costs.credit_parts(after | {dot}) == [(costs.kernels[0], True, 1.0), (costs.kernels[1], True, 0.5)]
    unknown = ProgramCosts((XlaKernel("custom-call.11", 1.0, frozenset({dot})), XlaKernel("fusion.1", 0.5, after | {dot})), g)
    assert unknown.computed[1] == after | {dot} and unknown.credit_ms(after) < 0.5  # (as it was priced before)
    triton = ProgramCosts((XlaKernel("gemm_fusion_dot.3", 1.5, after | {dot}, "kCustom"),), g)
    assert triton.computed == (after | {dot},) and triton.credit_ms(after) < 0.1 * 1.5


def test_fusion_instructions_are_read_with_their_kind():
    text = """HloModule m

ENTRY %main (x: f32[8,4]) -> f32[8] {
  %x = f32[8,4]{1,0} parameter(0)
  %cp = f32[8,4]{1,0} copy(%x)
  %loop_add_fusion.3 = f32[8,4]{1,0} fusion(%cp), kind=kLoop, calls=%fused_a, metadata={op_name="jit(run)/autofuse_n12/x"}
  %gemm_fusion_dot.2 = f32[8,8]{1,0} fusion(%cp, %cp), kind=kCustom, calls=%fused_b, backend_config={"kind":"__triton_gemm"}
  ROOT %input_reduce_fusion = f32[8]{0} fusion(%loop_add_fusion.3), kind=kInput, calls=%fused_c
}
"""
    assert fusion_kinds(text) == {"loop_add_fusion.3": "kLoop", "gemm_fusion_dot.2": "kCustom", "input_reduce_fusion": "kInput"}
    ev = KernelEvent("loop_add_fusion_3", 0.0, 2e6, {"hlo_op": "loop_add_fusion.3"})
    assert program_kernels([ev], {"loop_add_fusion.3": frozenset({12})}, 1, fusion_kinds(text)) == [
        XlaKernel("loop_add_fusion.3", 2.0, frozenset({12}), "kLoop")]


def _priced(times: dict[str, float]):
    """The norm -> GEMM -> GELU program's candidates, each with XLA's time alone 1.0 ms and a fused best of
    `times[kind]` for the kinds named ("whole": the GEMM with its normalised operand and all of GELU, "gelu": a
    group of GELU's ops that is not all of them), and a profile where XLA runs four kernels: the norm's statistics
    (0.3 ms), its normalisation (0.2), the GEMM (1.0) and GELU (0.5)."""
    args = _inputs()
    g = capture(_norm_matmul_gelu, *args)
    by_sig, cands = distinct_candidates(g)
    (dot,) = [n.id for n in g.nodes if n.name == "dot_general"]
    after = {n.id for n in g.nodes if n.id > dot}
    whole = min((r for r in cands if r.template == "matmul" and set(r.nodes) >= after), key=lambda r: len(r.nodes))
    prologue = set(whole.nodes) - after - {dot}
    part = next(r for r in cands if set(r.nodes) < after and len(r.nodes) > 1)
    costs = ProgramCosts((XlaKernel("stats", 0.3, frozenset(n.id for n in g.nodes if n.id < dot) - prologue),
                          XlaKernel("normalise", 0.2, frozenset(prologue)), XlaKernel("gemm", 1.0, frozenset({dot})),
                          XlaKernel("gelu", 0.5, frozenset(after))), g)
    for r in cands:
        r.xla_ms, r.best_ms, r.best_config = 1.0, None, None
    for r, kind in ((whole, "whole"), (part, "gelu")):
        if kind in times:
            r.best_ms, r.best_config = times[kind], {}
    return g, by_sig, cands, costs, whole, part


def test_a_candidate_not_timed_alone_is_priced_no_higher_than_the_models_xla_time_of_it():
    """A group that cuts a large kernel, not timed alone yet, is credited no more than the model's XLA time of it alone
    (then its own time alone, once measured): not the model's share of the kernel it cuts, which sent phase 1 to
    fourteen variants of GPT-2's first layer norm priced 1.56 ms each (0.07-0.14 ms alone)."""
    g = capture(_norm_matmul_gelu, jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16), jax.ShapeDtypeStruct((1024, 4096), jnp.bfloat16),
                jax.ShapeDtypeStruct((1024,), jnp.float32))
    by_sig, cands = distinct_candidates(g)
    (dot,) = [n.id for n in g.nodes if n.name == "dot_general"]
    fusion = frozenset(n.id for n in g.nodes if n.id >= dot)  # XLA's GEMM with all of GELU, 150 ms (say)
    costs = ProgramCosts((XlaKernel("gemm_fusion", 150.0, fusion),), g)
    cut = next(r for r in cands if r.template == "matmul")
    spaces = search_spaces(by_sig, cands, costmodel.H200)
    by_sig = {**by_sig, cut.signature: [Candidate(Group.of(g, [dot]), "matmul", None)]}  # its instance: the GEMM alone
    cut.xla_ms = None
    costs.price([cut], by_sig)
    unbounded = cut.program_xla_ms
    assert unbounded > 50.0  # most of the kernel it cuts, on the model's word alone
    model_alone = spaces[cut.signature].xla_model_ms
    costs.price([cut], by_sig, spaces)
    assert cut.program_xla_ms == pytest.approx(costs.credit_ms({dot}, model_alone)) and cut.program_xla_ms <= model_alone < 1.0
    cut.xla_ms = 0.5  # timed alone: its own time bounds it, whatever the model said
    costs.price([cut], by_sig, {cut.signature: replace(spaces[cut.signature], xla_model_ms=1e-6)})
    assert cut.program_xla_ms == pytest.approx(0.5)


def test_the_cover_priced_by_the_profile_takes_what_saves_in_the_program():
    """Alone, a group of some of GELU's ops saved 0.9 ms against XLA's 1.0, and the GEMM with its normalised operand
    and GELU (1.2 ms) looked to save less; in the program XLA spends 1.7 ms on the latter's nodes and runs GELU's
    kernel whatever part of it a group takes (now reading what the part writes): the part saves nothing, the whole
    chain 0.5 ms."""
    g, by_sig, cands, costs, whole, part = _priced({"whole": 1.2, "gelu": 0.1})
    assert [set(fg.nodes) for fg in savings_plan(g, by_sig, cands).groups] == [set(part.nodes)]  # priced alone
    cover = best_cover(g, by_sig, cands, costmodel.H200, "device", costs=costs)
    assert [set(fg.nodes) for fg in cover.plan.groups] == [set(whole.nodes)]
    assert cover.baseline_ms == pytest.approx(2.0) and cover.tuned_ms == pytest.approx(1.5)
    saving = group_savings(cands, by_sig, costs)
    assert saving[whole.signature] == pytest.approx(0.5) and saving[part.signature] <= -0.1
    assert [set(fg.nodes) for fg in savings_plan(g, by_sig, cands, costs=costs).groups] == [set(whole.nodes)]


def test_the_cover_priced_by_the_profile_keeps_xla_where_no_group_saves_there():
    g, by_sig, cands, costs, whole, part = _priced({"whole": 1.8, "gelu": 0.1})
    assert best_cover(g, by_sig, cands, costmodel.H200, "device", costs=costs).plan.is_xla
    assert savings_plan(g, by_sig, cands, costs=costs).is_xla


def test_without_a_gpu_trace_the_selection_prices_groups_alone_and_says_so():
    """On the CPU the program is compiled and traced for real but no kernel is seen: the profile is empty, the
    selection falls back to the times alone, and the run's record (and `show run`) says why."""
    args = _inputs()
    g = capture(_norm_matmul_gelu, *args)
    assert profile_program(g, list(args)) == []
    ev = Evaluator(g, measure="device")
    res = ev.handle(ProfileRequest())
    assert res.ok and res.kernels == () and res.seconds["profile"] > 0

    class Runner:
        call = staticmethod(ev.handle)

    timings: dict = {}
    assert take_profile(Runner(), timings, g) is None
    assert timings["profile"]["error"] == "no kernel of the program's nodes in the trace"
    shown = format_phases({"selection": {"check": 0.1, **timings}})
    assert any("jax.jit's program profiled: failed (no kernel of the program's nodes in the trace)" in line for line in shown)
    model = Evaluator(g, measure="model").handle(ProfileRequest())
    assert model.ok and model.kernels == ()


def test_the_profiled_program_is_compiled_ahead_with_the_first_batch_and_run_once(monkeypatch):
    """A `ProfileRequest` among a batch's items compiles the program the profile runs (beside jax.jit's reference, on
    the batch's threads); the profile then runs that executable, once, and compiles its own where none is left."""
    from autofuse.runner import evaluator as E
    from autofuse.runner.protocol import CompileRequest, ProgramRequest
    from autofuse.tuning.ahead import CompileAhead

    args = _inputs()
    g = capture(_norm_matmul_gelu, *args)
    from autofuse.tuning.job import search_spaces

    by_sig, cands = distinct_candidates(g)
    ahead = CompileAhead(None, cands, search_spaces(by_sig, cands, costmodel.H200, ("triton",)), "device", 4)
    assert ahead.first_compiles()[-2:] == [ProgramRequest(), ProfileRequest()]
    compiled = []
    monkeypatch.setattr(E, "compile_profiled", lambda graph: compiled.append(graph) or jax.jit(scoped(graph)).lower(*args).compile())
    ran = []
    real = E.profile_program
    monkeypatch.setattr(E, "profile_program", lambda graph, inputs, compiled=None: ran.append(compiled) or real(graph, inputs, compiled=compiled))
    ev = Evaluator(g, measure="device")
    res = ev.handle(CompileRequest((ProgramRequest(), ProfileRequest()), 2))
    assert res.ok and res.compiled == 2 and len(compiled) == 1 and "profile" in res.longest
    assert ev.handle(ProfileRequest()).ok and ran[-1] is not None and len(compiled) == 1  # the executable compiled ahead
    assert ev.handle(ProfileRequest()).ok and len(compiled) == 2  # run once: the next compiles its own
    assert Evaluator(g, measure="model").handle(CompileRequest((ProfileRequest(),), 2)).compiled == 0


def test_show_run_says_what_the_profile_saw():
    """The run's record keeps the profile's size and its longest kernels with the operations each computes: `show
    run` names the first few (the report's table of them: test_tune_output)."""
    args = _inputs()
    g = capture(_norm_matmul_gelu, *args)
    (dot,) = [n.id for n in g.nodes if n.name == "dot_general"]
    after = frozenset(n.id for n in g.nodes if n.id > dot)
    costs = ProgramCosts((XlaKernel("cublas-lt-matmul.2", 4.0, frozenset({dot})), XlaKernel("loop_multiply_fusion.3", 1.25, after),
                          XlaKernel("Memset 0", 0.5, frozenset())), g, taken={"profile": 3.25})
    record = costs.summary()
    assert [k["instruction"] for k in record["longest"]] == ["cublas-lt-matmul.2", "loop_multiply_fusion.3", "Memset 0"]
    assert record["longest"][0]["ops"] == "dot_general" and record["longest"][1]["ops"].startswith("mul x")
    shown = format_phases({"selection": {"check": 0.1, "profile": record}})
    assert any("jax.jit's program profiled: 3 kernels, 5.750 ms a call, 5.250 ms of them computing the program's nodes "
               "(the prices of the cover), in 3.25 s" in line for line in shown), shown
    assert any(line.strip().startswith("its longest: cublas-lt-matmul.2 4.000 ms (dot_general); loop_multiply_fusion.3 1.250 ms (mul x")
               for line in shown), shown


def test_the_budget_rule_weighs_defaults_against_xla_in_the_program():
    """Priced by the profile (`ProgramCosts.price`), a group of some of GELU's ops, which XLA's time alone (1.0 ms)
    made the largest modelled saving, is a loss (it saves nothing of GELU's kernel) and phase 1 visits the whole chain first; the
    part is no contender, and what more trials of the chain can save is its best's time."""
    from autofuse.tuning.job import search_spaces

    g, by_sig, cands, costs, whole, part = _priced({})
    spaces = search_spaces(by_sig, cands, costmodel.H200, ("triton",))
    assert modelled_saving(part, spaces[part.signature]) > 0  # alone: XLA's 1.0 ms against a modelled default
    costs.price(cands, by_sig)
    assert whole.program_xla_ms == pytest.approx(1.7) and part.program_xla_ms <= 0.0
    assert modelled_saving(part, spaces[part.signature]) < 0
    order = phase1_order(cands, spaces)
    assert order.index(cands.index(whole)) < order.index(cands.index(part))
    whole.best_ms, part.best_ms = 1.2, 0.1
    whole.best_config = part.best_config = {}
    cover = best_cover(g, by_sig, cands, costmodel.H200, "device", costs=costs)
    chosen = contenders(g, by_sig, cands, costmodel.H200, cover)
    assert cands.index(whole) in chosen and cands.index(part) not in chosen
    assert time_at_stake(whole) == pytest.approx(1.2 * whole.instances)


@pytest.mark.slow
@pytest.mark.parametrize("traced", [False, True], ids=["no-trace", "kernels"])
def test_a_device_job_takes_its_profile_once_and_prices_by_it(monkeypatch, tmp_path, traced):
    """A whole job in device mode (forced on the CPU, where it times for real): the profile is taken once, before the
    trials. Where it saw no kernel (the CPU's trace) its failure is recorded and said by `show run`, and the groups
    are priced by their times alone; where it saw kernels (here one of XLA's, 1 ms, computing every node: its device
    time, the level groups are timed at), its size, its longest kernels and each tuned candidate's price in the
    program are recorded. Either way the job chooses,
    validates and stores its plan."""
    from autofuse.runner.evaluator import Evaluator as Ev
    from autofuse.runner.protocol import ProfileResult
    from autofuse.status import TrialStatus
    from autofuse.store import PlanStore
    from autofuse.tuning import local
    from autofuse.tuning.local import tune_here
    from autofuse.tuning.options import Job, JobOptions
    from benchmarks.workloads import rms_norm
    from tests.dist_programs import rms_norm_inputs

    calls = []

    def profile(self):
        calls.append(1)
        if not traced:
            return real(self)
        return ProfileResult(TrialStatus.OK, (XlaKernel("fusion.1", 1.0, frozenset(n.id for n in self.graph.nodes)),), seconds={"profile": 0.5})

    real = Ev.profile
    monkeypatch.setattr(Ev, "profile", profile)
    monkeypatch.setattr(local, "resolve_measure", lambda measure, has_gpu: "device")
    db = f"sqlite:///{tmp_path}/d.db"
    job = Job.of(trials=2, store=db, quiet=True, backends=("triton",), options=JobOptions(isolate=False))
    report = tune_here(rms_norm, rms_norm_inputs(), {}, job)
    assert calls == [1] and report.measure == "device" and report.validation.ok
    store = PlanStore(db)
    (run,) = store.runs()
    phases = store.get_run(run["id"])["phases"]
    shown = format_phases(phases)
    if traced:
        assert phases["selection"]["profile"]["kernels"] == 1 and phases["selection"]["profile"]["longest"][0]["instruction"] == "fusion.1"
        prices = phases["selection"]["in_program_xla_ms"]
        # the trace's device time as it is: no price above XLA's one kernel
        assert prices and all(v <= 1.0 + 1e-9 for v in prices.values())
        assert any(abs(v - 1.0) < 1e-9 for v in prices.values())  # a group of every node removes XLA's one kernel whole
        assert any("jax.jit's program profiled: 1 kernels, 1.000 ms a call" in line and "scaled" not in line for line in shown), shown
    else:
        assert phases["selection"]["profile"]["error"] == "no kernel of the program's nodes in the trace"
        assert "in_program_xla_ms" not in phases["selection"]
        assert any("jax.jit's program profiled: failed" in line for line in shown)




def test_a_library_gemm_named_by_the_transpose_of_its_product_computes_the_dot():
    """XLA folds a transpose of a GEMM's product into the GEMM's output layout, and the cuBLAS call then carries the
    transpose's name alone (GPT-2's QKV weight gradient in its step): the kernel computes the dot too, so a group
    holding the dot is credited most of it. A fusion or a copy named by a transpose computes no dot it reads."""
    def wgrad(x, dy):
        return (x.T @ dy).T * 2.0

    args = (jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16), jax.ShapeDtypeStruct((4096, 3072), jnp.bfloat16))
    g = capture(wgrad, *args)
    (dot,) = [n.id for n in g.nodes if n.name == "dot_general"]
    layout = frozenset(n.id for n in g.nodes if n.name == "transpose" and n.id > dot)
    assert layout
    costs = ProgramCosts((XlaKernel("custom-call.70", 1.0, layout),), g)
    assert costs.computed == (layout | {dot},)
    assert costs.credit_ms({dot}) > 0.5
    for other in (XlaKernel("loop_transpose_fusion", 0.2, layout, "kLoop"), XlaKernel("copy.3", 0.2, layout)):
        moved = ProgramCosts((other,), g)
        assert moved.computed == (layout,) and moved.credit_ms({dot}) == 0.0
