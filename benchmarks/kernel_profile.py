"""Where a compiled program's GPU time goes: the kernels of a few traced calls (`jax.profiler`, CUPTI), their
device time summed by kernel name, per call. Used by the benchmarks to say what is left of a step once a plan
runs (a kernel's share of the step, before guessing where the next gain is).

    rows = kernel_times(jax.jit(step), args)
    print("\n".join(kernel_table(rows, top=20)))
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable

from autofuse.runner.profile import kernel_events


@dataclass(frozen=True)
class KernelTime:
    name: str
    ms_per_call: float  # device time of every launch of this kernel in one call of the program
    launches_per_call: float


def kernel_times(fn: Callable, args: tuple, *, calls: int = 3) -> list[KernelTime]:
    """The kernels `fn(*args)` launches on the GPU, longest first (empty where no device plane is traced: the CPU)."""
    total: dict[str, list[float]] = {}
    for ev in kernel_events(fn, args, calls):
        name, duration_ns = ev.name, ev.duration_ns
        t = total.setdefault(name, [0.0, 0])
        t[0] += duration_ns
        t[1] += 1
    rows = [KernelTime(k, ns / calls / 1e6, n / calls) for k, (ns, n) in total.items()]
    return sorted(rows, key=lambda r: -r.ms_per_call)


@dataclass(frozen=True)
class Timeline:
    """How busy the GPU is over back-to-back calls: the time some kernel runs, the span from the first kernel's
    start to the last one's end (per call), and the longest idle gaps between kernels, by the kernels around them."""

    busy_ms: float
    span_ms: float
    gaps: list[tuple[str, str, float, int]]  # (kernel before, kernel after, idle ms per call, gaps per call)


def timeline(fn: Callable, args: tuple, *, calls: int = 3, top: int = 8) -> Timeline | None:
    """`fn(*args)`'s GPU timeline over `calls` back-to-back calls, every stream together (None without a GPU).
    A plan whose kernels add up to less than jax.jit's can still take longer if the GPU waits between them."""
    events = sorted(((e.name, e.start_ns, e.duration_ns) for e in kernel_events(fn, args, calls)), key=lambda e: e[1])
    if not events:
        return None
    busy, span_end, gaps = 0.0, events[0][1], {}
    prev = None
    for name, start, dur in events:
        if start > span_end and prev is not None:
            g = gaps.setdefault((prev, name), [0.0, 0])
            g[0] += start - span_end
            g[1] += 1
        busy += max(0.0, start + dur - max(start, span_end))
        if start + dur > span_end:
            span_end, prev = start + dur, name
    span = span_end - events[0][1]
    worst = sorted(((a, b, ns / calls / 1e6, n / calls) for (a, b), (ns, n) in gaps.items()), key=lambda g: -g[2])[:top]
    return Timeline(busy / calls / 1e6, span / calls / 1e6, worst)


def kernel_table(rows: list[KernelTime], *, top: int = 20, title: str = "") -> list[str]:
    """A Markdown table of the `top` kernels (share of all the kernels' time), then the rest in one line."""
    whole = sum(r.ms_per_call for r in rows) or 1.0
    out = ([f"{title}", ""] if title else []) + ["| kernel | ms per call | share | launches per call |", "|---|---|---|---|"]
    for r in rows[:top]:
        out.append(f"| `{_short(r.name)}` | {r.ms_per_call:.3f} | {r.ms_per_call / whole:.1%} | {r.launches_per_call:g} |")
    rest = rows[top:]
    if rest:
        out.append(f"| {len(rest)} others | {sum(r.ms_per_call for r in rest):.3f} | {sum(r.ms_per_call for r in rest) / whole:.1%} | |")
    out.append(f"| all kernels | {whole:.3f} | 100% | {sum(r.launches_per_call for r in rows):g} |")
    return out


def _short(name: str, width: int = 90) -> str:
    return name if len(name) <= width else name[:width - 3] + "..."


def as_json(rows: list[KernelTime]) -> list[dict[str, Any]]:
    return [asdict(r) for r in rows]


def from_json(items: list[dict[str, Any]]) -> list[KernelTime]:
    return [KernelTime(**d) for d in items]
