"""Enumerate candidate groups: the sets of nodes a template could run as one kernel.

Enumeration: from every fusible node (a seed) a group grows one neighbour at
a time, the lowest-numbered first, each step closed under convexity (every
node on a path between two members joins, so no path leaves the group and
re-enters it). Along each growth path, the largest group of each run of
steps that one template implements with one loop structure (for row_reduce:
one number of reductions) is a candidate (so a layer norm yields the whole
norm, and its elementwise tail on its own, not every prefix; a stack of norms
yields groups that end at each norm, not only at the size bound).
A dot_general also grows forward (its consumers before its operands'
producers), so a dot's epilogue, reductions and a second dot (attention)
form one group even when reshapes feed the dot. Every registered template is also
asked for the groups it finds itself (`Template.candidate_groups`: in a gradient program, attention's forward chain
with its own backward, a dot whose product is reduced and read again after the reductions), of whatever size; in a
training step, where the two are not convex together, such a candidate runs in two stages (`Candidate.stages`: each
convex, the forward then its backward; the cover orders them as two units of one option). A group of a template
with `offers_row_sums` (row_reduce) is also offered with the sums over the rows that read only what it reads or
makes (a norm's dγ, dβ). A group holding a dot is also
offered with the side inputs of its epilogue made inside it (producers only
it reads and that feed no dot: a bool mask's broadcast and conversion, GQA's
broadcast), so a template sees what they are (a {0, 1} factor, not any float).
Bounds: a group holds at most `max_group_size` nodes and the whole
enumeration yields groups of at most `max_candidates` distinct computations
(group signatures: the instances of a repeated layer count once, as they are
tuned once), so the work is O(nodes x max_group_size) closure steps, each a
few big-int operations, plus one signature per group.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from .. import ops
from ..graph import Graph, Group, Node, node_text
from ..kernels import TEMPLATES, match_template
from ..kernels.passes import foldable_gather
from ..ops import OpClass

MAX_GROUP_SIZE = 64
MAX_CANDIDATES = 5000
_FUSIBLE_DTYPES = {np.dtype(d) for d in ("float32", "bfloat16", "float16", "int32", "uint32", "int8", "uint8", "bool")}


_LAZY = object()  # a match not made yet: `Candidate.spec` makes it when first asked


@dataclass(frozen=True, eq=False)
class Candidate:
    """A group that a template can implement, with the template's match data (`spec`, matched when first asked
    where the group's structure matched before: a repeated layer's groups are matched once while enumerating)."""

    group: Group
    template: str
    match_data: object = _LAZY
    stages: tuple[frozenset[int], ...] = ()  # a group run in stages (each convex, in order; their union need not be)
    reductions: int = 0  # the template's reductions (a run of growing groups ends where this changes)

    @property
    def spec(self) -> object:
        if self.match_data is _LAZY:
            object.__setattr__(self, "match_data", TEMPLATES[self.template].match(self.group))
        return self.match_data

    @property
    def nodes(self) -> frozenset[int]:
        return frozenset(self.group.node_ids)


class _Reach:
    """Ancestor/descendant sets of every node as bitmasks."""

    def __init__(self, graph: Graph):
        self.n = len(graph.nodes)
        self.anc = [0] * self.n
        for nd in graph.nodes:
            m = 0
            for p in graph.preds(nd.id):
                m |= self.anc[p] | (1 << p)
            self.anc[nd.id] = m
        self.desc = [0] * self.n
        for nd in reversed(graph.nodes):
            m = 0
            for s in graph.succs(nd.id):
                m |= self.desc[s] | (1 << s)
            self.desc[nd.id] = m

    def spans(self, members: int) -> tuple[int, int]:
        """(every ancestor, every descendant) of the members."""
        a = d = 0
        m = members
        while m:
            low = m & -m
            i = low.bit_length() - 1
            a |= self.anc[i]
            d |= self.desc[i]
            m ^= low
        return a, d

    def closure(self, members: int) -> int:
        """Members plus every node on a path between two members (one pass is whole: a node on a path between a
        member and a node this adds lies on a path between two members already)."""
        a, d = self.spans(members)
        return members | (a & d)

    def closure_with(self, members: int, spans: tuple[int, int], node: int) -> int:
        """`closure(members | 1 << node)` from `spans(members)`: a growing group's every next step in a few big-int
        operations, not one per member (505k closures of up to 64 members in GPT-2 medium's training step)."""
        a, d = spans
        return members | (1 << node) | ((a | self.anc[node]) & (d | self.desc[node]))


def widening(graph: Graph, nd: Node) -> bool:
    """A conversion of a float to a wider float: exact, so XLA may as well make it wherever the value is read."""
    if nd.name != "convert_element_type" or not isinstance(nd.inputs[0], int):
        return False
    src, dst = np.dtype(graph.aval(nd.inputs[0]).dtype), np.dtype(graph.avals[nd.outputs[0]].dtype)
    return all(jnp.issubdtype(d, jnp.floating) for d in (src, dst)) and dst.itemsize > src.itemsize


def _bits(mask: int) -> list[int]:
    """The set bits of `mask`, lowest first. A group's nodes lie close together in a program of thousands: shifted
    down to its lowest member first, the loop works on a small int, not on one as wide as the program (GPT-2
    medium's training step: 6295 bits, 400k calls, a seventh of its enumeration)."""
    if not mask:
        return []
    base = (mask & -mask).bit_length() - 1
    m = mask >> base
    out = []
    while m:
        low = m & -m
        out.append(base + low.bit_length() - 1)
        m ^= low
    return out


def is_fusible(graph: Graph, node_id: int) -> bool:
    nd = graph.node_index[node_id]
    if ops.op_class(nd.name) not in ops.FUSIBLE and not foldable_gather(graph, nd):  # take_along_axis: matmul_reduce folds it
        return False
    vals = [graph.aval(a) for a in nd.inputs] + [graph.avals[v] for v in nd.outputs]
    return all(np.dtype(a.dtype) in _FUSIBLE_DTYPES for a in vals)


def enumerate_candidates(graph: Graph, *, max_group_size: int = MAX_GROUP_SIZE, max_candidates: int = MAX_CANDIDATES) -> list[Candidate]:
    """Connected, convex groups of fusible nodes that some template implements."""
    reach = _Reach(graph)
    fusible = 0
    for nd in graph.nodes:
        if is_fusible(graph, nd.id):
            fusible |= 1 << nd.id
    producers = [sum(1 << o for o in graph.preds(nd.id)) for nd in graph.nodes]
    consumers = [sum(1 << o for o in graph.succs(nd.id)) for nd in graph.nodes]
    neighbours = [p | c for p, c in zip(producers, consumers)]
    dots = feeds_dot = 0  # feeds_dot: what makes a dot's operand, through layout ops and conversions
    for nd in reversed(graph.nodes):
        if ops.op_class(nd.name) is OpClass.CONTRACTION:
            dots |= 1 << nd.id
            feeds_dot |= producers[nd.id]
        elif feeds_dot >> nd.id & 1 and (ops.op_class(nd.name) is OpClass.LAYOUT or nd.name == "convert_element_type"):
            feeds_dot |= producers[nd.id]
    cache: dict[int, Candidate | None] = {}
    matched: dict[tuple, tuple[str, int] | None] = {}
    emitted: set[int] = set()
    found: list[Candidate] = []
    distinct: set[str] = set()  # the budget counts computations: a repeated layer's instances count once

    def emit(c: Candidate | None) -> None:
        mask = sum(1 << i for i in c.group.node_ids) if c else 0
        if c is not None and mask not in emitted and (c.group.signature in distinct or len(distinct) < max_candidates) \
                and c.spec is not None:
            emitted.add(mask)
            distinct.add(c.group.signature)
            found.append(c)
            if mask & dots:
                emit_absorbed(c, mask)
            if TEMPLATES[c.template].offers_row_sums:
                emit_sibling_sums(c, mask)
            emit_narrowed(c, mask)

    def emit_narrowed(c: Candidate, mask: int) -> None:
        # A group that ends in widening a value it makes (a residual sum's bf16 converted to float32 for the next
        # norm's statistics) writes the wide copy, twice the bytes, where XLA fuses the conversion into its readers:
        # the group is offered again without such conversions (read by no node of it), the narrow value its output.
        drop = sum(1 << i for i in _bits(mask) if consumers[i] & mask == 0 and producers[i] & mask
                   and widening(graph, graph.node_index[i]))
        if drop and drop != mask:
            trial = mask & ~drop
            if trial not in cache:
                cache[trial] = _candidate(graph, trial, matched)
            if cache[trial] is not None and cache[trial].template == c.template:
                emit(cache[trial])

    def emit_sibling_sums(c: Candidate, mask: int) -> None:
        # A norm's backward with its sums over the rows: dβ = Σ dy and dγ = Σ dy·x̂ read only values the group
        # reads or makes (dy, x̂), so no edge may lead growth to them before a dot or the forward ends the run;
        # the group is offered again with every such sum (its product, the reshapes and conversion after it).
        known = set(c.group.inputs) | {v for i in c.group.node_ids for v in graph.node_index[i].outputs}
        ready = lambda nd: all(isinstance(a, int) and a in known for a in nd.inputs)  # noqa: E731
        grown = mask
        chains = []
        def over_rows(k: int) -> bool:  # a sum over leading axes only (a column's), not a row's
            r = graph.node_index[k]
            return ops.op_class(r.name) is OpClass.REDUCTION and len(graph.aval(r.inputs[0]).shape) - 1 not in r.params["axes"]

        for i in sorted({k for v in known for k in graph.consumers.get(v, ())}):
            nd = graph.node_index[i]
            if grown >> i & 1 or not fusible >> i & 1 or not ready(nd):
                continue
            chain = [i]
            if not over_rows(i):  # x̂ * dy, then its sum
                nxt = _bits(consumers[i])
                if ops.op_class(nd.name) is not OpClass.ELEMENTWISE or len(nxt) != 1 or not fusible >> nxt[0] & 1 or not over_rows(nxt[0]):
                    continue
                chain.append(nxt[0])
            while True:
                nxt = _bits(consumers[chain[-1]])
                if len(nxt) != 1 or not fusible >> nxt[0] & 1 or not (
                        ops.op_class(graph.node_index[nxt[0]].name) in (OpClass.LAYOUT, OpClass.REDUCTION)
                        or graph.node_index[nxt[0]].name == "convert_element_type"):
                    break
                chain.append(nxt[0])
            chains.append(sum(1 << k for k in chain))
        for chain in chains:  # one at a time, each kept where the template still takes the group
            trial = grown | chain
            if trial != grown and bin(trial).count("1") <= max_group_size and reach.closure(trial) == trial:
                if trial not in cache:
                    cache[trial] = _candidate(graph, trial, matched)
                if cache[trial] is not None and cache[trial].template == c.template:
                    grown = trial
        if grown != mask:
            emit(cache[grown])

    def emit_absorbed(c: Candidate, mask: int) -> None:
        # A dot's group with the side inputs of its epilogue made inside it (a bool mask's convert and
        # broadcast, a bias's broadcast: producers read by the group alone, not feeding a dot), which growth
        # by number may never reach before a dot operand's producer ends the run. Within the group a template
        # sees what they are (a {0, 1} factor, not any float).
        grown = mask
        while True:
            own = 0
            for i in _bits(grown):
                own |= producers[i]
            own &= fusible & ~grown & ~feeds_dot
            add = [nb for nb in _bits(own) if consumers[nb] & ~grown == 0  # not a reduction or a product making one
                   and ops.op_class(graph.node_index[nb].name) not in (OpClass.REDUCTION, OpClass.CONTRACTION)]  # (key
            # lengths summed from a mask; the projection whose bias add the group starts at)
            if not add:
                break
            grown |= sum(1 << nb for nb in add)
        if grown != mask and bin(grown).count("1") <= max_group_size and reach.closure(grown) == grown:
            if grown not in cache:
                cache[grown] = _candidate(graph, grown, matched)
            if cache[grown] is not None and cache[grown].template == c.template:
                emit(cache[grown])

    def grow(cur: int, forward: bool) -> int | None:
        # A forward path takes in consumers before producers (a dot's epilogue before its operands' producers).
        ins = outs = 0
        for i in _bits(cur):
            ins |= neighbours[i]
            outs |= consumers[i]
        spans = reach.spans(cur)
        for frontier in ((outs, ins) if forward else (ins,)):
            for nb in _bits(frontier & fusible & ~cur):
                new = reach.closure_with(cur, spans, nb)
                if new & ~fusible == 0 and bin(new).count("1") <= max_group_size:
                    return new
        return None

    def kind(c: Candidate | None) -> tuple | None:
        # A run is one template with one loop structure: a row_reduce that takes in one
        # more reduction may need one more pass over the columns, so a run ends there.
        return None if c is None else (c.template, c.reductions)

    # All seeds grow in step (one node per round), so a budget that runs out cuts
    # the largest groups everywhere, not every seed after the first few. Growth is
    # a function of the current set: a path that reaches a set another path has
    # visited continues as that one (and ends its runs in the same sets), so it stops.
    # Every seed grows lowest-numbered neighbour first; a dot also grows forward, so that
    # its consumers (epilogue, reductions, a second dot) join before its operands' producers.
    seeds = _bits(fusible)
    paths = [(1 << s, None, False) for s in seeds]
    paths += [(1 << s, None, True) for s in seeds if ops.op_class(graph.node_index[s].name) is OpClass.CONTRACTION]
    visited: set[tuple[int, bool]] = set()
    while paths and len(distinct) < max_candidates:
        nxt = []
        for cur, run, forward in paths:
            if cur not in cache:
                cache[cur] = _candidate(graph, cur, matched)
            cand = cache[cur]
            if cand is None or (run is not None and kind(run) != kind(cand)):
                emit(run)
            if (cur, forward) in visited:
                continue
            visited.add((cur, forward))
            run = cand
            grown = grow(cur, forward)
            if grown is None:
                emit(run)
            else:
                nxt.append((grown, run, forward))
        paths = nxt
    # Groups a template finds itself (`Template.candidate_groups`): in a gradient program, a forward with its own
    # backward (attention's flash pair; a dot whose product is reduced and read again), whatever the size bound, in
    # two stages where the two are not convex together (a training step)
    fusible_node = lambda i: is_fusible(graph, i)  # noqa: E731
    for template in list(TEMPLATES.values()):
        for grp, spec, stages in template.candidate_groups(graph, fusible_node):
            emit(Candidate(grp, template.name, spec, stages))
    return found


def _candidate(graph: Graph, mask: int, matched: dict[tuple, tuple[str, int] | None] | None = None) -> Candidate | None:
    """The group of `mask` with its template, or None. `matched` memoises which template (if any) took
    each group structure, and its reductions: a repeated layer's groups are matched once, not once per layer
    (their `spec` is made when asked: for the candidates emitted, not the many groups a growing path passes).
    The group's inputs, outputs and structure come from one pass over its nodes (GPT-2 medium's training step
    passes 123k groups while enumerating: `Group.of` and a separate renaming were half of its time)."""
    ids = _bits(mask)
    computes, readers, texts = _node_facts(graph)
    if not any(computes[i] for i in ids):
        return None
    index = graph.node_index
    inputs: dict[int, int] = {}  # value -> position, in order of first use (as `Group.of`)
    made: dict[int, int] = {}  # value made inside -> position
    body = []
    outs = []
    for i in ids:
        nd = index[i]
        wiring = []
        for a in nd.inputs:
            if not isinstance(a, int):
                wiring.append(None)  # a literal: in the op text
            elif a in made:
                wiring.append(made[a])
            else:
                wiring.append(~inputs.setdefault(a, len(inputs)))
        body.append((texts[i], tuple(wiring)))
        for v in nd.outputs:
            made[v] = len(made)
            if readers[v] & ~mask:
                outs.append(v)
    if not outs:
        return None
    group = Group(graph, tuple(ids), tuple(inputs), tuple(outs))
    key = None
    if matched is not None:
        key = (tuple(graph.avals[v] for v in inputs), tuple(body), tuple(made[v] for v in outs))
        if key in matched:
            known = matched[key]
            return Candidate(group, known[0], reductions=known[1]) if known is not None else None
    m = match_template(group)
    reductions = len(getattr(m[1], "reductions", ())) if m else 0
    if key is not None:
        matched[key] = (m[0], reductions) if m else None
    return Candidate(group, m[0], m[1], reductions=reductions) if m else None


def _node_facts(graph: Graph) -> tuple[dict[int, bool], dict[int, int], dict[int, str]]:
    """Per node, whether it computes (elementwise or a reduction: a group of layout ops alone is no candidate); per
    value, its readers as a bitmask of node ids (with a bit past every node's where the graph returns it), so that a
    value of a group is an output where `readers & ~group` is not 0; per node, `_op_text`. Made once per graph
    (`graph.extra`)."""
    facts = graph.extra.get("node_facts")
    if facts is None:
        computes = {n.id: ops.op_class(n.name) in (OpClass.ELEMENTWISE, OpClass.REDUCTION) for n in graph.nodes}
        beyond = 1 << (max((n.id for n in graph.nodes), default=0) + 1)  # a bit no group has: the program's reader
        readers = {v: sum(1 << c for c in set(graph.consumers.get(v, ()))) | (beyond if v in graph.output_values else 0)
                   for n in graph.nodes for v in n.outputs}
        facts = graph.extra["node_facts"] = (computes, readers, {n.id: _op_text(graph, n) for n in graph.nodes})
    return facts


def _op_text(graph: Graph, n: Node) -> str:
    """A node's primitive, params and output types, without value ids."""
    return node_text(n, graph.avals, {a: 0 for a in (*n.inputs, *n.outputs) if isinstance(a, int)})
