"""Issue 16 on the GPU: (a) a fresh process reproduces the tuned time of XLA-heavy plans, and (b) the preallocation case.

    python -m benchmarks.deploy_repro --out $OUT/deploy_repro.md [--commit HASH] [--deadline 540]
        [--programs cross_entropy:float32,gpt2:bfloat16] [--trials 6] [--n 3] [--parts a,b]
    python -m benchmarks.deploy_repro --small --out /tmp/deploy_repro_cpu.md     # the whole path on a CPU (model mode)

(a) XLA re-autotunes its GEMMs at every compilation and does not always pick the same kernels, so the parts of a
plan left to XLA (and the jax.jit baseline) may drift between the tuning job and a deployed process. `import
autofuse` points XLA's per-fusion autotune cache at one directory (`autofuse/xla_autotune.py`). Here: each program
whose plan keeps most of its work in XLA GEMMs (default: the suite's large-vocabulary cross-entropy in float32,
7 ms of GEMM, whose plan is XLA's own; GPT-2 medium's forward with 2 layers, B8 S2048, whose plan fuses the
attention and leaves 9 of its 13 dots to XLA; any suite workload as NAME:DTYPE, `gpt2:<dtype>` names GPT-2,
whose inputs are bf16 anyway) is tuned by `autofuse tune` in a subprocess (device measurement, a small trial
budget, a SQLite store and `AUTOFUSE_XLA_AUTOTUNE_DIR` in a temporary directory); the plan's tuned ms and jax.jit
ms are read from the store (the job's final validation: the two timed in alternation, `time_pair`). Then `--n`
fresh processes with the same autotune directory, each `autofuse.jit(fn, store=db)` on every program, time the
plan and jax.jit of the same program on the validation's 3 input sets (same seeds), warmup, median of `--repeats`:
in alternation as the validation did (the verdict: within ±3% of the tuned ms passes), and each alone
(`time_fn`). As the control, as many fresh processes with `AUTOFUSE_XLA_AUTOTUNE_DIR` pointing at a new empty
directory each (XLA autotunes afresh), alternating with the cached ones so that both see the same GPU clocks.
"new cache entries": files the process added to its autotune directory (a cached process that adds none compiled
only fusions whose autotuning the job had stored: it runs the GEMM kernels the job measured).

(b) A caller that makes arrays before `import autofuse` lets JAX preallocate 75% of the GPU in its own process;
the trial subprocess then gets the rest, and big candidates fail out of memory. A child process makes the caller's
arrays (q, k, v of the suite's attention in float32, `benchmarks.workloads.attention_bhld`, [8, 32, 2048, 128]:
the "held-out float32 attention" of the issue) on the GPU and runs `autofuse.tune` on them with a few trials, in
two orders: good (import autofuse first), then bad (import jax, make the arrays, then import autofuse). Per order:
whether tune() warned (its line), the caller's JAX pool, the GPU's free memory before the job (nvidia-smi: what
the trial process can have) and the memory limit JAX sets in a fresh process started as the trial process is
(import autofuse, then JAX with `XLA_PYTHON_CLIENT_PREALLOCATE=false`: 75% of the card, whatever is free, so the
trial process learns of the shortage only when an allocation fails), and from the job's store (read back even
when the job is killed at its time limit): how far it got, the XLA timings that failed, the trials that failed
out of memory, and the plan's speedup. A failed allocation costs about 10 s (JAX's allocator waits for memory to
be freed before it gives up), so a job short of memory is slow as well as worse: the bad order gets the longer
limit (`--b-timeout`). The allocator variables are removed from these children's environment (JAX's default is
the case under test). (b) runs first: its length is bounded by its limits; (a) takes what is left of
`--deadline` (at least `--a-reserve`), and a fresh process that no longer fits is a row that says so.

The parent process imports neither JAX's backends nor autofuse (it would change the environment its children
inherit). The Markdown table is rewritten after every row, so a run cut short keeps what it did; what is skipped
for want of time (`--deadline`) says so. Logs of every subprocess are kept beside it (`<out>.logs/`, or `--logs DIR`).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.provenance import commit  # noqa: E402  (the tree's root on the path first: run as a script too)

FLAG = "--xla_gpu_per_fusion_autotune_cache_dir"  # autofuse.xla_autotune.FLAG (importing autofuse here would set it)
ENV_DIR = "AUTOFUSE_XLA_AUTOTUNE_DIR"
ALLOCATOR_VARS = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION",
                  "XLA_PYTHON_CLIENT_ALLOCATOR")  # autofuse.gpumem.ALLOCATOR_VARS
DEFAULT_PROGRAMS = "cross_entropy:float32,gpt2:bfloat16"
SMALL_PROGRAMS = "cross_entropy:float32,gpt2:float32"
GPT2_LAYERS = 2
TOLERANCE = 0.03
PREALLOC_LINE = "JAX preallocated"  # autofuse.gpumem.preallocation_warning's line contains it
ALLOC_FAILED = "ran out of memory trying to allocate"  # JAX's allocator, once per allocation that failed (after its ~10 s wait)


# ---------------------------------------------------------------------------------------------------- programs

def fn_ref(name: str) -> str:
    """`MODULE:FUNCTION` of a program: a suite workload by its name, or gpt2 (GPT-2 medium's forward)."""
    if name == "gpt2":
        return "examples.gpt2:forward"
    from benchmarks.workloads import workloads

    found = [w for w in workloads() if w.name == name]
    if not found:
        raise ValueError(f"unknown program {name!r}: a workload of benchmarks/workloads.py or gpt2")
    return f"benchmarks.workloads:{found[0].fn.__name__}"


def example_args(name: str, dtype: str, small: bool = False) -> tuple:
    """The program's arguments as shapes (`jax.ShapeDtypeStruct` pytrees)."""
    import jax
    import jax.numpy as jnp

    if name == "gpt2":
        from examples import gpt2

        return tuple(jax.eval_shape(gpt2.small_inputs if small else (lambda: gpt2.example_inputs(GPT2_LAYERS))))
    from benchmarks.workloads import specs, workloads

    (w,) = [w for w in workloads(small) if w.name == name]
    return tuple(specs(w, jnp.dtype(dtype)))


def __getattr__(attr: str) -> Any:
    """`inputs__<program>__<dtype>[__small]`: the `--inputs` factory `autofuse tune` is given for a program."""
    if attr.startswith("inputs__"):
        parts = attr.split("__")[1:]
        if len(parts) in (2, 3) and parts[2:] in ([], ["small"]):
            return lambda: example_args(parts[0], parts[1], small=len(parts) == 3)
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


def attention_shape(batch: int, small: bool) -> tuple[int, ...]:
    return (2, 2, 100, 64) if small else (batch, 32, 2048, 128)


# ---------------------------------------------------------------------------------------------------- helpers
def is_oom(text: str | None) -> bool:
    """An out-of-memory failure of the device's memory (not shared memory or registers)."""
    low = (text or "").lower()
    return "out of memory" in low or ("resource_exhausted" in low and "shared memory" not in low and "smem" not in low
                                      and "register" not in low)


def cache_files(path: str) -> int:
    """Files under an autotune directory (XLA writes one per fusion and device)."""
    if not os.path.isdir(path):
        return 0
    return sum(len(files) for _, _, files in os.walk(path))


def child_env(autotune_dir: str | None = None, strip_allocator: bool = False) -> dict[str, str]:
    """This environment for a child: `AUTOFUSE_XLA_AUTOTUNE_DIR` set, the autotune flag removed from `XLA_FLAGS`
    (so that the directory is autofuse's), no persistent compilation cache (it would hide recompilation)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(FLAG + "=")]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    else:
        env.pop("XLA_FLAGS", None)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    if autotune_dir is not None:
        env[ENV_DIR] = autotune_dir
    if strip_allocator:
        for k in ALLOCATOR_VARS:
            env.pop(k, None)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    return env


def run_logged(cmd: list[str], env: dict[str, str], log: str, limit_s: float) -> tuple[Any, str, float]:
    """Run `cmd` in its own process group (killed whole at `limit_s`): exit code or "timeout", stdout, seconds."""
    t0 = time.time()
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=f, env=env, cwd=ROOT, start_new_session=True, text=True)
        try:
            out, _ = proc.communicate(timeout=max(1.0, limit_s))
            code: Any = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the child and its trial processes
            out, _ = proc.communicate()
            code = "timeout"
        f.write("\n--- stdout ---\n" + (out or ""))
    return code, out or "", time.time() - t0


def read_json_lines(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def nvidia_smi_free() -> dict[str, Any]:
    """Free and total memory (MiB) of the first visible GPU as nvidia-smi sees it, or {} without it."""
    try:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
        cmd = ["nvidia-smi", "--query-gpu=memory.free,memory.total", "--format=csv,noheader,nounits"] + (["-i", visible] if visible else [])
        line = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True).stdout.strip().splitlines()[0]
        free, total = (int(x) for x in line.split(","))
        return {"free_mib": free, "total_mib": total}
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return {}


PROBE = ("import json, autofuse, jax; d = jax.devices()[0]; s = {}\n"
         "try: s = d.memory_stats() or {}\nexcept Exception: pass\n"
         "print(json.dumps({'bytes_limit': s.get('bytes_limit'), 'platform': d.platform}))")


def trial_like_limit() -> dict[str, Any]:
    """The memory limit of a fresh process started as the trial process is (its environment, import autofuse, JAX)."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONUNBUFFERED="1")  # as autofuse.runner.process spawns it
    try:
        out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT,
                             check=False)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        return {"error": f"{type(e).__name__}: {e}"}


# ---------------------------------------------------------------------------------------------------- children
def child_deploy(a: argparse.Namespace) -> int:
    """A fresh process: `autofuse.jit(fn, store=db)` of each program, timed against the tuned times, one JSON line each."""
    import jax
    import numpy as np

    import autofuse  # before JAX's backends start (jax.devices below): it sets the autotune directory and the allocator
    from autofuse.refs import resolve
    from autofuse.graph import Aval
    from autofuse.runner.measure import random_inputs, time_fn, time_pair

    d = jax.devices()[0]
    base = {"label": a.label, "autotune_dir": autofuse._xla_autotune.DIR, "device": d.device_kind if d.platform == "gpu" else d.platform,
            "jax": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", "")}
    for spec in a.programs.split(","):
        name, dtype = spec.split(":")
        row = dict(base, program=f"{name}-{dtype}")
        before = cache_files(base["autotune_dir"] or "")
        try:
            fn = resolve(fn_ref(name))
            args = example_args(name, dtype, a.small)
            leaves, tree = jax.tree_util.tree_flatten(args)
            avals = [Aval(tuple(x.shape), np.dtype(x.dtype)) for x in leaves]
            sets = [tuple(jax.tree_util.tree_unflatten(tree, random_inputs(avals, 1000 + k))) for k in range(3)]  # the validation's seeds
            graph = autofuse.capture(fn, *args)
            row["dots"] = [n.id for n in graph.nodes if n.name == "dot_general"]
            fused, xla = autofuse.jit(fn, store=a.db), jax.jit(fn)
            t0 = time.perf_counter()
            jax.block_until_ready(fused(*sets[0]))
            row["first_call_s"] = time.perf_counter() - t0
            row["status"] = fused.last_status
            t0 = time.perf_counter()
            jax.block_until_ready(xla(*sets[0]))
            row["jit_first_call_s"] = time.perf_counter() - t0
            row["new_entries"] = cache_files(base["autotune_dir"] or "") - before
            # As the job's validation timed them (jax.jit and the plan in alternation, `time_pair`), then each alone (`time_fn`).
            bx, bp, ratio = time_pair(xla, fused, sets, repeats=a.repeats)
            row.update(plan_ms=bp.median_ms, plan_spread=bp.spread, jit_ms=bx.median_ms, jit_spread=bx.spread, ratio=ratio.median_ms,
                       ratio_spread=ratio.spread)
            tp = time_fn(fused, sets, repeats=a.repeats)
            tx = time_fn(xla, sets, repeats=a.repeats)
            row.update(plan_alone_ms=tp.median_ms, jit_alone_ms=tx.median_ms)
        except Exception as e:  # noqa: BLE001 - one program's failure is its row, the others go on
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        with open(a.json_out, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
    return 0


def child_prealloc(a: argparse.Namespace) -> int:
    """The caller of (b): its arrays made on the GPU before (bad) or after (good) `import autofuse`, then tune()."""
    shape = attention_shape(a.b_batch, a.small)
    row: dict[str, Any] = {"order": a.order, "shape": "x".join(map(str, shape)) + " float32"}
    if a.order == "good":
        import autofuse  # first: JAX's GPU client will start without preallocating
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(kk, shape, jnp.float32) for kk in keys)  # the caller's arrays: JAX's GPU client starts here
    jax.block_until_ready((q, k, v))
    import autofuse  # the bad order: only now
    from autofuse.plan import describe_groups
    from benchmarks.workloads import attention_bhld

    d = jax.devices()[0]
    row.update(device=d.device_kind if d.platform == "gpu" else d.platform, jax=jax.__version__,
               allocator_env={k: os.environ[k] for k in ALLOCATOR_VARS if k in os.environ})
    try:
        st = d.memory_stats() or {}
        row["caller_pool_gib"] = st["pool_bytes"] / 2**30 if st.get("pool_bytes") is not None else None
        row["caller_limit_gib"] = (st.get("bytes_limit") or 0) / 2**30 or None
    except Exception as e:  # noqa: BLE001 - not every backend reports memory
        row["memory_stats_error"] = f"{type(e).__name__}: {e}"
    row["smi"] = nvidia_smi_free()
    row["trial_like"] = trial_like_limit()
    print(json.dumps(row), flush=True)
    print("--- tune() begins ---", file=sys.stderr, flush=True)
    t0 = time.time()
    try:
        rep = autofuse.tune(attention_bhld, q, k, v, trials=a.b_trials, store=a.db, name=f"attention-float32-{a.order}", quiet=True,
                            measure="model" if a.small else "device")
    except Exception as e:  # noqa: BLE001 - the row says what happened
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    else:
        v = rep.validation
        row.update(
            tune_s=time.time() - t0, speedup=rep.speedup, baseline_ms=rep.baseline_ms, tuned_ms=rep.tuned_ms,
            plan="XLA" if rep.plan.is_xla else describe_groups(rep.plan) + ": " + ", ".join(f"{g.template}/{g.backend}" for g in rep.plan.groups),
            validation=None if v is None else (v.status.value + (f": {v.error[:200]}" if v.error else "")),
            validation_oom=bool(v is not None and is_oom(v.error)), summary=rep.summary())
    with open(a.json_out, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)
    return 0


# ---------------------------------------------------------------------------------------------------- the table
DOING = {"start": "setting up", "setup": "timing the candidates in XLA", "xla": "running trials", "trials": "selecting and validating",
         "selected": "saving the plan", "saved": "done"}  # what a job was doing after the last phase it reached


def _f(x: Any, fmt: str = "{:.3f}") -> str:
    return "—" if x is None else fmt.format(x)


def _cell(s: Any) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def plan_text(plan: dict | None) -> str:
    groups = (plan or {}).get("groups") or []
    if not groups:
        return "XLA (nothing beat jax.jit)"
    return f"{len(groups)} fused: " + ", ".join(f"{g['template']}/{g.get('backend', 'triton')}" for g in groups)


def dots_in_xla(plan: dict | None, dots: list[int] | None) -> str:
    if dots is None:
        return "—"
    fused = {n for g in (plan or {}).get("groups") or [] for n in g["nodes"]}
    return f"{sum(d not in fused for d in dots)}/{len(dots)}"


def markdown(header: dict[str, str], tunes: list[dict], fresh: list[dict], prealloc: list[dict], notes: list[str]) -> str:
    L = ["# Issue 16 on the GPU: a fresh process reproduces the tuned time (XLA autotune cache), and the preallocation case", ""]
    L += [f"- {k}: {v}" for k, v in header.items()]
    L += ["", "## (a) Deployed in a fresh process: plan time against the tuned time (±3%)", "",
          "Tuning jobs (`autofuse tune` in a subprocess; tuned and jax.jit ms: the job's final validation, the two timed in alternation):", "",
          "| program | exit | plan | dots left to XLA | trials | tune s | tuned ms | jax.jit ms | speedup | noise | autotune entries written |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    dots = {r["program"]: r.get("dots") for r in fresh if r.get("dots") is not None}
    for t in tunes:
        j = t.get("json") or {}
        noise = t.get("noise")
        L.append(f"| {t['program']} | {t['exit']} | {_cell(plan_text(j.get('plan')) if j else t.get('error', '—'))} | "
                 f"{dots_in_xla(j.get('plan'), dots.get(t['program']))} | {_f(j.get('trials'), '{}')} | {_f(t.get('wall_s'), '{:.0f}')} | "
                 f"{_f(j.get('tuned_ms'), '{:.4f}')} | {_f(j.get('baseline_ms'), '{:.4f}')} | {_f(j.get('speedup'), '{:.2f}x')} | "
                 f"{_f(noise, '±{:.1%}')} | {_f(t.get('entries'), '{}')} |")
    by_prog = {t["program"]: t.get("json") or {} for t in tunes}
    L += ["", ("Fresh processes (`autofuse.jit(fn, store=db)`; each process times every program; cached and empty alternate). "
               "plan ms and jax.jit ms: timed in alternation (`time_pair`, as the job's validation timed the tuned ms), the speedup "
               "the median per-repeat ratio; alone: each timed by itself (`time_fn`):"), "",
          ("| program | process | XLA autotune cache | lookup | first call s | new cache entries | plan ms | plan / tuned | within ±3% "
           "| jax.jit ms | jax.jit / tuned jax.jit | speedup now (tuned) | alone: plan ms, jax.jit ms |"),
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in fresh:
        j = by_prog.get(r["program"], {})
        if r.get("skipped") or r.get("error"):
            L.append(f"| {r['program']} | {r['label']} | {r.get('cache', '')} | {_cell(r.get('skipped') or r.get('error'))} | | | | | | | | | |")
            continue
        pr = r["plan_ms"] / j["tuned_ms"] if j.get("tuned_ms") else None
        jr = r["jit_ms"] / j["baseline_ms"] if j.get("baseline_ms") else None
        ok = "—" if pr is None else ("pass" if abs(pr - 1) <= TOLERANCE else "**fail**")
        L.append(f"| {r['program']} | {r['label']} | {r['cache']} | {_cell(r.get('status', ''))} | {_f(r.get('first_call_s'), '{:.1f}')} | "
                 f"{_f(r.get('new_entries'), '{}')} | {r['plan_ms']:.4f} (IQR {r['plan_spread']:.1%}) | {_f(pr)} | {ok} | "
                 f"{r['jit_ms']:.4f} | {_f(jr)} | {1 / r['ratio']:.2f}x ({_f(j.get('speedup'), '{:.2f}x')}) | "
                 f"{r['plan_alone_ms']:.4f}, {r['jit_alone_ms']:.4f} |")
    L += [""] + summary_lines(tunes, fresh)
    L += ["", "## (b) Arrays made before `import autofuse` (JAX preallocates 75% of the GPU in the caller's process)", "",
          ("| order | caller's arrays (q, k, v) | caller's JAX pool GiB (limit) | warned | GPU free MiB before the job (nvidia-smi) "
           "| trial-like process: JAX limit GiB | job | allocations that failed (its log) | XLA timings failed | trials ok/run "
           "| trials out of memory | validation | plan | speedup |"),
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in prealloc:
        if r.get("skipped"):
            L.append(f"| {r['order']} | {r['skipped']} | | | | | | | | | | | | |")
            continue
        order = {"bad": "bad: jax, arrays, then `import autofuse`", "good": "good: `import autofuse` first"}[r["order"]]
        smi, db = r.get("smi") or {}, r.get("db") or {}
        lim = (r.get("trial_like") or {}).get("bytes_limit")
        pool = f"{_f(r.get('caller_pool_gib'), '{:.1f}')} ({_f(r.get('caller_limit_gib'), '{:.1f}')})"
        warned = f"yes: {_cell(r['warning'])}" if r.get("warning") else "no"
        free = f"{_f(smi.get('free_mib'), '{}')}" + (f" of {smi['total_mib']}" if smi else "")
        if r.get("exit") == 0 and not r.get("error"):
            job = f"finished in {_f(r.get('wall_s'), '{:.0f}')} s"
        else:
            doing = DOING.get(db.get("phase", ""), f"after phase {db.get('phase', '?')}")
            job = f"{_cell(r.get('error') or 'exit ' + str(r.get('exit')))}; its store: run {db.get('status', '?')}, {doing}"
        xla = "—" if db.get("xla_failed") is None else f"{db['xla_failed']}/{db['candidates']}"
        val = "—" if r.get("validation") is None else ("out of memory" if r.get("validation_oom") else _cell(r["validation"])[:80])
        L.append(f"| {order} | {r.get('shape', '')} | {pool} | {warned} | {free} | {_f(lim and lim / 2**30, '{:.1f}')} | {job} | "
                 f"{_f(r.get('failed_allocations'), '{}')} | {xla} | "
                 f"{_f(db.get('trials_ok'), '{}')}/{_f(db.get('trials_run'), '{}')} | {_f(db.get('trials_oom'), '{}')} | {val} | "
                 f"{_cell(r.get('plan', '—'))} | {_f(r.get('speedup'), '{:.2f}x')} |")
    for r in prealloc:
        errs = (r.get("db") or {}).get("oom_errors")
        if errs:
            L.append(f"\n{r['order']} order, out-of-memory errors of its trials (first {len(errs)}): " + "; ".join(f"`{_cell(e)}`" for e in errs))
    if notes:
        L += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    return "\n".join(L) + "\n"


def summary_lines(tunes: list[dict], fresh: list[dict]) -> list[str]:
    out = []
    by_prog = {t["program"]: t.get("json") or {} for t in tunes}
    for prog, j in by_prog.items():
        if not j.get("tuned_ms"):
            continue
        parts = []
        for cache in ("tuned", "empty"):
            rs = [r for r in fresh if r["program"] == prog and r.get("cache") == cache and r.get("plan_ms")]
            if not rs:
                continue
            ratios = [r["plan_ms"] / j["tuned_ms"] for r in rs]
            jits = [r["jit_ms"] / j["baseline_ms"] for r in rs] if j.get("baseline_ms") else []
            within = sum(abs(x - 1) <= TOLERANCE for x in ratios)
            what = "the job's autotune cache" if cache == "tuned" else "an empty autotune cache (control)"
            parts.append(f"with {what}: {within}/{len(rs)} within ±3%, plan/tuned {min(ratios):.3f}–{max(ratios):.3f}"
                         + (f", jax.jit/tuned {min(jits):.3f}–{max(jits):.3f}" if jits else ""))
        if parts:
            out.append(f"- **{prog}**: " + "; ".join(parts))
    return out


# ---------------------------------------------------------------------------------------------------- the parent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.deploy_repro", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "deploy_repro.md"))
    ap.add_argument("--commit", default=None)
    ap.add_argument("--deadline", type=float, default=540.0, help="seconds for everything (default 540)")
    ap.add_argument("--parts", default="a,b", help="a (deploy reproduction), b (preallocation), or both")
    ap.add_argument("--programs", default=None, help=f"NAME:DTYPE,... for (a) (default {DEFAULT_PROGRAMS}; gpt2:bfloat16 adds GPT-2 medium's "
                    f"forward with {GPT2_LAYERS} layers)")
    ap.add_argument("--trials", type=int, default=6, help="trial budget of each tuning job in (a)")
    ap.add_argument("--time-budget", type=float, default=45.0, help="time budget (s) of each tuning job in (a)")
    ap.add_argument("--tune-timeout", type=float, default=200.0, help="kill a tuning job of (a) after this many seconds")
    ap.add_argument("--n", type=int, default=3, help="fresh processes with the job's autotune cache, and as many with an empty one")
    ap.add_argument("--repeats", type=int, default=20, help="timed repeats per measurement in a fresh process (the validation's 20)")
    ap.add_argument("--child-timeout", type=float, default=150.0)
    ap.add_argument("--b-batch", type=int, default=8, help="batch of (b)'s [B, 32, 2048, 128] float32 attention (the suite's 8)")
    ap.add_argument("--b-trials", type=int, default=3)
    ap.add_argument("--b-timeout", type=float, default=150.0, help="limit of (b)'s bad order, in seconds (the good order: half of it)")
    ap.add_argument("--a-reserve", type=float, default=330.0, help="seconds kept for (a) while (b) runs first")
    ap.add_argument("--logs", default=None, help="where the subprocesses' logs go (default: <out without .md>.logs/)")
    ap.add_argument("--workdir", default=None, help="stores and autotune directories (default: a new temporary directory, removed)")
    ap.add_argument("--small", action="store_true", help="CPU-sized shapes and model mode: the whole path without a GPU (times meaningless)")
    ap.add_argument("--child", choices=["deploy", "prealloc"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--db", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--label", default="", help=argparse.SUPPRESS)
    ap.add_argument("--json-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--order", choices=["bad", "good"], default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.programs = a.programs or (SMALL_PROGRAMS if a.small else DEFAULT_PROGRAMS)
    if a.child == "deploy":
        return child_deploy(a)
    if a.child == "prealloc":
        return child_prealloc(a)
    return parent(a, argv if argv is not None else sys.argv[1:])


def parent(a: argparse.Namespace, argv: list[str]) -> int:
    t_start = time.time()
    parts = {p.strip() for p in a.parts.split(",") if p.strip()}
    if not parts or parts - {"a", "b"}:
        raise SystemExit(f"--parts: a, b or a,b, not {a.parts!r}")
    programs = [p.strip() for p in a.programs.split(",") if p.strip()]
    for p in programs:
        fn_ref(p.split(":")[0])  # an unknown program fails here, in one line
    out = os.path.abspath(a.out)
    logs = os.path.abspath(a.logs) if a.logs else os.path.splitext(out)[0] + ".logs"
    os.makedirs(logs, exist_ok=True)
    work = os.path.abspath(a.workdir) if a.workdir else tempfile.mkdtemp(prefix="deploy_repro-")
    os.makedirs(work, exist_ok=True)
    header = {"card": "(from the children)", "jax": "(from the children)", "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
              "commit": commit(a.commit), "command": " ".join([os.path.basename(sys.executable), "-m", "benchmarks.deploy_repro", *argv]),
              "host": f"{os.uname().nodename}, {os.cpu_count()} cores, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}",
              "XLA_FLAGS given": os.environ.get("XLA_FLAGS", "(unset)") + f" (children: without any {FLAG})",
              "setup": (f"(b) first: attention {'x'.join(map(str, attention_shape(a.b_batch, a.small)))} float32, {a.b_trials} trials per "
                        f"order; then (a) {', '.join(programs)}: `autofuse tune --trials {a.trials} --time-budget {a.time_budget:g} "
                        f"--measure {'model' if a.small else 'device'}`, then {a.n} fresh processes with the job's autotune directory and "
                        f"{a.n} with an empty one, alternating, each timing with the validation's inputs (3 sets), median of "
                        f"{a.repeats} repeats")}
    if a.small:
        header["note"] = "--small: CPU-sized shapes, model mode; times are meaningless (the path is what is tried)"
    tunes: list[dict] = []
    fresh: list[dict] = []
    prealloc: list[dict] = []
    notes: list[str] = []

    def left() -> float:
        return a.deadline - (time.time() - t_start)

    def say(msg: str) -> None:
        print(f"[{time.time() - t_start:5.0f} s] {msg}", flush=True)

    def write() -> None:
        for r in [*fresh, *prealloc]:
            if r.get("device") and header["card"].startswith("("):
                header["card"], header["jax"] = r["device"], r.get("jax", "?")
        with open(out, "w") as f:
            f.write(markdown(header, tunes, fresh, prealloc, notes))

    try:
        if "b" in parts:  # first: its length is bounded by its limits, and (a) takes what is left
            keep = a.a_reserve if "a" in parts else 0.0
            for order in ("good", "bad"):
                limit = min(a.b_timeout / 2 if order == "good" else a.b_timeout, left() - keep)
                if limit < 40:
                    say(f"skip (b) {order} order: {left():.0f} s left of --deadline ({keep:.0f} s kept for (a))")
                    prealloc.append({"order": order, "skipped": "skipped: out of time"})
                    write()
                    continue
                prealloc.append(run_prealloc(a, order, work, logs, limit, say))
                write()
        if "a" in parts:
            run_deploy(a, programs, work, logs, left, say, write, tunes, fresh, notes)
    finally:
        write()
        if not a.workdir:
            shutil.rmtree(work, ignore_errors=True)
    with open(out) as f:
        print(f.read())
    print(f"written: {out} in {time.time() - t_start:.0f} s (logs in {logs})")
    return 0


def run_prealloc(a: argparse.Namespace, order: str, work: str, logs: str, limit: float, say: Any) -> dict:
    """(b) in one order: the child, then what its output, its log and its store say."""
    jpath = os.path.join(work, f"prealloc_{order}.jsonl")
    log = os.path.join(logs, f"prealloc_{order}.log")
    bdb = os.path.join(work, f"prealloc_{order}.db")
    cmd = [sys.executable, "-m", "benchmarks.deploy_repro", "--child", "prealloc", "--order", order, "--db", f"sqlite:///{bdb}",
           "--json-out", jpath, "--b-batch", str(a.b_batch), "--b-trials", str(a.b_trials)] + (["--small"] if a.small else [])
    say(f"(b) {order} order (limit {limit:.0f} s)")
    code, stdout, wall = run_logged(cmd, child_env(os.path.join(work, f"xla-autotune-b-{order}"), strip_allocator=True), log, limit)
    rows = read_json_lines(jpath)
    if rows:
        row = rows[-1]
    else:  # killed or crashed before the end: what it printed before tune() began
        printed = [json.loads(x) for x in stdout.splitlines() if x.startswith("{")]
        row = printed[-1] if printed else {"order": order}
        row["error"] = f"{'killed at its limit' if code == 'timeout' else f'exit {code}'} after {wall:.0f} s"
    row.update(exit=code, log=log, wall_s=wall, db=read_run_db(bdb))
    with open(log) as f:
        lines = f.read().splitlines()
    warn = [x for x in lines if PREALLOC_LINE in x]
    row["warning"] = warn[0].strip() if warn else ""
    row["failed_allocations"] = sum(ALLOC_FAILED in x for x in lines)
    say(f"    exit {code} in {wall:.0f} s: warned {'yes' if warn else 'no'}; {row.get('summary') or row.get('error')}; "
        f"{row['failed_allocations']} failed allocations in its log; store: {row['db']}")
    return row


def run_deploy(a: argparse.Namespace, programs: list[str], work: str, logs: str, left: Any, say: Any, write: Any, tunes: list[dict],
               fresh: list[dict], notes: list[str]) -> None:
    """(a): tune each program, then the fresh processes, cached and empty alternating."""
    tuned_dir = os.path.join(work, "xla-autotune")
    os.makedirs(tuned_dir, exist_ok=True)
    db = os.path.join(work, "plans.db")
    url = f"sqlite:///{db}"
    ok_programs = []
    for k, spec in enumerate(programs):
        name, dtype = spec.split(":")
        prog = f"{name}-{dtype}"
        limit = min(a.tune_timeout, left() - 60)  # 60 s: at least one fresh process after the jobs
        if limit < 30:
            say(f"skip tuning {prog}: {left():.0f} s left of --deadline")
            tunes.append({"program": prog, "exit": "skipped", "error": "skipped: out of time"})
            write()
            continue
        inputs = f"benchmarks.deploy_repro:inputs__{name}__{dtype}" + ("__small" if a.small else "")
        cmd = [sys.executable, "-m", "autofuse.cli", "tune", fn_ref(name), "--inputs", inputs, "--trials", str(a.trials),
               "--time-budget", f"{a.time_budget:g}", "--measure", "model" if a.small else "device", "--db", url, "--name", prog,
               "--json", "--quiet"]
        say(f"(a) tune {k + 1}/{len(programs)} {prog} (limit {limit:.0f} s)")
        before = cache_files(tuned_dir)
        log = os.path.join(logs, f"tune_{prog}.log")
        code, stdout, wall = run_logged(cmd, child_env(tuned_dir), log, limit)
        row: dict[str, Any] = {"program": prog, "spec": spec, "exit": code, "wall_s": wall, "entries": cache_files(tuned_dir) - before}
        try:
            row["json"] = json.loads(stdout)
        except ValueError:
            row["error"] = f"no report (exit {code}; log {log})"
        if row.get("json"):
            row["noise"] = noise_of(db, row["json"].get("plan_id"))
            ok_programs.append(spec)
        tunes.append(row)
        say(f"    exit {code} in {wall:.0f} s: {(row.get('json') or {}).get('summary') or row.get('error')}; "
            f"{row['entries']} autotune entries written")
        write()
    names = [f"{s.split(':')[0]}-{s.split(':')[1]}" for s in ok_programs]
    for i in range(a.n if ok_programs else 0):
        for cache in ("tuned", "empty"):
            label = f"{cache} #{i + 1}"
            limit = min(a.child_timeout, left())
            if limit < 20:
                say(f"skip fresh process {label}: {left():.0f} s left of --deadline")
                fresh += [{"program": n, "label": label, "cache": cache, "skipped": "skipped: out of time"} for n in names]
                write()
                continue
            adir = tuned_dir if cache == "tuned" else os.path.join(work, f"xla-autotune-empty-{i + 1}")
            os.makedirs(adir, exist_ok=True)
            jpath = os.path.join(work, f"fresh_{cache}_{i + 1}.jsonl")
            cmd = [sys.executable, "-m", "benchmarks.deploy_repro", "--child", "deploy", "--db", url, "--programs", ",".join(ok_programs),
                   "--label", label, "--json-out", jpath, "--repeats", str(a.repeats)] + (["--small"] if a.small else [])
            say(f"(a) fresh process {label} ({'the job' if cache == 'tuned' else 'an empty'} autotune dir, limit {limit:.0f} s)")
            code, _, wall = run_logged(cmd, child_env(adir), os.path.join(logs, f"fresh_{cache}_{i + 1}.log"), limit)
            rows = read_json_lines(jpath)
            for r in rows:
                r["cache"] = cache
                if r.get("autotune_dir") != adir:
                    notes.append(f"{label}: autofuse's autotune directory was {r.get('autotune_dir')!r}, not {adir!r}")
            done = {r["program"] for r in rows}
            rows += [{"program": n, "label": label, "cache": cache,
                      "error": f"{'killed at its limit' if code == 'timeout' else f'exit {code}'} after {wall:.0f} s, before this program"}
                     for n in names if n not in done]
            fresh += rows
            for r in rows:
                say(f"    {r['program']}: " + (f"plan {r['plan_ms']:.4f} ms, jax.jit {r['jit_ms']:.4f} ms (paired), {r.get('status')}"
                                            if r.get("plan_ms") else str(r.get("error") or r.get("skipped"))))
            write()


def read_run_db(db: str) -> dict[str, Any]:
    """What a (b) job's store says, read without importing JAX (also of a job killed midway): the run's status and
    the last phase it reached, its candidates and the XLA timings that failed (known once the XLA phase ended), its
    trials by outcome and those that failed out of memory (with the first errors)."""
    import sqlite3

    if not os.path.exists(db):
        return {"error": "no store (the job never opened it)"}
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
            run = con.execute("SELECT id, status, phases FROM autofuse_runs ORDER BY id DESC LIMIT 1").fetchone()
            if run is None:
                return {"error": "no run in the store"}
            run_id, status, phases = run
            marks = json.loads(phases) if phases else {}
            reached = [k for k in ("start", "setup", "xla", "trials", "selected", "saved") if isinstance(marks.get(k), (int, float))]
            cands = con.execute("SELECT xla_ms FROM autofuse_candidates WHERE run_id = ?", (run_id,)).fetchall()
            trials = con.execute("SELECT t.status, t.error FROM autofuse_trials t JOIN autofuse_candidates c ON c.id = t.candidate_id "
                                 "WHERE c.run_id = ?", (run_id,)).fetchall()
    except (sqlite3.Error, ValueError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    ran = [(st, err) for st, err in trials if st not in ("infeasible", "pruned", "lost")]
    ooms = [err for _, err in trials if is_oom(err)]
    return {"status": status, "phase": reached[-1] if reached else "—", "candidates": len(cands),
            "xla_failed": sum(x is None for (x,) in cands) if "xla" in reached else None,
            "trials_run": len(ran), "trials_ok": sum(st == "ok" for st, _ in ran), "trials_oom": len(ooms),
            "oom_errors": sorted({e[:160] for e in ooms})[:2]}


def noise_of(db: str, plan_id: int | None) -> float | None:
    """The stored plan's noise (the validation's spread of the plan / jax.jit ratio), read without importing JAX."""
    if plan_id is None:
        return None
    import sqlite3

    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
            (noise,) = con.execute("SELECT noise FROM autofuse_plans WHERE id = ?", (plan_id,)).fetchone()
        return noise
    except (sqlite3.Error, TypeError):
        return None


if __name__ == "__main__":
    raise SystemExit(main())
