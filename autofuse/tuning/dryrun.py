"""A dry run of a tuning job (``autofuse tune ... --dry-run``): what the job would tune and whether its budget is
enough, from the program and the roofline model alone. Nothing is compiled, timed or written to a store.

The budget rule (`scheduler`) first gives every distinct candidate its default config, the largest modelled saving
first, then shares what is left among the contenders; a budget smaller than the candidates leaves some untried, and
one that leaves fewer trials than contenders gives some contender nothing beyond its default. Both are said before
an hour of GPU time is spent finding out.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import jax

from .. import costmodel
from ..graph import capture
from ..tables import Column, fmt_ms, fmt_x, format_table, plural
from .budget import check_budget, trials_for
from .job import Notes, check_backends, distinct_candidates, program_name, resolve_measure, search_spaces, tunable
from .output import group_label
from .scheduler import contenders, phase1_order
from .select import best_cover


@dataclass(frozen=True)
class DryRunRow:
    """One distinct candidate as the budget rule will see it, by the model."""

    order: int  # when phase 1 gives it its default config (1: first)
    signature: str
    template: str
    ops: tuple[str, ...]
    nodes: int
    instances: int
    configs: int  # its search space's size, over its backends
    backends: tuple[str, ...]
    xla_ms: float  # modelled: XLA's fusion of the group, one instance
    default_ms: float  # modelled: the template's default config, one instance
    contender: bool  # in the modelled cover, or within reach of XLA: phase 2 gives it more trials
    cut_ms: float = 0.0  # modelled: what its outputs cost its neighbours in the program, one instance

    @property
    def saving_ms(self) -> float:
        """What fusing all its instances with the default config saves in the program, by the model (negative: it
        loses), as the budget rule ranks it (`scheduler.modelled_saving`)."""
        return (self.xla_ms - self.default_ms - self.cut_ms) * self.instances


@dataclass
class DryRun:
    """What a tuning job would do with this budget, by the model (`model` names the GPU it describes)."""

    name: str
    fingerprint: str
    model: str
    n_nodes: int
    rows: list[DryRunRow]
    trials: int | None
    time_budget_s: float | None
    baseline_ms: float  # the modelled program under XLA's own fusions
    plan_ms: float  # the modelled program under the cheapest cover of default configs
    plan_groups: int
    warnings: list[str] = field(default_factory=list)

    @property
    def contenders(self) -> int:
        return sum(r.contender for r in self.rows)

    def table(self) -> str:
        return dry_run_table(self)

    def to_dict(self) -> dict:
        return {"name": self.name, "fingerprint": self.fingerprint, "model": self.model, "nodes": self.n_nodes, "trials": self.trials,
                "time_budget_s": self.time_budget_s, "baseline_ms": self.baseline_ms, "plan_ms": self.plan_ms, "plan_groups": self.plan_groups,
                "contenders": self.contenders, "warnings": list(self.warnings),
                "candidates": [{**{k: getattr(r, k) for k in DryRunRow.__dataclass_fields__}, "saving_ms": r.saving_ms} for r in self.rows]}


def budget_warnings(n_candidates: int, n_contenders: int, trials: int | None, time_budget_s: float | None, n_losses: int = 0) -> list[str]:
    """What a budget of `trials` cannot do for `n_candidates` distinct candidates of which `n_contenders` contend
    and `n_losses` are modelled losses."""
    if trials is None:
        return [f"a time budget of {time_budget_s:g} s: how many trials it allows depends on compile and run times; phase 1 alone "
                + f"needs {plural(n_candidates, 'trial')} (give --trials to know)"] if time_budget_s else []
    if trials < n_candidates:
        losses = (f"; the {plural(n_losses, 'modelled loss', 'modelled losses')} get a trial only when no other candidate can use one"
                  if n_losses else "")
        return [f"{plural(trials, 'trial')} for {plural(n_candidates, 'distinct candidate')}: {n_candidates - trials} of them (the smallest modelled "
                + "savings) never get even their default config, and no contender gets more than its default"
                + f"{losses}; give --trials {n_candidates + 2 * max(n_contenders, 1)} or more"]
    left = trials - n_candidates
    if left < n_contenders:
        return [f"{plural(trials, 'trial')}: {n_candidates} go to the candidates' default configs, and the {left} left cannot give each of the "
                + f"{n_contenders} contenders more than its default config; give --trials {n_candidates + 2 * n_contenders} or more"]
    return []


def dry_run(fn: Callable, *args: Any, kwargs: dict | None = None, trials: int | None = None, time_budget_s: float | None = None,
            effort: str | None = None, name: str | None = None, model: str = "h200", backends: Sequence[str] | None = None, static_argnums: Sequence[int] = (),
            static_argnames: Sequence[str] = (), measure: str | None = None) -> DryRun:
    """The candidates a job for `fn` would tune (measured as `measure` says, default as a job would: on a GPU where
    there is one), their modelled savings in the order the budget reaches them, the modelled plan of default configs,
    and what the budget (`trials`, or the trials of `effort`, default 48; or `time_budget_s`) cannot do. Notes on backends or candidates a job
    would leave out go to stderr."""
    check_budget(trials, time_budget_s)
    trials = trials_for(trials, time_budget_s, effort)
    backends, left_out = check_backends(backends, resolve_measure(measure, jax.default_backend() == "gpu"))
    gmodel = costmodel.get_model(model)
    graph = capture(fn, *args, static_argnums=tuple(static_argnums), static_argnames=tuple(static_argnames), **dict(kwargs or {}))
    by_sig, cands, left_to_xla = tunable(*distinct_candidates(graph), backends)
    notes = Notes()
    notes(left_out)
    notes(left_to_xla)
    spaces = search_spaces(by_sig, cands, gmodel, backends)
    for r in cands:
        sp = spaces[r.signature]
        r.xla_ms = sp.xla_model_ms
        r.best_ms, r.best_config = sp.model_ms(sp.default), sp.default  # as if every default had been measured as modelled
    order = {i: k + 1 for k, i in enumerate(phase1_order(cands, spaces))}
    cover = best_cover(graph, by_sig, cands, gmodel, "model") if cands else None
    contending = set(contenders(graph, by_sig, cands, gmodel, cover)) if cands else set()
    rows = [DryRunRow(order[i], r.signature, r.template, r.ops, len(r.nodes), r.instances, spaces[r.signature].size,
                      tuple(spaces[r.signature].spaces), r.xla_ms, r.best_ms, i in contending, spaces[r.signature].cut_ms)
            for i, r in enumerate(cands)]
    rows.sort(key=lambda row: row.order)
    baseline = cover.baseline_ms if cover else 0.0
    out = DryRun(name or program_name(fn), graph.fingerprint, gmodel.name, len(graph.nodes), rows, trials, time_budget_s, baseline,
                 cover.tuned_ms if cover else baseline, len(cover.plan.groups) if cover else 0)
    losses = sum(1 for r in rows if r.saving_ms <= 0)
    return replace(out, warnings=budget_warnings(len(rows), out.contenders, trials, time_budget_s, losses))


def dry_run_table(d: "DryRun") -> str:
    """The dry run: the candidates in the order the budget reaches them, the modelled plan, the budget's warnings."""
    cells = [{"#": r.order, "": "*" if r.contender else "", "group": group_label(r.template, r.ops), "x": r.instances, "configs": r.configs,
              "backends": ",".join(r.backends), "xla ms": r.xla_ms, "default ms": r.default_ms, "saving ms": r.saving_ms} for r in d.rows]
    columns = [Column("#"), Column(""), Column("group"), Column("x"), Column("configs"), Column("backends"), Column("xla ms", fmt=fmt_ms),
               Column("default ms", fmt=fmt_ms), Column("saving ms", fmt=lambda v: f"{v:+.3g}")]
    budget = plural(d.trials, "trial") if d.trials is not None else ""
    if d.time_budget_s:
        budget += (" and " if budget else "") + f"{d.time_budget_s:g} s"
    instances = sum(r.instances for r in d.rows)
    lines = [f"autofuse tune {d.name} --dry-run  program {d.fingerprint[:16]}  (MODELLED on a model of {d.model}: nothing compiled, "
             + "timed or stored)"]
    lines.append(format_table(cells, columns) if cells else "(no fusible group: the plan is XLA's own)")
    lines.append("# = the order phase 1 gives each its default config (largest modelled saving first; modelled losses last, the "
                 "nearest to break-even first); * = contender (in the modelled plan, or within 25% of XLA): phase 2 shares the rest "
                 "of the budget among these, by XLA time")
    lines.append(f"{len(d.rows)} distinct candidates ({instances} instances) in {d.n_nodes} nodes; {d.contenders} contenders; modelled plan "
                 f"of default configs: {d.plan_groups} fused groups, {fmt_ms(d.baseline_ms)} -> {fmt_ms(d.plan_ms)} ms "
                 f"({fmt_x(d.baseline_ms / d.plan_ms) if d.plan_ms else '-'}); budget {budget}")
    lines += [f"warning: {w}" for w in d.warnings]
    return "\n".join(lines)
