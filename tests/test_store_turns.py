"""Writers of one SQLite file queue for it (`store/turns.py`), and Optuna's reads take no lock (`optuna_storage`):
real files, real processes holding real locks."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from autofuse.store import PlanStore, db
from autofuse.store.optuna_storage import optuna_storage
from autofuse.store.turns import Turns, turns_for


def _holder(code: str) -> subprocess.Popen:
    """A process that runs `code`, prints "held" and keeps what it took until its stdin closes."""
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code) + "\nprint('held', flush=True)\nsys.stdin.read()\n"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def _release(p: subprocess.Popen) -> None:
    p.stdin.close()
    assert p.wait(timeout=30) == 0


def test_a_write_transaction_holds_its_files_turn_until_it_ends(tmp_path: Path) -> None:
    path = str(tmp_path / "a.db")
    engine = db.create_engine(f"sqlite:///{path}")
    turns = turns_for(path)
    with db.transaction(engine, write=True) as conn:
        conn.exec_driver_sql("CREATE TABLE t (x INTEGER)")
        assert turns._locked
    assert not turns._locked
    try:
        with db.transaction(engine, write=True) as conn:
            conn.exec_driver_sql("INSERT INTO t VALUES (1)")
            raise KeyError("boom")
    except KeyError:
        pass
    assert not turns._locked  # rolled back: given back too
    with db.transaction(engine, write=False) as conn:  # a read takes none
        assert conn.exec_driver_sql("SELECT count(*) FROM t").scalar() == 0 and not turns._locked


def test_another_process_waits_for_the_turn_and_gets_it_when_given_back(tmp_path: Path) -> None:
    path = str(tmp_path / "b.db")
    p = _holder(f"""
        import sys
        from autofuse.store.turns import turns_for
        assert turns_for({path!r}).take(5.0)
    """)
    try:
        t0 = time.monotonic()
        assert not Turns(path).take(0.3)  # held elsewhere: waited its timeout, then goes on without
        assert time.monotonic() - t0 >= 0.3
    finally:
        _release(p)
    mine = Turns(path)
    assert mine.take(5.0)
    mine.give_back()


def test_writers_go_on_without_turns_where_no_lock_file_can_be_made(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "missing"))
    t = Turns(str(tmp_path / "c.db"))
    assert not t.take(5.0) and not t._locked
    engine = db.create_engine(f"sqlite:///{tmp_path / 'c.db'}")
    with db.transaction(engine, write=True) as conn:  # SQLite alone orders it
        conn.exec_driver_sql("CREATE TABLE t (x INTEGER)")


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")  # the heartbeat's arguments
def test_optunas_reads_take_no_lock_while_another_process_writes(tmp_path: Path) -> None:
    """A worker's sampler reads a study's trials while another worker holds SQLite's write lock: the read goes on at
    once (it used to wait for the lock like a write), and a write still waits for it."""
    import optuna

    url = PlanStore(str(tmp_path / "d.db")).url
    storage = optuna_storage(url, heartbeat_s=5)
    study = optuna.create_study(study_name="s", storage=storage)
    study.enqueue_trial({"x": 1})
    study_id = storage.get_study_id_from_name("s")
    p = _holder(f"""
        import sqlite3, sys
        c = sqlite3.connect({str(tmp_path / 'd.db')!r}, isolation_level=None)
        c.execute("BEGIN IMMEDIATE")
    """)
    try:
        t0 = time.monotonic()
        assert len(storage.get_all_trials(study_id)) == 1 and storage.get_study_directions(study_id)
        assert storage._get_stale_trial_ids(study_id) == []  # what every trial of a worker asks first
        assert time.monotonic() - t0 < 5.0
        engine = sa.create_engine(url, connect_args={"timeout": 0.5})
        db.serialise_sqlite(engine, timeout=0.5)
        try:
            with engine.begin() as conn:  # not a read: waits for the lock, and gives up after its timeout
                conn.exec_driver_sql("SELECT 1")
            raise AssertionError("took the write lock another process holds")
        except sa.exc.OperationalError as e:
            assert "locked" in str(e)
    finally:
        _release(p)
