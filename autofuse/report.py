"""Markdown + PNG report of one tuning run, from the plan store.

``write_report(store, run_id, out_dir)`` writes ``out_dir/report.md`` and
two plots next to it:

* ``convergence.png``: best-so-far median time (ms) vs trial number, one line
  per candidate (successful trials only; log scale);
* ``speedup.png``: per-candidate speedup of the best config over XLA
  (``xla_ms / best_ms``), a bar per candidate, 1.0 marked.

Matplotlib is used through its object API with the Agg canvas: no display,
no global backend switch, no pyplot state. Imports nothing from JAX.
"""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path
from typing import Any

from .tables import Column, fmt_short, format_table

MAX_LEGEND = 12


def _label(c: dict[str, Any]) -> str:
    return f"#{c['id']} {c['template']} {str(c['signature'])[:8]}"


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v:.4g}"


def _x(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}×"


def _md_escape(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def convergence_series(trials: list[dict[str, Any]]) -> dict[int, tuple[list[int], list[float]]]:
    """Per candidate id: trial numbers and best-so-far median_ms over ok trials."""
    out: dict[int, tuple[list[int], list[float]]] = {}
    for t in sorted(trials, key=lambda t: (t["candidate_id"], t["number"])):
        ms = t.get("median_ms")
        if t.get("status") != "ok" or ms is None or not ms > 0:
            continue
        xs, ys = out.setdefault(t["candidate_id"], ([], []))
        best = min(ms, ys[-1]) if ys else ms
        xs.append(t["number"])
        ys.append(best)
    return out


def _plot_convergence(path: Path, cands: list[dict[str, Any]], trials: list[dict[str, Any]], title: str) -> bool:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    series = convergence_series(trials)
    fig = Figure(figsize=(8, 4.8), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    by_id = {c["id"]: c for c in cands}
    for cid, (xs, ys) in series.items():
        c = by_id.get(cid)
        ax.step(xs, ys, where="post", marker=".", markersize=3, linewidth=1.2,
                label=_label(c) if c else f"#{cid}")
    if series:
        ax.set_yscale("log")
        if len(series) <= MAX_LEGEND:
            ax.legend(fontsize=7, loc="upper right")
    else:
        ax.text(0.5, 0.5, "no successful trials", ha="center", va="center", transform=ax.transAxes)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("trial number (within candidate)")
    ax.set_ylabel("best-so-far median time (ms)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    return bool(series)


def _plot_speedups(path: Path, cands: list[dict[str, Any]], title: str) -> bool:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = [(c, c["speedup"]) for c in cands if c.get("speedup") is not None]
    rows.sort(key=lambda cs: cs[1])
    fig = Figure(figsize=(8, max(2.5, 0.3 * len(rows) + 1.2)), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if rows:
        labels = [_label(c) for c, _s in rows]
        values = [s for _c, s in rows]
        colors = ["tab:green" if s >= 1.0 else "tab:red" for s in values]
        ax.barh(range(len(rows)), values, color=colors)
        ax.set_yticks(range(len(rows)), labels, fontsize=7)
        ax.axvline(1.0, color="black", linewidth=0.8, linestyle="--")
        for i, v in enumerate(values):
            ax.text(v, i, f" {v:.2f}×", va="center", fontsize=7)
    else:
        ax.text(0.5, 0.5, "no candidate with both XLA and best times", ha="center", va="center",
                transform=ax.transAxes)
        ax.set_yticks([])
    ax.set_xlabel("speedup over XLA (xla_ms / best_ms)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    return bool(rows)


def write_report(store: Any, run_id: int, out_dir: str | Path) -> Path:
    """Write ``report.md``, ``convergence.png`` and ``speedup.png`` for a run.

    *store* is a :class:`autofuse.store.PlanStore`. Returns the path of
    ``report.md``. Raises KeyError for an unknown run.
    """
    run = store.get_run(run_id)
    cands = store.candidates(run_id)
    trials = store.trials(run_id)
    plans = [p for p in store.plans(run["fingerprint"]) if p["run_id"] == run_id]

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    title = f"run {run_id}: {run['program']} on {run['device']} ({run['backend']})"
    _plot_convergence(out / "convergence.png", cands, trials, title)
    _plot_speedups(out / "speedup.png", cands, title)

    counts: dict[str, int] = {}
    for t in trials:
        counts[t["status"]] = counts.get(t["status"], 0) + 1
    errors: dict[str, int] = {}
    for t in trials:
        if t.get("error"):
            first = str(t["error"]).strip().splitlines()[0][:160] if str(t["error"]).strip() else ""
            errors[f"{t['status']}: {first}"] = errors.get(f"{t['status']}: {first}", 0) + 1

    started, ended = run["started_at"], run["ended_at"]
    duration = f"{(ended - started).total_seconds():.1f} s" if started and ended else "–"
    lines: list[str] = [
        f"# autofuse run {run_id}",
        "",
        f"Program **{_md_escape(run['program'])}** (`{run['fingerprint']}`) on **{_md_escape(run['device'])}**.",
        "",
        "| field | value |",
        "|---|---|",
        f"| status | {run['status']} |",
        f"| measure | {run['measure']} |",
        f"| software | jax {run['jax']}, jaxlib {run['jaxlib']}, autofuse {run['autofuse']}, "
        f"backend {run['backend']} |",
        f"| budget | `{json.dumps(run['budget'])}` |",
        f"| sampler / seed | {run['sampler']} / {run['seed']} |",
        f"| started (UTC) | {started.isoformat(timespec='seconds') if started else '–'} |",
        f"| ended (UTC) | {ended.isoformat(timespec='seconds') if ended else '–'} |",
        f"| duration | {duration} |",
        f"| host / pid | {run['host'] or '–'} / {run['pid'] if run['pid'] is not None else '–'} |",
        f"| baseline (XLA) ms | {_ms(run['baseline_ms'])} |",
        f"| best ms | {_ms(run['best_ms'])} |",
        f"| speedup | {_x(run['speedup'])} |",
        f"| candidates / trials | {len(cands)} / {len(trials)} |",
    ]
    if run.get("error"):
        lines.append(f"| error | {_md_escape(str(run['error']).strip().splitlines()[0][:200])} |")
    lines += [
        "",
        "## Search convergence",
        "",
        "Best-so-far median time of the successful trials of each candidate.",
        "",
        "![convergence](convergence.png)",
        "",
        "## Speedup per candidate",
        "",
        "Best config of each candidate against XLA's kernels for the same nodes (xla_ms / best_ms).",
        "",
        "![speedup](speedup.png)",
        "",
        "## Candidates",
        "",
    ]
    if cands:
        lines.append(format_table(cands, [
            Column("id"), Column("template"), Column("signature", fmt=lambda s: f"`{str(s)[:12]}`"), Column("nodes", fmt=fmt_short(60)),
            Column("status"), Column("trials", "n_trials"), Column("best ms", "best_ms", _ms), Column("XLA ms", "xla_ms", _ms),
            Column("speedup", fmt=_x), Column("best config", "best_config", lambda v: f"`{json.dumps(v)}`" if v else "–")], markdown=True))
    else:
        lines.append("No candidates recorded.")
    lines += ["", "## Trials by status", ""]
    if counts:
        lines.append(format_table([{"status": k, "trials": v} for k, v in sorted(counts.items(), key=lambda kv: -kv[1])],
                                  [Column("status"), Column("trials")], markdown=True))
    else:
        lines.append("No trials recorded.")
    if errors:
        lines += ["", "Most frequent errors:", ""]
        for msg, n in sorted(errors.items(), key=lambda kv: -kv[1])[:10]:
            quoted = msg.replace("`", "'")
            lines.append(f"- {n}× `{quoted}`")
    lines += ["", "## Plans saved by this run", ""]
    if plans:
        lines.append(format_table(plans, [
            Column("plan", "id"), Column("created (UTC)", "created_at", lambda v: v.isoformat(timespec="seconds")),
            Column("ms", "measured_ms", _ms), Column("baseline ms", "baseline_ms", _ms), Column("speedup", fmt=_x),
            Column("max error", "max_error", lambda v: f"{v:.2g}"), Column("current", "is_current", lambda v: "yes" if v else "no")],
            markdown=True))
    else:
        lines.append("None.")
    now = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    lines += ["", f"_Generated {now} from the plan store._", ""]

    report = out / "report.md"
    report.write_text("\n".join(lines), encoding="utf-8")
    return report
