"""Close calls in the selection: a later plan that beat the fastest so far, but within the noise of each one's timing
against jax.jit, is timed against it head to head (`CompareRequest`), and kept only where it was faster in three
pairs of four; the evaluator answers such a request with the two plans in alternation."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import autofuse
from autofuse.plan import Plan, plan_from_choices
from autofuse.runner.evaluator import COMPARE_PAIRS, Evaluator
from autofuse.runner.protocol import CompareRequest, ComparisonResult, Timing, ValidateRequest, ValidationResult
from autofuse.status import TrialStatus
from autofuse.tables import format_phases
from tests.quick import slow_except
from tests.test_concat_sink import NAME, _args, _candidates, qkv_block
from tests.test_helpers import TWO_PARTS_ARGS, two_parts


def _timing(v: float, spread: float = 0.0) -> Timing:
    return Timing(v, v * (1 - spread), v * (1 + spread), v * (1 - spread), v * (1 + spread / 2), 1, 16)


@pytest.fixture(scope="module")
def tuned():
    """A two-group program tuned on the model, and its graph."""
    rep = autofuse.tune(two_parts, *TWO_PARTS_ARGS, trials=20, seed=0, quiet=True, store=False, isolate=False)
    assert len({g.signature for g in rep.plan.groups}) == 2
    return rep, autofuse.capture(two_parts, *TWO_PARTS_ARGS)


@pytest.mark.parametrize("head_to_head", slow_except([0.97, 0.995, 1.01], "0.995"))
def test_a_later_plan_within_noise_is_kept_only_where_it_wins_head_to_head(tuned, head_to_head) -> None:
    """The chosen plan (both groups) keeps 0.3 of the 1.8 ms they saved alone, so each group is judged alone in the
    program: group a's plan is faster than the chosen one, but within the 2% noise of both timings against jax.jit.
    The two are then timed against each other: a is kept where it won (median ratio 0.97; 0.995, its upper quartile
    above 1: faster in more pairs than not), the chosen plan where it did not (1.01)."""
    from autofuse.tuning.job import distinct_candidates
    from autofuse.tuning.select import Cover
    from autofuse.tuning.validate import validate

    rep, graph = tuned
    a, b = sorted({g.signature for g in rep.plan.groups})
    ms = {frozenset({a, b}): 9.7, frozenset({a}): 9.6, frozenset({b}): 9.9}
    for r in rep.candidates:
        if r.signature in (a, b):
            r.xla_ms = r.best_ms + (1.0 if r.signature == a else 0.8)
    distinct_candidates(graph)
    asked = []

    class Device:
        def call(self, req):
            if isinstance(req, CompareRequest):
                asked.append(tuple(frozenset(g.signature for g in Plan.from_json(j).groups) for j in (req.first_json, req.second_json)))
                return ComparisonResult(TrialStatus.OK, _timing(9.7), _timing(9.6), _timing(head_to_head, 0.02), seconds={"time": 1.0})
            v = ms.get(frozenset(g.signature for g in Plan.from_json(req.plan_json).groups), 10.0)
            return ValidationResult(TrialStatus.OK, 0.0, baseline=_timing(10.0), plan=_timing(v), ratio=_timing(v / 10.0, 0.02))

        def close(self):
            pass

    timings: dict = {}
    out = validate(graph, Cover(rep.plan, 1.0, 0.5), Device(), "device", "two_parts", rep.candidates, 0, 0.0, timings=timings)
    assert asked == [(frozenset({a, b}), frozenset({a}))]  # one close call: the chosen plan first, group a's second
    kept = {g.signature for g in out.plan.groups}
    assert kept == ({a} if head_to_head < 1 else {a, b})
    (record,) = timings["comparisons"]
    assert record["kept"] == ("second" if head_to_head < 1 else "first") and record["pairs"] == 16
    shown = [line for line in format_phases({"selection": timings}) if "close call" in line]
    assert len(shown) == 1 and ("kept the later" if head_to_head < 1 else "kept the earlier") in shown[0]


@pytest.mark.slow
def test_the_evaluator_times_two_validated_plans_against_each_other() -> None:
    """On this machine's device (the CPU): the program under jax.jit and its plan with the QKV gradient's
    concatenation read in parts, the second validated before (held compiled), timed in alternation over at least
    COMPARE_PAIRS pairs."""
    fn = jax.grad(qkv_block, argnums=(0, 1, 2))
    graph, (c,) = _candidates(fn, _args(jnp.float32))
    fused = plan_from_choices(graph, [(c.group, NAME, {"accumulate": 0, "contracted": 0, "backend": "xla_ops"})])
    xla = Plan(graph.fingerprint, ())
    ev = Evaluator(graph, measure="device")
    assert ev.handle(ValidateRequest(fused.to_json())).ok
    res = ev.handle(CompareRequest(xla.to_json(), fused.to_json()))
    assert res.ok and res.ratio.repeats >= COMPARE_PAIRS and res.first.median_ms > 0 and res.second.median_ms > 0
    assert res.ratio.q1_ms <= res.ratio.median_ms <= res.ratio.q3_ms
    assert res.second_faster == (res.ratio.median_ms < 1.0)
    model = Evaluator(graph, measure="model").handle(CompareRequest(xla.to_json(), fused.to_json()))
    assert model.ok and model.ratio is None and not model.second_faster  # nothing to time on the model


@pytest.mark.parametrize("b_alone, judged", [(0.05, False), (0.8, True)])
def test_a_group_saving_less_alone_than_half_the_noise_is_not_judged_alone_in_the_program(tuned, b_alone, judged) -> None:
    """The chosen plan (both groups, timed with a spread that makes its noise ~0.29 ms of a 10 ms program) keeps 0.3
    of what they saved alone, so each group is judged in the program on its own; group b, which saved 0.05 ms alone,
    could not tell its saving there from that noise: it is not judged (the plan's reason says so), where at 0.8 ms it
    is. GPT-2's forward spent 10 s of its selection on two such groups."""
    from autofuse.tuning.job import distinct_candidates
    from autofuse.tuning.select import Cover
    from autofuse.tuning.validate import validate

    rep, graph = tuned
    a, b = sorted({g.signature for g in rep.plan.groups})
    for r in rep.candidates:
        if r.signature in (a, b):
            r.xla_ms = r.best_ms + (1.0 if r.signature == a else b_alone)
    distinct_candidates(graph)
    asked: list[frozenset] = []

    class Device:
        def call(self, req):
            if isinstance(req, CompareRequest):
                return ComparisonResult(TrialStatus.OK, _timing(9.7), _timing(9.6), _timing(1.01, 0.02), seconds={"time": 1.0})
            sigs = frozenset(g.signature for g in Plan.from_json(req.plan_json).groups)
            asked.append(sigs)
            v = {frozenset({a, b}): 9.7, frozenset({a}): 9.6}.get(sigs, 10.0)
            return ValidationResult(TrialStatus.OK, 0.0, baseline=_timing(10.0), plan=_timing(v), ratio=_timing(v / 10.0, 0.02))

        def close(self):
            pass

    timings: dict = {}
    validate(graph, Cover(rep.plan, 1.0, 0.5), Device(), "device", "two_parts", rep.candidates, 0, 0.0, timings=timings)
    assert asked[:2] == [frozenset({a, b}), frozenset({a})]  # the chosen plan, then the larger saver alone
    assert (frozenset({b}) in asked) == judged
    shown = [line for line in format_phases({"selection": timings}) if "not judged alone" in line]
    if judged:
        assert "not_judged" not in timings and shown == []
    else:
        assert timings["not_judged"]["groups"] == [{"instances": 1, "alone_ms": 0.05}] and 0.05 < timings["not_judged"]["floor_ms"]
        assert len(shown) == 1 and "0.050 ms (1 instance)" in shown[0]
