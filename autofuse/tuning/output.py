"""What a tuning job prints, and nothing else: a group's readable name, the final table, the one summary line, the
progress bar's text and the dry run's table.

A person reads these after a job, so the chosen groups come first and are named by what they compute
(``attention: dot_general·div·exp·reduce_sum·dot_general``), not by node indices; candidates never measured are
left out unless asked; and the last line says on its own what the job found (``--quiet`` prints only it).
"""
from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

from ..tables import Column, device_label, fmt_ms, fmt_x, format_table

if TYPE_CHECKING:
    from .dryrun import DryRun
    from .ledger import CandidateState
    from .report import TuneReport

LABEL_WIDTH = 72
# Ops that only move or retype data: left out of a long group's name (they say little about what it computes).
_PLUMBING = frozenset({"broadcast_in_dim", "reshape", "convert_element_type", "squeeze", "expand_dims", "transpose", "copy", "copy_p",
                       "iota", "stop_gradient", "select_n"})
_SHORT = {"convert_element_type": "convert", "broadcast_in_dim": "broadcast"}
# Ops that say what a long group computes (its contractions, reductions and transcendentals): a name too long for
# its column keeps these.
_DEFINING = frozenset({"dot_general", "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin", "cumsum", "cummax",
                       "exp", "exp2", "log", "log1p", "tanh", "logistic", "rsqrt", "sqrt", "erf", "erf_inv", "sin", "cos", "pow"})


def group_label(template: str, ops: Sequence[str], width: int = LABEL_WIDTH) -> str:
    """``template: op·op·op`` with repeats folded (``mul×3``); a group too long for `width` drops its data-movement
    ops, then keeps only the ops that define it (dots, reductions, transcendentals) with its op count, then elides
    its middle (``…``)."""
    def parts_of(names: Sequence[str]) -> list[str]:
        runs: list[list] = []
        for o in names:
            if runs and runs[-1][0] == o:
                runs[-1][1] += 1
            else:
                runs.append([o, 1])
        return [o if n == 1 else f"{o}×{n}" for o, n in runs]

    head = f"{template}: "
    parts = parts_of([_SHORT.get(o, o) for o in ops])
    if not parts or len(head + "·".join(parts)) <= width:
        return head + "·".join(parts) if parts else template
    parts = parts_of([_SHORT.get(o, o) for o in ops if o not in _PLUMBING]) or parts
    if len(head + "·".join(parts)) <= width:
        return head + "·".join(parts)
    tail = f" ({len(ops)} ops)"
    key = parts_of([o for o in ops if o in _DEFINING])  # what makes it this computation: its dots, reductions, transcendentals
    if len(key) >= 2 and len(head + "·".join(key) + tail) <= width:
        return head + "·".join(key) + tail
    parts = key if len(key) >= 2 else parts
    for keep in range(len(parts) - 1, 0, -1):  # the first `keep` parts, an ellipsis, the last part
        text = head + "·".join(parts[:keep]) + "·…·" + parts[-1] + tail
        if len(text) <= width:
            return text
    return head + parts[0] + "·…·" + parts[-1] + tail


def candidate_label(c: CandidateState) -> str:
    return group_label(c.template, c.ops) if c.ops else f"{c.template}: {len(c.nodes)} nodes"


def config_text(config: dict | None) -> str:
    """A config as ``backend k=v k=v`` (the backend first: it says which lowering the rest configures)."""
    if not config:
        return ""
    rest = " ".join(f"{k}={v}" for k, v in sorted(config.items()) if k != "backend")
    return f"{config.get('backend', 'triton')} {rest}".strip()


@dataclass(frozen=True)
class Row:
    """One candidate as the final table shows it."""

    chosen: int  # instances the plan runs fused (0: not in the plan)
    cand: CandidateState

    @property
    def saving_ms(self) -> float:
        c = self.cand
        return ((c.xla_ms or 0.0) - c.best_ms) * c.instances if c.best_ms is not None else float("-inf")


def table_rows(report: TuneReport, all_candidates: bool = False) -> list[Row]:
    """The plan's groups first (largest saving first), then the other measured candidates by speedup, then (with
    `all_candidates`) the ones never measured."""
    used = Counter(g.signature for g in report.plan.groups)
    rows = [Row(used.get(c.signature, 0), c) for c in report.candidates if all_candidates or c.measured or used.get(c.signature)]
    return sorted(rows, key=lambda r: (not r.chosen, not r.cand.measured, -r.saving_ms if r.chosen else -(r.cand.speedup or 0.0)))


def kind_text(report: TuneReport) -> str:
    """How the times were obtained: measured on a device, or modelled (never to pass for measured)."""
    if report.measure == "device":
        return f"measured on {report.device}"
    return f"MODELLED: analytic roofline {device_label('model', report.device, report.model)}, no GPU"


def final_table(report: TuneReport, all_candidates: bool = False) -> str:
    """The header, the candidates' table, why the plan is XLA's (if it is) and the summary line."""
    rows = table_rows(report, all_candidates)
    labels = [candidate_label(r.cand) for r in rows]
    twice = {lb for lb in labels if labels.count(lb) > 1}
    labels = [f"{lb} #{r.cand.signature[:6]}" if lb in twice else lb for lb, r in zip(labels, rows)]  # the same ops, other shapes
    cells = [{"": "*" if r.chosen else "", "group": label, "x": r.cand.instances,
              "trials": f"{sum(t.status.value == 'ok' for t in r.cand.trials)}/{sum(t.status.compiled for t in r.cand.trials)}",
              "xla ms": r.cand.xla_ms, "best ms": r.cand.best_ms, "speedup": r.cand.speedup, "config": config_text(r.cand.best_config)}
             for r, label in zip(rows, labels)]
    columns = [Column(""), Column("group"), Column("x"), Column("trials"), Column("xla ms", fmt=fmt_ms), Column("best ms", fmt=fmt_ms),
               Column("speedup", fmt=fmt_x), Column("config")]
    lines = [f"autofuse tune {report.name}  program {report.fingerprint[:16]}  ({kind_text(report)})"]
    lines.append(format_table(cells, columns) if cells else "(no candidate was measured)")
    hidden = len(report.candidates) - len(rows)
    notes = []
    if report.plan.groups:
        notes.append("* in the plan")
    if hidden:
        notes.append(f"{hidden} candidate(s) never measured not shown (--all lists them)")
    notes.append("trials: ok/run, infeasible configs not counted")
    lines.append("; ".join(notes))
    if report.plan.is_xla and report.plan.provenance.get("reason"):
        lines.append(f"plan: XLA's own, because {report.plan.provenance['reason']}")
    lines.append(summary_line(report))
    return "\n".join(lines)


def plan_text(report: TuneReport) -> str:
    """``2 fused groups (attention, row_reduce×2)``."""
    n = len(report.plan.groups)
    by_template = Counter(g.template for g in report.plan.groups)
    kinds = ", ".join(t if k == 1 else f"{t}×{k}" for t, k in sorted(by_template.items(), key=lambda tk: (-tk[1], tk[0])))
    return f"{n} fused group{'s' if n != 1 else ''} ({kinds})"


def summary_line(report: TuneReport) -> str:
    """Everything a job found, on one line: the speedup and how it was obtained, the plan, the trials, the store rows."""
    how = f"measured on {report.device}" if report.measure == "device" else \
        f"MODELLED on a {device_label('model', report.device, report.model)}, not measured"
    if report.plan.is_xla:
        found = f"XLA's own plan, nothing beat jax.jit ({fmt_ms(report.baseline_ms)} ms, {how})"
    else:
        extra = [f"noise ±{report.noise:.1%}"] if report.noise is not None else []
        if report.validation.max_error is not None:
            extra.append(f"max rel error {report.validation.max_error:.1e}")
        found = (f"{fmt_x(report.speedup)} over jax.jit ({fmt_ms(report.baseline_ms)} -> {fmt_ms(report.tuned_ms)} ms"
                 + "".join(f", {e}" for e in extra) + f"; {how}) with {plan_text(report)}")
    store = f"; run {report.run_id}, plan {report.plan_id}" if report.run_id is not None else ""
    return f"autofuse: {report.name}: {found}; {report.trials_run} trials in {report.wall_s:.1f} s{store}"


def best_postfix(baseline_ms: float | None, tuned_ms: float | None) -> str:
    """The progress bar's text: the job's best plan so far (its groups' best configs, measured alone)."""
    return f"best plan {baseline_ms / tuned_ms:.2f}x" if baseline_ms and tuned_ms else "best plan -"


def trial_line(c: CandidateState) -> str:
    """One trial as ``-v`` prints it (the candidate's latest trial)."""
    t = c.trials[-1]
    ms = f"{t.median_ms:.4g} ms" if t.median_ms is not None else ""
    sp = f" ({c.xla_ms / t.median_ms:.2f}x)" if t.median_ms and c.xla_ms else ""
    err = f": {t.error.strip().splitlines()[0][:100]}" if t.error and t.status.value != "ok" and t.error.strip() else ""
    return f"  trial {candidate_label(c)} #{t.number} {t.status.value} {ms}{sp}{err}  [{config_text(t.config)}]"


def candidate_line(c: CandidateState) -> str:
    """One candidate's outcome as ``-v`` prints it at the end of the trials."""
    return (f"  candidate {c.signature[:12]} {candidate_label(c)} x{c.instances}: xla {fmt_ms(c.xla_ms) or '-'} ms, best "
            f"{fmt_ms(c.best_ms) or '-'} ms ({fmt_x(c.speedup) or '-'}) after {len(c.trials)} trials [{c.status}]")


def dry_run_table(d: DryRun) -> str:
    """The dry run: the candidates in the order the budget reaches them, the modelled plan, the budget's warnings."""
    cells = [{"#": r.order, "": "*" if r.contender else "", "group": group_label(r.template, r.ops), "x": r.instances, "configs": r.configs,
              "backends": ",".join(r.backends), "xla ms": r.xla_ms, "default ms": r.default_ms, "saving ms": r.saving_ms} for r in d.rows]
    columns = [Column("#"), Column(""), Column("group"), Column("x"), Column("configs"), Column("backends"), Column("xla ms", fmt=fmt_ms),
               Column("default ms", fmt=fmt_ms), Column("saving ms", fmt=lambda v: f"{v:+.3g}")]
    budget = f"{d.trials} trials" if d.trials is not None else ""
    if d.time_budget_s:
        budget += (" and " if budget else "") + f"{d.time_budget_s:g} s"
    instances = sum(r.instances for r in d.rows)
    lines = [f"autofuse tune {d.name} --dry-run  program {d.fingerprint[:16]}  (MODELLED on a model of {d.model}: nothing compiled, "
             + "timed or stored)"]
    lines.append(format_table(cells, columns) if cells else "(no fusible group: the plan is XLA's own)")
    lines.append("# = the order phase 1 gives each its default config (largest modelled saving first); * = contender (in the "
                 "modelled plan, or within 25% of XLA): phase 2 shares the rest of the budget among these, by XLA time")
    lines.append(f"{len(d.rows)} distinct candidates ({instances} instances) in {d.n_nodes} nodes; {d.contenders} contenders; modelled plan "
                 f"of default configs: {d.plan_groups} fused groups, {fmt_ms(d.baseline_ms)} -> {fmt_ms(d.plan_ms)} ms "
                 f"({fmt_x(d.baseline_ms / d.plan_ms) if d.plan_ms else '-'}); budget {budget}")
    lines += [f"warning: {w}" for w in d.warnings]
    return "\n".join(lines)


class StatusLine:
    """A slow phase's progress ("validating plan 2 of 4") on one line of stderr, rewritten in place on a terminal
    (a log gets each line): the default output stays compact while saying what the job is doing."""

    def __init__(self, stream: TextIO | None = None):
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.open = False

    def __call__(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r\x1b[2K" + text)
            self.open = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the rewritten line (before the table prints)."""
        if self.open:
            self.stream.write("\r\x1b[2K")
            self.stream.flush()
            self.open = False
