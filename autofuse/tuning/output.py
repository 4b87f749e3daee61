"""How a tuning job names what it prints: a group's readable name, a config's text, the progress bar's text and the
``-v`` lines (the final table and summary line are `report`'s, the dry run's table `dryrun`'s).

A person reads these after a job, so the chosen groups come first and are named by what they compute
(``attention: dot_general·div·exp·reduce_sum·dot_general``), not by node indices; candidates never measured are
left out unless asked; and the last line says on its own what the job found (``--quiet`` prints only it).
"""
from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, TextIO

from ..spaces import DEFAULT_BACKEND
from ..tables import fmt_ms, fmt_x, plural

if TYPE_CHECKING:
    from .ledger import CandidateState

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
    return f"{config.get('backend', DEFAULT_BACKEND)} {rest}".strip()


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
            f"{fmt_ms(c.best_ms) or '-'} ms ({fmt_x(c.speedup) or '-'}) after {plural(len(c.trials), 'trial')} [{c.status}]")


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
