"""A run's trials on a time line, per worker: when each started and ended (seconds from the run's start), its
candidate, config backend and outcome, and the gaps between one worker's trials (where a job's trial phase goes).

    python -m benchmarks.run_timeline sqlite:///gpt2_w4.db [--run 1]
"""
from __future__ import annotations

import argparse
from collections import defaultdict

import sqlalchemy as sa


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("db")
    ap.add_argument("--run", type=int, default=1)
    a = ap.parse_args()
    eng = sa.create_engine(a.db)
    with eng.connect() as c:
        (start,) = c.execute(sa.text("select started_at from autofuse_runs where id = :r"), {"r": a.run}).one()
        rows = c.execute(sa.text(
            "select t.worker, t.created_at, t.finished_at, c.template, t.status, t.config, t.median_ms, c.id "
            "from autofuse_trials t join autofuse_candidates c on c.id = t.candidate_id where c.run_id = :r order by t.created_at"),
            {"r": a.run}).all()
    t0 = sa.types.DateTime().result_processor  # noqa: F841 - rows come back as strings on SQLite
    import datetime as dt

    def secs(x):
        if x is None:
            return None
        if isinstance(x, str):
            x = dt.datetime.fromisoformat(x)
        s = start if not isinstance(start, str) else dt.datetime.fromisoformat(start)
        return (x.replace(tzinfo=None) - s.replace(tzinfo=None)).total_seconds()

    by_worker = defaultdict(list)
    for w, c0, c1, tmpl, status, cfg, ms, cid in rows:
        by_worker[w].append((secs(c0), secs(c1), tmpl, status, cfg, ms, cid))
    for w, ts in by_worker.items():
        print(f"worker {w}: {len(ts)} trials")
        prev = None
        for s0, s1, tmpl, status, cfg, ms, cid in ts:
            backend = '"mosaic_gpu"' in str(cfg) and "mosaic" or "triton"
            gap = f"gap {s0 - prev:5.2f}" if prev is not None and s0 is not None else " " * 9
            took = f"{s1 - s0:5.2f}" if s1 is not None and s0 is not None else "  -  "
            print(f"  {s0:7.2f} +{took} {gap}  cand {cid:3d} {tmpl:12s} {backend:6s} {status:10s} {ms if ms is not None else ''}")
            prev = s1 if s1 is not None else prev


if __name__ == "__main__":
    main()
