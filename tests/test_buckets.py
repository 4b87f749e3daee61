"""Tuning over shape buckets (issue 19): `autofuse tune --shapes` tunes N buckets in one job (N plans of one
structure), each bucket's studies first try the nearest tuned bucket's best configs, a deploy at an untuned shape
takes the nearest bucket's plan, and bad specs are one-line errors."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest

import autofuse
from autofuse.cli import main
from autofuse.shapes import nearest_first
from autofuse.store import PlanStore, queries
from autofuse.tuning.buckets import parse_axes
from tests.shape_programs import norm
from tests.test_shapes import _args, _close, _save

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NORM = ["tests.shape_programs:norm"]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autofuse.cli", *args], check=False, cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=ROOT), timeout=600)


@pytest.mark.slow
def test_bucket_tuning_stores_one_plan_per_bucket_and_seeds_each_study_from_the_bucket_before(tmp_path) -> None:
    db = f"sqlite:///{tmp_path}/plans.db"
    out = _cli("tune", *NORM, "--shapes", "tests.shape_programs:norm_buckets", "--measure", "model", "--trials", "6", "--db", db,
               "--no-isolate", "--json", "--quiet")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stderr.count("no GPU measurement") == 1, out.stderr  # said once per job, not once per bucket
    runs = json.loads(out.stdout)["buckets"]
    # smallest first, whatever order the factory gave
    assert [r["bucket"] for r in runs] == ["small", "mid", "large"]
    assert [r["inputs"][0] for r in runs] == ["float32[8, 128]", "float32[32, 128]", "float32[128, 128]"]
    store = PlanStore(db, readonly=True)
    plan_ids = [r["plan_id"] for r in runs]
    assert len(set(plan_ids)) == 3 and len({r["run_id"] for r in runs}) == 3
    programs = {p["plan_id"]: p for p in store._read(queries.plan_programs(plan_ids))}
    assert len({programs[i]["fingerprint"] for i in plan_ids}) == 3  # each bucket its own program ...
    assert len({programs[i]["structure"] for i in plan_ids}) == 1  # ... of one structure
    assert [programs[i]["fingerprint"] for i in plan_ids] == [r["fingerprint"] for r in runs]

    def trials_by_candidate(run_id: int) -> dict[tuple, list[dict]]:
        cands = {c["id"]: (c["template"], tuple(c["nodes"])) for c in store.candidates(run_id)}
        out: dict[tuple, list[dict]] = {}
        for t in store.trials(run_id):
            out.setdefault(cands[t["candidate_id"]], []).append(t)
        return out

    assert runs[0]["seeded"] == {}  # the first bucket has none to learn from
    for k, after in enumerate(runs[1:], 1):
        assert after["seeded"], after
        cur = trials_by_candidate(after["run_id"])
        sig_of = {c["signature"]: (c["template"], tuple(c["nodes"])) for c in store.candidates(after["run_id"])}
        for sig, seeded in after["seeded"].items():
            # from the nearest bucket before that tried the candidate (a short budget reaches no modelled loss)
            (source,) = [r for r in runs[:k] if r["bucket"] == seeded["from"]]
            prev = trials_by_candidate(source["run_id"])
            key = sig_of[sig]
            # the seeds are the bucket before's fastest configs that ran, fastest first ...
            ok = sorted((t for t in prev[key] if t["status"] == "ok"), key=lambda t: t["median_ms"])
            best = []
            for t in ok:
                if t["config"] not in best:
                    best.append(t["config"])
            assert seeded["configs"] == best[:len(seeded["configs"])]
            # ... and, where this bucket's budget reached the candidate (a short one reaches no modelled loss), its
            # first trials of it, in that order
            first = [t["config"] for t in sorted(cur.get(key, ()), key=lambda t: t["number"])][:len(seeded["configs"])]
            assert first == seeded["configs"][:len(first)], (first, seeded)
        assert any(sig_of[sig] in cur for sig in after["seeded"]), (after["seeded"], cur)  # some seeded candidate was tried


def test_seeds_that_no_longer_fit_are_dropped() -> None:
    from autofuse.costmodel import get_model
    from autofuse.status import TrialStatus
    from autofuse.tuning.buckets import Bucket, Seeder, prepare
    from autofuse.tuning.job import distinct_candidates, search_spaces
    from autofuse.tuning.ledger import TrialRecord
    from tests.shape_programs import norm_specs

    big, small = prepare(norm, [Bucket("big", norm_specs(64)), Bucket("small", norm_specs(8))])[::-1]
    seeder = Seeder()
    g = autofuse.capture(norm, *big.args)
    by_sig, cands = distinct_candidates(g)
    spaces = search_spaces(by_sig, cands, get_model("h200"))
    for r in cands:
        base = {"backend": "triton", **spaces[r.signature].spaces["triton"].default}
        r.trials = [TrialRecord(0, {**base, "block_rows": 64}, TrialStatus.OK, median_ms=1.0),
                    TrialRecord(1, {**base, "block_rows": 4}, TrialStatus.OK, median_ms=2.0)]
    seeder.record(big, by_sig, cands)
    g8 = autofuse.capture(norm, *small.args)
    by_sig8, cands8 = distinct_candidates(g8)
    seeds, source = seeder.seeds(small, by_sig8, cands8, search_spaces(by_sig8, cands8, get_model("h200")))
    assert seeds and set(source.values()) == {"big"}
    # block_rows=64 breaks block_rows <= next_pow2(8) at 8 rows: only the second best carries over
    assert all([c["block_rows"] for c in cfgs] == [4] for cfgs in seeds.values()), seeds


@pytest.mark.slow
def test_deploy_at_an_untuned_shape_takes_the_nearest_buckets_plan(tmp_path) -> None:
    url = f"sqlite:///{tmp_path}/plans.db"
    # buckets stored 8, 32, 128 rows: newest first would give the 128-row plan to every shape
    ids = {rows: _save(url, rows=rows, block_rows=4) for rows in (8, 32, 128)}
    f = autofuse.jit(norm, store=url)
    for rows, bucket in ((12, 8), (24, 32), (48, 32), (96, 128), (4, 8)):
        a = _args(rows)
        _close(f(*a), jax.jit(norm)(*a))
        assert f.last_status.startswith(f"plan (tuned at f32[{bucket},128], serving f32[{rows},128])"), f.last_status
        assert f"plan {ids[bucket]}," in f.last_status, (rows, f.last_status)
    # a bucket that does not adapt is passed over for the next nearest (block_rows=16 > next_pow2(3) = 4 rows)
    url2 = f"sqlite:///{tmp_path}/plans2.db"
    far, near = _save(url2, rows=64, block_rows=4), _save(url2, rows=16, block_rows=16)
    g = autofuse.jit(norm, store=url2)
    a = _args(3)
    _close(g(*a), jax.jit(norm)(*a))
    assert f"plan {far}," in g.last_status and "tuned at f32[64,128]" in g.last_status, (near, g.last_status)


def test_nearest_first_orders_by_log_distance_then_the_larger_bucket() -> None:
    class F:
        def __init__(self, rows: int, exact: bool = True) -> None:
            self.inputs, self.exact = (f"float32[{rows}, 128]",), exact

    found = [F(64), F(8), F(32, exact=False), F(16)]  # newest first, as the store gives them
    order = nearest_first(found, ("float32[32, 128]",), exact=lambda f: f.exact)
    assert [f.inputs[0] for f in order] == ["float32[64, 128]", "float32[16, 128]", "float32[8, 128]", "float32[32, 128]"]


@pytest.mark.parametrize(("spec", "message"), [
    ("rows=3-32", "a range's ends must be powers of two (3 is not)"),
    ("rows=32-8", "'rows=32-8': 32 > 8"),
    ("rows", "expected NAME=LO-HI,... (axes) or MODULE:BUCKETS (a factory of buckets), got 'rows'"),
    ("rows=8,seq", "expected NAME=LO-HI (powers of two) or NAME=N, got 'seq'"),
    ("rows=1-2,rows=4", "axis 'rows' is given twice"),
    ("rows=a-b", "expected integers"),
    ("rows=0", "sizes start at 1"),
    ("rows=1-1024,cols=1-1024", "makes 121 buckets, more than 64"),
    ("batch=1-2", "the --inputs factory tests.shape_programs:norm_specs failed at batch=1: TypeError"),
    ("tests.shape_programs:nope", "has no attribute 'nope'"),
    ("tests.shape_programs:norm_specs", "the buckets factory tests.shape_programs:norm_specs failed: TypeError"),
    ("tests.shape_programs:norm_mixed_buckets", "is not the program of bucket f32[8,128], f32[128] at other sizes"),
    ("", "--shapes: empty"),
])
def test_bad_shapes_specs_are_one_line_errors(spec: str, message: str, capsys, tmp_path) -> None:
    code = main(["tune", *NORM, "--inputs", "tests.shape_programs:norm_specs", "--shapes", spec, "--measure", "model",
                 "--db", f"sqlite:///{tmp_path}/p.db"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_shapes_flags_that_do_not_combine(capsys) -> None:
    for extra, flag in ((["--workers", "2"], "--workers"), (["--dry-run"], "--dry-run"), (["--resume", "1"], "--resume")):
        assert main(["tune", *NORM, "--inputs", "tests.shape_programs:norm_specs", "--shapes", "rows=8-16", *extra]) == 2
        err = capsys.readouterr().err
        assert f"drop {flag}" in err and len(err.strip().splitlines()) == 1, err
    assert main(["tune", *NORM, "--shapes", "rows=8-16"]) == 2  # axes need the --inputs factory
    assert "give --inputs MODULE:FACTORY" in capsys.readouterr().err
    assert main(["tune", *NORM]) == 2
    assert "--inputs MODULE:FACTORY is required" in capsys.readouterr().err
    assert parse_axes("batch=1-64,seq=128-4096,heads=12") == {"batch": [1, 2, 4, 8, 16, 32, 64], "seq": [128, 256, 512, 1024, 2048, 4096],
                                                               "heads": [12]}
