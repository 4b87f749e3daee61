"""`python -m benchmarks SUITE [PART] [args]`: the maintained GPU benchmarks behind `results/`, one entry.

A suite is one or more parts, each a module's `main`; a suite's first part is its default, so `python -m benchmarks
models --out x.md` runs `models forward`. Every part writes a results/-style Markdown table whose first line names
the card, jax version, date, commit and command (`benchmarks/provenance.py`). Why one entry: the folder's one-off
probes are gone (their findings are in results/), and what is left is named by what it measures.
"""
from __future__ import annotations

import importlib
import sys
from typing import NamedTuple

from benchmarks.provenance import ENTRY


class Part(NamedTuple):
    module: str
    measures: str


# suite -> (what it measures, {part: Part}); the first part is the suite's default
SUITES: dict[str, tuple[str, dict[str, Part]]] = {
    "models": ("the example models' forward and training step, tuned by autofuse, against jax.jit", {
        "forward": Part("benchmarks.models", "each example model's forward (or grad_step): one tuning job, its plan against jax.jit"),
        "step": Part("benchmarks.train_step", "a training step's gradients through the loss's plan against jax.jit(jax.grad(loss))"),
    }),
    "kernels": ("autofuse's kernels alone against XLA, cuDNN, Pallas and hopper_matmul_mgpu", {
        "mosaic": Part("benchmarks.mosaic_probe", "matmul, GEMM epilogues and attention, Mosaic GPU and Triton, against XLA, "
                       "cuDNN and hopper_matmul_mgpu"),
        "gemm-clocks": Part("benchmarks.gemm_clocks", "GEMMs (Mosaic GPU, cuBLAS, hopper_matmul_mgpu) and attention (cuDNN) at the card's boost clock and under "
                            "its power cap, the SM clock sampled"),
        "attention": Part("benchmarks.attention_bench", "attention forward tiles (or a tuned plan) against jax.jit, cuDNN and Pallas mha"),
        "attention-grad": Part("benchmarks.attention_grad_bench", "attention forward + backward, the flash pair, against jax.jit and cuDNN"),
        "norm-gemm": Part("benchmarks.norm_gemm", "a layer norm feeding a GEMM, its half folded around the GEMM or not, against jax.jit"),
        "norm-grad": Part("benchmarks.norm_grad", "the layer norm's and RMS norm's backward, tuned, against jax.jit"),
        "concat-sink": Part("benchmarks.concat_sink_probe", "GPT-2's QKV backward with its concatenation read in parts "
                            "(`concat_sink`'s configs) against XLA"),
        "unaligned-gemm": Part("benchmarks.unaligned_gemm", "XLA's GEMMs at a vocabulary of unaligned rows against the same padded "
                               "(why aligned_dot exists)"),
    }),
    "suite": ("the tuning job on every workload of benchmarks/workloads.py (held-out style), against jax.jit", {
        "tune": Part("benchmarks.tune_suite", "per workload and dtype: jax.jit, autofuse, speedup, memory floor, tuning time"),
    }),
    "workers": ("tuning with several GPUs: `autofuse tune --workers N` for each N on one trial budget", {
        "tune": Part("benchmarks.multi_gpu", "per workload and worker count: wall time, phases, trials per minute, speedup"),
    }),
    "deploy": ("fresh-process deploys: autofuse.jit serving stored plans against jax.jit", {
        "check": Part("benchmarks.deploy_check", "every stored suite plan in a new process: lookup, correctness, speedup, call overhead"),
        "shapes": Part("benchmarks.shape_serving", "a plan tuned at one shape serving other shapes, against plans tuned there"),
        "versus": Part("benchmarks.versus", "a stored plan of one program against jax.jit of another computing the same "
                       "(library attention at its default, tuned, against cuDNN's under jax.jit)"),
    }),
    "profile": ("profiling aids that results/ tables cite", {
        "composition": Part("benchmarks.composition", "a plan's savings per group alone against the whole program's, and its kernels"),
        "ncu": Part("benchmarks.ncu_kernel", "one kernel of `kernels mosaic` (Mosaic GPU, Triton or JAX's hopper GEMM), run a few times for ncu to profile"),
        "memory": Part("benchmarks.memory_probe", "a plan's peak device memory against jax.jit's, and their largest temporary buffers"),
        "xla-time": Part("benchmarks.xla_time", "jax.jit's time by kernel (or a plan's: --plan FILE): what each XLA fusion computes, the bytes it moves, its bandwidth"),
        "precision": Part("benchmarks.precision_probe", "the precision of XLA's float32 dots under JAX's defaults"),
        "timing": Part("benchmarks.timing_probe", "small kernels timed by the host's clock (as the tuner times groups) against the "
                       "device's, on an idle host and a busy one"),
        "group": Part("benchmarks.group_probe", "one candidate group of an example model's program: XLA's version against "
                      "chosen configs of autofuse's, each checked and timed on the device as a job times it"),
        "lowering": Part("benchmarks.lowering_apart", "GPT-2's kernels lowered by CPU-only helper processes against this GPU "
                         "process's own lowering: the same module, and the seconds each way"),
    }),
}
HELP = ("-h", "--help")


def usage() -> str:
    width = max(map(len, SUITES))
    lines = [f"usage: {ENTRY} SUITE [PART] [args]   ({ENTRY} SUITE --help: its parts; SUITE PART --help: its options)", "", "suites:"]
    lines += [f"  {name:{width}}  {what}" for name, (what, _) in SUITES.items()]
    return "\n".join(lines)


def suite_usage(suite: str) -> str:
    what, parts = SUITES[suite]
    width = max(map(len, parts))
    lines = [f"usage: {ENTRY} {suite} [PART] [args]   (PART defaults to {next(iter(parts))}; {ENTRY} {suite} PART --help: its options)",
             "", f"{suite}: {what}", "", "parts:"]
    lines += [f"  {name:{width}}  {p.measures} ({p.module})" for name, p in parts.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in HELP:
        print(usage())
        return 0
    suite, args = args[0], args[1:]
    if suite not in SUITES:
        print(f"{usage()}\n\n{ENTRY}: error: no suite {suite!r}", file=sys.stderr)
        return 2
    parts = SUITES[suite][1]
    if args and args[0] in HELP:
        print(suite_usage(suite))
        return 0
    part = args.pop(0) if args and args[0] in parts else next(iter(parts))
    # the part's own parser and its table's command line name the entry, not the module
    sys.argv = [f"{ENTRY} {suite} {part}", *args]
    rc = importlib.import_module(parts[part].module).main()
    return rc if isinstance(rc, int) else 0


if __name__ == "__main__":
    sys.exit(main())
