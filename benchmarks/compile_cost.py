"""What compiling a whole program costs on the GPU, and what of it is XLA's autotuning (issue 18's 66 s).

    python -m benchmarks.compile_cost --out $OUT/compile_cost.md [--program examples.gpt2:forward]
        [--inputs examples.gpt2:example_inputs] [--db sqlite:///run.db] [--commit HASH]

Each mode runs in a fresh process (XLA's in-process caches empty) and reports the seconds to trace and lower
`jax.jit(fn)`, to compile it, and the median of its calls:

- ``cold``: XLA's per-fusion autotune cache in an empty directory (what a tuning job's first compile of the
  whole program pays when its candidates' fusions were different ones);
- ``cached``: the same directory, now filled by ``cold`` (what a deployed process, or a second compile, pays);
- ``no-autotune``: ``--xla_gpu_autotune_level=0`` (XLA's default GEMM configs: compile cost without autotuning,
  and what the program's speed owes to it);
- ``plan`` (with ``--db``): ``autofuse.jit(fn, store=db)``'s first call, the stored plan's kernels and XLA's
  parts, with the autotune directory of ``cached``.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile

MODES = ("cold", "cached", "no-autotune", "plan")


def measure(program: str, inputs: str, mode: str, db: str | None) -> dict:
    """In this (fresh) process: seconds to lower and compile, the median ms of 20 calls; JSON on stdout."""
    import importlib
    import time

    import jax
    import numpy as np

    def load(ref: str):
        mod, name = ref.split(":")
        return getattr(importlib.import_module(mod), name)

    fn, args = load(program), load(inputs)()
    jax.block_until_ready(args)
    out: dict = {"mode": mode, "device": jax.devices()[0].device_kind}
    t0 = time.perf_counter()
    if mode == "plan":
        import autofuse

        f = autofuse.jit(fn, store=db)
        jax.block_until_ready(f(*args))
        out["first_call_s"] = round(time.perf_counter() - t0, 2)
        out["status"] = str(getattr(f, "last_status", ""))[:120]
        call = f
    else:
        lowered = jax.jit(fn).lower(*args)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
        out["lower_s"], out["compile_s"] = round(t1 - t0, 2), round(t2 - t1, 2)
        call = compiled
    jax.block_until_ready(call(*args))
    times = []
    for _ in range(20):
        s = time.perf_counter()
        jax.block_until_ready(call(*args))
        times.append((time.perf_counter() - s) * 1e3)
    out["median_ms"], out["spread_ms"] = round(float(np.median(times)), 3), round(float(np.ptp(times)), 3)
    return out


def run_mode(program: str, inputs: str, mode: str, cache_dir: str, db: str | None) -> dict:
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", AUTOFUSE_XLA_AUTOTUNE_DIR=cache_dir)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "autotune" not in f]
    flags.append(f"--xla_gpu_per_fusion_autotune_cache_dir={cache_dir}")
    if mode == "no-autotune":
        flags.append("--xla_gpu_autotune_level=0")
    env["XLA_FLAGS"] = " ".join(flags)
    cmd = [sys.executable, "-m", "benchmarks.compile_cost", "--one", mode, "--program", program, "--inputs", inputs]
    if db:
        cmd += ["--db", db]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode or not lines:
        return {"mode": mode, "error": (p.stderr.strip().splitlines() or ["exit %d" % p.returncode])[-1][:200]}
    res = json.loads(lines[-1])
    res["cache_files"] = sum(len(f) for _, _, f in os.walk(cache_dir))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--program", default="examples.gpt2:forward")
    ap.add_argument("--inputs", default="examples.gpt2:example_inputs")
    ap.add_argument("--db", default=None, help="a store with a plan for the program: adds the 'plan' mode")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "compile_cost.md"))
    ap.add_argument("--commit", default=None)
    ap.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(measure(a.program, a.inputs, a.one, a.db)))
        return
    from benchmarks.provenance import commit

    cache_dir = tempfile.mkdtemp(prefix="autofuse-compile-cost-")
    rows = []
    for mode in MODES:
        if mode == "plan" and not a.db:
            continue
        rows.append(run_mode(a.program, a.inputs, mode, cache_dir, a.db))
        print(json.dumps(rows[-1]), flush=True)
    import jax

    lines = [f"# Compile cost of `{a.program}` ({a.inputs})", "",
             f"Card: {rows[0].get('device', '?')}; jax {jax.__version__}; {dt.date.today()}; commit {commit(a.commit)}.",
             f"Command: `python -m benchmarks.compile_cost {' '.join(sys.argv[1:])}`", "",
             "Each mode in a fresh process. cache files: XLA per-fusion autotune cache entries after the mode.", "",
             "| mode | lower s | compile s | first call s | median ms | spread ms | cache files | note |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r.get('lower_s', '')} | {r.get('compile_s', '')} | {r.get('first_call_s', '')} | "
                     f"{r.get('median_ms', '')} | {r.get('spread_ms', '')} | {r.get('cache_files', '')} | "
                     f"{r.get('error', r.get('status', ''))} |")
    with open(a.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
