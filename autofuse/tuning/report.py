"""What a tuning job found (`TuneReport`) and the table it prints."""
from __future__ import annotations

from dataclasses import dataclass

from ..plan import Plan
from ..runner.protocol import ValidationResult
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

    model: str | None = None  # the GPU the analytic model describes (measure == "model")
    plan_current: bool | None = None  # whether the stored plan became current (None: not stored)
    plan_note: str = ""  # why a stored plan is not current, in one line

    def table(self, all_candidates: bool = False) -> str:
        """The job's table: the plan's groups first, named by their ops, the other measured candidates after (all of
        them with `all_candidates`), and the summary line last."""
        from .output import final_table

        return final_table(self, all_candidates)

    def summary(self) -> str:
        """One line: the speedup, measured or modelled, the plan, the trials, the run and plan ids."""
        from .output import summary_line

        return summary_line(self)
