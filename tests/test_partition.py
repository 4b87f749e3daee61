"""Partition: candidate groups are convex and connected, enumeration is bounded, the cover is exact and acyclic."""
from __future__ import annotations

import itertools
import os
import time

import jax
import jax.numpy as jnp
import pytest

import autofuse
from autofuse import ops
from autofuse.tuning import partition
from autofuse.graph import Graph, Group
from autofuse.kernels import TEMPLATES
from autofuse.runner.measure import check
from autofuse.ops import OpClass
from autofuse.graph import execution_order
from autofuse.tuning.partition import enumerate_candidates
from autofuse.tuning.select import Option, exclusive_pairs, select_cover
from autofuse.tuning.select import default_plan
from benchmarks.workloads import layer_norm, log_relu_bias, logsumexp, rms_norm, softmax

S = jax.ShapeDtypeStruct
F32 = jnp.float32


# ---------------------------------------------------------------------------
# Independent graph helpers (not partition's own bitmask machinery).
def _reach(graph: Graph, start: int, step) -> set[int]:
    seen, todo = set(), list(step(start))
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(step(n))
    return seen


def _is_convex(graph: Graph, members: set[int]) -> bool:
    """No node outside the set lies on a path between two members."""
    for nd in graph.nodes:
        if nd.id in members:
            continue
        if _reach(graph, nd.id, graph.preds) & members and _reach(graph, nd.id, graph.succs) & members:
            return False
    return True


def _is_connected(graph: Graph, members: set[int]) -> bool:
    start = next(iter(members))
    seen, todo = {start}, [start]
    while todo:
        n = todo.pop()
        for m in graph.preds(n) + graph.succs(n):
            if m in members and m not in seen:
                seen.add(m)
                todo.append(m)
    return seen == members


def _acyclic(graph: Graph, groups) -> bool:
    try:
        execution_order(graph, [frozenset(g) for g in groups])
        return True
    except ValueError:
        return False


# ---------------------------------------------------------------------------
def cumsum_sort_chain(x, b):
    h = jnp.tanh(x * 2.0 + b)
    h = jnp.cumsum(h, axis=-1)
    h = jnp.sort(h, axis=-1)
    return jax.nn.softmax(h * 0.5, axis=-1)


def opaque_diamond(x):
    e = jnp.exp(x)
    return jnp.log(e + jnp.cumsum(e, axis=-1)) * jnp.tanh(e)


def two_branches(x, y):
    a, b = jnp.exp(x), jnp.exp(y)
    m = jnp.max(a + b, axis=-1, keepdims=True)
    return (a * b) - m, jnp.sort(a, axis=-1) + b


GRAPHS = [
    pytest.param(log_relu_bias, ((37, 300), (300,)), id="log_relu_bias"),
    pytest.param(softmax, ((37, 300),), id="softmax"),
    pytest.param(layer_norm, ((37, 300), (300,), (300,)), id="layer_norm"),
    pytest.param(rms_norm, ((37, 300), (300,)), id="rms_norm"),
    pytest.param(logsumexp, ((37, 300),), id="logsumexp"),
    pytest.param(cumsum_sort_chain, ((37, 300), (300,)), id="cumsum_sort_chain"),
    pytest.param(opaque_diamond, ((16, 64),), id="opaque_diamond"),
    pytest.param(two_branches, ((16, 64), (16, 64)), id="two_branches"),
]


@pytest.mark.parametrize("fn,shapes", GRAPHS)
def test_candidates_are_convex_connected_and_fusible(fn, shapes):
    graph = autofuse.capture(fn, *[S(s, jnp.bfloat16) for s in shapes])
    cands = enumerate_candidates(graph)
    assert cands
    seen = set()
    for c in cands:
        members = set(c.group.node_ids)
        assert members == set(c.nodes)
        assert _is_connected(graph, members), sorted(members)
        assert _is_convex(graph, members), sorted(members)
        assert all(ops.op_class(graph.node_index[i].name) in ops.FUSIBLE for i in members)
        assert c.template in TEMPLATES and TEMPLATES[c.template].match(c.group) is not None
        assert c.group.outputs
        of = Group.of(graph, c.group.node_ids)  # enumeration builds its groups in one pass of its own: the same group
        assert (c.group.inputs, c.group.outputs) == (of.inputs, of.outputs) and c.group.signature == of.signature
        assert len(members) <= partition.MAX_GROUP_SIZE
        seen.add(frozenset(members))
    assert len(seen) == len(cands)  # no duplicates
    # Every arithmetic node can be fused somehow.
    covered = set().union(*seen)
    compute = {n.id for n in graph.nodes if ops.op_class(n.name) in (OpClass.ELEMENTWISE, OpClass.REDUCTION)}
    assert compute <= covered


def test_no_candidate_straddles_an_opaque_node():
    graph = autofuse.capture(opaque_diamond, S((16, 64), F32))
    by_name = {}
    for n in graph.nodes:
        by_name.setdefault(n.name, n.id)
    exp, add = by_name["exp"], by_name["add"]
    cands = enumerate_candidates(graph)
    assert any(exp in c.nodes for c in cands) and any(add in c.nodes for c in cands)
    for c in cands:
        assert by_name["cumsum"] not in c.nodes
        assert not {exp, add} <= c.nodes  # exp -> cumsum -> add: a path through an outside node


def test_convexity_checker_itself():
    graph = autofuse.capture(opaque_diamond, S((16, 64), F32))
    names = [n.name for n in graph.nodes]
    exp, cumsum, add = names.index("exp"), names.index("cumsum"), names.index("add")
    assert not _is_convex(graph, {exp, add})
    assert _is_convex(graph, {exp, cumsum, add})
    assert not _is_connected(graph, {exp, names.index("log")})
    assert _is_connected(graph, {exp, names.index("tanh"), names.index("mul")})


# ---------------------------------------------------------------------------
# A generated graph of a few hundred equations.
def deep_model(x, w):
    for i in range(40):
        x = rms_norm(x, w) * w + jnp.tanh(x)
        if i % 10 == 9:
            x = jnp.cumsum(x, axis=-1)
    return x


@pytest.mark.slow
def test_large_graph_enumeration_is_bounded_and_plan_runs():
    specs = (S((8, 128), F32), S((128,), F32))
    graph = autofuse.capture(deep_model, *specs)
    assert 300 <= len(graph.nodes) <= 1000
    t0 = time.perf_counter()
    cands = enumerate_candidates(graph)
    elapsed = time.perf_counter() - t0
    assert elapsed < 60, f"enumeration took {elapsed:.1f} s"
    assert 0 < len({c.group.signature for c in cands}) <= partition.MAX_CANDIDATES  # the bound counts distinct computations
    cumsum_ids = sorted(n.id for n in graph.nodes if n.name == "cumsum")
    assert len(cumsum_ids) == 4 and cumsum_ids[-1] == len(graph.nodes) - 1
    # Candidates reach the last ten layers (a capped enumeration must not spend its budget on the first ones).
    assert any(c.template == "row_reduce" and min(c.nodes) > cumsum_ids[-2] for c in cands)

    t0 = time.perf_counter()
    plan = default_plan(graph)
    assert time.perf_counter() - t0 < 60
    cumsums = {n.id for n in graph.nodes if n.name == "cumsum"}
    reductions = {n.id for n in graph.nodes if ops.op_class(n.name) is OpClass.REDUCTION}
    assert len(reductions) == 40
    grouped = [set(g.nodes) for g in plan.groups]
    for nodes in grouped:
        assert not nodes & cumsums
        assert _is_convex(graph, nodes) and _is_connected(graph, nodes)
    covered = set().union(*grouped)
    missing = sorted(reductions - covered)
    assert not missing, f"reductions left to XLA: {missing}"  # every layer's norm is fused, to the last one
    assert _acyclic(graph, grouped)

    fused = autofuse.jit(deep_model, plan=plan, on_miss="error")
    avals = [graph.avals[v] for v in graph.inputs]
    res = check(lambda *a: [fused(*a)], lambda *a: [jax.jit(deep_model)(*a)], avals, seeds=(1,))
    assert res.ok, res.reason


# ---------------------------------------------------------------------------
# select_cover on hand-built cost tables.
def _chain5(x):
    a = jnp.exp(x)
    b = jnp.tanh(a)
    c = jnp.sin(b)
    d = jnp.cos(c)
    return jnp.log(d)


def _cost(graph, chosen, node_cost) -> float:
    covered = set().union(*[o.nodes for o in chosen]) if chosen else set()
    return sum(o.cost for o in chosen) + sum(node_cost[n.id] for n in graph.nodes if n.id not in covered)


def _brute_force(graph, options, node_cost):
    best = None
    for r in range(len(options) + 1):
        for combo in itertools.combinations(options, r):
            sets = [o.nodes for o in combo]
            if sum(len(s) for s in sets) != len(set().union(*sets) if sets else set()):
                continue
            if not _acyclic(graph, sets):
                continue
            c = _cost(graph, combo, node_cost)
            if best is None or c < best[0] - 1e-12:
                best = (c, combo)
    return best


def test_select_cover_is_exact_where_greedy_is_not():
    graph = autofuse.capture(_chain5, S((4, 8), F32))
    assert [n.name for n in graph.nodes] == ["exp", "tanh", "sin", "cos", "log"]
    node_cost = {i: 1.0 for i in range(5)}
    X = Option(frozenset({0, 1, 2, 3}), 2.0, "X")  # largest, and cheapest per node (0.5)
    Y = Option(frozenset({0, 1}), 1.1, "Y")  # 0.55 per node
    Z = Option(frozenset({2, 3, 4}), 1.6, "Z")  # 0.533 per node
    W = Option(frozenset({3, 4}), 1.5, "W")
    options = [X, Y, Z, W]

    def greedy(key):
        chosen, used = [], set()
        for o in sorted(options, key=key):
            if not o.nodes & used:
                chosen.append(o)
                used |= o.nodes
        return _cost(graph, chosen, node_cost)

    greedy_largest = greedy(lambda o: -len(o.nodes))
    greedy_per_node = greedy(lambda o: o.cost / len(o.nodes))
    chosen = select_cover(graph, options, node_cost)
    assert {o.label for o in chosen} == {"Y", "Z"}
    assert _cost(graph, chosen, node_cost) == pytest.approx(2.7)
    assert greedy_largest == pytest.approx(3.0) and greedy_per_node == pytest.approx(3.0)
    assert _cost(graph, chosen, node_cost) == pytest.approx(_brute_force(graph, options, node_cost)[0])
    # Chosen options are disjoint.
    assert sum(len(o.nodes) for o in chosen) == len(set().union(*[o.nodes for o in chosen]))


def test_select_cover_leaves_nodes_alone_when_that_is_cheaper():
    graph = autofuse.capture(_chain5, S((4, 8), F32))
    node_cost = {0: 0.1, 1: 0.1, 2: 5.0, 3: 5.0, 4: 0.1}
    options = [Option(frozenset({0, 1, 2}), 5.5, "A"), Option(frozenset({2, 3}), 3.0, "B"), Option(frozenset({1, 2, 3, 4}), 3.5, "C")]
    chosen = select_cover(graph, options, node_cost)
    best_cost, best = _brute_force(graph, options, node_cost)
    assert _cost(graph, chosen, node_cost) == pytest.approx(best_cost)
    assert {o.label for o in chosen} == {o.label for o in best} == {"B"}  # 3.0 + 0.3 beats C (3.5 + 0.1) and A
    assert select_cover(graph, [], node_cost) == []


def _crossing(x, y):
    a, b = jnp.exp(x), jnp.exp(y)
    return a + b, a * b


def test_select_cover_never_returns_a_cyclic_cover():
    # a=exp(x), b=exp(y), c=a+b, d=a*b: {a,d} and {b,c} are each convex, but a->c and b->d make them a cycle.
    graph = autofuse.capture(_crossing, S((4, 8), F32), S((4, 8), F32))
    assert [n.name for n in graph.nodes] == ["exp", "exp", "add", "mul"]
    a, b, c, d = 0, 1, 2, 3
    G1 = Option(frozenset({a, d}), 0.1, "G1")
    G2 = Option(frozenset({b, c}), 0.1, "G2")
    assert not _acyclic(graph, [G1.nodes, G2.nodes])  # the cheapest disjoint pair is cyclic
    node_cost = {i: 1.0 for i in range(4)}

    chosen = select_cover(graph, [G1, G2], node_cost)
    assert _acyclic(graph, [o.nodes for o in chosen])
    assert len(chosen) == 1 and _cost(graph, chosen, node_cost) == pytest.approx(2.1)

    G3 = Option(frozenset({a, b, c, d}), 0.5, "G3")
    chosen = select_cover(graph, [G1, G2, G3], node_cost)
    assert [o.label for o in chosen] == ["G3"]

    G4 = Option(frozenset({a, c}), 0.15, "G4")
    G5 = Option(frozenset({b, d}), 0.15, "G5")
    options = [G1, G2, G4, G5]  # {a,c}+{b,d} is cyclic as well
    chosen = select_cover(graph, options, node_cost)
    order = execution_order(graph, [o.nodes for o in chosen])  # does not raise
    assert len(order) == len(graph.nodes) - sum(len(o.nodes) - 1 for o in chosen)
    assert _cost(graph, chosen, node_cost) == pytest.approx(_brute_force(graph, options, node_cost)[0])


def _crossings(*xs):
    return [v for x, y in zip(xs[::2], xs[1::2]) for v in _crossing(x, y)]


def test_select_cover_excludes_the_pairs_that_wait_on_each_other_at_once():
    # Eight copies of the crossing above (a layer repeated), each with two cyclic pairs of options: cut one cover at a
    # time that took 16+ rounds; cutting every cycle of a round, then excluding such pairs outright, it takes three.
    k = 8
    graph = autofuse.capture(_crossings, *[S((4, 8), F32)] * (2 * k))
    names = [n.name for n in graph.nodes]
    a, b, c, d = (names.index("exp"), names.index("exp", names.index("exp") + 1), names.index("add"), names.index("mul"))
    shapes = {"G1": (a, d), "G2": (b, c), "G4": (a, c), "G5": (b, d)}
    cost = {"G1": 0.1, "G2": 0.1, "G4": 0.15, "G5": 0.15}
    stride = len(names) // k
    options = [Option(frozenset(i * stride + n for n in nodes), cost[label], (label, i))
               for i in range(k) for label, nodes in shapes.items()]
    pairs = {frozenset((options[p].label[0], options[q].label[0])) for p, q in exclusive_pairs(graph, options)}
    assert pairs == {frozenset(("G1", "G2")), frozenset(("G4", "G5"))}
    assert len(exclusive_pairs(graph, options)) == 2 * k
    node_cost = {n.id: 1.0 for n in graph.nodes}
    chosen = select_cover(graph, options, node_cost, max_rounds=3)
    assert _acyclic(graph, [o.nodes for o in chosen])
    one = autofuse.capture(_crossing, S((4, 8), F32), S((4, 8), F32))
    best_one = _brute_force(one, [Option(frozenset(n), cost[label], label) for label, n in shapes.items()], {i: 1.0 for i in range(4)})[0]
    assert _cost(graph, chosen, node_cost) == pytest.approx(k * best_one)


def test_select_cover_rejects_a_non_convex_option():
    # exp -> cumsum -> exp: the option {exp, exp} is cheap but cannot be ordered around the cumsum.
    graph = autofuse.capture(lambda x: jnp.exp(jnp.cumsum(jnp.exp(x), axis=-1)), S((4, 8), F32))
    assert [n.name for n in graph.nodes] == ["exp", "cumsum", "exp"]
    bad = Option(frozenset({0, 2}), 0.01, "bad")
    good = Option(frozenset({0}), 0.5, "good")
    chosen = select_cover(graph, [bad, good], {0: 1.0, 1: 1.0, 2: 1.0})
    assert [o.label for o in chosen] == ["good"]


def test_execution_order_contracts_groups():
    graph = autofuse.capture(cumsum_sort_chain, S((8, 64), F32), S((64,), F32))
    plan = default_plan(graph)
    groups = [frozenset(g.nodes) for g in plan.groups]
    order = execution_order(graph, groups)
    assert sorted(ref for kind, ref in order if kind == "group") == list(range(len(groups)))
    singles = [ref for kind, ref in order if kind == "node"]
    assert sorted(singles + [i for g in groups for i in g]) == list(range(len(graph.nodes)))
    pos = {u: k for k, u in enumerate(order)}
    unit = {i: ("group", k) for k, g in enumerate(groups) for i in g}
    for nd in graph.nodes:
        for p in graph.preds(nd.id):
            u, pu = unit.get(nd.id, ("node", nd.id)), unit.get(p, ("node", p))
            assert u == pu or pos[pu] < pos[u]


def test_a_programs_candidates_are_enumerated_once_and_read_back_by_the_next_job(tmp_path, monkeypatch):
    """The candidates of a program are kept by its fingerprint and the code that enumerates them (GPT-2 medium's
    forward: 7.7 s to enumerate on this CPU, 0.07 s to read back); another registered template is another key, and
    `off` keeps nothing."""
    from autofuse.kernels import register_template
    from autofuse.tuning import job

    monkeypatch.setenv(job.ENUMERATION_CACHE, str(tmp_path))
    g = autofuse.capture(layer_norm, *(jax.ShapeDtypeStruct(s, jnp.float32) for s in ((64, 128), (128,), (128,))))
    fresh = job.distinct_candidates(g)
    path = job.enumeration_file(g.fingerprint)
    assert path.startswith(str(tmp_path)) and os.path.exists(path)
    calls = []
    monkeypatch.setattr(job, "enumerate_candidates", lambda graph: calls.append(graph) or [])
    again = job.distinct_candidates(g)
    instances = lambda found: {k: [c.group.node_ids for c in v] for k, v in found[0].items()}  # noqa: E731
    assert calls == [] and instances(again) == instances(fresh)
    assert [(r.signature, r.template, r.nodes, r.instances) for r in again[1]] == [(r.signature, r.template, r.nodes, r.instances) for r in fresh[1]]
    saved = dict(TEMPLATES)
    try:
        register_template(type("Another", (type(TEMPLATES["elementwise"]),), {"name": "another"})())
        assert job.enumeration_file(g.fingerprint) != path  # a plugin changes what the partitioner may offer
    finally:
        TEMPLATES.clear()
        TEMPLATES.update(saved)
    monkeypatch.setenv(job.ENUMERATION_CACHE, "off")
    assert job.enumeration_file(g.fingerprint) is None and job.distinct_candidates(g) == ({}, []) and len(calls) == 1


def test_a_group_ending_in_a_widening_conversion_is_offered_without_it():
    """A GEMM's epilogue that adds the residual (bf16) and converts the sum to float32 for the next norm writes both,
    the float32 copy twice the bytes, where XLA fuses the exact conversion into the norm's reductions: the group is
    also offered without the conversion, its only output the bf16 sum (GPT-2's down-projection + residual, x23)."""
    def block(r, x, w, b):
        y = r + (x @ w + b)
        yf = y.astype(jnp.float32)
        return y, jnp.mean(yf, axis=-1), jnp.sum(yf * yf, axis=-1)

    graph = autofuse.capture(block, S((256, 128), jnp.bfloat16), S((256, 128), jnp.bfloat16), S((128, 128), jnp.bfloat16),
                             S((128,), jnp.bfloat16))
    (conv,) = [n.id for n in graph.nodes if n.name == "convert_element_type" and str(graph.avals[n.outputs[0]].dtype) == "float32"]
    cands = [c for c in enumerate_candidates(graph) if c.template == "matmul"]
    readers = set(graph.consumers[graph.node_index[conv].outputs[0]])
    wide = [c for c in cands if conv in c.group.node_ids and not readers & set(c.group.node_ids)]  # the float32 copy written
    assert len(wide) == 2, [c.group.node_ids for c in cands]  # with the bias's broadcast and without
    for c in wide:
        narrow = set(c.group.node_ids) - {conv}
        (n,) = [d for d in cands if set(d.group.node_ids) == narrow]
        assert [str(graph.avals[v].dtype) for v in n.group.outputs] == ["bfloat16"]
        assert "float32" in [str(graph.avals[v].dtype) for v in c.group.outputs]
