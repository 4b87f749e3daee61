"""Small kernels timed by the host's clock (`runner.measure.time_fn`, as the tuner times groups) against the device's
own (the kernels' durations in a profiler trace of the same calls), on an idle host and on one as busy as a tuning
job's (every core spinning): whether a ~0.05 ms kernel's time in a job is its own or its dispatch's.

Why: a layer norm's forward and backward, tuned alone, ran 0.049 and 0.078 ms against XLA's 0.079 and 0.099; in a
GPT-2 training step's job the same groups timed 0.066-0.092 and 0.136-0.144 against XLA's 0.064 and 0.128
(results/recompute_h200.md). In the program no host dispatches a group: the plan's kernels run back to back.

    python -m benchmarks profile timing --out results/timing_probe.md
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

import autofuse
from autofuse.runner.evaluator import CANDIDATE_BATCH_MS
from autofuse.runner.measure import time_fn, time_kernels
from autofuse.runner.profile import traced_events
from benchmarks.norm_grad import CASES as NORM_CASES
from benchmarks.provenance import header
from benchmarks.workloads import emit


def gemm_gelu(x, w, b):
    """A kernel long enough that its dispatch hides behind it: GPT-2 medium's MLP up-projection."""
    return jax.nn.gelu(x @ w + b)


def _gemm_args(keys):
    return [jax.random.normal(keys[0], (16384, 1024), jnp.float32).astype(jnp.bfloat16),
            (0.03 * jax.random.normal(keys[1], (1024, 4096), jnp.float32)).astype(jnp.bfloat16),
            jnp.zeros((4096,), jnp.bfloat16) + 0.1]


CASES = {name: (fn, lambda keys, R=R, C=C, make=make: make(R, C, keys))
         for name, (fn, R, C, make) in NORM_CASES.items() if name in ("residual_norm_stats", "layer_norm_grad_from_input", "layer_norm_grad")}
CASES["gemm_gelu"] = (gemm_gelu, _gemm_args)
SETS = 4  # input sets rotated, as the tuner's groups are
REPEATS = 10  # the repeats of a group's timing (`Evaluator`'s default)


def device_span_ms(fn, sets, calls: int) -> float:
    """Per call, the device's span over `calls` calls rotating `sets`: first kernel's start to last one's end, the
    gaps between kernels included (where the host does not keep up, mostly gaps)."""
    jax.block_until_ready(fn(*sets[0]))

    def run():
        out = None
        for i in range(calls):
            out = fn(*sets[i % len(sets)])
        jax.block_until_ready(out)

    events = traced_events(run)
    if not events:  # no device plane: the CPU
        return float("nan")
    return (max(e.start_ns + e.duration_ns for e in events) - min(e.start_ns for e in events)) / calls / 1e6


def busy_host(n: int) -> list[subprocess.Popen]:
    """`n` processes spinning a core each (a tuning job's compile threads and lowering helpers)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=4, help="trials of each case's tuning job (its plan is what is timed)")
    ap.add_argument("--calls", type=int, default=400, help="calls per profiler trace")
    ap.add_argument("--busy", type=int, default=os.cpu_count() or 1, help="spinning processes for the busy host")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    rows = []
    for name, (fn, make_args) in CASES.items():
        sets = [make_args(jax.random.split(jax.random.PRNGKey(s), 4)) for s in range(SETS)]
        rep = autofuse.tune(fn, *sets[0], trials=a.trials, name=name, quiet=True, store=False)
        fns = {"jax.jit": jax.jit(fn)}
        if not rep.plan.is_xla:
            fns["autofuse"] = autofuse.jit(fn, plan=rep.plan)
        for label, f in fns.items():
            host, span = time_fn(f, sets).median_ms, device_span_ms(f, sets, a.calls)
            t0 = time.perf_counter()
            device = time_kernels(f, sets, repeats=REPEATS, target_ms=CANDIDATE_BATCH_MS).median_ms
            device_s = time.perf_counter() - t0
            procs = busy_host(a.busy)
            try:
                host_busy, span_busy = time_fn(f, sets).median_ms, device_span_ms(f, sets, a.calls)
                device_busy = time_kernels(f, sets, repeats=REPEATS, target_ms=CANDIDATE_BATCH_MS).median_ms
            finally:
                for p in procs:
                    p.kill()
            rows.append(f"| {name} | {label} | {host:.4f} | {host_busy:.4f} | {device:.4f} | {device_busy:.4f} | {span:.4f} | "
                        f"{span_busy:.4f} | {device_s:.2f} |")
            print(rows[-1], flush=True)
    emit([header(), "",
          f"Host clock: `time_fn` (the tuner's group timing before), median of 15 batches of ~25 ms, {SETS} input sets rotated. "
          f"Device: `time_kernels` (the tuner's group timing now: the kernels' durations in a trace of {REPEATS} batches "
          f"of ~{CANDIDATE_BATCH_MS:g} ms), and its seconds; the device's span per call over a trace of {a.calls} calls (gaps included). "
          f"Busy host: {a.busy} processes spinning.", "",
          "| program | run by | host clock, idle (ms) | host clock, busy | device, idle | device, busy | device span, idle | "
          "device span, busy | device timing's seconds |",
          "|---|---|---|---|---|---|---|---|---|", *rows], a.out)


if __name__ == "__main__":
    main()
