"""Template `attention`: scores = q·k, elementwise work, softmax over keys, · v, as one flash-style kernel.

The group is matched by its structure, not by a name: a `dot_general` whose
output (the scores, axes [batch..., q, k]) feeds elementwise work (scale,
bias, masks from inputs or from `iota`, soft-capping), a `reduce_max` and a
`reduce_sum` over the key axis with the softmax wiring between them
(`exp(x - max)`, divided or multiplied by a function of the sum), and a
second `dot_general` contracting the probabilities with the values.
Operands may reach the dots through broadcasts and merging reshapes (that is
how `jnp.repeat` expresses grouped-query attention): the kernel reads the
original arrays with the index arithmetic those ops imply.

What the match reads is an `AttentionSpec` (`attention_spec.py`); masks known at build time are analysed in
`attention_masks.py`. Kernel (`triton/attention.py`): one program per (batch position, block of queries); a loop over key
blocks keeps a running max, a running sum and a float32 accumulator
(FlashAttention-2). The score work is the group's own equations, evaluated on
[block_q, block_k] tiles (`AttentionEval`); `iota` gives the tile's global
query/key positions. Masks that depend on `iota` alone are evaluated once on
the host over the whole [q, k] grid: key blocks that are masked out for a
whole query block are never visited, and blocks without a masked position
skip the mask arithmetic.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .. import costmodel
from ..costmodel import H200, GPUModel
from ..differentiate import VJPRule
from ..graph import Graph, Group, Node
from ..ops import OpClass, op_class
from ..spaces import DEFAULT_BACKEND
from .attention_library import CUDNN_FORWARD_FACTOR, is_cudnn, library_group, library_kernel, xla_path_groups, xla_path_spec
from .attention_masks import block_ranges, bound_inputs
from .attention_spec import AttentionSpec, Operand
from .matmul import DOT_DTYPES, default_precision
from .template import NoMatch, Template
from .tiling import Span, TileSpec, cdiv, needed, next_pow2, place_axes



# ---------------------------------------------------------------------------
# Matching.
def _match(group: Group) -> AttentionSpec:
    g = group.graph
    dots = [n for n in group.nodes if op_class(n.name) is OpClass.CONTRACTION]
    if len(dots) != 2:
        raise NoMatch("needs two dots")
    reds = [n for n in group.nodes if op_class(n.name) is OpClass.REDUCTION]
    maxes = [n for n in reds if n.name == "reduce_max"]
    sums = [n for n in reds if n.name == "reduce_sum"]
    if len(maxes) != 1 or len(sums) != 1 or len(reds) != 2 or len(group.outputs) != 1:
        raise NoMatch("needs one max, one sum and one output")
    members = set(group.node_ids)
    dep = _dependents(group)
    d1, d2 = (dots[0], dots[1]) if dots[1].id in dep[dots[0].id] else (dots[1], dots[0])
    if d2.id not in dep[d1.id]:
        raise NoMatch("the dots are independent")
    mx, sm = maxes[0], sums[0]
    if not (mx.id in dep[d1.id] and sm.id in dep[mx.id] and d2.id in dep[sm.id]):
        raise NoMatch("not a softmax between the dots")
    if not all(default_precision(d, g.aval(d.inputs[0]).dtype) for d in (d1, d2)):
        raise NoMatch("non-default precision")

    # score space: the shape the softmax reduces (dot1's output up to unit axes)
    x = mx.inputs[0]
    S = tuple(g.avals[x].shape)
    n = len(S)
    (red_axis,) = mx.params["axes"]
    S2 = tuple(g.aval(sm.inputs[0]).shape)
    (red2,) = sm.params["axes"] if len(sm.params["axes"]) == 1 else (None,)
    nu = lambda sh, ax: ([s for s in sh if s != 1], sum(1 for s in sh[:ax] if s != 1))  # noqa: E731 - up to unit axes
    if red2 is None or S[red_axis] == 1 or nu(S, red_axis) != nu(S2, red2):
        raise NoMatch("max and sum must reduce the scores over one axis")
    k_axis = red_axis
    d1_out = d1.outputs[0]
    osh = g.avals[d1_out].shape
    nu_s, nu_o = [d for d in range(n) if S[d] != 1], [d for d in range(len(osh)) if osh[d] != 1]
    if [S[d] for d in nu_s] != [osh[d] for d in nu_o]:
        raise NoMatch("the softmax is not over dot1's output")
    seed: list = [None] * len(osh)
    for do, ds in zip(nu_o, nu_s):
        seed[do] = ds
    (lc, rc), (lb, rb) = d1.params["dimension_numbers"]
    a_sh, b_sh = g.aval(d1.inputs[0]).shape, g.aval(d1.inputs[1]).shape
    # each side's free axes: one key or query axis, and unit axes (`jax.nn.dot_product_attention`'s XLA path writes
    # queries [B, T, N_kv, G, H], G the query heads per key head: 1 without grouped-query heads; with them its
    # transposes of the scores between the dots are data moves the tiling does not take)
    free = [[d for d in range(len(sh)) if d not in b and d not in c] for sh, b, c in ((a_sh, lb, lc), (b_sh, rb, rc))]
    nb1 = len(lb)
    at = [{d: nb1 + i for i, d in enumerate(free[0])}, {d: nb1 + len(free[0]) + i for i, d in enumerate(free[1])}]  # in dot1's output
    k_side = next((side for side in (1, 0) for d in free[side] if seed[at[side][d]] == k_axis), None)
    if len(lc) != 1 or k_side is None or not free[1 - k_side]:
        raise NoMatch("dot1 is not [.., q, d] x [.., k, d]")
    shapes = (a_sh, b_sh)
    q_side = 1 - k_side
    k_free = [d for d in free[k_side] if shapes[k_side][d] != 1]
    q_free = [d for d in free[q_side] if shapes[q_side][d] != 1] or free[q_side][:1]
    if len(k_free) != 1 or len(q_free) != 1 or seed[at[k_side][k_free[0]]] != k_axis:
        raise NoMatch("dot1 is not [.., q, d] x [.., k, d]")
    q_dim = q_free[0]
    q_axis = seed[at[q_side][q_dim]]
    if q_axis is None:
        raise NoMatch("a single query")
    batch_axes = tuple(d for d in range(n) if d not in (q_axis, k_axis))
    bdims, cdims = (lb, rb), (lc[0], rc[0])
    batch_of = [{bdims[side][i]: seed[i] for i in range(nb1)} for side in (0, 1)]
    qo = _operand(group, d1.inputs[q_side], batch_of[q_side], q_dim, cdims[q_side])
    ko = _operand(group, d1.inputs[k_side], batch_of[k_side], k_free[0], cdims[k_side])
    D = a_sh[lc[0]]

    # dot2: P (derived from the scores) with V; then the output tail
    (lc2, rc2), (lb2, rb2) = d2.params["dimension_numbers"]
    p_idx = next((i for i, a in enumerate(d2.inputs) if isinstance(a, int) and g.producer.get(a) in members
                  and any(nd.id == d1.id for nd in needed(group.nodes, {a}, set()))), None)
    if p_idx is None or len(lc2) != 1:
        raise NoMatch("dot2 does not contract the probabilities")
    pc, vc = (lc2[0], rc2[0]) if p_idx == 0 else (rc2[0], lc2[0])
    pb, vb = (lb2, rb2) if p_idx == 0 else (rb2, lb2)
    p_val, v_atom = d2.inputs[p_idx], d2.inputs[1 - p_idx]
    out = d2.outputs[0]
    post = []
    while out not in group.outputs:
        cons = [c for c in g.consumers.get(out, ()) if c in members]
        nd = g.node_index[cons[0]] if len(cons) == 1 else None
        if nd is None or nd.name not in ("convert_element_type", "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose"):
            raise NoMatch("work after dot2 other than converts, transposes and unit axes")
        post.append(nd)
        out = nd.outputs[0]
    skip = {d1.id, d2.id} | {nd.id for nd in post}
    for atom in (d1.inputs[0], d1.inputs[1], v_atom):
        skip |= set(_chain_nodes(group, atom))
    score_nodes = [nd for nd in group.nodes if nd.id not in skip]
    axes = _place(group, score_nodes, S, d1_out, tuple(seed))
    p_axes = axes[p_val]
    p_sh = g.avals[p_val].shape
    p_free_all = [d for d in range(len(p_axes)) if d not in pb and d != pc]
    p_free = [d for d in p_free_all if p_sh[d] != 1]  # the others: unit axes
    if p_axes[pc] != k_axis or len(p_free) != 1 or p_axes[p_free[0]] != q_axis:
        raise NoMatch("dot2 contracts the wrong axis of the probabilities")
    v_sh = g.aval(v_atom).shape
    v_free_all = [d for d in range(len(v_sh)) if d not in vb and d != vc]
    v_free = [d for d in v_free_all if v_sh[d] != 1] or v_free_all[:1]
    if len(v_free) != 1:
        raise NoMatch("values are not [.., k, d]")
    vo = _operand(group, v_atom, {vb[i]: p_axes[pb[i]] for i in range(len(vb))}, vc, v_free[0])
    Dv = v_sh[v_free[0]]
    if min(D, Dv) < 16 or D > 256 or Dv > 256:
        raise NoMatch("head dims outside 16..256")
    # dot2's output axes: the batch axes, then each side's free axes (the unit ones without a role)
    p_roles = ["q" if d == p_free[0] else None for d in p_free_all]
    v_roles = ["d" if d == v_free[0] else None for d in v_free_all]
    roles: list = [p_axes[d] for d in pb] + (p_roles + v_roles if p_idx == 0 else v_roles + p_roles)
    for nd in post:
        roles = _carry_roles(nd, roles, g)
    dm, dl = dep[mx.id], dep[sm.id]
    pre = [nd for nd in score_nodes if nd.id not in dm and nd.id != mx.id]
    row_m = [nd for nd in score_nodes if nd.id in dm and nd.id not in dl and nd.id != sm.id and not _has_k(axes, nd, k_axis)]
    exp_branch = [nd for nd in score_nodes if nd.id in dm and nd.id not in dl and nd.id != sm.id and _has_k(axes, nd, k_axis)]
    row_l = [nd for nd in score_nodes if nd.id in dl and not _has_k(axes, nd, k_axis)]
    full_l = [nd for nd in score_nodes if nd.id in dl and _has_k(axes, nd, k_axis)]
    if any(op_class(nd.name) is OpClass.SOURCE for nd in row_m + exp_branch + row_l):
        raise NoMatch("iota after the max")
    # exp branch: sub(y, m_row) -> exp -> converts
    if not exp_branch or exp_branch[0].name != "sub" or len(exp_branch) < 2 or exp_branch[1].name != "exp":
        raise NoMatch("exp branch is not exp(x - max)")
    sub, ex = exp_branch[0], exp_branch[1]
    if g.consumers.get(sub.outputs[0]) != [ex.id]:
        raise NoMatch("x - max is used other than by exp")
    y, m_row = sub.inputs
    if not (isinstance(y, int) and isinstance(m_row, int)) or ex.inputs[0] != sub.outputs[0]:
        raise NoMatch("exp branch wiring")
    if g.producer.get(m_row) not in {nd.id for nd in row_m} | {mx.id} or g.producer.get(y) in dm:
        raise NoMatch("exp branch does not subtract the row max")
    e_vals = [ex.outputs[0]]
    for nd in exp_branch[2:]:
        if nd.name != "convert_element_type" or nd.inputs[0] not in e_vals:
            raise NoMatch("exp branch: only converts after exp")
        e_vals.append(nd.outputs[0])
    if sm.inputs[0] not in e_vals:
        raise NoMatch("sum is not over the exp branch")
    # combine: exactly one full-size node on the sum, then converts into dot2
    if not full_l or full_l[0].name not in ("div", "mul"):
        raise NoMatch("no normalisation by the sum")
    comb = full_l[0]
    a0, a1 = comb.inputs
    if a0 in e_vals and isinstance(a1, int) and (g.producer.get(a1) in {nd.id for nd in row_l} | {sm.id}):
        e_first, e_dot, l_row = True, a0, a1
    elif comb.name == "mul" and a1 in e_vals and isinstance(a0, int) and (g.producer.get(a0) in {nd.id for nd in row_l} | {sm.id}):
        e_first, e_dot, l_row = False, a1, a0
    else:
        raise NoMatch("normalisation is not exp-branch (div|mul) row value")
    cur = comb.outputs[0]
    for nd in full_l[1:]:
        if nd.name not in ("convert_element_type", "squeeze", "reshape", "expand_dims") or nd.inputs[0] != cur:
            raise NoMatch("work between normalisation and dot2")
        cur = nd.outputs[0]
    if cur != p_val:
        raise NoMatch("normalised probabilities do not feed dot2")
    if g.producer.get(x) in dm:
        raise NoMatch("max of a max-dependent value")
    _inputs_within(row_m, {mx.outputs[0]})
    _inputs_within(row_l, {sm.outputs[0]})

    dt_q, dt_k = g.avals[qo.value].dtype, g.avals[ko.value].dtype
    dt_p, dt_v = g.avals[p_val].dtype, g.avals[vo.value].dtype
    for dt in (dt_q, dt_k, dt_v):
        if np.dtype(dt) not in DOT_DTYPES:
            raise NoMatch("operand dtype")
    if np.dtype(dt_q) != np.dtype(dt_k):
        raise NoMatch("q and k dtypes differ")
    dot_dtype2 = np.dtype(dt_v) if np.dtype(dt_v) != np.dtype("float32") else np.dtype(dt_p)
    if np.dtype(dot_dtype2) not in DOT_DTYPES:
        raise NoMatch("probability dtype")

    span = {v: Span(q_axis in ax, k_axis in ax) for v, ax in axes.items()}
    sub_group = Group.of(g, [nd.id for nd in score_nodes])
    if not set(sub_group.inputs) <= set(group.inputs) - {qo.value, ko.value, vo.value} | {d1.outputs[0]}:
        raise NoMatch("score work reads q, k, v or an operand chain")
    tile = TileSpec(sub_group, S, n - 1, axes, span, [])
    spec = AttentionSpec(group, S, q_axis, k_axis, batch_axes, qo, ko, vo, D, Dv, d1, d2, mx, sm, comb, x, m_row,
                         sm.inputs[0], e_dot, e_first, l_row, pre, row_m, exp_branch, row_l, post, out, roles,
                         tile, np.dtype(dt_q), np.dtype(dot_dtype2))
    return spec


def _inputs_within(nodes: list[Node], allowed: set[int]) -> None:
    """Row work at the end of the loop may read only its own chain (not per-tile values)."""
    have = set(allowed) | {v for nd in nodes for v in nd.outputs}
    if any(isinstance(a, int) and a not in have for nd in nodes for a in nd.inputs):
        raise NoMatch("row work reads a per-tile value")


def _dependents(group: Group) -> dict[int, set[int]]:
    """node id -> ids of the group's nodes that (transitively) read it."""
    g = group.graph
    members = set(group.node_ids)
    out: dict[int, set[int]] = {}
    for nd in reversed(group.nodes):
        s: set[int] = set()
        for c in g.succs(nd.id):
            if c in members:
                s |= {c} | out[c]
        out[nd.id] = s
    return out


def _chain_nodes(group: Group, atom) -> list[int]:
    """Broadcast/reshape nodes between a group input and a dot operand."""
    g = group.graph
    members = set(group.node_ids)
    out = []
    v = atom
    while isinstance(v, int) and g.producer.get(v) in members:
        nd = g.node_index[g.producer[v]]
        if nd.name not in ("broadcast_in_dim", "reshape", "squeeze", "expand_dims") or not isinstance(nd.inputs[0], int):
            raise NoMatch(f"dot operand computed by {nd.name}")
        if len([c for c in g.consumers.get(v, ()) if c in members]) != 1 or v in group.outputs:
            raise NoMatch("an operand chain value is shared")  # (a reader outside makes it an output)
        out.append(nd.id)
        v = nd.inputs[0]
    return out


def _operand(group: Group, atom, batch_of: dict[int, int], seq_dim: int, d_dim: int) -> Operand:
    """Follow broadcasts and reshapes back to a group input; map operand axes to input axes.

    Handles the layouts people write: heads split out of a [B, L, H*D] array
    (`x.reshape(B, L, H, D)`: the head index offsets the input's last axis), and key/value
    heads repeated for GQA (broadcast + merging reshape: the head index is divided).
    """
    g = group.graph
    if not isinstance(atom, int):
        raise NoMatch("literal dot operand")
    chain = [g.node_index[i] for i in reversed(_chain_nodes(group, atom))]
    src = chain[0].inputs[0] if chain else atom
    if src not in group.inputs:
        raise NoMatch("dot operand is not read from memory")
    shape = g.avals[src].shape
    # per current axis i: [(source axis, div, mod, mul)]: source index += ((i // div) % mod) * mul
    cur = [[(a, 1, s, 1)] if s != 1 else [] for a, s in enumerate(shape)]
    for nd in chain:
        ish, osh = g.aval(nd.inputs[0]).shape, g.avals[nd.outputs[0]].shape
        if nd.name == "broadcast_in_dim":
            new = [[] for _ in osh]
            for i, j in enumerate(nd.params["broadcast_dimensions"]):
                if ish[i] == osh[j]:
                    new[j] = cur[i]
            cur = new
        else:
            if nd.name == "reshape" and nd.params.get("dimensions") is not None:
                raise NoMatch("reshape with dimensions")
            cur = _reshape_terms(cur, ish, osh)
    op_shape = g.aval(atom).shape
    seq_axis = d_axis = None
    batch: dict[int, list] = {}
    for j, terms in enumerate(cur):
        if j in (seq_dim, d_dim):
            if len(terms) != 1 or terms[0][1:] != (1, op_shape[j], 1):
                raise NoMatch("sequence/head axis is not a plain input axis")
            if j == seq_dim:
                seq_axis = terms[0][0]
            else:
                d_axis = terms[0][0]
        elif terms and j not in batch_of:
            raise NoMatch("operand axis of unknown role")
        else:
            for a, div, mod, mul in terms:
                batch.setdefault(a, []).append((batch_of[j], div, mod, mul))
    if seq_axis is None or d_axis is None or seq_axis == d_axis:
        raise NoMatch("operand lacks a sequence or head axis")
    return Operand(src, seq_axis, d_axis, batch)


def _reshape_terms(cur: list, ish: tuple, osh: tuple) -> list:
    """Index terms through a reshape that merges consecutive axes or splits one (unit axes come and go)."""
    i_nu = [d for d, s in enumerate(ish) if s != 1]
    o_nu = [d for d, s in enumerate(osh) if s != 1]
    out: list = [[] for _ in osh]
    i = j = 0
    while i < len(i_nu) and j < len(o_nu):
        ins, outs = [i_nu[i]], [o_nu[j]]
        pi, po = ish[i_nu[i]], osh[o_nu[j]]
        while pi != po:  # grow the smaller side until both runs cover the same elements
            if pi < po and i + len(ins) < len(i_nu):
                ins.append(i_nu[i + len(ins)])
                pi *= ish[ins[-1]]
            elif po < pi and j + len(outs) < len(o_nu):
                outs.append(o_nu[j + len(outs)])
                po *= osh[outs[-1]]
            else:
                raise NoMatch("reshape does not regroup axes")
        if len(ins) > 1 and len(outs) > 1:
            raise NoMatch("reshape both merges and splits")
        if len(outs) == 1:  # merge: out index x -> in index (x // inner) % size
            inner = 1
            for d in reversed(ins):
                for a, div, mod, mul in cur[d]:
                    if d != ins[0] and ish[d] % (div * mod):
                        raise NoMatch("reshape of a partially broadcast axis")
                    out[outs[0]].append((a, inner * div, mod, mul))
                inner *= ish[d]
        else:  # split: in index = sum(out index_t * stride_t)
            (d,) = ins
            if any(div != 1 or mod != ish[d] for _, div, mod, _ in cur[d]):
                raise NoMatch("split of a composite axis")
            stride = 1
            for o in reversed(outs):
                out[o] = [(a, 1, osh[o], mul * stride) for a, _, _, mul in cur[d]]
                stride *= osh[o]
        i, j = i + len(ins), j + len(outs)
    return out


def _carry_roles(nd: Node, roles: list, g) -> list:
    """Output-axis roles through a convert, a transpose or a unit-axis layout op."""
    if nd.name == "convert_element_type":
        return roles
    if nd.name == "transpose":
        return [roles[i] for i in nd.params["permutation"]]
    ish, osh = g.aval(nd.inputs[0]).shape, g.avals[nd.outputs[0]].shape
    if [s for s in ish if s != 1] != [s for s in osh if s != 1]:
        raise NoMatch(f"{nd.name} after dot2 moves data")
    kept = [r for r, s in zip(roles, ish) if s != 1]
    it = iter(kept)
    return [next(it) if s != 1 else None for s in osh]


def _has_k(axes: dict, nd: Node, k_axis: int) -> bool:
    return k_axis in axes[nd.outputs[0]]


def _place(group: Group, nodes: list[Node], S: tuple, scores: int, seed: tuple) -> dict[int, tuple]:
    """S-axis of every dim of every score-space value (as `tiling.analyze`, over these nodes only)."""
    vals = {a for nd in nodes for a in nd.inputs if isinstance(a, int)} | {v for nd in nodes for v in nd.outputs}
    axes = place_axes(group.graph, nodes, sorted(vals), S, seed={scores: seed}, strict=False)
    for v in vals:
        if v not in axes:
            raise NoMatch(f"cannot place value %{v}")
        ax = [a for a in axes[v] if a is not None]
        if len(set(ax)) != len(ax):
            raise NoMatch("a value repeats an axis")
    return axes





# ---------------------------------------------------------------------------
# The template: matching, search space, model.
def timing_inputs(spec: AttentionSpec) -> dict[int, int]:
    """`bound_inputs` as the group's own inputs (a library call read from a graph of its own: through `spec.feeds`)."""
    return {spec.feeds.get(v, v): n for v, n in bound_inputs(spec).items()}


class AttentionTemplate(Template[AttentionSpec]):
    name = "attention"
    backends = ("triton", "mosaic_gpu")

    def match(self, group: Group) -> AttentionSpec | None:
        """The attention structure of `group`, or None. A cuDNN attention call alone, and JAX's own XLA path of
        `jax.nn.dot_product_attention` with grouped-query heads, are read as what they compute (`attention_library`:
        the spec of a captured graph of its own)."""
        if len(group.node_ids) == 1:
            found = library_group(group.graph, group.nodes[0], _match)
            return None if found is None else found[1]
        try:
            return _match(group)
        except NoMatch:
            return xla_path_spec(group, _match)

    def candidate_groups(self, graph: Graph, fusible) -> list[tuple[Group, AttentionSpec, tuple]]:
        """Each cuDNN attention call the template can run, as a group of its own (the growth by neighbours never
        takes an opaque node), and each grouped-query `jax.nn.dot_product_attention` on JAX's XLA path
        (`attention_library.xla_path_groups`)."""
        found = (library_group(graph, nd, _match) for nd in graph.nodes if nd.name == "custom_vjp_call")
        return [(grp, spec, ()) for grp, spec in [*filter(None, found), *xla_path_groups(graph, _match)]]

    def build(self, group: Group, config: dict, *, backend: str = DEFAULT_BACKEND, interpret: bool = False,
              spec: AttentionSpec | None = None):
        spec = spec if spec is not None else self.match(group)
        if spec is not None and spec.group.graph is not group.graph:  # library attention: the kernel of what it computes
            return library_kernel(group, spec, super().build(spec.group, config, backend=backend, interpret=interpret, spec=spec))
        return super().build(group, config, backend=backend, interpret=interpret, spec=spec)

    def xla_model_ms(self, group: Group, spec: AttentionSpec, model: GPUModel = H200) -> float:
        """A cuDNN call's: the flash kernel's modelled default over the ratio measured between them
        (`attention_library.CUDNN_FORWARD_FACTOR`); XLA's fusion's for any other group."""
        if spec is None or not is_cudnn(group):
            return super().xla_model_ms(group, spec, model)
        return CUDNN_FORWARD_FACTOR * self.default_model_ms(spec, model)

    def vjp_rule(self, group: Group, config: dict, *, backend: str = DEFAULT_BACKEND, interpret: bool = False) -> VJPRule | None:
        """The flash pair where `flash_backward_unsupported` allows it, else None (recompute in XLA): `backend`'s
        `vjp_rule` in its `attention_vjp` lowering (the pair's), which runs the forward on the group's own backend
        and config, emitting the row logsumexp. The config's `bwd_` keys, if any, tile the backward (their
        defaults otherwise)."""
        spec = self.match(group)
        if spec is None or flash_backward_unsupported(spec) is not None or spec.group.graph is not group.graph:
            return None  # (library attention: differentiated as JAX does it, by cuDNN's backward or the XLA path's)
        pair = self.lowering_module(backend, "attention_vjp")
        return pair.vjp_rule(group, spec, {**self.defaults, **config}, interpret=interpret)

    def timing_inputs(self, group: Group, spec: AttentionSpec) -> dict[int, int]:
        """Key lengths at the full length (`attention_masks.bound_inputs`), as the program's values they stand for."""
        return timing_inputs(spec)

    def facts(self, group: Group, spec: AttentionSpec) -> dict:
        """What search_spaces/attention[.<backend>].toml's constraints read."""
        return {"Lq": spec.Lq, "Lk": spec.Lk, "D": next_pow2(spec.D), "Dv": next_pow2(spec.Dv), "itemsize": spec.dot_dtype1.itemsize,
                "smem_bytes": H200.smem_bytes}

    def model_time_ms(self, spec: AttentionSpec, config: dict, model: GPUModel = H200) -> float:
        """Flops of both dots over the visited blocks at an efficiency that grows with tile size; K/V re-read per q block.

        A Mosaic GPU config (`config["backend"] == "mosaic_gpu"`: compute_wgs warpgroups of block_q rows per CTA,
        block_kv keys per step) runs at attention_mgpu's measured share of the peak (653 of ~790 TFLOP/s on an H100 at
        D128)."""
        low = spec.dot_dtype1 != np.dtype("float32")
        if config.get("backend") == "mosaic_gpu":
            bq, bk = int(config.get("compute_wgs", 2)) * int(config["block_q"]), int(config["block_kv"])
            eff = 0.8 * min(1.0, bq * bk / (128 * 128)) ** 0.3 * min(1.0, int(config["max_concurrent_steps"]) / 2) ** 0.2
        else:
            bq, bk, warps = int(config["block_q"]), int(config["block_k"]), int(config["num_warps"])
            eff = 0.55 * min(1.0, bq * bk / (128 * 64)) ** 0.3 * (1.0 if bq * bk <= 64 * 32 * warps * 2 else 0.6)
        frac = live_fraction(spec, bq, bk)
        flops = 2.0 * spec.batch * spec.Lq * spec.Lk * (spec.D + spec.Dv) * frac
        per_q = spec.Lk * (spec.D + spec.Dv) * spec.dot_dtype1.itemsize * frac
        bytes_moved = spec.batch * cdiv(spec.Lq, bq) * per_q + sum(a.nbytes for a in spec.group.input_avals()) + sum(
            a.nbytes for a in spec.group.output_avals())
        programs = spec.batch * cdiv(spec.Lq, bq)
        work = costmodel.kernel_time_ms(bytes_moved, flops / eff, model, low) - 1e3 * model.launch_s
        return work * max(1.0, 132 / max(1, programs)) ** 0.5 + 1e3 * model.launch_s  # fewer programs than SMs idle some


def live_fraction(spec: AttentionSpec, bq: int, bk: int) -> float:
    """The share of [q-block, k-block] pairs the kernel visits."""
    r = block_ranges(spec, bq, bk)
    if r is None:
        return 1.0
    return float((r[:, 3] - r[:, 0]).sum()) / (len(r) * cdiv(spec.Lk, bk))


TEMPLATE = AttentionTemplate()
match, default_config, space, model_time_ms, build = (TEMPLATE.match, TEMPLATE.default_config, TEMPLATE.space,
                                                      TEMPLATE.model_time_ms, TEMPLATE.build)


# ---------------------------------------------------------------------------
# Reverse mode: the flash pair (forward emitting the row logsumexp, backward kernels re-evaluating the scores).
def flash_backward_unsupported(spec: AttentionSpec, side_gradients: bool = True) -> str | None:
    """Why the flash backward cannot differentiate this group (None: it can).

    It needs the softmax itself (`exp(y - max) / sum`, the division directly by the sum, which the identity
    rowsum(dP * P) = rowsum(dO * O) rests on) and, where a floating-point side input's gradient may be read
    (`side_gradients`: a custom VJP must return one), no such input: a bias's gradient is not generated, so such
    groups keep the recompute rule (XLA). A gradient program's pair knows which cotangents it computes."""
    if spec.combine.name != "div" or not spec.e_first:
        return "the normalisation is not a division by the row sum"
    if any(op_class(nd.name) not in (OpClass.BROADCAST, OpClass.LAYOUT) and nd.name != "convert_element_type" for nd in spec.row_l):
        return "work on the row sum before the division"
    if side_gradients and float_side_inputs(spec):
        return "a floating-point side input (its gradient is not generated)"
    return None


def float_side_inputs(spec: AttentionSpec) -> list[int]:
    """The score work's floating-point inputs besides q, k and v (a bias): the flash backward generates no gradient
    for them."""
    g, qkv = spec.group.graph, {spec.q.value, spec.k.value, spec.v.value}
    return [v for v in spec.tile.group.inputs
            if v not in qkv and v != spec.dot1.outputs[0] and jnp.issubdtype(g.avals[v].dtype, jnp.inexact)]


def _dot_roles(spec: AttentionSpec) -> dict[int, list]:
    """The roles of the axes of each dot operand as it enters its dot (after the broadcasts and reshapes):
    a score axis (batch), "s" (sequence), "d" (head dim) or None (a unit axis) -- keyed by "q", "k", "v"."""
    g = spec.group.graph
    S, osh = spec.score_shape, g.avals[spec.dot1.outputs[0]].shape
    nu_s, nu_o = [d for d in range(len(S)) if S[d] != 1], [d for d in range(len(osh)) if osh[d] != 1]
    seed: list = [None] * len(osh)
    for do, ds in zip(nu_o, nu_s):
        seed[do] = ds
    (lc, rc), (lb, rb) = spec.dot1.params["dimension_numbers"]
    nb1 = len(lb)

    def free_axes(shape, batch, contract) -> list[int]:
        return [d for d in range(len(shape)) if d not in batch and d not in contract]

    def roles(shape, batch, contract, first_out: int) -> list:
        """`first_out`: where the operand's free axes start among the dot's output axes (each free axis is the
        sequence, or a unit axis: JAX's XLA path adds one to the query for the heads' group)."""
        out: list = [None] * len(shape)
        for i, d in enumerate(batch):
            out[d] = seed[i]
        out[contract[0]] = "d"
        for j, free in enumerate(free_axes(shape, batch, contract)):
            out[free] = "s" if seed[first_out + j] is not None else None
        return out

    lhs_shape, rhs_shape = g.aval(spec.dot1.inputs[0]).shape, g.aval(spec.dot1.inputs[1]).shape
    lhs = roles(lhs_shape, lb, lc, nb1)
    rhs = roles(rhs_shape, rb, rc, nb1 + len(free_axes(lhs_shape, lb, lc)))
    q_is_lhs = seed[nb1] == spec.q_axis
    (lc2, rc2), (lb2, rb2) = spec.dot2.params["dimension_numbers"]
    p_idx = 0 if spec.dot2.inputs[0] in spec.tile.axes else 1
    p_axes = spec.tile.axes[spec.dot2.inputs[p_idx]]
    pb, vb, vc = (lb2, rb2, rc2) if p_idx == 0 else (rb2, lb2, lc2)
    v_shape = g.aval(spec.dot2.inputs[1 - p_idx]).shape
    v_roles: list = [None] * len(v_shape)
    for i, d in enumerate(vb):
        v_roles[d] = p_axes[pb[i]]
    v_roles[vc[0]] = "s"
    v_roles[next(d for d in range(len(v_shape)) if d not in vb and d != vc[0])] = "d"
    return {"q": lhs if q_is_lhs else rhs, "k": rhs if q_is_lhs else lhs, "v": v_roles,
            "atoms": {"q": spec.dot1.inputs[0 if q_is_lhs else 1], "k": spec.dot1.inputs[1 if q_is_lhs else 0],
                      "v": spec.dot2.inputs[1 - p_idx]}}


def _to_operand(spec: AttentionSpec, x: jax.Array, roles: list, shape: tuple) -> jax.Array:
    """A [batch, L, D] gradient laid out as the dot operand with `roles` and `shape`."""
    bsizes = [spec.score_shape[a] for a in spec.batch_axes]
    x = jnp.reshape(x, (*bsizes, x.shape[1], x.shape[2]))
    names = list(spec.batch_axes) + ["s", "d"]
    kept = [r for r in roles if r is not None]
    x = jnp.sum(x, axis=tuple(i for i, n in enumerate(names) if n not in kept)) if set(names) - set(kept) else x
    names = [n for n in names if n in kept]
    return jnp.reshape(jnp.transpose(x, [names.index(r) for r in kept]), shape)


def _through_chain(spec: AttentionSpec, atom: int, src_value: jax.Array, grad_atom: jax.Array) -> jax.Array:
    """The cotangent of a group input from that of the dot operand it becomes: the VJP of the broadcasts and
    reshapes between them (GQA's repeated heads are summed here)."""
    from ..graph import bind_node

    g = spec.group.graph
    chain = [g.node_index[i] for i in reversed(_chain_nodes(spec.group, atom))]
    if not chain:
        return grad_atom

    def f(x):
        for nd in chain:
            (x,) = bind_node(nd, [x])
        return x

    _, pull = jax.vjp(f, src_value)
    return pull(grad_atom.astype(g.avals[atom].dtype))[0]


