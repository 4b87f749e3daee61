"""Markdown + PNG report of one tuning run, from the plan store.

``write_report(store, run_id, out_dir)`` writes ``out_dir/report.md`` and
two plots next to it:

* ``convergence.png``: each candidate's best-so-far speedup over XLA
  (``xla_ms / best median_ms``) against the job's trial number (every
  candidate's trials on one axis, in the order the job ran them), each line
  held to the job's end, so a candidate with one trial still reads as a
  level; the plan's groups drawn bold;
* ``speedup.png``: per-candidate speedup of the best config over XLA, a bar
  per candidate grown from 1.0 (so 1.06x and 1.13x differ by twice the
  length), the plan's groups marked.

Titles name the device, or the GPU model of a modelled run. Matplotlib is
used through its object API with the Agg canvas: no display, no global
backend switch, no pyplot state. Imports nothing from JAX.
"""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path
from typing import Any

from .status import TrialStatus
from .tables import Column, device_label, fmt_short, format_table, memory_text

MAX_LINES = 12  # convergence: the plan's groups and the best others, at most this many lines (the legend stays legible)


def _label(c: dict[str, Any], chosen: set[str] = frozenset()) -> str:
    mark = " (plan)" if c.get("signature") in chosen else ""
    return f"#{c['id']} {c['template']} {str(c['signature'])[:8]}{mark}"


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v:.4g}"


def _x(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}×"


def _md_escape(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def run_title(run: dict[str, Any]) -> str:
    """``run 3: attention on NVIDIA H100 80GB HBM3`` (``on a model of NVIDIA H200`` for a modelled run)."""
    on = device_label(run.get("measure"), run.get("device"), (run.get("budget") or {}).get("model"))
    return f"run {run['id']}: {run['program']} on {'a ' if run.get('measure') == 'model' else ''}{on}"


def chosen_signatures(store: Any, run: dict[str, Any]) -> set[str]:
    """The signatures of the fused groups in the plan(s) the run saved."""
    out: set[str] = set()
    for p in store.plans(run["fingerprint"]):
        if p["run_id"] == run["id"]:
            out |= {g.get("signature") for g in (store.get_plan(p["id"])["plan"].get("groups") or [])}
    return out


def convergence_series(trials: list[dict[str, Any]], cands: list[dict[str, Any]]) -> dict[int, tuple[list[int], list[float]]]:
    """Per candidate id: the job's trial numbers (1, 2, ... over every candidate's trials, in the order run) at
    which its best-so-far speedup over XLA changed, and those speedups; each series ends at the job's last trial.
    Candidates without an XLA time or an ok trial have no series."""
    xla = {c["id"]: c.get("xla_ms") for c in cands}
    order = sorted(trials, key=lambda t: (t.get("created_at") or _dt.datetime.min.replace(tzinfo=_dt.UTC), t.get("id") or 0))
    out: dict[int, tuple[list[int], list[float]]] = {}
    best: dict[int, float] = {}
    for k, t in enumerate(order, start=1):
        cid, ms = t["candidate_id"], t.get("median_ms")
        if t.get("status") != "ok" or ms is None or not ms > 0 or not xla.get(cid):
            continue
        if cid not in best or ms < best[cid]:
            best[cid] = ms
            xs, ys = out.setdefault(cid, ([], []))
            xs.append(k)
            ys.append(xla[cid] / ms)
    for xs, ys in out.values():  # held to the job's end
        if xs[-1] != len(order):
            xs.append(len(order))
            ys.append(ys[-1])
    return out


def speedup_axis(values: list[float]) -> tuple[str, float, float]:
    """Scale and limits of the speedup axis: bars grow from 1.0, so the axis always holds 1.0 and every value with a
    margin; a linear scale unless the values span more than 4x (then log, where 2x and 0.5x are equally far)."""
    lo, hi = min([1.0, *values]), max([1.0, *values])
    if hi / lo > 4.0:
        return "log", lo / 1.15, hi * 1.15
    pad = max(0.08 * (hi - lo), 0.01)
    return "linear", lo - pad, hi + pad


def convergence_figure(cands: list[dict[str, Any]], trials: list[dict[str, Any]], chosen: set[str], title: str) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    series = convergence_series(trials, cands)
    by_id = {c["id"]: c for c in cands}
    ranked = sorted(series, key=lambda cid: (by_id.get(cid, {}).get("signature") not in chosen, -series[cid][1][-1]))[:MAX_LINES]
    fig = Figure(figsize=(8, 4.8), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for cid in ranked:
        xs, ys = series[cid]
        c = by_id.get(cid)
        bold = c is not None and c.get("signature") in chosen
        ax.step(xs, ys, where="post", marker="o" if bold else ".", markersize=4 if bold else 3, linewidth=2.4 if bold else 1.0,
                alpha=1.0 if bold else 0.7, label=_label(c, chosen) if c else f"#{cid}", zorder=3 if bold else 2)
    if series:
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.legend(fontsize=7, loc="best", title=None if len(series) <= MAX_LINES else f"{len(ranked)} of {len(series)} candidates",
                  title_fontsize=7)
    else:
        ax.text(0.5, 0.5, "no successful trials", ha="center", va="center", transform=ax.transAxes)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("trial of the job (every candidate's, in the order run)")
    ax.set_ylabel("best-so-far speedup over XLA (xla_ms / best ms)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    return fig


def speedup_figure(cands: list[dict[str, Any]], chosen: set[str], title: str) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    rows = sorted(((c, c["speedup"]) for c in cands if c.get("speedup") is not None), key=lambda cs: cs[1])
    fig = Figure(figsize=(8, max(2.5, 0.3 * len(rows) + 1.4)), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if rows:
        values = [v for _c, v in rows]
        in_plan = [c.get("signature") in chosen for c, _v in rows]
        colors = ["tab:blue" if p else "tab:green" if v >= 1.0 else "tab:red" for p, v in zip(in_plan, values)]
        ax.barh(range(len(rows)), [v - 1.0 for v in values], left=1.0, color=colors, edgecolor=["black" if p else "none" for p in in_plan],
                hatch=None)
        ax.set_yticks(range(len(rows)), [_label(c, chosen) for c, _v in rows], fontsize=7)
        for tick, p in zip(ax.get_yticklabels(), in_plan):
            tick.set_fontweight("bold" if p else "normal")
        scale, lo, hi = speedup_axis(values)
        ax.set_xscale(scale)
        ax.set_xlim(lo, hi)
        ax.axvline(1.0, color="black", linewidth=0.8, linestyle="--")
        for i, v in enumerate(values):
            ax.text(v, i, f" {v:.2f}×" if v >= 1.0 else f"{v:.2f}× ", va="center", ha="left" if v >= 1.0 else "right", fontsize=7)
        handles = [Patch(color="tab:blue", label="in the plan")] if any(in_plan) else []
        handles += [Patch(color="tab:green", label="faster than XLA"), Patch(color="tab:red", label="slower than XLA")]
        ax.legend(handles=handles, fontsize=7, loc="lower right")
    else:
        ax.text(0.5, 0.5, "no candidate with both XLA and best times", ha="center", va="center", transform=ax.transAxes)
        ax.set_yticks([])
    ax.set_xlabel("speedup over XLA (xla_ms / best_ms); bars grow from 1.0")
    ax.set_title(title, fontsize=10)
    ax.grid(True, axis="x", which="both", alpha=0.3)
    fig.tight_layout()
    return fig


def write_report(store: Any, run_id: int, out_dir: str | Path) -> Path:
    """Write ``report.md``, ``convergence.png`` and ``speedup.png`` for a run.

    *store* is a :class:`autofuse.store.PlanStore`. Returns the path of
    ``report.md``. Raises KeyError for an unknown run.
    """
    run = store.get_run(run_id)
    cands = store.candidates(run_id)
    trials = store.trials(run_id)
    plans = [dict(p, memory=memory_text(((store.get_plan(p["id"]).get("plan") or {}).get("provenance")) or {}))
             for p in store.plans(run["fingerprint"]) if p["run_id"] == run_id]

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    title = run_title(run)
    chosen = chosen_signatures(store, run)
    device = device_label(run["measure"], run["device"], (run.get("budget") or {}).get("model"))
    convergence_figure(cands, trials, chosen, title).savefig(out / "convergence.png")
    speedup_figure(cands, chosen, title).savefig(out / "speedup.png")

    counts: dict[str, int] = {}
    for t in trials:
        counts[t["status"]] = counts.get(t["status"], 0) + 1
    counted = sum(n for status, n in counts.items() if TrialStatus(status).spends_budget)  # as the job's summary line counts them
    uncounted = (f" (and {len(trials) - counted} not counted: configs found infeasible or pruned without compiling, or lost with "
                 "their worker)") if counted < len(trials) else ""
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
        f"Program **{_md_escape(run['program'])}** (`{run['fingerprint']}`) on **{_md_escape(device)}**"
        + (" (modelled: analytic roofline, not measured)." if run["measure"] == "model" else "."),
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
        f"| candidates / trials | {len(cands)} / {counted}{uncounted} |",
    ]
    if run.get("error"):
        lines.append(f"| error | {_md_escape(str(run['error']).strip().splitlines()[0][:200])} |")
    lines += [
        "",
        "## Search convergence",
        "",
        ("Each candidate's best-so-far speedup over XLA against the job's trials (all candidates' trials, in the order run); "
         "the plan's groups bold."),
        "",
        "![convergence](convergence.png)",
        "",
        "## Speedup per candidate",
        "",
        "Best config of each candidate against XLA's kernels for the same nodes (xla_ms / best_ms); the plan's groups in blue.",
        "",
        "![speedup](speedup.png)",
        "",
        "## Candidates",
        "",
    ]
    if cands:
        lines.append(format_table(cands, [
            Column("id"), Column("plan", of_row=lambda c: "*" if c["signature"] in chosen else ""), Column("template"),
            Column("signature", fmt=lambda s: f"`{str(s)[:12]}`"), Column("nodes", fmt=fmt_short(60)),
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
    profile = ((run.get("phases") or {}).get("selection") or {}).get("profile") or {}
    if isinstance(profile, dict) and profile.get("longest"):
        lines += ["", "## jax.jit's longest kernels", "",
                  f"The job profiled jax.jit's program once ({profile.get('kernels')} kernels, {profile.get('total_ms', 0):.3f} ms a call) "
                  "and priced each group by the XLA kernels it removes there; the longest of them, with the operations each computes:", ""]
        lines.append(format_table([k for k in profile["longest"] if isinstance(k, dict)], [
            Column("XLA instruction", "instruction"), Column("ms a call", "ms", _ms), Column("computes", "ops", lambda v: v or "–")],
            markdown=True))
    composition = ((run.get("phases") or {}).get("selection") or {}).get("composition") or []
    if composition:
        lines += ["", "## Savings alone and in the program", "",
                  "Each plan the job validated on the whole program: what its groups saved when each was timed alone, what a "
                  "profile of jax.jit's program expected them to save there (XLA's kernels they remove, less their time), and what "
                  "the plan saved against jax.jit in the program (the first is the cover's choice; then each distinct group on "
                  "its own; last, the groups that saved time in the program together).", ""]
        lines.append(format_table([{**r, "plan": i + 1} for i, r in enumerate(composition)], [
            Column("plan"), Column("validated as", "what", lambda v: v or "–"), Column("groups"),
            Column("distinct", of_row=lambda r: len(r["signatures"])),
            Column("status"), Column("alone ms", "alone_ms", _ms), Column("expected ms (profile)", "expected_ms", _ms),
            Column("in the program ms", "realised_ms", _ms),
            Column("share", of_row=lambda r: f"{r['realised_ms'] / r['alone_ms']:.0%}" if r.get("realised_ms") is not None and r.get("alone_ms") else "–"),
            Column("noise", fmt=lambda v: f"±{v:.1%}"), Column("why it failed", "error", lambda v: v or "")], markdown=True))
    lines += ["", "## Plans saved by this run", ""]
    if plans:
        lines.append(format_table(plans, [
            Column("plan", "id"), Column("created (UTC)", "created_at", lambda v: v.isoformat(timespec="seconds")),
            Column("ms", "measured_ms", _ms), Column("baseline ms", "baseline_ms", _ms), Column("speedup", fmt=_x),
            Column("max error", "max_error", lambda v: f"{v:.2g}"), Column("current", "is_current", lambda v: "yes" if v else "no"),
            Column("memory", fmt=lambda v: v or "–")],
            markdown=True))
    else:
        lines.append("None.")
    now = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    lines += ["", f"_Generated {now} from the plan store._", ""]

    report = out / "report.md"
    report.write_text("\n".join(lines), encoding="utf-8")
    return report
