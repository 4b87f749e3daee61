"""What a tuning job found (`TuneReport`) and the table it prints."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ..plan import Plan, describe_groups
from ..runner.protocol import ValidationResult
from ..tables import Column, device_label, fmt_ms, fmt_x, format_table, memory_text, plural, savings_text
from .ledger import CandidateState
from .output import candidate_label, config_text


@dataclass
class TuneReport:
    """What a tuning job found. Times are measured on the device, or modelled (`measure == "model"`)."""

    name: str
    fingerprint: str
    measure: str
    plan: Plan
    baseline_ms: float | None
    tuned_ms: float | None
    speedup: float | None
    noise: float | None
    candidates: list[CandidateState]
    validation: ValidationResult
    wall_s: float
    trials_run: int
    run_id: int | None = None
    plan_id: int | None = None
    device: str = ""

    model: str | None = None  # the GPU the analytic model describes (measure == "model")
    plan_current: bool | None = None  # whether the stored plan became current (None: not stored)
    plan_note: str = ""  # why a stored plan is not current, in one line
    stored_in: str | None = None  # the store its run and plan were written to, as shown (password masked); None: not stored

    def table(self, all_candidates: bool = False) -> str:
        """The job's table: the plan's groups first, named by their ops, the other measured candidates after (all of
        them with `all_candidates`), and the summary line last."""
        return final_table(self, all_candidates)

    def summary(self) -> str:
        """One line: the speedup, measured or modelled, the plan, the trials, the run and plan ids and their store."""
        return summary_line(self)


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
    planned = {g.signature: g.config for g in report.plan.groups}
    other = {r.cand.signature for r in rows if r.chosen and config_text(planned[r.cand.signature]) != config_text(r.cand.best_config)}
    cells = [{"": "*" if r.chosen else "", "group": label, "x": r.cand.instances,
              "trials": f"{sum(t.status.value == 'ok' for t in r.cand.trials)}/{sum(t.status.compiled for t in r.cand.trials)}",
              "xla ms": r.cand.xla_ms, "best ms": r.cand.best_ms, "speedup": r.cand.speedup,
              "config": (f"plan: {config_text(planned[r.cand.signature])} (fastest: {config_text(r.cand.best_config)})"
                         if r.cand.signature in other else config_text(r.cand.best_config))}
             for r, label in zip(rows, labels)]
    columns = [Column(""), Column("group"), Column("x"), Column("trials"), Column("xla ms", fmt=fmt_ms), Column("best ms", fmt=fmt_ms),
               Column("speedup", fmt=fmt_x), Column("config")]
    lines = [f"autofuse tune {report.name}  program {report.fingerprint[:16]}  ({kind_text(report)})"]
    lines.append(format_table(cells, columns) if cells else "(no candidate was measured)")
    hidden = len(report.candidates) - len(rows)
    notes = []
    if report.plan.groups:
        notes.append("* in the plan")
    if other:
        notes.append("plan: the config the plan runs where it is not the fastest trial's (a leaner one under --max-memory)")
    if hidden:
        notes.append(f"{hidden} candidate(s) never measured not shown (--all lists them)")
    notes.append("trials: ok/run, infeasible configs not counted")
    lines.append("; ".join(notes))
    if report.plan.is_xla and report.plan.provenance.get("reason"):
        lines.append(f"plan: XLA's own, because {report.plan.provenance['reason']}")
    lines.append(summary_line(report))
    return "\n".join(lines)


def _spread_note(validation: ValidationResult) -> str:
    """Where the worst error is of the size of jax.jit's own move (an output that is rounding noise, like a
    gradient that is zero in exact arithmetic, or a chaotic bf16 step), that move, so the number reads as what it is."""
    spread = max(validation.rounding_sensitivity, default=0.0)
    return f" (jax.jit's own move up to {spread:.2g})" if validation.max_error > 0.05 and spread >= validation.max_error / 10 else ""


def summary_line(report: TuneReport) -> str:
    """Everything a job found, on one line: the speedup and how it was obtained, the plan, the trials, the store rows
    and the store (a mistyped --db or $AUTOFUSE_DB shows)."""
    how = f"measured on {report.device}" if report.measure == "device" else \
        f"MODELLED on a {device_label('model', report.device, report.model)}, not measured"
    if report.plan.is_xla:
        found = f"XLA's own plan, nothing beat jax.jit ({fmt_ms(report.baseline_ms)} ms, {how})"
    else:
        extra = [f"noise ±{report.noise:.1%}"] if report.noise is not None else []
        if report.validation.max_error is not None:
            extra.append(f"max rel error {report.validation.max_error:.1e}" + _spread_note(report.validation))
        prov = report.plan.provenance
        if report.measure == "device" and isinstance(prov.get("alone_ms"), (int, float)):
            extra.append(savings_text(prov))
        if report.measure == "device" and memory_text(prov):
            extra.append(memory_text(prov))
        found = (f"{fmt_x(report.speedup)} over jax.jit ({fmt_ms(report.baseline_ms)} -> {fmt_ms(report.tuned_ms)} ms"
                 + "".join(f", {e}" for e in extra) + f"; {how}) with {describe_groups(report.plan)}")
    store = f"run {report.run_id}, plan {report.plan_id} in {report.stored_in}" if report.stored_in is not None else "not stored"
    return f"autofuse: {report.name}: {found}; {plural(report.trials_run, 'trial')} in {report.wall_s:.1f} s; {store}"
