"""One table formatter for everything autofuse prints: the CLI's listings, the tuning job's table, and the
Markdown report. Numbers right-aligned, every cell formatted by its column."""
from __future__ import annotations

import datetime as _dt
import json
from dataclasses import dataclass
from typing import Any, Callable, Sequence


def jsonable(value: Any) -> Any:
    """A value as JSON data: datetimes in ISO form, containers recursively, anything else as its text."""
    if isinstance(value, (_dt.datetime, _dt.date)):
        return value.isoformat()
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def plural(n: int, noun: str, many: str | None = None) -> str:
    """``1 trial``, ``2 trials``: a count and its noun in agreement (`many`: an irregular plural, ``studies``)."""
    return f"{n} {noun if n == 1 else many or noun + 's'}"


def fmt_bytes(n: int | float | None) -> str:
    """``1.25 GiB``, ``640 MiB``, ``12 KiB``: a size in the largest binary unit that keeps it at least 1."""
    if n is None:
        return ""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"


def memory_text(provenance: dict[str, Any]) -> str:
    """``peak memory 17.4 GiB (jax.jit 64.7 GiB)`` from a plan's provenance (`validate._report`), or ""."""
    peak, base = provenance.get("peak_bytes"), provenance.get("baseline_peak_bytes")
    return f"peak memory {fmt_bytes(peak)} (jax.jit {fmt_bytes(base)})" if peak and base else ""


def fmt_ms(v: Any) -> str:
    return "" if v is None else f"{v:.4g}"


def fmt_x(v: Any) -> str:
    return "" if v is None else f"{v:.2f}x"


def fmt_time(v: Any) -> str:
    return "" if v is None else v.astimezone(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M")


def fmt_short(n: int) -> Callable[[Any], str]:
    """Text (JSON for containers) cut to `n` characters."""
    def f(v: Any) -> str:
        if v is None:
            return ""
        s = v if isinstance(v, str) else json.dumps(jsonable(v), separators=(",", ":"))
        s = " ".join(s.split())
        return s if len(s) <= n else s[: n - 1] + "…"

    return f


#: The GPU the analytic model describes when a run does not say (the only model before runs recorded theirs).
DEFAULT_MODEL_NAME = "NVIDIA H200"


def device_label(measure: str | None, device: str | None, model: str | None = None) -> str:
    """The device a result is for, as people read it: a modelled one is for a model of a GPU, not for the CPU the
    model ran on."""
    if measure == "model":
        return f"model of {model or DEFAULT_MODEL_NAME}"
    return device or ""


def fmt_bool(v: Any) -> str:
    return "*" if v else ""


@dataclass(frozen=True)
class Column:
    header: str
    key: str | None = None  # the row's key (default: the header)
    fmt: Callable[[Any], str] | None = None  # default: str, "" for None
    of_row: Callable[[dict[str, Any]], Any] | None = None  # the value from the whole row (instead of `key`)

    def cell(self, row: dict[str, Any]) -> tuple[str, bool]:
        v = self.of_row(row) if self.of_row is not None else row.get(self.key or self.header)
        text = self.fmt(v) if self.fmt else ("" if v is None else str(v))
        return text, isinstance(v, (int, float)) and not isinstance(v, bool)


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[Column], *, markdown: bool = False) -> str:
    """An aligned text table under a rule (or a Markdown table); columns holding numbers are right-aligned."""
    cells = [[c.cell(r) for c in columns] for r in rows]
    right = [any(line[i][1] for line in cells) for i in range(len(columns))]
    if markdown:
        esc = lambda s: s.replace("|", "\\|").replace("\n", " ")  # noqa: E731
        out = ["| " + " | ".join(esc(c.header) for c in columns) + " |", "|" + "|".join("---:" if r else "---" for r in right) + "|"]
        return "\n".join(out + ["| " + " | ".join(esc(t) for t, _ in line) + " |" for line in cells])
    widths = [max([len(c.header)] + [len(line[i][0]) for line in cells]) for i, c in enumerate(columns)]
    just = lambda t, w, r: t.rjust(w) if r else t.ljust(w)  # noqa: E731
    out = ["  ".join(just(c.header, w, r) for c, w, r in zip(columns, widths, right)).rstrip(), "  ".join("-" * w for w in widths)]
    out += ["  ".join(just(t, w, r) for (t, _), w, r in zip(line, widths, right)).rstrip() for line in cells]
    return "\n".join(out)


#: A run's phase marks in the order a job reaches them (`autofuse.tuning.job.PhaseMarks`).
PHASE_ORDER = ("start", "candidates", "setup", "xla", "trials", "first_plan", "selected", "saved")
PROFILE_SHOWN = 5  # of the profile's longest XLA kernels in a run's record, those `show run` names (the report: all)


def format_phases(phases: dict[str, Any] | None) -> list[str]:
    """A run's recorded phases as lines: the run's marks in time order (seconds from the run's start, and since the
    mark before), each worker's, and where the selection's time went."""
    if not phases:
        return ["(not recorded)"]
    marks = sorted(((k, v) for k, v in phases.items() if isinstance(v, (int, float))), key=lambda kv: (kv[1], PHASE_ORDER.index(kv[0])
                                                                                                         if kv[0] in PHASE_ORDER else 99))
    out, prev = [], None
    for k, v in marks:
        out.append(f"{k} {v:.2f}" + (f" (+{v - prev:.2f})" if prev is not None else ""))
        prev = v
    lines = ["run: " + ", ".join(out)]
    for w, wm in sorted((phases.get("workers") or {}).items()):
        lines.append(f"worker {w}: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(wm.items(), key=lambda kv: kv[1])))
    for prefix, label in (("xla_parts", "XLA timings"), ("trial_parts", "trials")):  # where each process's time went
        for key, parts in sorted(phases.items()):
            if key.startswith(prefix) and isinstance(parts, dict):
                who = key[len(prefix):].strip() or "this process"
                lines.append(f"{label} ({who}): " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in parts.items()))
    sel = phases.get("selection")
    if isinstance(sel, dict):
        parts = [f"{k} {sel[k]:.2f}" for k in ("check", "singles", "cover", "compile_ahead", "validate") if isinstance(sel.get(k), (int, float))]
        compiled = [", ".join(f"{k} {v:.2f}" for k, v in batch.items()) for batch in sel.get("compiled") or [] if isinstance(batch, dict) and batch]
        lines.append("selection: " + ", ".join(parts) + (f" (longest compile of one: {'; then '.join(compiled)})" if compiled else ""))
        prof = sel.get("profile")
        if isinstance(prof, dict):
            lines.append("  jax.jit's program profiled: " + (f"failed ({prof['error']}), groups priced by their times alone" if prof.get("error") else
                         f"{prof.get('kernels')} kernels, {prof.get('total_ms', 0):.3f} ms a call, {prof.get('attributed_ms', 0):.3f} ms of them "
                         "computing the program's nodes (the prices of the cover)"
                         + (f"; its kernels scaled by {prof['scale']:.3f} to the program's time as groups were timed then"
                            if isinstance(prof.get("scale"), (int, float)) and abs(prof["scale"] - 1.0) > 1e-6 else ""))
                         + (f", in {prof['profile']:.2f} s" if isinstance(prof.get("profile"), (int, float)) else ""))
            longest = [k for k in prof.get("longest") or [] if isinstance(k, dict)][:PROFILE_SHOWN]
            if longest:
                lines.append("    its longest: " + "; ".join(f"{k.get('instruction')} {k.get('ms', 0):.3f} ms ({k.get('ops') or '?'})" for k in longest))
        saved = sel.get("composition") or []
        for i, p in enumerate(sel.get("plans") or []):
            inner = ", ".join(f"{k} {p[k]:.2f}" for k in ("compile", "reference", "check", "examples", "time") if isinstance(p.get(k), (int, float)))
            what = saved[i].get("what") if i < len(saved) and isinstance(saved[i], dict) else None
            lines.append(f"  plan {i + 1} ({what + ': ' if what else ''}{plural(p.get('groups') or 0, 'group')}, {p.get('status')}): "
                         f"{p.get('seconds', 0):.2f}"
                         + (f" = {inner}" if inner else "") + (f"; {savings_text(saved[i])}" if i < len(saved) and isinstance(saved[i], dict) else "")
                         + (f"; why: {p['error']}" if p.get("error") else "") + (f"; on GPU {p['gpu']}" if p.get("gpu") else ""))
        skipped = sel.get("not_judged")
        if isinstance(skipped, dict) and skipped.get("groups"):
            basis = "was expected to save less in the program" if skipped.get("profiled") else "saved less alone"
            lines.append(f"  not judged alone in the program (each {basis} than {skipped.get('floor_ms', 0):.3f} ms, half the "
                         "noise of a whole-program timing): " + ", ".join(f"{g.get('alone_ms', 0):.3f} ms ({plural(g.get('instances') or 0, 'instance')})"
                                                                          for g in skipped["groups"] if isinstance(g, dict)))
        for c in sel.get("comparisons") or []:
            if isinstance(c, dict):
                lines.append(f"  close call: a plan of {plural(c.get('second') or 0, 'group')} against one of {c.get('first')}, timed "
                             f"against each other: " + (f"ratio {c['ratio']:.4f} ({c['q1']:.4f}..{c['q3']:.4f}) over {c.get('pairs')} pairs, "
                                                        if isinstance(c.get("ratio"), (int, float)) else f"{c.get('status')}: {c.get('error')}, ")
                             + f"kept the {'later' if c.get('kept') == 'second' else 'earlier'}")
    return lines


def savings_text(record: dict[str, Any]) -> str:
    """What a validated plan's groups saved alone and in the program (`composition.Measured.record`): ``saved 1.469 ms
    alone, 0.916 ms in the program (62%)``; where the job profiled jax.jit's program, what that profile expected of
    them there too: ``saved 1.469 ms alone (0.950 expected in the program), 0.916 ms in the program (62%; 96% of
    expected)``."""
    alone, real, expected = record.get("alone_ms"), record.get("realised_ms"), record.get("expected_ms")
    if not isinstance(alone, (int, float)):
        return ""
    profiled = isinstance(expected, (int, float))
    said = f"saved {alone:.3f} ms alone" + (f" ({expected:.3f} expected in the program)" if profiled else "")
    if not isinstance(real, (int, float)):
        return f"{said}, not timed in the program"
    shares = ([f"{real / alone:.0%}"] if alone > 0 else []) + ([f"{real / expected:.0%} of expected"] if profiled and expected > 0 else [])
    return f"{said}, {real:.3f} ms in the program" + (f" ({'; '.join(shares)})" if shares else "")
