"""Where `jax.jit`'s time goes in a program, by what each of XLA's kernels computes (issue 32: which fusion across
the GEMM boundary is worth building).

    python -m benchmarks profile xla-time --model gpt2 --step grad_step_cudnn --top 40 --out results/x.md
    python -m benchmarks profile xla-time --model gpt2 --step grad_step_cudnn --plan plan.json   # around a plan's kernels

Compiles the example model's entry point with `jax.jit`, traces a few calls (CUPTI, the profiler's "XLA Ops" line:
device time per HLO instruction) and joins each instruction with the compiled module's text: its kind (cuBLAS or
Triton GEMM, cuDNN attention, XLA's loop/input fusions, copies), the bytes it reads and writes, the bandwidth that
implies, and the jaxpr operations it came from (`op_name`). A memory-bound fusion near the card's bandwidth can only
get faster by not existing (fused into a neighbour); one far below it is a slow kernel. On the CPU (no device trace)
it lists the instructions by bytes moved, untimed. With `--plan` (a plan's JSON: `autofuse show plan N --json`'s
"plan", or `profile composition --save-plan`) the program read is the plan's (`autofuse.jit`): what XLA runs around
its kernels, which can differ from what it ran there under jax.jit (GPT-2's layer norms after the plan's residual
GEMM: three kernels where jax.jit had fused the residual add with the norm's statistics, results/concat_once_h200.md).
"""
from __future__ import annotations

import argparse
import functools
import importlib
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable

import jax
import numpy as np

from autofuse.runner.profile import kernel_events
from benchmarks.provenance import header
from benchmarks.workloads import emit

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
               "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1}
SHAPE = re.compile(r"\b(" + "|".join(sorted(DTYPE_BYTES, key=len, reverse=True)) + r")\[([0-9,]*)\]")
INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*?)\s+([\w\-]+)\((.*)$")
COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%([\w.\-]+)\s*\(.*\{\s*$")
#: Instructions that launch nothing (views, bookkeeping) and take no device time of their own.
#: Library kernels the trace names by themselves, not by their HLO instruction: their kind by name.
LIBRARY_KERNELS = (("attention (cuDNN)", r"fmha|sdpa|flash|cudnn"), ("GEMM", r"nvjet|gemm|cutlass|xmma|cublas"))
FREE = frozenset({"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all", "partition-id", "replica-id"})


def shape_bytes(text: str) -> int:
    """Bytes of every array shape written in `text` (a tuple's elements summed)."""
    total = 0
    for dt, dims in SHAPE.findall(text):
        n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        total += n * DTYPE_BYTES[dt]
    return total


@dataclass
class Instruction:
    """One HLO instruction of the compiled module, as the profiler names it."""

    name: str
    opcode: str
    out_bytes: int
    in_bytes: int
    kind: str  # fusion kind, or the custom call's target
    op_name: str  # the jaxpr operation it came from (`metadata={op_name=...}`)
    source: str  # the Python function and line that made it (`stack_frame_id`: the innermost frame)
    fused_ops: Counter = field(default_factory=Counter)  # the ops of its fused computation, by opcode

    @property
    def category(self) -> str:
        k, f = self.kind.lower(), self.fused_ops
        if "cudnn" in k or "fmha" in k or "flash" in k:
            return "attention (cuDNN)"
        if "gemm" in k or "cublas" in k or self.opcode == "dot" or ("triton" in k and f.get("dot")) or f.get("dot"):
            return "GEMM"
        if self.opcode == "custom-call" and ("mosaic_gpu" in k or "triton" in k):
            return "Pallas kernel (the plan's)"
        if self.opcode == "kernel":  # a library's kernel the profiler names by itself (cuBLAS, cuDNN)
            for cat, pattern in LIBRARY_KERNELS:
                if re.search(pattern, self.name, re.IGNORECASE):
                    return cat
            return "other kernel"
        if self.opcode in ("copy", "transpose") or (f and set(f) <= {"copy", "transpose", "bitcast", "parameter"}):
            return "copy/transpose"
        if f.get("reduce") or self.opcode == "reduce":
            return "XLA fusion with a reduction"
        if self.opcode == "fusion" or self.opcode in ("add", "multiply", "convert"):
            return "XLA elementwise fusion"
        return "other"


def source_frames(text: str) -> dict[str, str]:
    """`function:line` of each stack frame id of the module's text (its FileNames, FunctionNames, FileLocations and
    StackFrames tables)."""
    tables: dict[str, dict[str, str]] = {}
    section = None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = tables.setdefault(line, {})
            continue
        m = re.match(r"^(\d+) (.*)$", line)
        if section is not None and m:
            section[m.group(1)] = m.group(2)
        elif not line.strip() or line.startswith("%") or line.startswith("ENTRY"):
            section = None if line.strip() else section
    funcs = {k: v.strip('"') for k, v in tables.get("FunctionNames", {}).items()}
    locs = {}
    for k, v in tables.get("FileLocations", {}).items():
        f, ln = re.search(r"function_name_id=(\d+)", v), re.search(r"\bline=(\d+)", v)
        locs[k] = f"{funcs.get(f.group(1), '?') if f else '?'}:{ln.group(1) if ln else '?'}"
    out = {}
    for k, v in tables.get("StackFrames", {}).items():
        loc = re.search(r"file_location_id=(\d+)", v)
        out[k] = locs.get(loc.group(1), "") if loc else ""
    return out


def parse_hlo(text: str) -> dict[str, Instruction]:
    """Every instruction of the compiled module's text by name, with the bytes its operands and result take and the
    opcodes of the computation it calls (fusions)."""
    frames = source_frames(text)
    shapes: dict[str, str] = {}
    bodies: dict[str, Counter] = {}
    lines: list[tuple[str | None, str, str, str, str]] = []
    current = None
    for line in text.splitlines():
        m = COMPUTATION.match(line)
        if m:
            current = m.group(1)
            bodies[current] = Counter()
            continue
        m = INSTR.match(line)
        if not m:
            continue
        name, shape, opcode, rest = m.groups()
        shapes[name] = shape
        if current is not None:
            bodies[current][opcode] += 1
        lines.append((current, name, shape, opcode, rest))
    inner = set(re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", text))  # fused and reducer computations: no launches
    out: dict[str, Instruction] = {}
    for comp, name, shape, opcode, rest in lines:
        if opcode in FREE or comp in inner:
            continue
        args = rest.split(")", 1)[0]
        operands = re.findall(r"%([\w.\-]+)", args)
        calls = re.search(r"calls=%([\w.\-]+)", rest)
        kind = re.search(r"kind=(\w+)", rest)
        target = re.search(r'custom_call_target="([^"]+)"', rest)
        fusion_kind = re.search(r'"kind":"([^"]+)"', rest)
        op = re.search(r'op_name="([^"]+)"', rest)
        frame = re.search(r"stack_frame_id=(\d+)", rest)
        fused = bodies.get(calls.group(1), Counter()) if calls else Counter()
        out[name] = Instruction(
            name, opcode, shape_bytes(shape), sum(shape_bytes(shapes.get(o, "")) for o in operands),
            (target.group(1) if target else fusion_kind.group(1) if fusion_kind else kind.group(1) if kind else opcode),
            op.group(1) if op else "", frames.get(frame.group(1), "") if frame else "", Counter({k: v for k, v in fused.items() if k not in ("parameter", "constant")}))
    return out


def op_times(fn: Callable, args: tuple, names: Iterable[str], calls: int = 3) -> dict[str, tuple[float, float]]:
    """Device ms per call and launches per call of each HLO instruction of `names`: a kernel is the instruction its
    `hlo_op` stat names, else the one its own name is (XLA names a fusion's kernel after it, '.' as '_'); a kernel
    of neither is kept under its own name. Empty without a device trace (the CPU)."""
    known = {n: n for n in names} | {n.replace(".", "_"): n for n in names}
    total: dict[str, list[float]] = {}
    for ev in kernel_events(fn, args, calls):
        hlo = next((str(ev.stats[k]) for k in ("hlo_op", "tf_op", "long_name") if str(ev.stats.get(k)) in known), None)
        name = known.get(hlo or ev.name, hlo or ev.name)
        t = total.setdefault(name, [0.0, 0.0])
        t[0] += ev.duration_ns / 1e6 / calls
        t[1] += 1 / calls
    return {k: (v[0], v[1]) for k, v in total.items()}


def _where(op_name: str, width: int = 70) -> str:
    """The jaxpr path of an op without the jit wrapper and the repeated transforms, shortened from the left."""
    s = re.sub(r"^jit\([^)]*\)/", "", op_name)
    return s if len(s) <= width else "…" + s[-(width - 1):]


def _ops(c: Counter, n: int = 4) -> str:
    return ", ".join(f"{k}×{v}" if v > 1 else k for k, v in c.most_common(n)) + (", …" if len(c) > n else "")


def plan_kernels(instrs: dict[str, Instruction], times: dict[str, tuple[float, float]]) -> dict[str, Instruction]:
    """The instructions with each of the plan's kernels under the name the profiler gives it: a Pallas call's kernel
    is traced by its own name (`autofuse_matmul_mgpu_8b626235_mosaic_gpu_kernel`, `autofuse_row_reduce_dd41066a`),
    not the custom call's (`mpmd_map.336`, one per layer), which carries that name in its op_name. The call's
    instructions are folded into one row under the kernel's name, with their bytes, kind and source line."""
    out = dict(instrs)
    for name in times:
        if name in instrs or not name.startswith("autofuse_"):
            continue
        stem = re.sub(r"_mosaic_gpu_kernel$", "", name)
        calls = [i for i in instrs.values() if f"/{stem}/" in i.op_name]
        if not calls:
            continue
        for i in calls:
            out.pop(i.name, None)
        c = calls[0]
        out[name] = Instruction(name, c.opcode, c.out_bytes, c.in_bytes, c.kind, c.op_name, c.source, c.fused_ops)
    return out


def table(instrs: dict[str, Instruction], times: dict[str, tuple[float, float]], top: int, bandwidth_gbs: float) -> list[str]:
    """By category, then the `top` instructions (by device time; by bytes where nothing was timed)."""
    timed = bool(times)
    key = (lambda i: -times.get(i.name, (0.0, 0))[0]) if timed else (lambda i: -(i.in_bytes + i.out_bytes))
    instrs = plan_kernels(instrs, times)
    stray = {k: Instruction(k, "kernel", 0, 0, "library kernel", "", "") for k in times if k not in instrs}
    rows = sorted([*instrs.values(), *stray.values()], key=key)
    lines = []
    if timed:
        by_cat: dict[str, list[float]] = {}
        for i in rows:
            ms, n = times.get(i.name, (0.0, 0.0))
            c = by_cat.setdefault(i.category, [0.0, 0.0, 0.0])
            c[0] += ms
            c[1] += n
            c[2] += (i.in_bytes + i.out_bytes) * n
        whole = sum(v[0] for v in by_cat.values())
        lines += ["| kind | ms per call | share | launches | GB moved | at the card's bandwidth, ms |", "|---|---|---|---|---|---|"]
        for cat, (ms, n, b) in sorted(by_cat.items(), key=lambda kv: -kv[1][0]):
            lines.append(f"| {cat} | {ms:.3f} | {ms / whole:.1%} | {n:g} | {b / 1e9:.2f} | {b / 1e6 / bandwidth_gbs:.3f} |")
        lines += [f"| all | {whole:.3f} | 100% | | | |", ""]
        by_src: dict[tuple[str, str], list[float]] = {}
        for i in rows:
            ms, n = times.get(i.name, (0.0, 0.0))
            c = by_src.setdefault((i.source or _where(i.op_name, 40), i.category), [0.0, 0.0, 0.0])
            c[0] += ms
            c[1] += n
            c[2] += (i.in_bytes + i.out_bytes) * n
        lines += ["By the line of the program that made them (every layer's instances together):", "",
                  "| source line | kind | ms per call | launches | GB moved | at the card's bandwidth, ms |", "|---|---|---|---|---|---|"]
        for (src, cat), (ms, n, b) in sorted(by_src.items(), key=lambda kv: -kv[1][0])[:top]:
            lines.append(f"| {src} | {cat} | {ms:.3f} | {n:g} | {b / 1e9:.2f} | {b / 1e6 / bandwidth_gbs:.3f} |")
        lines.append("")
    lines += ["| instruction | kind | ms per call | launches | MB in / out per launch | GB/s | ops fused | from |",
              "|---|---|---|---|---|---|---|---|"]
    for i in rows[:top]:
        ms, n = times.get(i.name, (float("nan"), 0.0))
        gbs = (i.in_bytes + i.out_bytes) * n / (ms * 1e6) if timed and ms > 0 else float("nan")
        lines.append(f"| `{i.name}` | {i.category}: {i.kind} | {ms:.3f} | {n:g} | {i.in_bytes / 1e6:.1f} / {i.out_bytes / 1e6:.1f} | "
                     f"{gbs:.0f} | {_ops(i.fused_ops)} | `{_where(i.op_name)}` {i.source} |")
    return lines


def program(fn: Callable, plan_file: str = "") -> tuple[Callable, str]:
    """`fn` under jax.jit, or under the plan in `plan_file` (`autofuse.jit`, a group it cannot run an error), and
    whose program that is."""
    if not plan_file:
        return jax.jit(fn), "jax.jit's"
    import autofuse
    from autofuse.plan import Plan

    with open(plan_file) as f:
        return autofuse.jit(fn, plan=Plan.from_json(f.read()), on_miss="error"), "the plan's"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2", help="an example model: examples.MODEL")
    ap.add_argument("--step", default="grad_step_cudnn", help="its entry point")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--top", type=int, default=40, help="instructions listed")
    ap.add_argument("--bandwidth", type=float, default=4300.0, help="the card's copy bandwidth in GB/s (H100/H200: ~4300 measured)")
    ap.add_argument("--small", action="store_true", help="the CPU-sized small_inputs() (a smoke run)")
    ap.add_argument("--plan", default="", help="a plan's JSON file: read the plan's program instead of jax.jit's")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    mod = importlib.import_module(f"examples.{a.model}")
    factory = mod.small_inputs if a.small else functools.partial(mod.example_inputs, a.layers) if a.layers else mod.example_inputs
    args = tuple(factory())
    fn, whose = program(getattr(mod, a.step), a.plan)
    instrs = parse_hlo(fn.lower(*args).compile().as_text())
    times = op_times(fn, args, instrs)
    lines = [f"## {whose} time by kernel: {a.model}:{a.step}", "", header(argv), ""]
    lines += table(instrs, times, a.top, a.bandwidth)
    emit(lines, a.out)


if __name__ == "__main__":
    main()
