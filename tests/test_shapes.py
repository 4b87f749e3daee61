"""Shape-generic deploy: a plan tuned at one batch size serves programs of the same structure at other sizes, after
one check against jax.jit per shape remembered in the store; shapes where a config no longer fits are refused."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

import autofuse
from autofuse.store.db import HEAD_REVISION
from autofuse.cli import main
from autofuse.device import device_info, software
from autofuse.graph import Group, qualified_name
from autofuse.kernels import TEMPLATES
from autofuse.plan import plan_from_choices
from autofuse.shapes import adapt
from autofuse.signatures import short_aval
from autofuse.store import PlanStore
from tests.shape_programs import norm, norm_specs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TUNED_ROWS = 16


def _save(url: str, rows: int = TUNED_ROWS, block_rows: int = 16, structure: bool = True) -> int:
    """A row_reduce plan of `norm` at [rows, 128] with block_rows, stored as the current plan; its id."""
    graph = autofuse.capture(norm, *norm_specs(rows))
    group = Group.of(graph, [n.id for n in graph.nodes])
    tmpl = TEMPLATES["row_reduce"]
    config = {**tmpl.default_config(tmpl.match(group)), "block_rows": block_rows}
    plan = plan_from_choices(graph, [(group, "row_reduce", config)], {"measure": "model"})
    store = PlanStore(url)
    dev = device_info()
    pid = store.program(graph.fingerprint, "norm", graph.signature(), len(graph.nodes), function=qualified_name(norm),
                        structure=graph.structure if structure else None)
    did = store.device(dev["name"], compute_capability=dev["compute_capability"], sm_count=dev["sm_count"], memory_bytes=dev["memory_bytes"])
    return store.save_plan(pid, did, store.software(**software()), plan.to_dict(), measured_ms=1.0, baseline_ms=1.5, speedup=1.5,
                           measure="model", tolerance={}, max_error=0.0)


def _args(rows: int, seed: int = 0) -> list[jax.Array]:
    rng = np.random.default_rng(seed)
    return [jax.numpy.asarray(rng.standard_normal(s.shape), s.dtype) for s in norm_specs(rows)]


def _close(a, b) -> None:
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)


def _checks(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "checking it once against jax.jit" in r.getMessage()]


SERVED = (32, 64, 24)  # 24: not a power of two; next_pow2(24) = 32 >= block_rows


def _fresh_process(url: str, rows: tuple[int, ...], readonly: bool = False) -> list[str]:
    """Each shape's last_status in a new process, then the warnings it logged."""
    store = f"autofuse.PlanStore({url!r}, readonly=True)" if readonly else repr(url)
    script = textwrap.dedent(f"""
        import logging, jax, numpy as np, autofuse
        from tests.shape_programs import norm, norm_specs
        logging.basicConfig(level=logging.WARNING, format="LOG %(message)s")
        f = autofuse.jit(norm, store={store})
        for rows in {rows!r}:
            args = [jax.numpy.asarray(np.random.default_rng(rows).standard_normal(s.shape), s.dtype) for s in norm_specs(rows)]
            np.testing.assert_allclose(np.asarray(f(*args)), np.asarray(jax.jit(norm)(*args)), rtol=2e-5, atol=2e-5)
            print("STATUS", f.last_status)
    """)
    out = subprocess.run([sys.executable, "-c", script], check=False, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return [line for line in out.stdout.splitlines() if line.startswith("STATUS")] + \
        [line for line in out.stderr.splitlines() if line.startswith("LOG")]


def test_structure_ignores_sizes_only() -> None:
    a, b = (autofuse.capture(norm, *norm_specs(r)) for r in (8, 48))
    assert a.fingerprint != b.fingerprint and a.structure == b.structure
    wider = autofuse.capture(norm, jax.ShapeDtypeStruct((8, 256), np.float32), jax.ShapeDtypeStruct((256,), np.float32))
    assert wider.structure != a.structure  # the mean divides by the row length: another computation
    half = autofuse.capture(norm, *(jax.ShapeDtypeStruct(s.shape, np.float16) for s in norm_specs(8)))
    assert half.structure != a.structure
    assert short_aval("bfloat16[8, 128]") == "bf16[8,128]"


@pytest.mark.slow
def test_plan_serves_three_other_batch_sizes_after_one_check_each(tmp_path, caplog, capsys) -> None:
    url = f"sqlite:///{tmp_path}/plans.db"
    plan_id = _save(url)
    f = autofuse.jit(norm, store=url)
    with caplog.at_level(logging.WARNING, logger="autofuse"):
        for rows in SERVED:
            a = _args(rows)
            _close(f(*a), jax.jit(norm)(*a))
            assert f.last_status == (f"plan (tuned at f32[16,128], serving f32[{rows},128]): 1 fused group (row_reduce), "
                                     f"plan {plan_id}, checked against jax.jit here"), f.last_status
            _close(f(*a), jax.jit(norm)(*a))  # the same shape again: no new trace, no new check
    assert len(_checks(caplog)) == 3
    assert "runs plan (tuned at f32[16,128], serving f32[48,128]): is checked against jax.jit at the first call" in f.explain(*_args(48))
    shapes = PlanStore(url, readonly=True).plan_shapes([plan_id])[plan_id]
    assert shapes["inputs"] == ["float32[16, 128]", "float32[128]"]
    assert sorted(c["inputs"][0] for c in shapes["checks"]) == ["float32[24, 128]", "float32[32, 128]", "float32[64, 128]"]
    assert {c["verdict"] for c in shapes["checks"]} == {"ok"}
    # Another autofuse.jit of the same function in this process takes the stored verdicts ...
    g = autofuse.jit(norm, store=url)
    g(*_args(64))
    assert g.last_status.endswith("(remembered)") and "serving f32[64,128]" in g.last_status, g.last_status
    # ... and so does a fresh process: no check at all.
    lines = _fresh_process(url, SERVED)
    assert [x.split(": 1 fused")[0] for x in lines if x.startswith("STATUS")] == [
        f"STATUS plan (tuned at f32[16,128], serving f32[{r},128])" for r in SERVED]
    assert all(x.endswith("(remembered)") for x in lines if x.startswith("STATUS")), lines
    assert not [x for x in lines if "checking it once" in x], lines
    # autofuse plans --shapes: what it may serve, where it was tuned, where it served.
    capsys.readouterr()
    assert main(["plans", "--shapes", "--db", url]) == 0
    table = capsys.readouterr().out
    assert "f32[?,?], f32[?]" in table and "may serve" in table and "f32[16,128], f32[128]" in table
    assert [line.split()[2] for line in table.splitlines() if " ok " in line] == ["f32[24,128],", "f32[64,128],", "f32[32,128],"]
    assert main(["plans", "--shapes", "--json", "--db", url]) == 0
    (listed,) = json.loads(capsys.readouterr().out)
    assert listed["plan_id"] == plan_id and listed["may_serve"] == "f32[?,?], f32[?]" and len(listed["checks"]) == 3


def test_shape_where_a_block_no_longer_fits_is_refused(tmp_path, caplog) -> None:
    url = f"sqlite:///{tmp_path}/plans.db"
    plan_id = _save(url)
    last = len(autofuse.capture(norm, *norm_specs(4)).nodes) - 1
    f = autofuse.jit(norm, store=url)
    a = _args(4)
    with caplog.at_level(logging.WARNING, logger="autofuse"):
        _close(f(*a), jax.jit(norm)(*a))
    why = (f"plan {plan_id} (tuned at f32[16,128]) does not serve f32[4,128]: row_reduce group 0-{last}: block_rows=16 breaks "
           "block_rows <= next_pow2(R) at R=4 (no block taller than the rows)")
    assert f.last_status.startswith("xla: ") and why in f.last_status, f.last_status
    assert "was tuned for other inputs: input 0 float32[16, 128] (this call float32[4, 128])" in f.last_status
    assert not _checks(caplog) and [r for r in caplog.records if why in r.getMessage()]
    assert PlanStore(url, readonly=True).plan_shapes([plan_id])[plan_id]["checks"] == []  # nothing was checked
    explained = autofuse.jit(norm, store=url).explain(*a)
    assert "runs plain jax.jit at the first call" in explained and why in explained, explained
    with pytest.raises(autofuse.PlanError, match="block_rows=16 breaks"):
        autofuse.jit(norm, store=url, on_miss="error")(*a)


def test_adapt_names_the_template_that_no_longer_matches() -> None:
    plan = plan_from_choices(g := autofuse.capture(norm, *norm_specs(16)),
                             [(Group.of(g, [n.id for n in g.nodes]), "row_reduce", {"block_rows": 4, "block_cols": 128,
                                                                                     "num_warps": 4, "num_stages": 1})])
    assert adapt(plan, autofuse.capture(norm, *norm_specs(64))).fingerprint != plan.fingerprint
    elementwise = plan_from_choices(g, [(Group.of(g, [n.id for n in g.nodes]), "elementwise", {})])
    with pytest.raises(autofuse.PlanError, match=r"elementwise group 0-\d+: the template no longer matches"):
        adapt(elementwise, autofuse.capture(norm, *norm_specs(64)))


@pytest.mark.slow
def test_readonly_store_serves_and_checks_in_every_process(tmp_path, caplog) -> None:
    url = f"sqlite:///{tmp_path}/plans.db"
    plan_id = _save(url)
    ro = PlanStore(url, readonly=True)
    f = autofuse.jit(norm, store=ro)
    with caplog.at_level(logging.WARNING, logger="autofuse"):
        for rows in (32, 64):
            a = _args(rows)
            _close(f(*a), jax.jit(norm)(*a))
            assert f.last_status.startswith(f"plan (tuned at f32[16,128], serving f32[{rows},128])"), f.last_status
    said = [r for r in caplog.records if "cannot remember which shapes" in r.getMessage()]
    assert len(said) == 1 and "opened read-only" in said[0].getMessage()
    assert len(_checks(caplog)) == 2
    assert PlanStore(url, readonly=True).plan_shapes([plan_id])[plan_id]["checks"] == []
    lines = _fresh_process(url, (32,), readonly=True)  # the next process checks again
    assert len([x for x in lines if "checking it once" in x]) == 1 and [x for x in lines if "cannot remember" in x], lines
    assert lines[0].startswith("STATUS plan (tuned at f32[16,128], serving f32[32,128])") and lines[0].endswith("here"), lines


@pytest.mark.slow
def test_old_store_upgraded_then_structure_computed_at_deploy(tmp_path) -> None:
    """A store of revision 0004 (no structures) upgrades with `autofuse db upgrade`; its programs' structure is NULL
    until a deploy meets the function again, traces it at the stored shapes and records it."""
    from autofuse.store import db

    path = tmp_path / "old.db"
    url = f"sqlite:///{path}"
    plan_id = _save(url, structure=False)
    store = PlanStore(url)
    db.downgrade(store.engine, "0004")
    store.close()
    assert PlanStore(url, readonly=True).revision == "0004"
    f = autofuse.jit(norm, store=url)
    f(*_args(32))  # an old store: no structures to look up
    assert f.last_status.startswith("xla: ") and "was tuned for other inputs" in f.last_status, f.last_status
    out = subprocess.run([sys.executable, "-m", "autofuse.cli", "db", "upgrade", "--db", url], check=False, cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0 and f"0004 -> {HEAD_REVISION}" in out.stdout, out.stdout + out.stderr
    assert PlanStore(url, readonly=True).plan_shapes([plan_id])[plan_id]["structure"] is None
    g = autofuse.jit(norm, store=PlanStore(url))  # (this process's read-only handle on the URL still reads it as 0004)
    g(*_args(64))
    assert g.last_status.startswith("plan (tuned at f32[16,128], serving f32[64,128])"), g.last_status
    assert PlanStore(url, readonly=True).plan_shapes([plan_id])[plan_id]["structure"] == autofuse.capture(norm, *norm_specs(64)).structure
