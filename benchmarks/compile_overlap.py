"""Does XLA compilation on threads overlap? The XLA references of a program's distinct candidates compiled ahead
(`Evaluator.compile_ahead`, the path a job's start takes) on 1 thread and on N, each in a fresh process (no
compilation cache shared), alternating, with wall and CPU time.

    python -m benchmarks.compile_overlap --fn examples.gpt2:forward --inputs examples.gpt2:small_inputs --threads 1,2 --repeats 3

Speedup = wall(1 thread) / wall(N threads); CPU/wall above 1 means several cores were busy at once (XLA:CPU also
compiles in parallel by itself, so one thread already uses more than one core there). On a machine whose cores
other work shares, wall times say little; "spinner kept" says whether compilation holds the GIL, whatever the
load: a pure-Python thread counting while the compile runs keeps this fraction of its rate alone (about 0 if
compilation held the GIL; up to 1 with a free core); and "compiles overlapping" is the fraction of the compiling
time when two or more `Lowered.compile` calls were in flight at once (0 if each held the GIL to its end).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable


def child(fn_ref: str, inputs_ref: str, threads: int, limit: int | None) -> dict:
    """Compile the program's candidates' XLA references on `threads` threads, in this process; what it took."""
    import autofuse
    from autofuse.runner.evaluator import Evaluator
    from autofuse.runner.protocol import CompileRequest, XlaRequest
    from autofuse.tuning.job import distinct_candidates
    from autofuse.refs import resolve

    graph = autofuse.capture(resolve(fn_ref), *resolve(inputs_ref)())
    _, cands = distinct_candidates(graph)
    cands = cands[:limit] if limit else cands
    ev = Evaluator(graph, measure="device")
    spans = record_compiles()
    alone = spin_rate(lambda: time.sleep(1.0))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu0, t0 = usage.ru_utime + usage.ru_stime, time.perf_counter()
    got: list = []
    during = spin_rate(lambda: got.append(ev.handle(CompileRequest(tuple(XlaRequest(tuple(r.nodes)) for r in cands), threads))))
    wall = time.perf_counter() - t0
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"threads": threads, "programs": got[0].compiled, "failed": got[0].failed, "wall_s": wall,
            "cpu_s": usage.ru_utime + usage.ru_stime - cpu0, "spinner_kept": during / alone, "overlap": overlap(spans)}


def record_compiles() -> list[tuple[float, float]]:
    """Every `Lowered.compile` from now on, as (start, end): XLA's compile proper, on whichever thread."""
    import jax

    spans: list[tuple[float, float]] = []
    compile_ = jax.stages.Lowered.compile

    def timed(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return compile_(self, *a, **k)
        finally:
            spans.append((t0, time.perf_counter()))

    jax.stages.Lowered.compile = timed
    return spans


def overlap(spans: list[tuple[float, float]]) -> float:
    """Of the time some compile was running, the fraction when two or more were: 0 if compiling held the GIL
    (no thread could even start one while another ran), whatever the machine's load."""
    events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    busy = multi = 0.0
    depth, last = 0, None
    for t, d in events:
        if last is not None and depth >= 1:
            busy += t - last
            multi += (t - last) if depth >= 2 else 0.0
        depth, last = depth + d, t
    return multi / busy if busy else 0.0


def spin_rate(work: Callable[[], None]) -> float:
    """Counts per second of a pure-Python loop on another thread while `work` runs."""
    stop, out = threading.Event(), []

    def spin() -> None:
        n = 0
        while not stop.is_set():
            n += 1
        out.append(n)

    t = threading.Thread(target=spin)
    t0 = time.perf_counter()
    t.start()
    work()
    stop.set()
    t.join()
    return out[0] / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compile_overlap")
    p.add_argument("--fn", default="examples.gpt2:forward")
    p.add_argument("--inputs", default="examples.gpt2:small_inputs")
    p.add_argument("--threads", default="1,2", help="thread counts to compare, the first the baseline")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--limit", type=int, default=None, help="compile only the first N candidates")
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child is not None:
        print(json.dumps(child(a.fn, a.inputs, a.child, a.limit)))
        return 0
    counts = [int(x) for x in a.threads.split(",")]
    runs: dict[int, list[dict]] = {n: [] for n in counts}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), *filter(None, [os.environ.get("PYTHONPATH")])]))
    for k in range(a.repeats):
        for n in counts:  # alternating, so that the load of a shared machine falls on both alike
            out = subprocess.run([sys.executable, "-m", "benchmarks.compile_overlap", "--fn", a.fn, "--inputs", a.inputs, "--child", str(n)]
                                 + (["--limit", str(a.limit)] if a.limit else []), env=env, capture_output=True, text=True, check=True)
            runs[n].append(json.loads(out.stdout.strip().splitlines()[-1]))
            r = runs[n][-1]
            print(f"repeat {k} threads {n}: {r['programs']} programs in {r['wall_s']:.2f} s wall, {r['cpu_s']:.2f} s CPU, "
                  f"spinner kept {r['spinner_kept']:.2f}, compiles overlapping {r['overlap']:.0%} of the time", flush=True)
    base = statistics.median(r["wall_s"] for r in runs[counts[0]])
    print(f"\n{a.fn} ({a.inputs}), {os.cpu_count()} cores")
    print(f"load average before: {os.getloadavg()[0]:.1f}")
    print("threads  wall s (median)  CPU s (median)  CPU/wall  speedup  spinner kept  compiles overlapping")
    for n in counts:
        wall, cpu = statistics.median(r["wall_s"] for r in runs[n]), statistics.median(r["cpu_s"] for r in runs[n])
        kept = statistics.median(r["spinner_kept"] for r in runs[n])
        ovl = statistics.median(r["overlap"] for r in runs[n])
        print(f"{n:7d}  {wall:15.2f}  {cpu:14.2f}  {cpu / wall:8.2f}  {base / wall:6.2f}x  {kept:12.2f}  {ovl:19.0%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
