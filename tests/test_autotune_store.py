"""XLA's per-fusion autotune results travel with the plan store (issue 16): a tuning job that measured on a device
copies the files of its autotune directory into the store, and a deploy that finds a plan there writes those its own
directory lacks before compiling, so that shipping the database alone compiles the GEMM kernels the job measured.

The CPU has no XLA autotune output: the entries are small text files made here, in a temporary directory that
`xla_autotune.DIR` points at. Real SQLite files, read-only ones included (chmod, or chattr +i as root)."""
from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autofuse
from autofuse import xla_autotune
from autofuse.device import device_info, software
from autofuse.store import PlanStore, db
from autofuse.tuning.job import PlanSaver, RunIds
from tests.readonly import read_only
from tests.test_readonly_store import SPEC, _save, softmax_rows

ENTRIES = {"k1PkE0aZ-w_Ab.textproto": 'results {\n  gemm { algorithm: 7 }\n}\n', "Zq9_x2-LmN.textproto": "triton { block_m: 64 }\n"}
ELSEWHERE = {"other-gpu.textproto": "gemm { algorithm: 1 }\n"}


def _here() -> tuple[str, str]:
    """(jaxlib, device) of this process: what the job files its entries under and a deploy reads them by."""
    return software()["jaxlib"], device_info()["name"]


def _autotune_dir(path: Path, entries: dict[str, str]) -> Path:
    """An autotune directory as XLA leaves it: one file per fusion, and its tmp/ subdirectory of half-written ones."""
    path.mkdir(parents=True, exist_ok=True)
    for name, text in entries.items():
        (path / name).write_text(text)
    (path / "tmp").mkdir(exist_ok=True)
    (path / "tmp" / "tmp_per_fusion_cache_x_1.textproto").write_text("half")
    return path


# --------------------------------------------------------------- the directory <-> entries


def test_entries_are_the_directorys_files_and_missing_ones_are_written_whole(tmp_path):
    src = _autotune_dir(tmp_path / "src", ENTRIES)
    (src / ".autofuse-half.tmp").write_text("ours, half written")
    assert xla_autotune.read_entries(str(src)) == ENTRIES  # not tmp/, not hidden files
    assert xla_autotune.read_entries(str(tmp_path / "none")) == {}
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "Zq9_x2-LmN.textproto").write_text("this machine's own choice\n")
    evil = {"../escaped.textproto": "x", "sub/x.textproto": "x", ".hidden": "x"}
    assert xla_autotune.write_entries(str(dst), {**ENTRIES, **evil}) == ["k1PkE0aZ-w_Ab.textproto"]
    assert (dst / "Zq9_x2-LmN.textproto").read_text() == "this machine's own choice\n"  # never overwritten
    assert xla_autotune.read_entries(str(dst))["k1PkE0aZ-w_Ab.textproto"] == ENTRIES["k1PkE0aZ-w_Ab.textproto"]
    assert sorted(os.listdir(dst)) == sorted(ENTRIES) and not (tmp_path / "escaped.textproto").exists()
    with pytest.raises(OSError):
        xla_autotune.write_entries(str(tmp_path / "absent"), ENTRIES)


# ------------------------------------------------------------------------------- the store


def test_the_store_keeps_entries_per_jaxlib_and_device_and_never_replaces_one(tmp_path):
    store = PlanStore(f"sqlite:///{tmp_path}/p.db")
    assert store.save_autotune("0.11.2", "NVIDIA H100", ENTRIES) == 2
    assert store.save_autotune("0.11.2", "NVIDIA H100", {**ENTRIES, "k1PkE0aZ-w_Ab.textproto": "changed", "new": "n"}) == 1
    assert store.save_autotune("0.11.2", "NVIDIA H200", ELSEWHERE) == 1 and store.save_autotune("0.11.2", "NVIDIA H200", {}) == 0
    assert store.autotune_entries("0.11.2", "NVIDIA H100") == {**ENTRIES, "new": "n"}  # the first content kept
    assert store.autotune_entries("0.11.2", "NVIDIA H200") == ELSEWHERE
    assert store.autotune_entries("0.12.0", "NVIDIA H100") == {}


# ------------------------------------------------------------------------- the job's end


@pytest.mark.slow
def test_a_jobs_end_copies_the_autotune_directory_into_the_store(tmp_path, monkeypatch):
    """A modelled job measured nothing: it copies nothing. A job that measured on the device copies the directory's
    files at its end (`PlanSaver.final`, which both drivers end with), for this jaxlib and device, again idempotently."""
    from benchmarks.workloads import rms_norm
    from tests.dist_programs import rms_norm_inputs

    monkeypatch.setattr(xla_autotune, "DIR", str(_autotune_dir(tmp_path / "autotune", ENTRIES)))
    url = f"sqlite:///{tmp_path}/p.db"
    report = autofuse.tune(rms_norm, *rms_norm_inputs(), trials=2, store=url, quiet=True, measure="model")
    store = PlanStore(url)
    jaxlib, device = _here()
    assert store.autotune_entries(jaxlib, device) == {}
    run = store.get_run(report.run_id)
    ids = RunIds(run["program_id"], run["device_id"], run["software_id"])
    measured = dataclasses.replace(report, measure="device")  # as a GPU job's report (the CPU measures nothing)
    for _ in range(2):
        again = store.start_run(ids.program, ids.device, ids.software, budget={"trials": 2}, seed=0, sampler="tpe", measure="device")
        assert PlanSaver(store, ids, again).final(measured) is not None
        assert store.autotune_entries(jaxlib, device) == ENTRIES
    assert store.get_run(again)["status"] == "finished"


def test_a_measuring_jobs_start_writes_the_stores_entries_its_trial_processes_lack(tmp_path, monkeypatch):
    """A job that measures on the device writes the store's entries for this jaxlib and device into its trial
    processes' directory when it opens its run, before anything compiles (a filled directory let GPT-2's four workers
    compile their XLA references in 3-5 s instead of 6-10 s), never replacing a file there and never another
    device's entries; a modelled job, which compiles nothing that autotunes, leaves the directory alone."""
    from autofuse.tuning.job import open_run

    jaxlib, device = _here()
    url = f"sqlite:///{tmp_path}/p.db"
    store = PlanStore(url)
    store.save_autotune(jaxlib, device, ENTRIES)
    store.save_autotune(jaxlib, "another GPU", ELSEWHERE)
    trials = _autotune_dir(tmp_path / "trials", {"Zq9_x2-LmN.textproto": "mine\n"})
    monkeypatch.setattr(xla_autotune, "DIR", str(trials))
    graph = autofuse.capture(softmax_rows, jnp.ones((4, 8), jnp.float32))
    open_run(url, graph, "p", "model", 2, None, 0, None)
    assert sorted(p.name for p in trials.iterdir() if p.is_file()) == ["Zq9_x2-LmN.textproto"]
    open_run(url, graph, "p", "device", 2, None, 0, None)
    assert {p.name: p.read_text() for p in trials.iterdir() if p.is_file()} == {**ENTRIES, "Zq9_x2-LmN.textproto": "mine\n"}


def test_a_failed_copy_is_a_warning_never_the_jobs_end(tmp_path, monkeypatch, caplog):
    from autofuse.tuning.job import store_autotune

    monkeypatch.setattr(xla_autotune, "DIR", str(_autotune_dir(tmp_path / "autotune", ENTRIES)))
    store = PlanStore(f"sqlite:///{tmp_path}/p.db")
    store.close()
    ro = PlanStore(store.url, readonly=True)
    with caplog.at_level(logging.WARNING, logger="autofuse"):
        assert store_autotune(ro) == 0
    assert "could not copy XLA's autotune results" in caplog.text and "read-only" in caplog.text
    # JAX had started before `import autofuse`: this process has no directory, its trial processes have the default
    monkeypatch.setattr(xla_autotune, "DIR", None)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setenv(xla_autotune.ENV_DIR, str(_autotune_dir(tmp_path / "trials", {"k1": "a"})))
    assert store_autotune(store) == 1 and store.autotune_entries(*_here()) == {"k1": "a"}
    monkeypatch.setenv("XLA_FLAGS", f"{xla_autotune.FLAG}={_autotune_dir(tmp_path / 'own', {'k2': 'b'})}")  # the user's flag wins
    assert store_autotune(store) == 1 and store.autotune_entries(*_here()) == {"k1": "a", "k2": "b"}
    monkeypatch.setenv("XLA_FLAGS", f"{xla_autotune.FLAG}=")  # the user turned the cache off
    assert store_autotune(store) == 0


# ------------------------------------------------------------------------------- deploy


def _x() -> jax.Array:
    return jnp.asarray(np.random.default_rng(0).standard_normal((8, 128)), jnp.float32)


def _fill(url: str) -> int:
    """A store with a plan for softmax_rows on this device, and entries here, on another GPU and another jaxlib."""
    store = PlanStore(url)
    plan = _save(store, softmax_rows, (SPEC,))
    jaxlib, device = _here()
    store.save_autotune(jaxlib, device, ENTRIES)
    store.save_autotune(jaxlib, "NVIDIA H100 80GB HBM3", ELSEWHERE)
    store.save_autotune("0.0.1", device, {"old-jaxlib.textproto": "gemm { algorithm: 2 }\n"})
    store.close()
    return plan


def _deploy(url: str, autotune: Path | None, monkeypatch) -> str:
    monkeypatch.setattr(xla_autotune, "DIR", None if autotune is None else str(autotune))
    f = autofuse.jit(softmax_rows, store=url, on_miss="error")
    np.testing.assert_allclose(f(_x()), jax.jit(softmax_rows)(_x()), rtol=1e-5, atol=1e-6)
    return f.last_status


def test_a_deploy_writes_the_missing_entries_before_compiling(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path}/p.db"
    plan = _fill(url)
    here = tmp_path / "deploy-autotune"
    here.mkdir()
    (here / "Zq9_x2-LmN.textproto").write_text("this machine's own\n")
    assert _deploy(url, here, monkeypatch).endswith(f"plan {plan}")
    assert sorted(os.listdir(here)) == sorted(ENTRIES)  # not another GPU's, nor another jaxlib's
    assert (here / "k1PkE0aZ-w_Ab.textproto").read_text() == ENTRIES["k1PkE0aZ-w_Ab.textproto"]
    assert (here / "Zq9_x2-LmN.textproto").read_text() == "this machine's own\n"  # existing files untouched


def test_no_directory_or_an_unwritable_one_still_runs_the_plan(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path}/p.db"
    plan = _fill(url)
    assert _deploy(url, None, monkeypatch).endswith(f"plan {plan}")
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert _deploy(url, blocker / "autotune", monkeypatch).endswith(f"plan {plan}")  # under a file: cannot be written (even by root)


@pytest.fixture()
def readonly_url(tmp_path: Path):
    """A store with a plan and autotune entries, in a directory nobody can write (as tests/test_readonly_store.py)."""
    d = tmp_path / "image"
    d.mkdir()
    url = f"sqlite:///{d}/plans.db"
    plan = _fill(url)
    with read_only(d / "plans.db", d):
        yield url, plan


def test_a_readonly_store_serves_its_entries(readonly_url, tmp_path, monkeypatch):
    url, plan = readonly_url
    jaxlib, device = _here()
    assert PlanStore(url, readonly=True).autotune_entries(jaxlib, device) == ENTRIES
    here = tmp_path / "fresh"
    here.mkdir()
    assert _deploy(url, here, monkeypatch).endswith(f"plan {plan}")
    assert sorted(os.listdir(here)) == sorted(ENTRIES)


# ---------------------------------------------------------------------------- migration


def test_a_0006_store_upgrades_and_is_read_as_it_is_before(tmp_path):
    """A store made before migration 0007 reads (read-only) as one without entries; opening it to write upgrades it."""
    url = f"sqlite:///{tmp_path}/old.db"
    store = PlanStore(url)
    plan = _save(store, softmax_rows, (SPEC,))
    db.downgrade(store.engine, "0006")
    store.close()
    old = PlanStore(url, readonly=True)
    assert old.revision == "0006" and old.autotune_entries(*_here()) == {} and old.get_plan(plan)["id"] == plan
    old.close()
    store = PlanStore(url)
    assert db.current(store.engine) == {db.HEAD_REVISION} == {"0007"}
    assert store.save_autotune(*_here(), ENTRIES) == 2 and store.get_plan(plan)["id"] == plan
    assert PlanStore(url, readonly=True).autotune_entries(*_here()) == ENTRIES
