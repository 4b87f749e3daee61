"""Plans are never lost to a worse one: the promotion rule, pinning, promote/rm by hand, each recorded, and old stores upgraded."""
from __future__ import annotations

import sqlite3
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
import sqlalchemy as sa

from autofuse.cli import main
from autofuse.store import PlanStore, db
from autofuse.store.promotion import MIN_NOISE, PlanFigures, decide

SW = {"jax": "0.11.2", "jaxlib": "0.11.2", "autofuse": "0.1.0", "backend": "pallas"}


# ----------------------------------------------------------------- the rule


def test_rule_measured_must_beat_beyond_noise():
    cur = PlanFigures(5, "device", 1.11, noise=0.01)
    assert decide(PlanFigures(None, "device", 1.13, 0.004), cur).current is True  # +1.8% > the larger noise, 1%
    slow = decide(PlanFigures(None, "device", 1.115, 0.004), cur)
    assert slow.current is False and "does not beat plan 5's 1.11x beyond noise ±1.0%" in slow.reason
    assert decide(PlanFigures(None, "device", 1.11 * (1 + MIN_NOISE / 2)), PlanFigures(5, "device", 1.11)).current is False
    assert decide(PlanFigures(None, "device", 1.0), cur).current is False  # an XLA plan after a fused one


def test_rule_measured_beats_modelled_never_the_reverse():
    modelled = decide(PlanFigures(None, "model", 3.0), PlanFigures(5, "device", 1.11))
    assert modelled.current is False and "modelled" in modelled.reason and "plan 5 was measured" in modelled.reason
    assert decide(PlanFigures(None, "device", 1.02, 0.01), PlanFigures(5, "model", 3.0)).current is True
    assert decide(PlanFigures(None, "model", 1.3), PlanFigures(5, "model", 1.2)).current is True  # no GPU anywhere: the model's estimate
    assert decide(PlanFigures(None, "model", 1.2), PlanFigures(5, "model", 1.2)).current is False


def test_rule_first_plan_forced_and_pinned():
    assert decide(PlanFigures(None, "model", 0.9), None).current is True
    assert decide(PlanFigures(None, "device", 0.5), PlanFigures(5, "device", 2.0), force=True).current is True
    pinned = decide(PlanFigures(None, "device", 9.0), PlanFigures(5, "device", 1.1, pinned=True), force=True)
    assert pinned.current is False and "plan 5 is pinned" in pinned.reason
    assert decide(PlanFigures(None, "device", 9.0), None, force=False).current is False


# ------------------------------------------------------------ the store


def _keys(store: PlanStore, fp: str = "fp-promo") -> tuple[int, int, int]:
    return (store.program(fp, "mlp", {"inputs": ["float32[8, 8]"]}, 3, function="mod:mlp"), store.device("NVIDIA H100", "9.0", 132, 80),
            store.software(**SW))


def _add(store: PlanStore, keys: tuple[int, int, int], speedup: float, measure: str = "device", noise: float | None = 0.005, **kw):
    return store.add_plan(*keys, {"groups": [], "speedup": speedup}, measured_ms=1 / speedup, baseline_ms=1.0, speedup=speedup,
                          measure=measure, tolerance={}, max_error=0.0, noise=noise, **kw)


def _current(store: PlanStore) -> list[int]:
    return [p["id"] for p in store.plans(current_only=True)]


def test_store_keeps_the_best_plan_current_and_records_why(tmp_path: Path):
    store = PlanStore(f"sqlite:///{tmp_path}/p.db")
    k = _keys(store)
    first = _add(store, k, 1.11)
    assert first.current and _current(store) == [first.plan_id]
    for speedup, measure in ((1.112, "device"), (1.0, "device"), (2.5, "model")):
        saved = _add(store, k, speedup, measure)
        assert not saved.current and saved.previous == first.plan_id
        assert _current(store) == [first.plan_id]
    better = _add(store, k, 1.3)
    assert better.current and "1.30x beats plan" in better.reason and _current(store) == [better.plan_id]
    forced = _add(store, k, 1.05, current=True, actor="ci@build")
    assert forced.current and _current(store) == [forced.plan_id]
    events = store.plan_events()
    assert [e["action"] for e in events] == ["saved"] * 6
    assert events[0]["actor"] == "ci@build" and events[0]["detail"].startswith("current: promoted on request")
    assert any(e["detail"].startswith("not current: it is modelled") for e in events)
    assert store.lookup("fp-promo", "NVIDIA H100", SW).plan_id == forced.plan_id


def test_pin_unpin_promote_rm(tmp_path: Path):
    store = PlanStore(f"sqlite:///{tmp_path}/p.db")
    k = _keys(store)
    a, b = _add(store, k, 1.2).plan_id, _add(store, k, 1.1).plan_id
    assert _current(store) == [a]
    assert "current in place of plan" in store.pin_plan(b, actor="ops@host").message
    assert _current(store) == [b] and store.get_plan(b)["pinned"] is True
    assert not _add(store, k, 5.0).current  # a pinned plan is never replaced by a tuning job...
    assert not _add(store, k, 5.0, current=True).current  # ... even one told to promote its plan
    with pytest.raises(ValueError, match=f"plan {b} is pinned"):
        store.promote_plan(a)
    with pytest.raises(ValueError, match="unpin it first"):
        store.remove_plan(b)
    store.unpin_plan(b)
    assert store.promote_plan(a).replaced == b and _current(store) == [a]
    assert "no current plan" in store.remove_plan(a).message
    assert _current(store) == [] and store.lookup("fp-promo", "NVIDIA H100", SW) is None
    with pytest.raises(KeyError, match=f"no plan with id {a}"):
        store.get_plan(a)
    actions = [(e["action"], e["plan_id"]) for e in store.plan_events() if e["action"] != "saved"]
    assert actions[:4] == [("rm", a), ("promote", a), ("unpin", b), ("pin", b)]
    assert store.plan_events(plan_id=a)[0]["detail"].startswith("device plan, speedup 1.20x")  # what was removed stays on record


def test_cli_plan_actions_and_listing(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    url = f"sqlite:///{tmp_path}/p.db"
    store = PlanStore(url)
    k = _keys(store)
    a, b = _add(store, k, 1.2).plan_id, _add(store, k, 1.1).plan_id
    assert main(["plans", "promote", str(b), "--db", url]) == 0
    assert capsys.readouterr().out.strip() == f"plan {b} promoted: current in place of plan {a}"
    assert main(["plans", "pin", str(b), "--db", url]) == 0
    assert main(["plans", "--current", "--db", url]) == 0  # the listing and its filters still work beside the actions
    out = capsys.readouterr().out
    assert f"plan {b} pinned" in out and "pin" in out.splitlines()[-3] and len([ln for ln in out.splitlines() if " * " in ln]) == 1
    assert main(["plans", "rm", str(b), "--db", url]) == 2
    assert capsys.readouterr().err.strip() == f"autofuse: error: plan {b} is pinned: unpin it first (autofuse plans unpin {b})"
    assert main(["plans", "unpin", str(b), "--db", url]) == 0 and main(["plans", "rm", str(a), "--db", url]) == 0
    assert main(["plans", "promote", "999", "--db", url]) == 2
    assert capsys.readouterr().err.strip().endswith("no plan with id 999")
    assert main(["plans", "events", "--plan", str(b), "--db", url, "--json"]) == 0
    assert [e["action"] for e in __import__("json").loads(capsys.readouterr().out)] == ["unpin", "pin", "promote", "saved"]


def test_old_database_upgrades_and_reads(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """A store made before plan promotion (revision 0002): read-only listings read it as it is, `db upgrade` brings it to head."""
    path = tmp_path / "old.db"
    engine = db.create_engine(f"sqlite:///{path}")
    db.upgrade(engine, "0002")
    engine.dispose()
    with sqlite3.connect(path) as c:
        c.execute("INSERT INTO autofuse_programs VALUES (1, 'fp-old', 'mlp', '{}', 3, '2026-01-01 00:00:00')")
        c.execute("INSERT INTO autofuse_devices VALUES (1, 'NVIDIA H100', '9.0', 132, 80)")
        c.execute("INSERT INTO autofuse_software VALUES (1, '0.11.2', '0.11.2', '0.1.0', 'pallas')")
        c.execute("INSERT INTO autofuse_plans (id, program_id, device_id, software_id, plan_json, measured_ms, baseline_ms, speedup, measure, "
                  "tolerance, max_error, is_current, created_at) VALUES (1, 1, 1, 1, '{\"groups\": []}', 1, 1.1, 1.1, 'device', '{}', 0, 1, "
                  "'2026-01-01 00:00:00')")
    url = f"sqlite:///{path}"
    ro = PlanStore(url, readonly=True)
    assert ro.revision == "0002" and [(p["id"], p["pinned"]) for p in ro.plans()] == [(1, False)] and ro.plan_events() == []
    assert ro.lookup("fp-old", "NVIDIA H100", SW).plan_id == 1
    ro.close()
    assert db.current(db.create_engine(url)) == {"0002"}  # reading never migrated it
    assert main(["db", "upgrade", "--db", url]) == 0
    assert capsys.readouterr().out.strip() == f"autofuse schema: 0002 -> {db.HEAD_REVISION}"
    store = PlanStore(url)
    assert store.get_plan(1)["pinned"] is False and store.pin_plan(1).plan_id == 1
    with store.engine.connect() as conn:
        assert conn.execute(sa.text("SELECT function FROM autofuse_programs")).scalar() is None


# ---------------------------------------------------------- tuning jobs


def _f(x, b):
    return jnp.log1p(jax.nn.relu(x + b))


@pytest.mark.slow
def test_a_tuning_job_does_not_replace_an_equal_plan_unless_told(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    from autofuse.tuning.local import tune

    url = f"sqlite:///{tmp_path}/t.db"
    args = (jax.ShapeDtypeStruct((128, 512), jnp.float32), jax.ShapeDtypeStruct((512,), jnp.float32))
    first = tune(_f, *args, trials=2, store=url, quiet=True)
    assert first.plan_current is True
    capsys.readouterr()
    second = tune(_f, *args, trials=2, store=url, quiet=True)  # the same modelled plan: no better
    err = capsys.readouterr().err
    assert second.plan_current is False and second.plan_id != first.plan_id
    line = f"autofuse: plan {second.plan_id} is stored but not current: "
    assert [ln for ln in err.splitlines() if ln.startswith(line)] == [second.plan_note]
    assert f"does not beat plan {first.plan_id}'s" in second.plan_note and f"autofuse plans promote {second.plan_id}" in second.plan_note
    third = tune(_f, *args, trials=2, store=url, quiet=True, promote=True)
    assert third.plan_current is True
    assert [p["id"] for p in PlanStore(url).plans(current_only=True)] == [third.plan_id]
