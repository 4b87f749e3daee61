"""A dot operand's affine prologue folded around the GEMM: a layer norm or an RMS norm feeding a matmul, with no
work added to the mainloop.

The elementwise half of a normalisation over K before a GEMM, `((x - mean) * rstd) * gamma + beta` then `@ W`, is
work on the A operand whose factors are constant along K (mean and rstd: one per row) or along M (gamma and beta:
one per column of A). Such a prologue is affine in x, and the contraction commutes with it:

    (qk ⊙ (pm ⊙ x + Σ u_i ⊗ v_i) + Σ s_j ⊗ t_j) @ W  =  pm ⊙ (x @ W') + Σ u_i ⊗ (v_i @ W') + Σ s_j ⊗ (t_j @ W),
    W' = qk ⊙ W (rows of W scaled),

so the kernel runs its GEMM on x itself against W' (made by XLA before the kernel: K x N elements, not M x K) and
the rest is a row scale and rank-one terms in the epilogue (`MatmulSpec` of a folded group: row vectors [M, 1]
and column vectors [N], which the epilogue already reads). XLA's normalised [M, K] operand is never written nor
read back; the row statistics stay XLA's (a reduction over x, which it fuses with x's producer). Normalising the A
tile on its way to the tensor cores instead would cost every K step register traffic and issue slots, once per
N / block_n output tiles; the fold costs the mainloop nothing.

Numerics: the terms added before the first factor along K (the mean's) meet the rounded W' itself (their dot with
W' in float32), so they cancel against x's share of the product as the centred operand would: what is left is W''s
rounding, of the size of XLA's own rounding of the normalised operand to the dot's dtype. x must be exact in the
dot's dtype (the operand's dtype, or an upcast of a value of it), else NoMatch; the numerics check of every trial
judges the rest.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..graph import Graph, Group, Node, bind_node, capture, read_atom
from ..ops import OpClass, op_class, widening
from .matmul import TEMPLATE, MatmulSpec
from .tiling import NoMatch

#: Elementwise primitives that keep a value affine in x when one operand is x's affine value.
AFFINE_OPS = ("add", "sub", "mul", "div", "neg", "convert_element_type", "copy")


@dataclass(frozen=True)
class PrologueFold:
    """A matmul group with its A prologue folded: `spec` is the folded group's (a graph of its own, x @ W' with the
    row scale and the rank-one terms in its epilogue); `prepare` maps the original group's inputs (in
    `group.inputs` order) to the folded group's (XLA's work before the kernel: W', the vectors)."""

    spec: MatmulSpec
    prepare: Callable[..., list]
    outputs: tuple[int, ...]  # the folded kernel's output positions of the original group's outputs, in order

    def around(self, kernel: Callable[..., Any]) -> Callable[..., Any]:
        """The original group's function from the folded group's kernel."""
        def run(*ins: Any) -> list:
            outs = kernel(*self.prepare(*ins))
            outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
            return [outs[i] for i in self.outputs]
        return run


def fold(spec: MatmulSpec) -> PrologueFold:
    """`spec`'s A prologue folded around its GEMM; NoMatch (the reason) where it is not affine in one operand with
    factors along M or K, or where the operand is not exact in the dot's dtype."""
    if spec.b in spec.pro or spec.a not in spec.pro:
        raise NoMatch("only a prologue of the A operand folds")
    if spec.a_km or spec.batch > 1 or spec.dot2 is not None:
        raise NoMatch("a folded prologue needs a plain [..., K] A operand")
    g = spec.group.graph
    pro_nodes = sorted(spec.pro[spec.a][0], key=lambda nd: nd.id)
    pro_ids = {nd.id for nd in pro_nodes}
    dot = spec.dot
    b_dtype = np.dtype(g.avals[spec.b].dtype)
    pro_inputs = [v for v in spec.group.inputs if any(v in nd.inputs for nd in pro_nodes)]
    epi_nodes = [nd for nd in spec.group.nodes if nd.id not in pro_ids and nd.id != dot.id]
    epi_inputs = [v for v in spec.group.inputs if any(v in nd.inputs for nd in epi_nodes)]
    if spec.b in epi_inputs or spec.b in pro_inputs:
        raise NoMatch("the dot's B is read again inside the group")
    shape = tuple(g.avals[spec.a].shape)
    const_axes = {v: _constant_axes(g, v, len(shape)) for v in pro_inputs}
    full = [v for v in pro_inputs if tuple(g.avals[v].shape) == shape and not const_axes[v]]
    if len(full) != 1:
        raise NoMatch(f"the prologue reads {len(full)} full operands (one folds: x)")
    (x_v,) = full
    x_cast = _exact_source(g, x_v, b_dtype)
    layout: list[str] = []  # set by the first evaluation: the prepared vectors' kinds

    def prepare(*ins: Any) -> list:
        env: dict[int, Any] = {}
        for v, arr in zip(spec.group.inputs, ins):
            if v == x_v:
                env[v] = _Affine(arr.astype(x_cast))
            elif v in const_axes:
                env[v] = arr[tuple(slice(0, 1) if d in const_axes[v] else slice(None) for d in range(arr.ndim))]
        for nd in pro_nodes:
            env[nd.outputs[0]] = _step(nd, [read_atom(env, a) for a in nd.inputs], shape)
        a = env[spec.a]
        if not isinstance(a, _Affine):
            raise NoMatch("the A operand does not depend on x")
        w_prime, vecs, kinds = _vectors(a, ins[spec.group.inputs.index(spec.b)], spec.b_nk, shape)
        layout[:] = kinds
        return [a.x, w_prime, *vecs, *[ins[spec.group.inputs.index(v)] for v in epi_inputs]]

    structs = [jax.ShapeDtypeStruct(g.avals[v].shape, g.avals[v].dtype) for v in spec.group.inputs]
    prepared = jax.eval_shape(prepare, *structs)
    folded_fn = _folded(spec, epi_nodes, epi_inputs, list(layout))
    fg = capture(folded_fn, *prepared)
    fgroup = Group.of(fg, [nd.id for nd in fg.nodes])
    fspec = TEMPLATE.match(fgroup)
    if fspec is None or fspec.pro:
        raise NoMatch("the folded group is no plain matmul")
    pos = {v: i for i, v in enumerate(fg.inputs)}
    order = [pos[v] for v in fgroup.inputs]
    if any(not isinstance(o, int) or o not in fgroup.outputs for o in fg.outputs):
        raise NoMatch("an output of the folded group is not made by it")
    outputs = tuple(fgroup.outputs.index(o) for o in fg.outputs)

    def prepare_in_order(*ins: Any) -> list:
        args = prepare(*ins)
        return [args[i] for i in order]

    return PrologueFold(fspec, prepare_in_order, outputs)


# ---------------------------------------------------------------------------
# x's affine value, evaluated on the call's arrays (vectors kept at their broadcast shape: size 1 along the axes
# they are constant on).
@dataclass
class _Affine:
    """qk ⊙ (pm ⊙ x + Σ inner) + Σ outer, each term an (m, k) pair: m of shape rows + (1,) or None (1), k of shape
    (1, ..., K) or None (1)."""

    x: Any
    pm: Any = None
    qk: Any = None
    inner: list = field(default_factory=list)
    outer: list = field(default_factory=list)

    def scaled(self, v: Any, along_k: bool) -> "_Affine":
        if along_k:
            return _Affine(self.x, self.pm, _mul(self.qk, v), list(self.inner), [(m, _mul(k, v)) for m, k in self.outer])
        return _Affine(self.x, _mul(self.pm, v), self.qk, [(_mul(m, v), k) for m, k in self.inner],
                       [(_mul(m, v), k) for m, k in self.outer])

    def plus(self, v: Any, along_k: bool) -> "_Affine":
        term = (None, v) if along_k else (v, None)
        if self.qk is None:
            return _Affine(self.x, self.pm, self.qk, self.inner + [term], list(self.outer))
        return _Affine(self.x, self.pm, self.qk, list(self.inner), self.outer + [term])


def _mul(a: Any, b: Any) -> Any:
    return b if a is None else a * b


def _minus_one(rank: int) -> Any:
    return jnp.full((1,) * rank, -1.0, jnp.float32)


def _along_k(v: Any, shape: tuple[int, ...]) -> bool:
    """Whether a vector is constant along M (one value per column of A) rather than along K; NoMatch where it is
    neither (a full [M, K] value besides x)."""
    vs = tuple(v.shape)
    if len(vs) != len(shape):
        raise NoMatch(f"a vector of rank {len(vs)} beside an operand of rank {len(shape)}")
    if vs[-1] == 1:
        return False
    if all(d == 1 for d in vs[:-1]):
        return True
    raise NoMatch(f"a value {vs} that is neither one per row nor one per column of the operand")


def _step(nd: Node, ins: list, shape: tuple[int, ...]) -> Any:
    """One prologue equation on vectors (run as it is, on their broadcast shapes) or on x's affine value."""
    aff = [a for a in ins if isinstance(a, _Affine)]
    if not aff:
        arrays = [a for a in ins if hasattr(a, "shape")]
        if nd.name == "broadcast_in_dim":
            (a,) = arrays
            bd = tuple(nd.params["broadcast_dimensions"])
            out = tuple(a.shape[bd.index(d)] if d in bd else 1 for d in range(len(nd.params["shape"])))
            return lax.broadcast_in_dim(a, out, bd)
        if op_class(nd.name) is not OpClass.ELEMENTWISE:
            raise NoMatch(f"{nd.name} on a prologue vector")
        common = np.broadcast_shapes(*[tuple(a.shape) for a in arrays])
        (out,) = bind_node(nd, [jnp.broadcast_to(a, common) if hasattr(a, "shape") else a for a in ins])
        return out
    if nd.name not in AFFINE_OPS or len(aff) != 1:
        raise NoMatch(f"{nd.name} of x: the prologue is not affine in x")
    (a,) = aff
    if nd.name in ("convert_element_type", "copy"):
        return a  # (a rounding of the normalised operand XLA makes and the fold does not)
    if nd.name == "neg":
        return a.scaled(_minus_one(len(shape)), False)
    other = ins[1] if ins[0] is a else ins[0]
    o = (other if hasattr(other, "shape") else jnp.asarray(other)).astype(jnp.float32)
    o = o.reshape((1,) * len(shape)) if o.ndim == 0 else o
    k = _along_k(o, shape)
    if nd.name == "add":
        return a.plus(o, k)
    if nd.name == "sub":
        return a.plus(-o, k) if ins[0] is a else a.scaled(_minus_one(len(shape)), False).plus(o, k)
    if nd.name == "mul":
        return a.scaled(o, k)
    if ins[0] is a:  # div
        return a.scaled(1.0 / o, k)
    raise NoMatch("x divides a value: the prologue is not affine in x")


def _vectors(a: _Affine, w: Any, b_nk: bool, shape: tuple[int, ...]) -> tuple[Any, list, list[str]]:
    """W' (rows of W scaled by qk, in W's dtype), the folded epilogue's vectors and their kinds, in order: "scale"
    the row scale pm ([*rows, 1]), "term" a row vector and a column vector ([N]) per rank-one term, "bias" the terms
    constant along M, summed ([N])."""
    rows = shape[:-1] + (1,)
    w_kn = (w.T if b_nk else w).astype(jnp.float32)
    wq = w if a.qk is None else _scale_rows(w, a.qk, b_nk).astype(w.dtype)  # W' rounded, as the kernel reads it
    wq_kn = (wq.T if b_nk else wq).astype(jnp.float32)

    def kdot(k, mat):  # (a float32 sum over K, not a dot: XLA fuses it with W''s scaling into one pass over W)
        return mat.sum(0) if k is None else (k.reshape(-1, 1).astype(jnp.float32) * mat).sum(0)

    vecs, kinds, bias = [], [], None
    if a.pm is not None:
        vecs.append(jnp.broadcast_to(a.pm, rows).astype(jnp.float32))
        kinds.append("scale")
    for terms, mat in ((a.inner, wq_kn), (a.outer, w_kn)):
        for m, k in terms:
            col = kdot(k, mat)
            if m is not None and m.shape[:-1] != (1,) * (len(shape) - 1):
                vecs += [jnp.broadcast_to(m, rows).astype(jnp.float32), col]
                kinds.append("term")
                continue
            col = col if m is None else m.reshape(()) * col
            bias = col if bias is None else bias + col
    if bias is not None:
        vecs.append(bias)
        kinds.append("bias")
    return wq, vecs, kinds


def _scale_rows(w: Any, qk: Any, b_nk: bool) -> Any:
    """W' = qk ⊙ W along K, in float32 (W [K, N], or [N, K] where `b_nk`)."""
    q = qk.reshape(-1).astype(jnp.float32)
    w32 = w.astype(jnp.float32)
    return w32 * q[None, :] if b_nk else w32 * q[:, None]


def _folded(spec: MatmulSpec, epi_nodes: list[Node], epi_inputs: list[int], kinds: list[str]) -> Callable:
    """The folded group as a function of (x, W', the vectors, the epilogue's inputs): the GEMM in float32, the row
    scale and the rank-one terms, the product in the dot's dtype, then the group's own epilogue."""
    g = spec.group.graph
    dot = spec.dot
    prod_dtype = g.avals[dot.outputs[0]].dtype
    n_vec = sum(2 if kind == "term" else 1 for kind in kinds)

    def folded(x, w, *rest):
        vecs, epi = rest[:n_vec], rest[n_vec:]
        pre = lax.dot_general(x, w, dot.params["dimension_numbers"], precision=dot.params.get("precision"),
                              preferred_element_type=jnp.float32)
        i = 0
        for kind in kinds:
            if kind == "scale":
                pre, i = pre * vecs[i], i + 1
            elif kind == "term":
                pre, i = pre + vecs[i] * vecs[i + 1], i + 2
            else:
                pre, i = pre + vecs[i], i + 1
        env: dict[int, Any] = dict(zip(epi_inputs, epi))
        env[dot.outputs[0]] = pre.astype(prod_dtype)
        for nd in epi_nodes:
            env.update(zip(nd.outputs, bind_node(nd, [read_atom(env, a) for a in nd.inputs])))
        return [env[v] for v in spec.group.outputs]

    return folded


# ---------------------------------------------------------------------------
# What the program knows about the prologue's inputs.
def _constant_axes(g: Graph, v: int, rank: int, depth: int = 0) -> frozenset[int]:
    """The axes along which value `v` (of the operand's rank) is constant by the way it is made: a broadcast's new
    axes, and what elementwise work on broadcasts keeps."""
    if len(g.avals[v].shape) != rank:
        return frozenset()
    p = g.producer.get(v)
    if p is None or depth > 8:
        return frozenset()
    nd = g.node_index[p]
    if nd.name == "broadcast_in_dim":
        (src,) = [a for a in nd.inputs if isinstance(a, int)] or [None]
        bd = tuple(nd.params["broadcast_dimensions"])
        src_shape = g.avals[src].shape if src is not None else ()
        out = g.avals[v].shape
        inner = _constant_axes(g, src, len(src_shape), depth + 1) if src is not None else frozenset()
        return frozenset(d for d in range(rank)
                         if d not in bd or (src_shape[bd.index(d)] == 1 and out[d] > 1) or bd.index(d) in inner)
    if op_class(nd.name) is OpClass.ELEMENTWISE:
        axes = [_constant_axes(g, a, rank, depth + 1) for a in nd.inputs if isinstance(a, int)]
        return frozenset.intersection(*axes) if axes else frozenset(range(rank))
    return frozenset()


def _exact_source(g: Graph, v: int, dtype: np.dtype) -> np.dtype:
    """The dtype x is read in by the folded GEMM: the dot's own, where x holds values exact in it (x of that dtype,
    or an upcast of a value of it: XLA then cancels the cast pair); NoMatch otherwise."""
    if np.dtype(g.avals[v].dtype) == dtype:
        return dtype
    p = g.producer.get(v)
    nd = g.node_index.get(p) if p is not None else None
    if nd is not None and nd.name == "convert_element_type" and isinstance(nd.inputs[0], int) \
            and np.dtype(g.avals[nd.inputs[0]].dtype) == dtype and widening(dtype, g.avals[v].dtype):
        return dtype
    raise NoMatch(f"x ({g.avals[v]}) is not exact in the dot's dtype {dtype}")
