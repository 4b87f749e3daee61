"""Deploy time: autofuse.jit finds stored plans (graded), and never crashes or goes wrong on a bad one."""
from __future__ import annotations

import ast
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autofuse
from autofuse.device import software
from autofuse.tuning.local import tune
from benchmarks.workloads import layer_norm
from tests.stored_plans import save_plan_here

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = ((2048, 1024), (1024,), (1024,))


def _specs(rows=2048):
    return [jax.ShapeDtypeStruct((rows,) + s[1:] if i == 0 else s, jnp.bfloat16) for i, s in enumerate(SHAPES)]


def _args(rows=2048, seed=0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(s.shape), jnp.bfloat16) for s in _specs(rows)]


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """One real (model-mode) tuning job whose plan fuses the layer norm."""
    url = f"sqlite:///{tmp_path_factory.mktemp('deploy')}/plans.db"
    rep = tune(layer_norm, *_specs(), trials=6, seed=0, quiet=True, store=url, name="layer_norm", isolate=False)
    assert not rep.plan.is_xla, rep.table()
    return url, rep


def _close(a, b):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2, atol=2e-2)


@pytest.mark.slow
def test_new_process_finds_the_plan(tuned):
    url, rep = tuned
    script = textwrap.dedent(f"""
        import jax, jax.numpy as jnp, numpy as np, autofuse
        from benchmarks.workloads import layer_norm
        rng = np.random.default_rng(3)
        args = [jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in {SHAPES!r}]
        f = autofuse.jit(layer_norm, store={url!r})
        out = f(*args)
        ref = jax.jit(layer_norm)(*args)
        err = float(jnp.linalg.norm((out - ref).astype(jnp.float32)) / jnp.linalg.norm(ref.astype(jnp.float32)))
        print("STATUS", f.last_status, "ERR", err)
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    status, err = out.stdout.split("STATUS")[1].split("ERR")
    assert status.strip().startswith("plan: 1 fused group"), status
    assert float(err) < 2e-2


@pytest.mark.slow
def test_deploy_path_imports_no_tuner(tuned):
    """Running a stored plan needs the plan, the kernels and the store: never the tuner, scipy, optuna or yaml."""
    url, rep = tuned
    script = textwrap.dedent(f"""
        import sys
        import jax.numpy as jnp, numpy as np, autofuse
        from benchmarks.workloads import layer_norm
        rng = np.random.default_rng(3)
        f = autofuse.jit(layer_norm, store={url!r})
        f(*[jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in {SHAPES!r}]).block_until_ready()
        print("STATUS", f.last_status)
        print("LOADED", sorted(m for m in sys.modules if m.split(".")[0] in ("scipy", "optuna", "yaml") or m.startswith("autofuse.tuning")))
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "STATUS plan" in out.stdout, out.stdout + out.stderr[-2000:]
    assert "LOADED []" in out.stdout, out.stdout


def _imported_modules(path: Path) -> set[str]:
    """Every module a source file imports, at its top or inside a function, relative imports resolved."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]) if node.level else ""
            mod = ".".join(x for x in (base, node.module or "") if x)
            out |= {mod} | {f"{mod}.{a.name}" for a in node.names}
    return out


def test_deploy_side_never_imports_the_tuner():
    """The face and the deploy package start a background tuning job as a process and never import the tuner
    (issue 34): no import of `autofuse.tuning` in their source, even inside a function, and none loaded by importing
    them and running a miss with on_miss="tune" settings."""
    files = [Path(ROOT, "autofuse", "api.py"), Path(ROOT, "autofuse", "background.py"), *Path(ROOT, "autofuse", "deploy").glob("*.py")]
    assert len(files) > 3
    for f in files:
        bad = sorted(m for m in _imported_modules(f) if m.startswith(("autofuse.tuning", "scipy", "optuna")))
        assert bad == [], (f, bad)
    script = textwrap.dedent("""
        import sys
        import jax.numpy as jnp, autofuse, autofuse.api, autofuse.deploy, autofuse.background
        f = autofuse.jit(lambda x: x * 2, store="sqlite:////nonexistent-dir/plans.db", on_miss="tune")
        f(jnp.ones(4))
        print("STATUS", f.last_status)
        print("LOADED", sorted(m for m in sys.modules if m.split(".")[0] in ("scipy", "optuna") or m.startswith("autofuse.tuning")))
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "STATUS xla: " in out.stdout and "not tuned in the background" in out.stdout, out.stdout + out.stderr[-2000:]
    assert "LOADED []" in out.stdout, out.stdout


@pytest.mark.slow
def test_each_signature_is_traced_once(tuned):
    """A stored plan's function traces (and compiles) each signature once: JAX's first lowering of a pallas_call
    imports modules that register configuration in jax.jit's cache key, which made every second call trace again
    until autofuse.jit imported them up front. In a fresh process, where nothing was lowered yet."""
    url, _ = tuned
    script = textwrap.dedent(f"""
        import jax.numpy as jnp, numpy as np, autofuse
        from benchmarks.workloads import layer_norm
        traces = []
        def counted(*a):
            traces.append(1)
            return layer_norm(*a)
        counted.__module__, counted.__qualname__ = layer_norm.__module__, layer_norm.__qualname__
        f = autofuse.jit(counted, store={url!r})
        rng = np.random.default_rng(3)
        xs = [jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in {SHAPES!r}]
        per_call = []
        for _ in range(3):
            n = len(traces)
            f(*xs).block_until_ready()
            per_call.append(len(traces) - n)
        print("STATUS", f.last_status)
        print("TRACES", per_call)
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "STATUS plan" in out.stdout, out.stdout + out.stderr[-2000:]
    assert "TRACES [1, 0, 0]" in out.stdout, out.stdout


def test_miss_runs_jax_jit_and_logs_once(tuned, caplog):
    url, _ = tuned
    f = autofuse.jit(layer_norm, store=url, on_other_shape="refuse")  # (else plans of the same structure may serve: test_shapes)
    with caplog.at_level(logging.WARNING, logger="autofuse"):
        a = _args(rows=512)  # another shape: another program
        _close(f(*a), jax.jit(layer_norm)(*a))
        _close(f(*a), jax.jit(layer_norm)(*a))
    why = "benchmarks.workloads:layer_norm was tuned for other inputs: input 0 bfloat16[2048, 1024] (this call bfloat16[512, 1024])"
    assert f.last_status == f"xla: {why}"
    assert len([r for r in caplog.records if why in r.message]) == 1
    strict = autofuse.jit(layer_norm, store=url, on_miss="error", on_other_shape="refuse")
    fp = autofuse.capture(layer_norm, *_specs(512)).fingerprint
    with pytest.raises(autofuse.PlanError, match=fp):
        strict(*a)


@pytest.mark.slow
def test_tuned_plan_serves_another_batch_size_after_a_check(tuned):
    """A tuning job records its program's structure, so its plan serves the same layer norm at another batch size."""
    url, rep = tuned
    assert autofuse.PlanStore(url, readonly=True).plan_shapes([rep.plan_id])[rep.plan_id]["structure"] == \
        autofuse.capture(layer_norm, *_specs()).structure
    f = autofuse.jit(layer_norm, store=url)
    a = _args(rows=1024)
    _close(f(*a), jax.jit(layer_norm)(*a))
    assert f.last_status.startswith(f"plan (tuned at bf16[2048,1024], serving bf16[1024,1024]): 1 fused group (row_reduce), run 1, "
                                    f"plan {rep.plan_id}, checked against jax.jit"), f.last_status


def _store_plan(url, plan_json, jax_version=None):
    store = autofuse.PlanStore(url)
    sw = {**software(), "jax": jax_version} if jax_version else None
    save_plan_here(store, autofuse.capture(layer_norm, *_specs()), "layer_norm", plan_json, sw=sw, baseline_ms=1.1)
    return store


@pytest.mark.slow
def test_other_software_version_is_reverified_or_refused(tuned, tmp_path):
    _, rep = tuned
    url = f"sqlite:///{tmp_path}/v.db"
    _store_plan(url, rep.plan.to_dict(), jax_version="0.0.1")
    a = _args()
    f = autofuse.jit(layer_norm, store=url)
    _close(f(*a), jax.jit(layer_norm)(*a))
    assert f.last_status.startswith("plan-reverified: 1 fused group") and "made with jax 0.0.1" in f.last_status, f.last_status
    g = autofuse.jit(layer_norm, store=url, on_version_mismatch="refuse")
    _close(g(*a), jax.jit(layer_norm)(*a))
    assert g.last_status.startswith("xla") and "other software" in g.last_status


@pytest.mark.parametrize("mutate, why", [
    (lambda p: {**p, "schema_version": 99}, "invalid"),
    (lambda p: {**p, "groups": [{**p["groups"][0], "template": "elementwise"}]}, "does not build"),
    (lambda p: {**p, "groups": [{**p["groups"][0], "signature": "0" * 20}]}, "does not build"),
])
def test_bad_stored_plan_falls_back_to_xla(tuned, tmp_path, mutate, why):
    _, rep = tuned
    url = f"sqlite:///{tmp_path}/bad.db"
    _store_plan(url, mutate(rep.plan.to_dict()))
    a = _args()
    f = autofuse.jit(layer_norm, store=url)
    _close(f(*a), jax.jit(layer_norm)(*a))
    assert f.last_status.startswith("xla") and why in f.last_status
    with pytest.raises(autofuse.PlanError):
        autofuse.jit(layer_norm, store=url, on_miss="error")(*a)


def test_corrupt_database_at_deploy_falls_back(tmp_path):
    p = tmp_path / "corrupt.db"
    p.write_bytes(os.urandom(4096))
    a = _args(rows=64)
    f = autofuse.jit(layer_norm, store=f"sqlite:///{p}")
    _close(f(*a), jax.jit(layer_norm)(*a))
    assert f.last_status.startswith("xla")


@pytest.mark.slow
def test_sigkilled_tune_is_interrupted_then_resumed(tmp_path):
    db = f"sqlite:///{tmp_path}/resume.db"
    env = dict(os.environ, PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "autofuse.cli", "tune", "examples.norms:forward", "--inputs", "examples.norms:example_inputs",
           "--trials", "14", "--db", db, "--quiet", "--seed", "4"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    store = autofuse.PlanStore(db)
    deadline = time.time() + 600
    n_before = 0
    while time.time() < deadline:
        runs = store.runs()
        n_before = len(store.trials(runs[0]["id"])) if runs else 0
        if n_before >= 4:
            break
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    assert n_before >= 4
    (run,) = store.runs()
    before = [(t["signature"], json.dumps(t["config"], sort_keys=True)) for t in store.trials(run["id"])]
    assert store.mark_interrupted() == [run["id"]]
    assert store.get_run(run["id"])["status"] == "interrupted"
    out = subprocess.run(cmd + ["--resume", str(run["id"])], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    final = store.get_run(run["id"])
    assert final["status"] == "finished"
    after = [(t["signature"], json.dumps(t["config"], sort_keys=True)) for t in store.trials(run["id"])]
    assert after[: len(before)] == before or set(before) <= set(after)  # nothing written before the kill is lost
    measured = [t for t in store.trials(run["id"]) if t["status"] != "infeasible"]
    assert len(measured) <= 14 + 1  # the budget is shared with what ran before the kill, not started over
    import optuna

    names = [s.study_name for s in optuna.study.get_all_study_summaries(db)]
    assert names and all(n.startswith(f"autofuse-run{run['id']}-") for n in names)


def _scaled(x, k, n):
    return x * k**n


def test_last_status_describes_the_call_just_made():
    """Issue 33: shapes A, B, then A again (each traced once by jax.jit) said B's status at the third call. Each call
    says what it ran: here a given (XLA) plan for A, a miss for B; a static argument's value and the array shapes
    tell the signatures apart, a Python scalar's value does not (jax.jit does not trace again for it)."""
    specs = (jax.ShapeDtypeStruct((8, 16), jnp.float32), 2.0, 3)
    plan = autofuse.Plan(autofuse.capture(_scaled, *specs, static_argnums=2).fingerprint, (), {"measure": "model"})
    f = autofuse.jit(_scaled, plan=plan, static_argnums=2)
    x, y = jnp.ones((8, 16)), jnp.ones((4, 16))
    statuses = []
    for args in ((x, 2.0, 3), (y, 2.0, 3), (x, 5.0, 3), (x, 2.0, 4), (x, 2.0, 3), (y, 1.0, 3)):
        f(*args)
        statuses.append(f.last_status)
    assert [s.split(":")[0] for s in statuses] == ["xla-plan", "xla", "xla-plan", "xla", "xla-plan", "xla"], statuses
    assert "the given plan is for program" in statuses[1] and statuses[1] != statuses[3]  # B and the other static value differ


def test_tune_without_a_store_saves_where_jit_looks(tmp_path, monkeypatch):
    """Issue 33: `autofuse.tune()` without store= saved nothing, so the `autofuse.jit(fn)` after it missed, while the
    CLI saved to the default store. Both now use it ($AUTOFUSE_DB, else the per-user file), the report says where;
    store=False keeps a job's result in memory."""
    url = f"sqlite:///{tmp_path}/default.db"
    monkeypatch.setenv("AUTOFUSE_DB", url)
    specs = _specs(rows=256)
    kept = tune(layer_norm, *specs, trials=2, seed=0, quiet=True, isolate=False, store=False)
    assert kept.run_id is None and kept.stored_in is None and kept.summary().endswith("; not stored")
    assert not (tmp_path / "default.db").exists()
    rep = tune(layer_norm, *specs, trials=2, seed=0, quiet=True, isolate=False)
    assert rep.stored_in == url and rep.summary().endswith(f"; run {rep.run_id}, plan {rep.plan_id} in {url}")
    f = autofuse.jit(layer_norm)
    f(*_args(rows=256))
    assert f.last_status.startswith(("plan: ", "xla-plan: ")) and f"plan {rep.plan_id}" in f.last_status, f.last_status
