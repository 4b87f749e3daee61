"""Plan JSON: exact round trips, and malformed or mismatched plans rejected with PlanError and a useful message."""
from __future__ import annotations

import copy
import json

import jax
import jax.numpy as jnp
import pytest

import autofuse
from autofuse.graph import Group
from autofuse.plan import SCHEMA_VERSION, FusedGroup, Plan, PlanError, bind_plan, executor, plan_from_choices
from autofuse.tuning.select import default_plan
from benchmarks.workloads import layer_norm, log_relu_bias, softmax

S = jax.ShapeDtypeStruct
F32 = jnp.float32


def chain(x, b):
    h = jnp.tanh(x * 2.0 + b)
    h = jnp.cumsum(h, axis=-1)
    return jax.nn.softmax(h, axis=-1)


@pytest.fixture(scope="module")
def graph():
    return autofuse.capture(chain, S((16, 96), F32), S((96,), F32))


@pytest.fixture(scope="module")
def plan(graph):
    p = default_plan(graph)
    assert len(p.groups) == 2  # an elementwise group and a row_reduce group around the cumsum
    return p


def _d(plan: Plan) -> dict:
    return copy.deepcopy(plan.to_dict())


def _rejects(data, *fragments):
    text = data if isinstance(data, (str, bytes)) else json.dumps(data)
    with pytest.raises(PlanError) as e:
        Plan.from_json(text)
    msg = str(e.value)
    for f in fragments:
        assert f in msg, msg
    return msg


# ---------------------------------------------------------------------------
# Round trips.
def test_round_trip_default_plans():
    for fn, specs in [
        (log_relu_bias, [S((37, 300), F32), S((300,), F32)]),
        (softmax, [S((37, 300), jnp.bfloat16)]),
        (layer_norm, [S((8, 64), F32), S((64,), F32), S((64,), F32)]),
        (chain, [S((16, 96), F32), S((96,), F32)]),
    ]:
        p = default_plan(autofuse.capture(fn, *specs))
        assert p.groups
        text = p.to_json()
        back = Plan.from_json(text)
        assert back == p
        assert back.to_json() == text
        assert Plan.from_json(text.encode()) == p  # bytes too
        assert json.loads(text)["schema_version"] == SCHEMA_VERSION


def test_round_trip_keeps_every_field():
    p = Plan(
        fingerprint="0123456789abcdef0123456789abcdef",
        groups=(
            FusedGroup((0, 1, 2), "row_reduce", {"block_rows": 4, "block_cols": 64, "num_warps": 4, "num_stages": 2}, "sig-a"),
            FusedGroup((5, 7), "elementwise", {"block_rows": 1, "block_cols": 1024, "num_warps": 8, "num_stages": 1, "note": "x", "f": 0.5, "flag": True}, "sig-b"),
            FusedGroup((9, 10), "matmul", {"block_m": 128, "block_n": 128, "block_k": 64, "max_concurrent_steps": 4}, "sig-c", "mosaic_gpu"),
        ),
        provenance={"measure": "device", "device": "NVIDIA H200", "trials": 40, "nested": {"a": [1, 2.5, None]}},
    )
    text = p.to_json()
    back = Plan.from_json(text)
    assert back == p and back.to_json() == text
    assert back.groups[1].config["flag"] is True and back.groups[1].config["f"] == 0.5
    assert back.groups[2].backend == "mosaic_gpu" and back.backends == ("mosaic_gpu", "triton")
    assert Plan.from_json(Plan(p.fingerprint).to_json()) == Plan(p.fingerprint)  # the XLA plan
    assert Plan.from_json(Plan(p.fingerprint).to_json()).is_xla


def test_round_tripped_plan_runs(graph, plan):
    back = Plan.from_json(plan.to_json())
    fused = autofuse.jit(chain, plan=back, on_miss="error")
    x = jnp.linspace(-2, 2, 16 * 96, dtype=F32).reshape(16, 96)
    b = jnp.linspace(0, 1, 96, dtype=F32)
    assert jnp.allclose(fused(x, b), jax.jit(chain)(x, b), rtol=1e-5, atol=1e-6)
    assert fused.last_status.startswith("plan:")


# ---------------------------------------------------------------------------
# Malformed plans.
def test_not_json():
    _rejects("{not json", "not valid JSON")
    _rejects("", "not valid JSON")
    _rejects("[1, 2]", "JSON object")
    _rejects("null", "JSON object")


def test_unknown_schema_version(plan):
    for v in (SCHEMA_VERSION + 1, 0, "1", None, 1.5, True, [1]):
        d = _d(plan)
        d["schema_version"] = v
        _rejects(d, "schema_version")
    d = _d(plan)
    del d["schema_version"]
    _rejects(d, "schema_version")


def test_unknown_template(plan):
    d = _d(plan)
    d["groups"][0]["template"] = "matmul_magic"
    msg = _rejects(d, "plan.groups[0]", "matmul_magic")
    assert "row_reduce" in msg and "elementwise" in msg  # says which templates exist


def test_overlapping_groups(plan):
    d = _d(plan)
    d["groups"][1]["nodes"] = d["groups"][1]["nodes"] + [d["groups"][0]["nodes"][0]]
    _rejects(d, "plan.groups[1]", "overlaps")
    d = _d(plan)
    d["groups"].append(copy.deepcopy(d["groups"][0]))
    _rejects(d, f"plan.groups[{len(d['groups']) - 1}]", "overlaps")


@pytest.mark.parametrize("nodes", [[-1], [0, -3], [], "0,1", [0.0, 1], [True], None], ids=repr)
def test_bad_node_ids(plan, nodes):
    d = _d(plan)
    d["groups"][0]["nodes"] = nodes
    _rejects(d, "plan.groups[0].nodes")


def test_extra_keys(plan):
    d = _d(plan)
    d["code"] = "import os"
    _rejects(d, "unknown plan keys", "code")
    d = _d(plan)
    d["groups"][0]["kernel_source"] = "def k(): ..."
    _rejects(d, "plan.groups[0]", "exactly")
    d = _d(plan)
    del d["groups"][0]["signature"]
    _rejects(d, "plan.groups[0]", "exactly")


def test_other_malformed_fields(plan):
    for key, value, frag in [
        ("fingerprint", "", "fingerprint"),
        ("fingerprint", 123, "fingerprint"),
        ("backend", "triton", "backend"),  # a version 1 key
        ("groups", {"0": {}}, "groups"),
        ("provenance", [1], "provenance"),
    ]:
        d = _d(plan)
        d[key] = value
        _rejects(d, frag)
    d = _d(plan)
    d["groups"][0]["config"] = {"block_rows": [4, 8]}
    _rejects(d, "plan.groups[0].config")
    d = _d(plan)
    d["groups"][0]["signature"] = 7
    _rejects(d, "plan.groups[0].signature")
    d = _d(plan)
    d["groups"][0]["backend"] = "mosaic_tpu"
    _rejects(d, "plan.groups[0].backend", "mosaic_tpu")


def test_version_1_plans_still_load_and_run_on_triton(graph, plan):
    d = _d(plan)
    d["schema_version"], d["backend"] = 1, "triton"
    for g in d["groups"]:
        del g["backend"]
    old = Plan.from_dict(d)
    assert old.groups == plan.groups and {g.backend for g in old.groups} == {"triton"}
    assert len(bind_plan(graph, old)) == len(plan.groups)


# ---------------------------------------------------------------------------
# Well-formed plans that do not fit the program.
def _bind_rejects(graph, plan: Plan, *fragments):
    for f in (lambda: bind_plan(graph, plan), lambda: executor(graph, plan)):
        with pytest.raises(PlanError) as e:
            f()
        for frag in fragments:
            assert frag in str(e.value), str(e.value)


def test_wrong_fingerprint(graph, plan):
    other = autofuse.capture(chain, S((16, 97), F32), S((97,), F32))
    assert other.fingerprint != graph.fingerprint
    _bind_rejects(other, plan, plan.fingerprint, other.fingerprint)
    # and through autofuse.jit in strict mode
    fused = autofuse.jit(chain, plan=plan, on_miss="error")
    with pytest.raises(PlanError, match=plan.fingerprint):
        fused(jnp.ones((16, 97), F32), jnp.ones((97,), F32))


def test_signature_mismatch(graph, plan):
    d = _d(plan)
    d["groups"][0]["signature"] = "0" * 20
    _bind_rejects(graph, Plan.from_dict(d), "does not match the program", "0" * 20)
    # Same fingerprint, nodes shifted onto other equations: the recorded signature no longer fits.
    d = _d(plan)
    ew = next(g for g in d["groups"] if g["template"] == "elementwise")
    ew["nodes"] = ew["nodes"][1:]
    _bind_rejects(graph, Plan.from_dict(d), "does not match the program")


def test_node_out_of_range(graph, plan):
    d = _d(plan)
    d["groups"][0]["nodes"] = [len(graph.nodes) + 5]
    _bind_rejects(graph, Plan.from_dict(d), str(len(graph.nodes) + 5), str(len(graph.nodes)))


def test_config_missing_a_parameter(graph, plan):
    for k in ("block_cols", "num_warps"):
        d = _d(plan)
        del d["groups"][1]["config"][k]
        _bind_rejects(graph, Plan.from_dict(d), "config lacks", k)


def test_a_plan_that_does_not_bind_fails_validation_as_a_compile_error(graph, plan):
    """The job's validation of a plan that cannot be built says so (compile_error, with its reason), where it
    once ran the whole program's check against it and recorded wrong_result: a plan's config lacking a parameter
    read as a numerics failure in a training step's record."""
    from autofuse.runner.evaluator import Evaluator
    from autofuse.runner.protocol import ValidateRequest
    from autofuse.status import TrialStatus

    d = _d(plan)
    del d["groups"][1]["config"]["num_warps"]
    res = Evaluator(graph, measure="model").handle(ValidateRequest(Plan.from_dict(d).to_json()))
    assert res.status is TrialStatus.COMPILE_ERROR
    assert res.error.startswith("PlanError: ") and "config lacks ['num_warps']" in res.error, res.error
    assert Evaluator(graph, measure="model").handle(ValidateRequest(plan.to_json())).ok


def test_template_that_does_not_fit_the_group(graph, plan):
    d = _d(plan)
    rr = next(g for g in d["groups"] if g["template"] == "row_reduce")
    rr["template"] = "elementwise"  # a group with reductions cannot run as a map
    with pytest.raises(PlanError, match="does not match group"):
        executor(graph, Plan.from_dict(d))


@pytest.mark.parametrize("value", [0, -4, "wide", 2.5, True, None, float("inf")], ids=repr)
def test_config_value_not_a_positive_integer(graph, plan, value):
    d = _d(plan)
    d["groups"][0]["config"]["block_cols"] = value
    try:
        p = Plan.from_dict(d)
    except PlanError as e:  # rejected on load (non-scalar values) ...
        assert "config" in str(e)
        return
    _bind_rejects(graph, p, "block_cols", "not one of the search space")  # ... or when bound, never a crash inside a template


_EW = {"block_rows": 8, "block_cols": 64, "num_warps": 4, "num_stages": 1}


def test_non_convex_group_rejected():
    # exp -> cumsum -> exp: a group of both exps would have to run before and after the cumsum.
    def f(x):
        return jnp.exp(jnp.cumsum(jnp.exp(x), axis=-1))

    g = autofuse.capture(f, S((8, 64), F32))
    assert [n.name for n in g.nodes] == ["exp", "cumsum", "exp"]
    p = plan_from_choices(g, [(Group.of(g, [0, 2]), "elementwise", _EW)])
    _bind_rejects(g, Plan.from_json(p.to_json()), "cannot be ordered", "not convex")
    # Each exp alone is fine.
    ok = plan_from_choices(g, [(Group.of(g, [0]), "elementwise", _EW), (Group.of(g, [2]), "elementwise", _EW)])
    assert len(bind_plan(g, ok)) == 2


def test_mutually_dependent_groups_rejected():
    # a=exp(x), b=exp(y); c=a+b, d=a*b. Groups {a,d} and {b,c} are each convex, but each needs the other's output.
    def f(x, y):
        a, b = jnp.exp(x), jnp.exp(y)
        return a + b, a * b

    g = autofuse.capture(f, S((8, 64), F32), S((8, 64), F32))
    assert [n.name for n in g.nodes] == ["exp", "exp", "add", "mul"]
    p = plan_from_choices(g, [(Group.of(g, [0, 3]), "elementwise", _EW), (Group.of(g, [1, 2]), "elementwise", _EW)])
    _bind_rejects(g, p, "cannot be ordered")
    ok = plan_from_choices(g, [(Group.of(g, [0, 1, 2, 3]), "elementwise", _EW)])
    assert len(bind_plan(g, ok)) == 1


def test_repeated_layers_lower_their_kernel_once():
    """Groups of the same computation and config share one jitted kernel: the lowered program calls one kernel
    (a `pallas_call` custom call) at every layer rather than lowering one per layer."""
    from autofuse.runner.evaluator import _program_structs, export_for_cuda

    def layers(x, g):
        for _ in range(4):
            x = x + jax.nn.softmax(x * g, axis=-1)
        return x

    graph = autofuse.capture(layers, S((64, 256), F32), S((256,), F32))
    (whole,) = default_plan(graph).groups  # one row_reduce group over all three layers: split it into one per layer
    n = len(graph.nodes) // 4
    groups = tuple(FusedGroup(tuple(range(k * n, (k + 1) * n)), "row_reduce", whole.config, Group.of(graph, range(k * n, (k + 1) * n)).signature)
                   for k in range(4))
    assert len(graph.nodes) == 4 * n and len({fg.signature for fg in groups}) == 1
    plan = Plan(graph.fingerprint, groups, {})
    run = executor(graph, plan, interpret=False)
    text = export_for_cuda(lambda *a: run(a), _program_structs(graph)).mlir_module()
    # one kernel lowered for all four layers (JAX lowers the call on the program's own argument apart: at most two)
    assert text.count("stablehlo.custom_call") <= 2 and text.count(" = call @") == 4, text.count("stablehlo.custom_call")
    x = jnp.linspace(-1, 1, 64 * 256, dtype=F32).reshape(64, 256)
    g = jnp.linspace(0.5, 1.5, 256, dtype=F32)
    run = executor(graph, plan, interpret=True)
    assert jnp.allclose(jax.jit(lambda *a: run(a))(x, g)[0], jax.jit(layers)(x, g), atol=1e-5)
