"""When a new plan becomes the current one: the rule, as a pure function of the two plans.

A tuning job's plan replaces the current plan of its (program, device,
software) key only where that is a known improvement: it was measured and
beats the current plan beyond the noise of either measurement. A slower plan,
an XLA plan after a fused one, or a modelled plan after a measured one is
stored beside the current plan, never in its place, and the job says why. A
pinned plan is never replaced by a tuning job; a person can promote any plan
(``autofuse plans promote ID``, or ``tune --promote``). Imports nothing from
JAX, so that the store decides inside its own transaction.
"""

from __future__ import annotations

from dataclasses import dataclass

#: A plan must beat the current one by at least this fraction, whatever the measured spread.
MIN_NOISE = 0.005


@dataclass(frozen=True)
class PlanFigures:
    """What the rule reads of a plan: its id (None: not stored yet), how it was timed, its speedup over
    jax.jit, the spread of that ratio when it was validated, and whether it is pinned."""

    id: int | None
    measure: str  # "device" (timed on the GPU) or "model" (the analytic roofline model)
    speedup: float
    noise: float | None = None
    pinned: bool = False


@dataclass(frozen=True)
class Decision:
    """Whether the new plan becomes current, and the reason in words (one line, for people)."""

    current: bool
    reason: str


def decide(new: PlanFigures, current: PlanFigures | None, *, force: bool | None = None) -> Decision:
    """Whether `new` replaces `current` (None: the key has no current plan).

    `force`: True, the user asked for it (still not over a pinned plan); False,
    never; None, the rule. Measured beats modelled; between two measured plans
    the new one must be faster by more than the larger of their noises (and at
    least `MIN_NOISE`); between two modelled plans (no GPU anywhere) the model's
    better estimate wins.
    """
    if force is False:
        return Decision(False, "stored as not current, as asked")
    if current is None:
        return Decision(True, "the first plan for this program, device and software")
    cur = f"plan {current.id}"
    if current.pinned:
        return Decision(False, f"{cur} is pinned (autofuse plans unpin {current.id} to let tuning jobs replace it)")
    if force:
        return Decision(True, f"promoted on request over {cur} ({_x(current.speedup)})")
    if new.measure != "device" and current.measure == "device":
        return Decision(False, f"it is modelled (no GPU measurement) and {cur} was measured ({_x(current.speedup)})")
    if new.measure == "device" and current.measure != "device":
        return Decision(True, f"measured, replacing the modelled {cur}")
    margin = max(new.noise or 0.0, current.noise or 0.0, MIN_NOISE) if new.measure == "device" else 0.0
    beyond = f" beyond noise ±{margin:.1%}" if margin else ""
    if new.speedup > current.speedup * (1.0 + margin):
        return Decision(True, f"{_x(new.speedup)} beats {cur}'s {_x(current.speedup)}{beyond}")
    return Decision(False, f"{_x(new.speedup)} does not beat {cur}'s {_x(current.speedup)}{beyond}")


def _x(v: float) -> str:
    return f"{v:.2f}x"
