"""What a traced signature runs, decided before anything is built: a typed `Resolution`, and the words each kind is
said in (the `last_status` line and `explain`), so that the face and the log speak of a plan the same way."""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Literal

from ..plan import Plan, describe_groups

if TYPE_CHECKING:  # the store's types without SQLAlchemy at deploy time
    from ..store.results import ShapeVerdict

Kind = Literal["plan", "plan-version", "plan-shape", "xla-plan", "miss"]


@dataclass(frozen=True)
class Checked:
    """A check made earlier by this process (the store could not remember it), read as a `store.ShapeVerdict`."""

    verdict: str
    detail: str
    checked_at: datetime | None = None


@dataclass(frozen=True)
class Resolution:
    """What a signature runs, as decided before anything is built: ``kind`` is ``plan`` (a fused plan for this
    program, device and software), ``plan-version`` (one made with other versions: re-verified before use),
    ``plan-shape`` (the plan of a program of the same structure tuned at other sizes, `tuned_at`, adapted to
    these, `serving`: checked against jax.jit unless a check is `remembered`), ``xla-plan`` (a stored plan whose
    tuning found nothing that beat jax.jit) or ``miss`` (no usable plan: `why`). `learned`: structures of stored
    programs computed on the way ((fingerprint, structure) pairs the store did not have), to record."""

    kind: Kind
    plan: Plan | None = None
    plan_id: int | None = None
    run_id: int | None = None
    software: dict = field(default_factory=dict)
    why: str = ""
    tuned_at: str = ""
    serving: str = ""
    remembered: ShapeVerdict | Checked | None = None  # an earlier check at this shape (plan-shape)
    learned: tuple[tuple[str, str], ...] = ()

    def where(self) -> str:
        """Which stored plan, e.g. ``run 7, plan 12`` (``given plan``: passed as plan=)."""
        if self.plan_id is None:
            return "given plan"
        return ", ".join(x for x in (f"run {self.run_id}" if self.run_id is not None else "", f"plan {self.plan_id}") if x)

    def status(self) -> str:
        """The `last_status` line: ``plan: 3 fused groups (attention, row_reduce×2), run 7, plan 12``,
        ``plan-reverified: ...``, ``xla-plan: nothing beat jax.jit (run 7, plan 12)`` or ``xla: <why>``."""
        if self.kind == "miss":
            return f"xla: {self.why}"
        if self.kind == "xla-plan":
            return f"xla-plan: nothing beat jax.jit when it was tuned ({self.where()})"
        if self.kind == "plan-shape":
            return f"plan (tuned at {self.tuned_at}, serving {self.serving}): {describe_groups(self.plan)}, {self.where()}, {self.checked()}"
        head = "plan-reverified" if self.kind == "plan-version" else "plan"
        made = f", made with jax {self.software.get('jax')} (re-verified here)" if self.kind == "plan-version" else ""
        return f"{head}: {describe_groups(self.plan)}, {self.where()}{made}"

    def checked(self) -> str:
        """How a plan-shape resolution was checked at its shape: ``checked against jax.jit here`` or
        ``checked against jax.jit 2026-11-28 10:02 (remembered)``."""
        when = getattr(self.remembered, "checked_at", None)
        return f"checked against jax.jit {when:%Y-%m-%d %H:%M} (remembered)" if when is not None else "checked against jax.jit here"

    def explain(self, head: str, on_miss: str, fingerprint: str) -> str:
        """`explain`'s sentence for a signature not traced yet: `head` (``name(inputs)``) and what its first call does."""
        if self.kind == "miss":
            act = "raises PlanError" if on_miss == "error" else "runs plain jax.jit"
            return f"{head} {act} at the first call: {self.why} (program {fingerprint})"
        if self.kind == "xla-plan":
            return f"{head} runs plain jax.jit: {self.status()}"
        if self.kind == "plan-version":
            return (f"{head} re-verifies against jax.jit at the first call, then runs {describe_groups(self.plan)}, {self.where()} "
                    f"(made with jax {self.software.get('jax')}, autofuse {self.software.get('autofuse')})")
        if self.kind == "plan-shape":
            first = (f"{self.checked()}, " if self.remembered is not None else
                     "is checked against jax.jit at the first call (once per store, or per process where it cannot remember), then ")
            return (f"{head} runs plan (tuned at {self.tuned_at}, serving {self.serving}): {first}{describe_groups(self.plan)}, "
                    f"{self.where()}")
        return f"{head} runs plan: {describe_groups(self.plan)}, {self.where()} (built at the first call)"
