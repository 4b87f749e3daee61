"""Choose the cheapest exact cover of the program from the candidates' costs.

Each node is covered by exactly one chosen option (a fused group, or XLA);
the cheapest such cover is an exact 0/1 program solved by HiGHS
(`scipy.optimize.milp`). A cover whose groups would depend on each other in a
cycle is cut off and the program solved again. An option run in stages (a
training step's attention forward + backward) covers all its nodes as one
option, and is ordered as one unit per stage (each convex, in order).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection, Iterator, Sequence

import numpy as np

from .. import costmodel, ops
from ..graph import Graph, Group, group_cycles
from ..kernels import TEMPLATES
from ..plan import Plan, plan_from_choices
from ..runner.protocol import XlaRequest
from .ledger import CandidateState
from .partition import Candidate, enumerate_candidates, is_fusible
from .program_costs import ProgramCosts


@dataclass(frozen=True)
class Option:
    """One way to run a set of nodes, at a cost (ms)."""

    nodes: frozenset[int]
    cost: float
    label: object = None
    stages: tuple[frozenset[int], ...] = ()  # run in stages: the units the ordering sees (empty: `nodes`, one unit)


PAIRS_AFTER_ROUNDS = 2  # rounds of cuts before the options that would wait on each other are excluded pairwise
# (`exclusive_pairs`: seconds on a 24-layer GPT-2 step, where most programs need no more than one or two cuts)
UNIT_COST_MS = 1e-6  # per chosen option: of covers that cost the same, the one of fewer units (a broadcast left to XLA
# beside a group that could read it inside costs nothing in the model, but is one more op and saves a residual)


def select_cover(graph: Graph, options: Sequence[Option], node_cost: dict[int, float], *, max_rounds: int = 50) -> list[Option]:
    """The cheapest exact cover: chosen options are disjoint; uncovered nodes run alone at `node_cost`.

    Exact (HiGHS MILP). Covers whose groups form a dependency cycle are excluded
    by a cut per cycle (`group_cycles`) and the problem re-solved; after `PAIRS_AFTER_ROUNDS` rounds of cuts, every
    pair of options that would wait on each other is excluded too (`exclusive_pairs`).
    """
    from scipy import sparse
    from scipy.optimize import Bounds, LinearConstraint, milp

    opts = [o for o in options if o.nodes]
    singles = [Option(frozenset([nd.id]), float(node_cost.get(nd.id, 0.0)), "xla-node") for nd in graph.nodes]
    allopts = opts + singles
    if not opts:
        return []
    A = np.zeros((len(graph.nodes), len(allopts)))
    for j, o in enumerate(allopts):
        for i in o.nodes:
            A[i, j] = 1.0
    c = np.array([o.cost + UNIT_COST_MS for o in allopts])
    excl: list = []
    cuts: list[np.ndarray] = []
    for rounds in range(max_rounds):
        if rounds == PAIRS_AFTER_ROUNDS and (pairs := exclusive_pairs(graph, opts)):
            excl = [LinearConstraint(sparse.csr_array((np.ones(2 * len(pairs)), (np.repeat(np.arange(len(pairs)), 2), np.ravel(pairs))),
                                                      shape=(len(pairs), len(allopts))), -np.inf, 1)]
        cons = [LinearConstraint(A, 1, 1), *excl] + [LinearConstraint(cut[None, :], -np.inf, cut.sum() - 1) for cut in cuts]
        res = milp(c, constraints=cons, integrality=np.ones(len(allopts)), bounds=Bounds(0, 1))
        if res.x is None:
            raise RuntimeError(f"cover selection failed: {res.message}")
        chosen = [j for j in range(len(opts)) if res.x[j] > 0.5]
        units, chains, owner = [], [], []
        for j in chosen:
            parts = opts[j].stages or (opts[j].nodes,)
            if len(parts) > 1:
                chains.append(list(range(len(units), len(units) + len(parts))))
            units.extend(parts)
            owner.extend([j] * len(parts))
        cycles = group_cycles(graph, units, chains)
        if not cycles:
            return [opts[j] for j in chosen]
        for cyc in cycles:
            cut = np.zeros(len(allopts))
            for k in cyc:
                cut[owner[k]] = 1.0
            cuts.append(cut)
    raise RuntimeError("cover selection: too many cyclic covers")


def exclusive_pairs(graph: Graph, options: Sequence[Option]) -> list[tuple[int, int]]:
    """Pairs of disjoint options (indices) each of which reads what the other makes: chosen together their groups
    would wait on each other. Excluded up front, not cut one cover at a time: a group that recomputes a layer norm
    in a checkpointed backward and takes its backward too, beside a dgrad GEMM whose epilogue reads the recomputed
    statistics, is one such pair in a dozen variants of each, per layer (a 2-layer GPT-2 step ran out of 50 rounds
    of cuts). Options run in stages are left to the cuts (another group may run between their stages)."""
    after = [0] * len(graph.nodes)  # node id -> bitset of the nodes that read what it makes, directly or not
    for nd in reversed(graph.nodes):
        for s in graph.succs(nd.id):
            after[nd.id] |= (1 << s) | after[s]
    spans = []
    for j, o in enumerate(options):
        if o.stages:
            continue
        bits = sum(1 << i for i in o.nodes)
        reach = 0
        for i in o.nodes:
            reach |= after[i]
        spans.append((min(o.nodes), max(o.nodes), bits, reach & ~bits, j))
    spans.sort()
    out = []
    for k, (lo, hi, bits, reach, j) in enumerate(spans):
        for lo2, _, bits2, reach2, j2 in spans[k + 1:]:
            if lo2 > hi:  # node ids are in program order: an option wholly after this one cannot feed it
                break
            if not bits & bits2 and reach & bits2 and reach2 & bits:
                out.append((j, j2))
    return out


def single_node_costs(graph: Graph, model: costmodel.GPUModel, covered: Collection[int] = frozenset()) -> dict[int, float]:
    """Cost of a node left alone in XLA: unfused for fusible nodes. An opaque node costs every cover alike (0), but
    one that some candidate's group takes (`covered`: a split written by its GEMM's epilogue, a concatenation read in
    parts) costs what XLA spends on it, which that group saves: priced at 0, GPT-2's QKV split (three slice copies,
    0.065 ms a layer on an H200) lost every cover to XLA's GEMM beside a free split."""
    return {n.id: costmodel.node_time_ms(graph, n.id, model) if is_fusible(graph, n.id) or n.id in covered else 0.0 for n in graph.nodes}


def library_calls_alone(graph: Graph, by_sig: dict[str, list[Candidate]], cands: Sequence[CandidateState]) -> dict[int, float]:
    """Cost of the opaque nodes of a group that holds nothing else (a cuDNN attention call; a training step's cuDNN
    forward and backward): left alone they run just as the group's XLA option does, so together they cost its time
    (shared evenly). At the model's memory floor, leaving GPT-2's cuDNN calls alone looked free beside their flash
    kernel, 1.06x faster alone, and no cover took it."""
    out: dict[int, float] = {}
    for r in cands:
        if r.xla_ms is None:
            continue
        for c in by_sig[r.signature]:
            if not any(is_fusible(graph, n) for n in c.nodes):
                out.update((n, r.xla_ms / len(c.nodes)) for n in c.nodes)
    return out


def model_cost_ms(cand: Candidate, model: costmodel.GPUModel = costmodel.H200, config: dict | None = None) -> float:
    tmpl = TEMPLATES[cand.template]
    return tmpl.model_time_ms(cand.spec, config or tmpl.default_config(cand.spec), model)


def default_plan(graph: Graph, model: costmodel.GPUModel = costmodel.H200) -> Plan:
    """A plan from default configs and modelled costs (no measurement)."""
    cands = enumerate_candidates(graph)
    options = [Option(c.nodes, model_cost_ms(c, model), c, c.stages) for c in cands]
    chosen = select_cover(graph, options, single_node_costs(graph, model, {n for c in cands for n in c.nodes}))
    choices = [(o.label.group, o.label.template, TEMPLATES[o.label.template].default_config(o.label.spec), o.label.stages) for o in chosen]
    return plan_from_choices(graph, choices, {"measure": "default", "model": model.name})


def contested_nodes(by_sig: dict[str, list[Candidate]], cands: Sequence[CandidateState]) -> set[int]:
    """The nodes where what a cover leaves alone can change the plan: those of every option (an instance's XLA or
    fused option) linked through shared nodes to a fused option. Elsewhere only XLA's options and lone nodes
    compete, and the plan runs XLA there whichever wins."""
    options = [frozenset(c.nodes) for r in cands if r.xla_ms is not None or r.best_ms is not None for c in by_sig[r.signature]]
    fused = [frozenset(c.nodes) for r in cands if r.best_ms is not None for c in by_sig[r.signature]]
    touching: dict[int, list[int]] = {}
    for k, nodes in enumerate(options):
        for n in nodes:
            touching.setdefault(n, []).append(k)
    out: set[int] = set()
    todo = [n for nodes in fused for n in nodes]
    seen: set[int] = set()
    while todo:
        n = todo.pop()
        if n in out:
            continue
        out.add(n)
        for k in touching.get(n, ()):
            if k not in seen:
                seen.add(k)
                todo.extend(options[k] - out)
    return out


def lone_contractions(graph: Graph, known: Sequence[str] = (), among: set[int] | None = None) -> list[int]:
    """The fusible dots a cover may leave alone, one node per distinct dot (those `lone_contraction_costs` times),
    but for those whose group signature is in `known`, and, with `among`, for those with no node in it."""
    seen, out = set(known), []
    wanted = None if among is None else _dot_signatures(graph, among)
    for nd in graph.nodes:
        if ops.op_class(nd.name) is not ops.OpClass.CONTRACTION or not is_fusible(graph, nd.id):
            continue
        sig = Group.of(graph, [nd.id]).signature
        if sig not in seen and (wanted is None or sig in wanted):
            seen.add(sig)
            out.append(nd.id)
    return out


def _dot_signatures(graph: Graph, nodes: set[int]) -> set[str]:
    """The group signatures of the fusible dots among `nodes`."""
    return {Group.of(graph, [n]).signature for n in nodes
            if ops.op_class(graph.node_index[n].name) is ops.OpClass.CONTRACTION and is_fusible(graph, n)}


def lone_contraction_costs(graph: Graph, runner: Any, known: dict[str, float] | None = None,
                           among: set[int] | None = None) -> dict[int, float]:
    """XLA's measured time of each fusible dot that a cover may leave alone (once per distinct dot; `known`: XLA's
    times already measured, by group signature: a dot that is a candidate by itself was timed with the candidates;
    `among`: only dots with a node there are timed, `contested_nodes`: elsewhere the dot costs every cover alike).

    The roofline puts a lone dot at its flop floor, far below what XLA's dot with
    its output write measures (SPLADE's head: 0.49 modelled, about 1.2 ms measured),
    which made "XLA dot + fused epilogue" look cheaper than one fused kernel.
    """
    by_sig: dict[str, float | None] = dict(known or {})
    wanted = None if among is None else _dot_signatures(graph, among)
    out = {}
    for nd in graph.nodes:
        if ops.op_class(nd.name) is not ops.OpClass.CONTRACTION or not is_fusible(graph, nd.id):
            continue
        sig = Group.of(graph, [nd.id]).signature
        if sig not in by_sig and wanted is not None and sig not in wanted:
            continue
        if sig not in by_sig:
            res = runner.call(XlaRequest((nd.id,)))
            by_sig[sig] = res.median_ms if res.ok else None
        if by_sig[sig] is not None:
            out[nd.id] = by_sig[sig]
    return out


@dataclass(frozen=True)
class Cover:
    """The cheapest cover found: its plan, and the modelled or measured-alone costs of it and of XLA's own cover."""

    plan: Plan
    baseline_ms: float
    tuned_ms: float


def best_cover(graph: Graph, by_sig: dict[str, list[Candidate]], cands: Sequence[CandidateState], model: costmodel.GPUModel, measure: str,
               measured_singles: dict[int, float] | None = None, costs: ProgramCosts | None = None) -> Cover:
    """Exact cheapest cover over fused (best config) and XLA options of every candidate instance.

    Nodes left alone cost their modelled XLA time, or `measured_singles` where given. With `measure="model"`
    every candidate's XLA option is priced, by the model where its XLA time was not asked for yet: the baseline
    is then the modelled program whatever the budget reached (with XLA options for the timed candidates only,
    the rest left to unfused nodes, a budget of 8 trials put one program at 0.055 ms and one of 16 at 0.028).
    With `costs` (a profile of jax.jit's program) every node left to XLA costs its share of XLA's kernels in the
    program (a group left to XLA is its nodes left alone: no option of its own), and a fused instance its time and
    its nodes' shares less what fusing them saves there (`ProgramCosts.fused_ms`).
    """
    options, xla_only = [], []
    for r in cands:
        xla_ms = r.xla_ms
        if xla_ms is None and measure == "model":
            xla_ms = costmodel.xla_group_time_ms(by_sig[r.signature][0].group, model)
        for c in by_sig[r.signature]:
            if costs is None and xla_ms is not None:
                o = Option(c.nodes, xla_ms, ("xla", c), c.stages)
                options.append(o)
                xla_only.append(o)
            if r.best_ms is not None:
                fused = costs.fused_ms(c.nodes, r.best_ms, r.xla_ms) if costs is not None else r.best_ms
                options.append(Option(c.nodes, fused, ("fused", c, r.best_config), c.stages))
    if costs is not None:
        singles = {n.id: costs.node_ms.get(n.id, 0.0) for n in graph.nodes}
    else:
        takeable = {n for group in by_sig.values() for c in group for n in c.nodes}  # nodes some candidate's group holds
        singles = {**single_node_costs(graph, model, takeable), **library_calls_alone(graph, by_sig, cands), **(measured_singles or {})}

    def cost(chosen: list[Option]) -> float:
        covered = {i for o in chosen for i in o.nodes}
        return sum(o.cost for o in chosen) + sum(singles[n.id] for n in graph.nodes if n.id not in covered)

    chosen = select_cover(graph, options, singles)
    base = select_cover(graph, xla_only, singles) if xla_only else []
    fused = [(o.label[1].group, o.label[1].template, o.label[2], o.label[1].stages) for o in chosen if o.label[0] == "fused"]
    plan = plan_from_choices(graph, fused, {"measure": measure, "model": model.name if measure == "model" else None})
    return Cover(plan, cost(base), cost(chosen))


def savings_plan(graph: Graph, by_sig: dict[str, list[Candidate]], cands: Sequence[CandidateState],
                 model: costmodel.GPUModel = costmodel.H200, costs: ProgramCosts | None = None) -> Plan:
    """The plan of the largest total saving: fused instances that share no node, each worth what its group saved
    against its own XLA time (XLA's time - its best), less what its outputs cost its neighbours
    (`costmodel.cut_outputs_ms`), nothing else priced; with `costs` (a profile of jax.jit's program), what the
    instance saves of XLA's kernels there less its time (`ProgramCosts.credit_ms`, which charges a kernel it cuts).
    `best_cover` also prices the rest of the program with XLA's options measured alone; this plan does not, so the
    two differ where those options (of other groupings of the same nodes) mislead the cover, and the validation
    judges both in the program (`composition.group_plans`)."""
    if costs is not None:
        options = [Option(c.nodes, r.best_ms - costs.credit_ms(c.nodes, r.xla_ms), (c, r.best_config), c.stages) for r in cands
                   if r.best_ms is not None for c in by_sig[r.signature] if r.best_ms < costs.credit_ms(c.nodes, r.xla_ms)]
    else:
        cut = {r.signature: costmodel.cut_outputs_ms(by_sig[r.signature][0].group, model) for r in cands if r.best_ms is not None}
        options = [Option(c.nodes, r.best_ms + cut[r.signature] - r.xla_ms, (c, r.best_config), c.stages) for r in cands
                   if r.best_ms is not None and r.xla_ms is not None and r.best_ms + cut[r.signature] < r.xla_ms for c in by_sig[r.signature]]
    chosen = select_cover(graph, options, {n.id: 0.0 for n in graph.nodes}) if options else []
    return plan_from_choices(graph, [(o.label[0].group, o.label[0].template, o.label[1], o.label[0].stages) for o in chosen],
                             {"measure": "device", "model": None})


def disjoint_savings(gains: dict[str, tuple[Sequence[Any], float]]) -> list[str]:
    """The keys of `gains` ({key: (groups, saving ms)}, a handful) whose groups share no node, of the largest total
    saving: every subset is tried."""
    keys = sorted(gains)
    best: tuple[float, list[str]] = (0.0, [])
    for mask in range(1, 1 << len(keys)):
        pick = [k for i, k in enumerate(keys) if mask >> i & 1]
        nodes = [n for k in pick for g in gains[k][0] for n in g.nodes]
        if len(nodes) == len(set(nodes)):
            total = sum(gains[k][1] for k in pick)
            if total > best[0]:
                best = (total, pick)
    return best[1]


def alone_savings(cands: Sequence[CandidateState]) -> dict[str, float]:
    """Per distinct group: what one instance saved alone (XLA's time - its best, ms; 0 where either is unknown)."""
    return {r.signature: (r.xla_ms - r.best_ms) if r.xla_ms is not None and r.best_ms is not None else 0.0 for r in cands}


def group_savings(cands: Sequence[CandidateState], by_sig: dict[str, list[Candidate]], costs: ProgramCosts | None) -> dict[str, float]:
    """Per distinct group: what one instance saves, in the program by XLA's kernels there where profiled (`costs`:
    the mean over its instances of what each saves of XLA's kernels, less its best), else alone (`alone_savings`)."""
    if costs is None:
        return alone_savings(cands)
    return {r.signature: costs.saving_ms([c.nodes for c in by_sig[r.signature]], r.best_ms, r.xla_ms) if r.best_ms is not None else 0.0
            for r in cands}


RIVAL_SHARE = 0.9  # a rival of a kept group saved at least this share of what the group saved alone (`Savings.rivals`)


@dataclass(frozen=True)
class Savings:
    """The tuned candidates' savings alone, from which the validation on the GPU draws other plans to judge in the
    program: the plan of the largest savings alone without some groups (`plan`), and a kept plan with one group
    swapped for a near-tie fusion of its nodes (`rivals`)."""

    graph: Graph
    by_sig: dict[str, list[Candidate]]
    cands: Sequence[CandidateState]
    model: costmodel.GPUModel = costmodel.H200
    costs: ProgramCosts | None = None  # a profile of jax.jit's program: savings in the program, not alone

    def plan(self, without: frozenset[str] = frozenset()) -> Plan:
        """The plan of the largest savings (`savings_plan`) of the candidates but those signed `without`."""
        return savings_plan(self.graph, self.by_sig, [r for r in self.cands if r.signature not in without], self.model, self.costs)

    def alone_plan(self) -> Plan | None:
        """The plan of the largest savings alone, unpriced by the profile (None without one: `plan` is that plan).
        A group whose price in jax.jit's program says it loses can still save there: GPT-2's step's dgrad + GELU' +
        bias-gradient group cuts the GELU backward's fusion, whose forward half (tanh, computed again) is priced
        to the group although the plan's own forward group is what makes XLA compute it."""
        return None if self.costs is None else savings_plan(self.graph, self.by_sig, self.cands, self.model)

    def rivals(self, plan: Plan, share: float = RIVAL_SHARE) -> Iterator[Plan]:
        """`plan` with one of its groups swapped for a rival, the nearest tie first: another tuned fusion of some of
        the group's nodes whose instances saved alone at least `share` of what the group's did (each summed over
        instances); the swapped plan is the plan of the largest savings alone of the other groups and the rival.

        Two fusions of the same nodes that nearly tie alone may not tie in the program, where one can share with its
        neighbours what each paid for alone: GPT-2's step chose a Mosaic GPU GEMM reading the logits' gradient as
        it is (6.84 ms saved alone) over XLA's GEMM reading it padded (6.74), beside two padded LM-head GEMMs whose
        pad of the same operand, 1.2 ms, the padded one would have shared. Lazily: each swapped plan is a cover
        solved again, and the validation judges only the first few."""
        nodes: dict[str, set[int]] = {}
        for g in plan.groups:
            nodes.setdefault(g.signature, set()).update(g.nodes)
        count = {sig: sum(1 for g in plan.groups if g.signature == sig) for sig in nodes}
        alone = group_savings(self.cands, self.by_sig, self.costs)
        others = [(r, alone[r.signature] * len(self.by_sig[r.signature]), {n for c in self.by_sig[r.signature] for n in c.nodes})
                  for r in self.cands if r.signature not in nodes and alone[r.signature] > 0]
        swaps = []
        for sig, taken in nodes.items():
            own = alone.get(sig, 0.0) * count[sig]
            swaps += [(theirs / own, sig, r) for r, theirs, reach in others if own > 0 and theirs >= share * own and reach & taken]
        for _, sig, r in sorted(swaps, key=lambda s: -s[0]):
            swapped = savings_plan(self.graph, self.by_sig, [c for c in self.cands if c.signature in nodes and c.signature != sig] + [r],
                                   self.model, self.costs)
            if any(g.signature == r.signature for g in swapped.groups):
                yield Plan(plan.fingerprint, swapped.groups, dict(plan.provenance))
