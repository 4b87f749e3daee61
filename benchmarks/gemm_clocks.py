"""GEMM and attention kernels at the card's two clocks: the Mosaic GPU `matmul` and `attention` lowerings (and XLA's
cuBLAS, JAX's hand-written `hopper_matmul_mgpu`, cuDNN's fused attention) timed by CUPTI as a burst after the card
idled (40 launches back to back: its boost clock) and again after a second of back-to-back calls (its clock under its
power cap), with the SM clock sampled meanwhile.

Why two: an H200 here runs a K = 1024 GEMM at 1980 MHz in a burst and at 1425-1650 MHz after a second of them
(nvidia-smi's clock event reason 0x4, the software power cap), its GEMMs 13-21% slower there, and a kernel that
draws more power is capped lower. JAX's GEMM benchmark (and GPU_NOTES' 799 TFLOP/s for `hopper_matmul_mgpu`) times bursts; the tuner's
`time_fn` sits in between. Every kernel is checked against jax.jit on the inputs before it is timed.

    python -m benchmarks kernels gemm-clocks [--only gemm-8192^3] [--configs JSON] [--hopper] [--out results/x.md]
    python -m benchmarks kernels gemm-clocks --configs '{"attention-B8H32L2048D64": [{}, {"overlap": 1}]}'

cuDNN (`jax.nn.dot_product_attention(implementation="cudnn")`) takes [B, L, H, D]: it is checked and timed on the same
inputs transposed beforehand, so no transpose is in its time.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from autofuse.kernels import TEMPLATES
from autofuse.kernels.mosaic_gpu import matmul as mosaic_matmul
from autofuse.runner.measure import check, cone_tolerances, random_inputs, time_fn, time_pair
from benchmarks.mosaic_probe import DTYPES, WORKLOADS, _group, arg_specs, attention_causal, cudnn_attention, flops_of
from benchmarks.provenance import header
from benchmarks.workloads import emit

# Issue 31's GEMM bars and the configs measured for them (each over the lowering's default; one without `pingpong`
# over the cooperative schedule's default, as `kernels mosaic` runs them); a plain GEMM also runs `hopper_matmul_mgpu`.
CONFIGS = {
    "bias-gelu-16384x1024x4096": [{}, {"pingpong": 1, "max_concurrent_steps": 5}, {"pingpong": 1, "block_n": 192, "cluster": 1},
                                  {"pingpong": 1, "block_n": 192}],
    "bias-residual-16384x4096x1024": [{}, {"pingpong": 1, "max_concurrent_steps": 5, "cluster": 2}, {"pingpong": 1, "max_concurrent_steps": 5}],
    "bias-gelu-8192x4096x8192": [{}],
    "gemm-16384x1024x4096": [{}],
    "gemm-8192^3": [{}, {"pingpong": 1, "block_m": 128, "block_n": 192, "block_k": 64, "max_concurrent_steps": 4}],
    # and attention against cuDNN (issue 31: <= 0.92x its time, D128 and D64)
    "attention-B8H32L2048D128": [{}, {"overlap": 1}],
    "attention-causal-B8H32L2048D128": [{}, {"overlap": 1}],
    "attention-B8H32L2048D64": [{}, {"overlap": 1}],
    "attention-causal-B8H32L2048D64": [{}, {"overlap": 1}],
}
# hopper_matmul_mgpu's own tuning space (tile_m, tile_n, wg_dimension, grid_tile_width, grid_minor_dim) where it fits
# in shared memory at 4 stages of 64-wide K steps
HOPPER = [(128, 128, "M", 8, "N"), (128, 128, "N", 8, "N"), (128, 128, "M", 16, "N"), (128, 128, "M", 4, "M"), (128, 128, "N", 16, "M"),
          (128, 64, "M", 8, "N"), (128, 64, "N", 16, "N"), (256, 64, "N", 8, "N")]
BURST = 40  # launches timed by CUPTI


@dataclass(frozen=True)
class ClockWindow:
    samples: int
    median_mhz: int
    reasons: tuple[str, ...]  # nvidia-smi's clocks_event_reasons.active seen (0x4: the software power cap)


def clock_window(csv_lines: list[str], t0: float, t1: float) -> ClockWindow:
    """The SM clock over [t0, t1] (Unix seconds) from `nvidia-smi --query-gpu=timestamp,clocks.sm,clocks_event_reasons.active
    --format=csv,noheader` lines."""
    mhz, reasons = [], set()
    for line in csv_lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 3:
            continue
        try:
            t = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            clock = int(parts[1].split()[0])
        except ValueError:
            continue
        if t0 <= t <= t1:
            mhz.append(clock)
            reasons.add(parts[2])
    return ClockWindow(len(mhz), int(np.median(mhz)) if mhz else 0, tuple(sorted(reasons)))


class ClockSampler:
    """nvidia-smi sampling the SM clock every 20 ms into a file while the benchmark runs (nothing where it is missing)."""

    def __enter__(self) -> "ClockSampler":
        self.file = tempfile.NamedTemporaryFile("w+", suffix=".csv", delete=False)
        try:
            self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,clocks_event_reasons.active", "--format=csv,noheader",
                                          "-lms", "20"], stdout=self.file, stderr=subprocess.DEVNULL)
        except OSError:
            self.proc = None
        return self

    def window(self, t0: float, t1: float) -> ClockWindow:
        self.file.flush()
        with open(self.file.name) as f:
            return clock_window(f.readlines(), t0, t1)

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()
        self.file.close()
        os.unlink(self.file.name)


def cupti_us(f, args) -> float:
    """Median kernel time of `f` over BURST launches back to back (CUPTI, every kernel of the call summed)."""
    from jax.experimental.mosaic.gpu import profiler

    _, runs = profiler.measure(f, iterations=BURST, aggregate=False)(*args)
    return float(np.median([sum(t for _, t in run) for run in runs])) * 1e3


def _swap(xs):
    """[B, H, L, D] <-> [B, L, H, D]."""
    return [jnp.swapaxes(x, 1, 2) for x in xs]


def measure(f, ref, avals, sets, tol, clocks: ClockSampler) -> dict:
    """`f` checked against `ref`, then its burst time, time_fn's median over ~1 s, and the burst right after that."""
    res = check(f, ref, avals, (1,), tol)
    if not res.ok:
        return {"status": "wrong", "error": res.reason}
    jax.block_until_ready(f(*sets[0]))
    time.sleep(0.5)  # idle: the clock back at boost
    burst = cupti_us(f, sets[0])
    t0 = time.time()
    sustained_ms = time_fn(f, sets, repeats=40).median_ms
    capped = cupti_us(f, sets[0])
    clock = clocks.window(t0 + 0.2, time.time())
    return {"status": "ok", "burst_us": burst, "capped_us": capped, "time_fn_us": sustained_ms * 1e3, "clock": clock, "max_error": res.max_error}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated workload name prefixes (of `kernels mosaic`'s workloads)")
    ap.add_argument("--configs", default="", help='JSON {workload: [config, ...]} instead of the built-in list (each over the default)')
    ap.add_argument("--hopper", action="store_true", help="plain GEMMs also run hopper_matmul_mgpu over its own tuning space")
    ap.add_argument("--pairs", type=int, default=0, metavar="N",
                    help="also time each Mosaic GPU kernel against the library's (cuDNN for attention, XLA otherwise) in N "
                         "alternating pairs of ~25 ms batches: the ratio's median and quartiles, each pair at one clock")
    ap.add_argument("--out", default="", help="the Markdown table")
    a = ap.parse_args(argv)
    plan = json.loads(a.configs) if a.configs else CONFIGS
    unknown = sorted(set(plan) - set(WORKLOADS))
    if unknown:
        print(f"gemm-clocks: unknown workload(s) {', '.join(unknown)}; known: {', '.join(WORKLOADS)}", file=sys.stderr)
        return 2
    rows = []
    with ClockSampler() as clocks:
        for name, cfgs in plan.items():
            if a.only and not any(name.startswith(p) for p in a.only.split(",")):
                continue
            fn, shapes = WORKLOADS[name]
            graph, cand = _group(fn, arg_specs(name, shapes, DTYPES.get(name, jnp.bfloat16)))
            g, tmpl = cand.group, TEMPLATES[cand.template]
            avals = g.input_avals()
            sets = [random_inputs(avals, 100 + k) for k in range(3)]
            flops = flops_of(fn, cand, shapes)
            ref = jax.jit(lambda *xs, g=g: g.evaluate(xs))
            tol = cone_tolerances(graph, g.node_ids, g.outputs)
            kernels = [("xla", None, ref)]
            for cfg in cfgs:
                base = mosaic_matmul.default_config(cand.spec, pingpong=False) \
                    if cand.template == "matmul" and cfg and "pingpong" not in cfg else tmpl.default_config_of(cand.spec, "mosaic_gpu")
                full = {**base, **cfg}
                why = tmpl.unsupported(cand.spec, "mosaic_gpu", full)
                if why:
                    rows.append({"workload": name, "kernel": "mosaic", "config": cfg, "status": "declined", "error": why})
                    continue
                k = tmpl.build(g, full, backend="mosaic_gpu", spec=cand.spec)
                kernels.append(("mosaic", cfg, jax.jit(lambda *xs, k=k: k(*xs))))
            if a.hopper and fn.__name__ == "plain":
                from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

                for tm, tn, wg, width, minor in HOPPER:
                    c = hm.TuningConfig(tile_m=tm, tile_n=tn, tile_k=64, max_concurrent_steps=4, epi_tile_m=64, epi_tile_n=64,
                                        grid_minor_dim=getattr(hm.MatmulDimension, minor), grid_tile_width=width,
                                        wg_dimension=getattr(hm.MatmulDimension, wg))
                    kernels.append(("hopper_matmul_mgpu", {"tile": f"{tm}x{tn}", "wg": wg, "width": width, "minor": minor},
                                    jax.jit(lambda x, w, c=c: [hm.matmul(x, w, None, c)])))
            runs = [(label, cfg, f, ref, avals, sets) for label, cfg, f in kernels]
            if cand.template == "attention":
                runs.append(("cudnn", None, cudnn_attention(fn is attention_causal), jax.jit(lambda *xs, g=g: _swap(g.evaluate(_swap(xs)))),
                    [jax.ShapeDtypeStruct(s.shape[:1] + (s.shape[2], s.shape[1]) + s.shape[3:], s.dtype) for s in avals],
                    [_swap(xs) for xs in sets]))
            done = []
            for label, cfg, f, f_ref, f_avals, f_sets in runs:
                try:
                    r = measure(f, f_ref, f_avals, f_sets, tol, clocks)
                except Exception as e:  # noqa: BLE001 - a kernel that fails is a row, not the end of the run
                    r = {"status": "error", "error": f"{type(e).__name__}: {str(e)[:200]}"}
                r.update(workload=name, kernel=label, config=cfg, flops=flops)
                rows.append(r)
                done.append((r, f, f_sets))
                print(line_of(r), flush=True)
            if a.pairs:
                paired(done, "cudnn" if cand.template == "attention" else "xla", a.pairs)
    emit(table(rows, argv), a.out)
    return 0


def paired(done: list[tuple[dict, object, list]], library: str, pairs: int) -> None:
    """Each Mosaic GPU row's time against the library kernel's, timed in alternation (`time_pair`: each pair of ~25 ms
    batches sees one clock, so the ratio's spread is the comparison's noise, whatever the power cap does): `r["pair"]`,
    the ratio mosaic / library's median and quartiles. The two take their own input sets (cuDNN's in [B, L, H, D])."""
    lib = next(((f, sets) for r, f, sets in done if r["kernel"] == library and r["status"] == "ok"), None)
    if lib is None:
        return
    for r, f, sets in done:
        if r["kernel"] != "mosaic" or r["status"] != "ok":
            continue
        _, _, ratio = time_pair(lambda i: lib[0](*lib[1][i]), lambda i, f=f, sets=sets: f(*sets[i]), [(i,) for i in range(len(sets))],
                                repeats=pairs, warmup=2)
        r["pair"] = (library, ratio.median_ms, ratio.q1_ms, ratio.q3_ms, ratio.repeats)
        print(f"{r['workload']:30} mosaic {json.dumps(r['config'])}: {ratio.median_ms:.3f}x {library} in {ratio.repeats} alternating pairs "
              f"(quartiles {ratio.q1_ms:.3f}..{ratio.q3_ms:.3f})", flush=True)


def line_of(r: dict) -> str:
    if r["status"] != "ok":
        return f"{r['workload']:30} {r['kernel']} {json.dumps(r['config'])} {r['status']}: {r['error'][:200]}"
    tf = lambda us: r["flops"] / us / 1e6  # noqa: E731 - TFLOP/s of a time in microseconds (attention: 4BHL^2D, causal half)
    return (f"{r['workload']:30} {r['kernel']} {json.dumps(r['config'])}: burst {r['burst_us']:.1f} us ({tf(r['burst_us']):.0f} TFLOP/s), "
            f"capped {r['capped_us']:.1f} us ({tf(r['capped_us']):.0f}) at {r['clock'].median_mhz} MHz, time_fn {r['time_fn_us']:.1f} us")


def table(rows: list[dict], argv: list[str] | None) -> list[str]:
    """The rows as a results/ table: per workload and kernel, burst and power-capped times, their rates, the clock."""
    lines = [header(argv), "", f"CUPTI kernel time, median of {BURST} launches back to back: a burst after 0.5 s idle, and again after "
             "`time_fn`'s ~1 s of back-to-back calls (the card under its power cap); the SM clock's median over that second and "
             "nvidia-smi's clock event reasons (0x4: software power cap). TFLOP/s count 2MNK (attention 4BHL^2D, causal half). "
             "`x library, alternating`: with `--pairs`, the Mosaic GPU kernel's time over the library's (cuDNN for attention, "
             "XLA otherwise) in alternating pairs of ~25 ms batches, median (quartiles).", "",
             "| workload | kernel | config | burst us | TFLOP/s | capped us | TFLOP/s | SM MHz (capped) | reasons | time_fn us | max error | x library, alternating |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cfg = json.dumps(r.get("config") or {})
        if r["status"] != "ok":
            lines.append(f"| {r['workload']} | {r['kernel']} | {cfg} | {r['status']}: {r['error'][:160].replace('|', '/')} | | | | | | | | |")
            continue
        tf = lambda us: r["flops"] / us / 1e6  # noqa: E731
        lines.append(f"| {r['workload']} | {r['kernel']} | {cfg} | {r['burst_us']:.1f} | {tf(r['burst_us']):.0f} | {r['capped_us']:.1f} | "
                     f"{tf(r['capped_us']):.0f} | {r['clock'].median_mhz} | {' '.join(r['clock'].reasons)} | {r['time_fn_us']:.1f} | "
                     f"{r['max_error']:.1e} | {_pair_cell(r)} |")
    return lines


def _pair_cell(r: dict) -> str:
    if "pair" not in r:
        return ""
    library, med, q1, q3, n = r["pair"]
    return f"{med:.3f} ({q1:.3f}..{q3:.3f}) x {library}, {n} pairs"


if __name__ == "__main__":
    sys.exit(main())
