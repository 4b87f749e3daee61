"""What a tuning job found (`TuneReport`) and the table it prints."""
from __future__ import annotations

from dataclasses import dataclass

from ..plan import Plan
from ..runner.protocol import ValidationResult
from ..status import TrialStatus
from ..tables import Column, fmt_ms, fmt_x, format_table
from .ledger import CandidateState


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

    def table(self) -> str:
        kind = "measured" if self.measure == "device" else "MODELLED (analytic roofline, no GPU)"
        rows = [{"candidate": c.signature, "template": c.template, "nodes": len(c.nodes), "x": c.instances,
                 "trials": f"{sum(t.status is TrialStatus.OK for t in c.trials)}/{len(c.trials)}", "xla ms": c.xla_ms, "best ms": c.best_ms,
                 "speedup": c.speedup, "config": ",".join(f"{k}={v}" for k, v in sorted((c.best_config or {}).items()))}
                for c in self.candidates]
        columns = [Column("candidate", fmt=lambda s: s[:20]), Column("template"), Column("nodes"), Column("x"), Column("trials"),
                   Column("xla ms", fmt=fmt_ms), Column("best ms", fmt=fmt_ms), Column("speedup", fmt=fmt_x), Column("config")]
        chosen = "XLA (no fused group beats it)" if self.plan.is_xla else f"{len(self.plan.groups)} fused group(s): " + ", ".join(
            f"{g.template}{list(g.nodes)}" for g in self.plan.groups)
        lines = [
            f"autofuse tune {self.name}  program {self.fingerprint}  ({kind}, device {self.device})",
            format_table(rows, columns),
            f"plan: {chosen}",
            f"jax.jit {fmt_ms(self.baseline_ms)} ms  autofuse {fmt_ms(self.tuned_ms)} ms  speedup {fmt_x(self.speedup)}"
            + (f"  (noise ±{self.noise:.1%})" if self.noise is not None else "")
            + f"  max rel error {self.validation.max_error:.2e}",
            f"{self.trials_run} trials in {self.wall_s:.1f} s" + (f"; run {self.run_id}, plan {self.plan_id}" if self.run_id else ""),
        ]
        return "\n".join(lines)
