"""Deploying from a read-only store, read-only commands that never create anything, and misses that say why.

The read-only directory is real: chmod for a normal user; as root (whom chmod does not stop) the file and its
directory are made immutable with chattr +i, which stops root too."""
from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autofuse
from autofuse.cli import main
from autofuse.device import device_info, software
from autofuse.graph import qualified_name
from autofuse.plan import Plan
from autofuse.store import PlanStore, StoreError, db
from autofuse.tuning.select import default_plan
from tests.readonly import read_only

SPEC = jax.ShapeDtypeStruct((8, 128), jnp.float32)


def softmax_rows(x):
    return jax.nn.softmax(x * 2.0, axis=-1)


def scaled(x, n):
    return jnp.tanh(x) * n


def _save(store: PlanStore, fn, args, plan_of=default_plan, device: str | None = None, sw: dict | None = None, **kw) -> int:
    g = autofuse.capture(fn, *args, **kw)
    prog = store.program(g.fingerprint, "prog", g.signature(), len(g.nodes), function=qualified_name(fn))
    dev = store.device(device or device_info()["name"])
    run = store.start_run(prog, dev, store.software(**(sw or software())), budget={"trials": 1}, seed=0, sampler="tpe", measure="model")
    cand = store.add_candidate(run, "sig", "row_reduce", [0])
    store.add_trial(cand, 0, {"block_rows": 8}, "ok", median_ms=1.0, min_ms=0.9, max_ms=1.1)
    store.update_candidate(cand, best_config={"block_rows": 8}, best_ms=1.0, xla_ms=1.2, status="tuned", n_trials=1)
    store.finish_run(run, "finished", baseline_ms=1.2, best_ms=1.0, speedup=1.2)
    plan = plan_of(g)
    return store.save_plan(prog, dev, store.software(**(sw or software())), plan.to_dict(), run_id=run, measured_ms=1.0,
                           baseline_ms=1.2, speedup=1.2, measure="model", tolerance={}, max_error=0.0)


@pytest.fixture()
def readonly_store(tmp_path: Path):
    """A store with a fused plan for softmax_rows and an XLA plan for scaled(x, 2), in a directory nobody can write."""
    d = tmp_path / "image"
    d.mkdir()
    url = f"sqlite:///{d}/plans.db"
    store = PlanStore(url)
    fused = _save(store, softmax_rows, (SPEC,))
    xla = _save(store, scaled, (SPEC, 2), plan_of=lambda g: Plan(g.fingerprint, (), {"reason": "no fused group is cheaper"}),
                static_argnums=1)
    store.close()
    with read_only(d / "plans.db", d):
        before = sorted(os.listdir(d))
        yield url, d, fused, xla
        assert sorted(os.listdir(d)) == before  # nothing was created beside the database (no journal, no WAL index)


def test_jit_runs_the_plan_from_a_readonly_store(readonly_store):
    url, _, fused, xla = readonly_store
    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 128)), jnp.float32)
    f = autofuse.jit(softmax_rows, store=url, on_miss="error")
    np.testing.assert_allclose(f(x), jax.jit(softmax_rows)(x), rtol=1e-5, atol=1e-6)
    assert f.last_status == f"plan: 1 fused group (row_reduce), run 1, plan {fused}"
    g = autofuse.jit(scaled, store=url, static_argnums=1, on_miss="error")
    np.testing.assert_allclose(g(x, 2), jnp.tanh(x) * 2)
    assert g.last_status == f"xla-plan: nothing beat jax.jit when it was tuned (run 2, plan {xla})"
    assert "xla-plan" in repr(g) and "tests.test_readonly_store:scaled" in repr(g)


@pytest.mark.parametrize("argv", [["runs"], ["plans"], ["plans", "--current"], ["trials", "1"], ["show", "run", "1"], ["show", "plan", "1"],
                                  ["compare"], ["plans", "events"], ["db", "current"]])
def test_readonly_commands_work_on_a_readonly_store(readonly_store, argv, capsys):
    url = readonly_store[0]
    assert main([*argv, "--db", url]) == 0, capsys.readouterr().err
    assert capsys.readouterr().err == ""


def test_report_from_a_readonly_store(readonly_store, tmp_path):
    assert main(["report", "1", "--db", readonly_store[0], "--out", str(tmp_path / "rep")]) == 0
    assert (tmp_path / "rep" / "report.md").exists()


def test_a_write_to_a_readonly_store_is_one_line(readonly_store, capsys):
    url, d, fused, _ = readonly_store
    assert main(["plans", "pin", str(fused), "--db", url]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is read-only" in err and f"{d}" in err, err
    with pytest.raises(StoreError, match="opened read-only; a write was asked for"):
        PlanStore(url, readonly=True).pin_plan(fused)


BAD_URLS = ["sqlite:////nonexistent/dir/x.db", "not a url"]


@pytest.mark.parametrize("argv", [["runs"], ["plans"], ["trials", "1"], ["show", "plan", "1"], ["compare"], ["report", "1", "--out", "r"],
                                  ["db", "current"]])
@pytest.mark.parametrize("url", BAD_URLS)
def test_readonly_commands_never_create_a_database(argv, url, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main([*argv, "--db", url]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("autofuse: error: no plan store at ") and (url in err or repr(url) in err), err
    assert os.listdir(tmp_path) == [] and not os.path.exists("/nonexistent")


# ----------------------------------------- stores declared read-only, whoever opens them (root included)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("AUTOFUSE_DB", "AUTOFUSE_DEBUG")}
    return subprocess.run([sys.executable, "-m", "autofuse.cli", *args], capture_output=True, text=True, env=env, timeout=120)


@contextlib.contextmanager
def _declared_read_only(path: Path, how: str) -> Iterator[str]:
    """The closed store at `path` declared read-only `how` (``chmod``: no write permission bit for anyone, which root's
    writes would ignore; ``url``: SQLite's ``?mode=ro``), as its URL; on the way out, neither its bytes nor its
    directory have changed."""
    gc.collect()  # the writer's pooled connections closed: the store as a tuning job leaves it
    before = (path.read_bytes(), sorted(os.listdir(path.parent)))
    assert before[1] == [path.name]
    if how == "chmod":
        path.chmod(0o444)
    try:
        yield f"sqlite:///{path}" + ("?mode=ro" if how == "url" else "")
    finally:
        path.chmod(0o644)
    assert sorted(os.listdir(path.parent)) == before[1] and path.read_bytes() == before[0]


@pytest.mark.parametrize("how", ["chmod", "url"])
@pytest.mark.slow
def test_a_store_declared_read_only_is_read_and_never_written(tmp_path, how):
    store = PlanStore(f"sqlite:///{tmp_path}/plans.db")
    plan = _save(store, softmax_rows, (SPEC,))
    store.close()
    with _declared_read_only(tmp_path / "plans.db", how) as url:
        for argv in (["plans", "pin", str(plan)], ["db", "upgrade"]):
            res = _cli(*argv, "--db", url)
            assert res.returncode == 2 and res.stdout == "", (argv, res.stdout, res.stderr)
            assert res.stderr.count("\n") == 1 and res.stderr.startswith("autofuse: error: the plan store ") and "is read-only" in res.stderr, res.stderr
        with pytest.raises(db.ReadOnlyStoreError, match="is read-only"):
            PlanStore(url)
        listed = _cli("plans", "--json", "--db", url)
        assert listed.returncode == 0 and [(p["id"], bool(p["pinned"])) for p in json.loads(listed.stdout)] == [(plan, False)], listed.stderr
        assert _cli("db", "current", "--db", url).stdout.strip() == f"{db.HEAD_REVISION} (head)"
        assert PlanStore(url, readonly=True).get_plan(plan)["pinned"] is False


@pytest.mark.parametrize("how", ["chmod", "url"])
@pytest.mark.slow
def test_deploy_at_another_shape_leaves_a_read_only_store_untouched(tmp_path, how):
    """autofuse.jit serving a shape it was not tuned at checks the plan once and would remember the verdict in the store:
    not in one declared read-only (it says it cannot remember, once)."""
    from tests.test_shapes import _fresh_process, _save as save_norm

    save_norm(f"sqlite:///{tmp_path}/plans.db")
    with _declared_read_only(tmp_path / "plans.db", how) as url:
        lines = _fresh_process(url, (32,))
    assert lines[0].startswith("STATUS plan (tuned at f32[16,128], serving f32[32,128])") and lines[0].endswith("here"), lines
    assert [x for x in lines if "cannot remember which shapes" in x and "is read-only" in x], lines


@pytest.mark.slow
def test_reads_leave_no_file_beside_the_store(tmp_path):
    """Listings, `db current` and deploy lookups of a store shipped closed leave it closed: no -wal, no -shm."""
    url = f"sqlite:///{tmp_path}/plans.db"
    store = PlanStore(url)
    plan = _save(store, softmax_rows, (SPEC,))
    store.close()
    assert os.listdir(tmp_path) == ["plans.db"]
    for argv in (["runs"], ["plans"], ["plans", "--shapes"], ["show", "plan", str(plan)], ["show", "run", "1"], ["trials", "1"], ["compare"],
                 ["plans", "events"], ["db", "current"]):
        res = _cli(*argv, "--db", url)
        assert res.returncode == 0, (argv, res.stderr)
        assert os.listdir(tmp_path) == ["plans.db"], argv
    f = autofuse.jit(softmax_rows, store=url, on_miss="error")
    f(jnp.ones((8, 128)))
    assert f.last_status.startswith("plan: ") and os.listdir(tmp_path) == ["plans.db"]


# ----------------------------------------------------------------- misses


@pytest.fixture()
def store_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path}/plans.db"


def _miss(fn, url, *args, caplog, **kw) -> str:
    f = autofuse.jit(fn, store=url, **kw)
    with caplog.at_level(logging.WARNING, logger="autofuse"):
        f(*args)
    assert f.last_status.startswith("xla: ")
    record = [r for r in caplog.records if "running plain jax.jit" in r.message][-1]
    assert record.message.startswith(f"autofuse: tests.test_readonly_store:{fn.__name__}: program ")  # named, not only a fingerprint
    return f.last_status[len("xla: "):]


def test_miss_never_tuned(store_url, caplog):
    _save(PlanStore(store_url), scaled, (SPEC, 2), static_argnums=1)
    why = _miss(softmax_rows, store_url, jnp.ones((8, 128)), caplog=caplog)
    assert why == f"no plan for this program at all in {store_url} (never tuned: autofuse tune)"


def test_miss_other_shapes_names_the_inputs_that_differ(store_url, caplog):
    _save(PlanStore(store_url), softmax_rows, (SPEC,))
    why = _miss(softmax_rows, store_url, jnp.ones((16, 128)), caplog=caplog, on_other_shape="refuse")  # (else served: test_shapes)
    assert why == "tests.test_readonly_store:softmax_rows was tuned for other inputs: input 0 float32[8, 128] (this call float32[16, 128])"
    why = _miss(softmax_rows, store_url, jnp.ones((8, 128), jnp.bfloat16), caplog=caplog)
    assert "input 0 float32[8, 128] (this call bfloat16[8, 128])" in why


def test_miss_other_static_values(store_url, caplog):
    _save(PlanStore(store_url), scaled, (SPEC, 2), static_argnums=1)
    why = _miss(scaled, store_url, jnp.ones((8, 128)), 3, caplog=caplog, static_argnums=1)
    assert why == "tests.test_readonly_store:scaled was tuned for other inputs: static values [(1, 2)][] (this call [(1, 3)][])"


def test_miss_other_device_and_other_versions(store_url, caplog):
    store = PlanStore(store_url)
    _save(store, softmax_rows, (SPEC,), device="NVIDIA H100 80GB HBM3")
    here = device_info()["name"]
    why = _miss(softmax_rows, store_url, jnp.ones((8, 128)), caplog=caplog)
    assert why == f"this program has plans only for another device (NVIDIA H100 80GB HBM3), not {here}"
    caplog.clear()
    old = dict(software(), jax="0.0.1")
    plan = _save(store, softmax_rows, (SPEC,), sw=old)
    why = _miss(softmax_rows, store_url, jnp.ones((8, 128)), caplog=caplog, on_version_mismatch="refuse")
    assert why.startswith(f"stored plan {plan} was made with other software (jax 0.0.1, ") and f"here jax {jax.__version__}" in why


def test_miss_error_and_explain_name_the_function(store_url):
    _save(PlanStore(store_url), softmax_rows, (SPEC,))
    f = autofuse.jit(softmax_rows, store=store_url, on_miss="error", on_other_shape="refuse")
    assert "not traced yet" in repr(f)
    text = f.explain(jnp.ones((16, 128)))
    assert text.startswith("tests.test_readonly_store:softmax_rows(float32[16, 128]) raises PlanError at the first call: ")
    assert "was tuned for other inputs" in text
    assert f.explain(SPEC).startswith("tests.test_readonly_store:softmax_rows(float32[8, 128]) runs plan: 1 fused group (row_reduce), run 1, plan 1")
    with pytest.raises(autofuse.PlanError, match=r"^autofuse: tests.test_readonly_store:softmax_rows: program [0-9a-f]+: .*other inputs"):
        f(jnp.ones((16, 128)))
    f(jnp.ones((8, 128)))
    assert f.explain(SPEC) == "tests.test_readonly_store:softmax_rows(float32[8, 128]) runs plan: 1 fused group (row_reduce), run 1, plan 1"
    assert repr(f).endswith("last traced: plan: 1 fused group (row_reduce), run 1, plan 1>")


def test_missing_store_url_at_deploy_says_so(tmp_path):
    url = f"sqlite:///{tmp_path}/nope/plans.db"
    f = autofuse.jit(softmax_rows, store=url)
    f(jnp.ones((8, 128)))
    assert f.last_status.startswith(f"xla: the plan store {url} cannot be opened (no plan store at {url}")
    assert not (tmp_path / "nope").exists()
