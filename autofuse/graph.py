"""Capture a JAX function into a flat `Graph` and fingerprint it.

All access to `jax.extend.core` lives in this module, so that drift in JAX's
jaxpr API is fixed in one place. Nested `jit`/`pjit`, `closed_call`,
`custom_jvp_call` (primal) and `jax.checkpoint` (`remat2`, its backward behind
the barrier its lowering uses) are inlined; control flow (`cond`, `while`,
`scan`) and everything else stays one opaque node.
"""
from __future__ import annotations

import graphlib
import hashlib
import inspect
import itertools
import math
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Sequence

import jax
import jax.extend.core as jcore
import numpy as np

from .ops import IDENTITY_OPS, OpClass, op_class

# Primitives whose body is inlined into the graph, with the parameter holding it.
_INLINE_PARAM = {
    "pjit": "jaxpr",
    "jit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "remat2": "jaxpr",  # `jax.checkpoint`: its body inlined behind the barrier its lowering puts there (`_remat_inputs`)
}


@dataclass(frozen=True)
class Aval:
    """Shape and dtype of a value (a hashable, JAX-independent record)."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def size(self) -> int:
        return math.prod(self.shape)  # plain ints: np.prod here was 40% of candidate enumeration

    @property
    def nbytes(self) -> int:
        return self.size * np.dtype(self.dtype).itemsize

    def __str__(self) -> str:
        return f"{np.dtype(self.dtype).name}{list(self.shape)}"


@dataclass(frozen=True)
class Lit:
    """A literal scalar operand of a node."""

    value: Any
    aval: Aval


Atom = int | Lit  # an int names a value of the graph


@dataclass
class Node:
    """One equation: a primitive applied to atoms, producing values."""

    id: int
    primitive: Any  # jax.extend.core.Primitive
    params: dict
    inputs: tuple[Atom, ...]
    outputs: tuple[int, ...]

    @property
    def name(self) -> str:
        return self.primitive.name


@dataclass
class Graph:
    """A program as a DAG: nodes in topological order, values with avals."""

    nodes: list[Node]
    avals: dict[int, Aval]
    inputs: list[int]
    outputs: list[Atom]
    consts: dict[int, np.ndarray]
    in_tree: Any
    out_tree: Any
    static_repr: str = ""
    extra: dict = field(default_factory=dict)

    # ---- structure ---------------------------------------------------------
    @cached_property
    def producer(self) -> dict[int, int]:
        """value id -> id of the node that produces it."""
        return {v: n.id for n in self.nodes for v in n.outputs}

    @cached_property
    def consumers(self) -> dict[int, list[int]]:
        """value id -> ids of nodes reading it (in order, no duplicates)."""
        out: dict[int, list[int]] = {}
        for n in self.nodes:
            for a in n.inputs:
                if isinstance(a, int):
                    lst = out.setdefault(a, [])
                    if not lst or lst[-1] != n.id:
                        lst.append(n.id)
        return out

    @cached_property
    def node_index(self) -> dict[int, Node]:
        return {n.id: n for n in self.nodes}

    @cached_property
    def output_values(self) -> frozenset[int]:
        return frozenset(a for a in self.outputs if isinstance(a, int))

    def preds(self, node_id: int) -> list[int]:
        """Ids of the nodes whose outputs `node_id` reads."""
        prod = self.producer
        return sorted({prod[a] for a in self.node_index[node_id].inputs if isinstance(a, int) and a in prod})

    def succs(self, node_id: int) -> list[int]:
        cons = self.consumers
        return sorted({c for v in self.node_index[node_id].outputs for c in cons.get(v, ())})

    def aval(self, atom: Atom) -> Aval:
        return atom.aval if isinstance(atom, Lit) else self.avals[atom]

    # ---- evaluation --------------------------------------------------------
    def evaluate(self, flat_args: Sequence[Any], override: Callable[[Node, list], list | None] | None = None) -> list:
        """Run the graph with plain JAX primitives (the XLA path)."""
        env: dict[int, Any] = dict(zip(self.inputs, flat_args))
        env.update(self.consts)
        for node in self.nodes:
            ins = [read_atom(env, a) for a in node.inputs]
            outs = override(node, ins) if override else None
            if outs is None:
                outs = bind_node(node, ins)
            env.update(zip(node.outputs, outs))
        return [read_atom(env, a) for a in self.outputs]

    # ---- identity ----------------------------------------------------------
    @cached_property
    def fingerprint(self) -> str:
        """Stable hash of ops, params, shapes, dtypes, constants and pytree structure."""
        h = hashlib.sha256()
        h.update(f"in_tree={self.in_tree};out_tree={self.out_tree};static={self.static_repr}\n".encode())
        h.update(("inputs=" + ",".join(str(self.avals[v]) for v in self.inputs) + "\n").encode())
        for v in sorted(self.consts):
            c = np.asarray(self.consts[v])
            h.update(f"const {v} {c.dtype} {c.shape} ".encode() + hashlib.sha256(c.tobytes()).digest() + b"\n")
        for n in self.nodes:
            h.update(node_text(n, self.avals).encode() + b"\n")
        h.update(("outputs=" + ",".join(atom_text(a) for a in self.outputs)).encode())
        return h.hexdigest()[:32]

    @cached_property
    def structure(self) -> str:
        """Stable hash of the program with its sizes abstracted: the fingerprint's ops, params, dtypes, ranks,
        constants' dtypes and ranks and pytree structure, without the sizes of any array (shapes, and the
        shape-valued params of broadcasts, reshapes, iotas, slices). Programs that differ only in their input sizes
        (a batch, a sequence length) share it, and their nodes correspond one to one by id."""
        h = hashlib.sha256()
        h.update(f"in_tree={self.in_tree};out_tree={self.out_tree};static={self.static_repr}\n".encode())
        h.update(("inputs=" + ",".join(_rank_text(self.avals[v]) for v in self.inputs) + "\n").encode())
        for v in sorted(self.consts):
            c = np.asarray(self.consts[v])
            h.update(f"const {v} {c.dtype} {c.ndim}\n".encode())
        for n in self.nodes:
            h.update(structure_text(n, self.avals).encode() + b"\n")
        h.update(("outputs=" + ",".join(atom_text(a) for a in self.outputs)).encode())
        return h.hexdigest()[:32]

    def signature(self) -> dict:
        """Input/output shapes and dtypes, for people and for the store."""
        sig = {
            "inputs": [str(self.avals[v]) for v in self.inputs],
            "outputs": [str(self.aval(a)) for a in self.outputs],
        }
        if self.static_repr not in ("", "[][]"):  # the static arguments' values, where there are any
            sig["static"] = self.static_repr
        return sig


# ---------------------------------------------------------------------------
# Canonical text, shared by graph and group fingerprints.
_ADDR = re.compile(r" at 0x[0-9a-fA-F]+")


def atom_text(a: Atom) -> str:
    if isinstance(a, Lit):
        return f"lit({np.asarray(a.value).item()!r}:{a.aval})"
    return f"%{a}"


def _param_text(v: Any) -> str:
    if isinstance(v, (jcore.ClosedJaxpr, jcore.Jaxpr)):
        return _ADDR.sub("", str(v))
    if isinstance(v, np.ndarray) or hasattr(v, "__array__") and hasattr(v, "dtype") and hasattr(v, "shape"):
        arr = np.asarray(v)
        return f"array({arr.dtype},{arr.shape},{hashlib.sha256(arr.tobytes()).hexdigest()[:16]})"
    if isinstance(v, (tuple, list)):
        return "(" + ",".join(_param_text(x) for x in v) + ")"
    if callable(v) and not isinstance(v, type):
        return f"<callable {getattr(v, '__name__', type(v).__name__)}>"
    return _ADDR.sub("", repr(v))


def node_text(n: Node, avals: dict[int, Aval], rename: dict[int, int] | None = None) -> str:
    """Canonical text of a node; `rename` maps value ids to local numbers."""
    def ref(a: Atom) -> str:
        if isinstance(a, Lit) or rename is None:
            return atom_text(a)
        return f"%{rename.get(a, a)}"

    params = ";".join(f"{k}={_param_text(n.params[k])}" for k in sorted(n.params))
    ins = ",".join(ref(a) for a in n.inputs)
    outs = ",".join(f"{ref(v)}:{avals[v]}" for v in n.outputs)
    return f"{outs} = {n.name}[{params}]({ins})"


# Params whose values are sizes (abstracted in `structure_text`); axes, permutations and dimension numbers are structure.
SIZE_PARAMS = frozenset({"shape", "new_sizes", "sizes", "slice_sizes", "start_indices", "limit_indices", "strides",
                         "padding_config", "split_sizes"})
_SIZES = re.compile(r"\b([a-z]+[0-9]*)\[[0-9, ]*\]")  # f32[8,128] in a nested jaxpr's text


def _rank_text(a: Aval) -> str:
    return f"{np.dtype(a.dtype).name}[{len(a.shape)}d]"


def structure_text(n: Node, avals: dict[int, Aval]) -> str:
    """`node_text` with sizes abstracted: values as dtype and rank, size-valued params as `?`."""
    def param(k: str, v: Any) -> str:
        if k in SIZE_PARAMS:
            return re.sub(r"-?[0-9]+", "?", _param_text(v))
        return _SIZES.sub(lambda m: f"{m.group(1)}[?]", _param_text(v))

    params = ";".join(f"{k}={param(k, n.params[k])}" for k in sorted(n.params))
    ins = ",".join(atom_text(a) for a in n.inputs)
    outs = ",".join(f"%{v}:{_rank_text(avals[v])}" for v in n.outputs)
    return f"{outs} = {n.name}[{params}]({ins})"


def read_atom(env: dict[int, Any], a: Atom) -> Any:
    return a.value if isinstance(a, Lit) else env[a]


def bind_node(node: Node, ins: Sequence[Any]) -> list:
    """Re-run one equation the way `jax.core.eval_jaxpr` does."""
    bp = node.primitive.get_bind_params(node.params)
    subfuns, bind_params = bp if isinstance(bp, tuple) else ((), bp)  # older JAX returned (subfuns, params)
    out = node.primitive.bind(*subfuns, *ins, **bind_params)
    return list(out) if node.primitive.multiple_results else [out]


# ---------------------------------------------------------------------------
# Capture.
def _to_aval(a: Any) -> Aval:
    return Aval(tuple(int(d) for d in a.shape), np.dtype(a.dtype))


class _Builder:
    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.avals: dict[int, Aval] = {}
        self.consts: dict[int, np.ndarray] = {}

    def new_value(self, aval: Any) -> int:
        vid = len(self.avals)
        self.avals[vid] = _to_aval(aval)
        return vid

    def atom(self, env: dict, x: Any) -> Atom:
        if isinstance(x, jcore.Literal):
            return Lit(x.val, _to_aval(x.aval))
        return env[x]

    def add_consts(self, env: dict, constvars: Sequence[Any], consts: Sequence[Any]) -> None:
        for var, c in zip(constvars, consts):
            vid = self.new_value(var.aval)
            self.consts[vid] = np.asarray(c)
            env[var] = vid

    def walk(self, jaxpr: Any, in_atoms: Sequence[Atom], env: dict | None = None) -> list[Atom]:
        env = {} if env is None else env
        for var, a in zip(jaxpr.invars, in_atoms):
            env[var] = a
        for eqn in jaxpr.eqns:
            ins = [self.atom(env, x) for x in eqn.invars]
            key = _INLINE_PARAM.get(eqn.primitive.name)
            inner = eqn.params.get(key) if key else None
            if inner is not None:
                outs = self._inline(inner, ins, eqn)
            else:
                outs = [self.new_value(v.aval) for v in eqn.outvars]
                prim, params = _as_reshape(eqn) or (eqn.primitive, dict(eqn.params))
                self.nodes.append(Node(len(self.nodes), prim, params, tuple(ins), tuple(outs)))
            for var, a in zip(eqn.outvars, outs):
                if not isinstance(var, jcore.DropVar):
                    env[var] = a
        return [self.atom(env, x) for x in jaxpr.outvars]

    def _inline(self, inner: Any, ins: list[Atom], eqn: Any) -> list[Atom]:
        sub_env: dict = {}
        if isinstance(inner, jcore.ClosedJaxpr):
            self.add_consts(sub_env, inner.jaxpr.constvars, inner.consts)
            inner = inner.jaxpr
        if eqn.primitive.name == "custom_jvp_call":
            ins = ins[: len(inner.invars)] if len(ins) > len(inner.invars) else ins
        if eqn.primitive.name == "remat2":
            ins = self._remat_inputs(ins, eqn.params)
        return self.walk(inner, ins, sub_env)

    def _remat_inputs(self, ins: list[Atom], params: dict) -> list[Atom]:
        """A `jax.checkpoint` body's inputs as its lowering gives them: in the backward (`differentiated`) those
        marked `prevent_cse` pass together through one `optimization_barrier`, so that XLA neither merges the
        forward's recomputation with the forward itself (CSE) nor runs it before the cotangents it waits for arrive,
        which is what keeps the memory `jax.checkpoint` saves. Inlined without it, the recomputation would be
        merged away and the residuals kept after all; inlined with it, the backward's GEMMs and their epilogues
        are the graph's to fuse (kept opaque, they were not)."""
        cse = params.get("prevent_cse", True)
        cse = (cse,) * len(ins) if isinstance(cse, bool) else tuple(cse)
        held = [i for i, (a, c) in enumerate(zip(ins, cse)) if c and not isinstance(a, Lit)]
        if not params.get("differentiated") or not held:
            return ins
        outs = [self.new_value(self.avals[ins[i]]) for i in held]
        self.nodes.append(Node(len(self.nodes), jax.lax.optimization_barrier_p, {}, tuple(ins[i] for i in held), tuple(outs)))
        ins = list(ins)
        for i, v in zip(held, outs):
            ins[i] = v
        return ins


def _as_reshape(eqn: Any) -> tuple[Any, dict] | None:
    """A transpose that moves only unit axes (`jax.nn.dot_product_attention`'s XLA path moves its grouped-query axis
    of size 1 so) as the reshape it is, primitive and params: the templates tile reshapes, not transposes."""
    if eqn.primitive.name != "transpose":
        return None
    shape = eqn.invars[0].aval.shape
    moved = [p for p in eqn.params["permutation"] if shape[p] != 1]
    if moved != sorted(moved):
        return None
    out = tuple(int(d) for d in eqn.outvars[0].aval.shape)
    return jax.lax.reshape_p, {"new_sizes": out, "dimensions": None, "sharding": None}


def _split_static(fn: Callable, args: tuple, kwargs: dict, static_argnums: Sequence[int], static_argnames: Sequence[str]):
    """Return (dynamic args, dynamic kwargs, a function of the dynamic ones, repr of statics)."""
    try:
        names = [p.name for p in inspect.signature(fn).parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        names = []
    if static_argnames and not static_argnums:  # like jax.jit: a static name given positionally is static too
        static_argnums = tuple(names.index(n) for n in static_argnames if n in names and names.index(n) < len(args))
    elif static_argnums and not static_argnames:  # and a static position given by keyword
        static_argnames = tuple(names[i] for i in static_argnums if 0 <= i < len(names))
    static_argnums = tuple(i + len(args) if i < 0 else i for i in static_argnums)
    static_pos = {i: args[i] for i in static_argnums if i < len(args)}
    static_kw = {k: v for k, v in kwargs.items() if k in set(static_argnames)}
    dyn_args = tuple(a for i, a in enumerate(args) if i not in static_pos)
    dyn_kwargs = {k: v for k, v in kwargs.items() if k not in static_kw}

    def dyn_fn(d_args: tuple, d_kwargs: dict):
        it = iter(d_args)
        full = [static_pos[i] if i in static_pos else next(it) for i in range(len(args))]
        return fn(*full, **d_kwargs, **static_kw)

    static_repr = repr(sorted(static_pos.items())) + repr(sorted(static_kw.items()))
    return dyn_args, dyn_kwargs, dyn_fn, _ADDR.sub("", static_repr)


def qualified_name(fn: Callable) -> str:
    """``module:qualname`` of a function (through `functools.wraps` and `jax.jit` wrappers): how the store and
    the deploy-time messages name it."""
    inner = getattr(fn, "__wrapped__", fn)
    mod = getattr(inner, "__module__", None) or getattr(fn, "__module__", None) or "?"
    name = getattr(inner, "__qualname__", None) or getattr(inner, "__name__", None) or type(inner).__name__
    return f"{mod}:{name}"


def capture(fn: Callable, *args: Any, static_argnums: Sequence[int] = (), static_argnames: Sequence[str] = (), **kwargs: Any) -> Graph:
    """Trace `fn(*args, **kwargs)` into a `Graph`.

    Arguments are pytrees of arrays or `jax.ShapeDtypeStruct`s; those named in
    `static_argnums`/`static_argnames` are treated as compile-time constants,
    as with `jax.jit`.
    """
    if isinstance(static_argnums, int):
        static_argnums = (static_argnums,)
    if isinstance(static_argnames, str):
        static_argnames = (static_argnames,)
    dyn_args, dyn_kwargs, dyn_fn, static_repr = _split_static(fn, args, kwargs, static_argnums, static_argnames)
    leaves, in_tree = jax.tree_util.tree_flatten((dyn_args, dyn_kwargs))
    specs = [jax.ShapeDtypeStruct(np.shape(x), _leaf_dtype(x)) for x in leaves]
    out_tree_box: list = []

    def flat_fn(*flat):
        d_args, d_kwargs = jax.tree_util.tree_unflatten(in_tree, flat)
        out = dyn_fn(d_args, d_kwargs)
        out_flat, out_tree = jax.tree_util.tree_flatten(out)
        out_tree_box.append(out_tree)
        return out_flat

    closed = jax.make_jaxpr(flat_fn)(*specs)
    b = _Builder()
    env: dict = {}
    b.add_consts(env, closed.jaxpr.constvars, closed.consts)
    in_ids = [b.new_value(v.aval) for v in closed.jaxpr.invars]
    outs = b.walk(closed.jaxpr, in_ids, env)
    return recompute_for_late_readers(Graph(b.nodes, b.avals, in_ids, outs, b.consts, in_tree, out_tree_box[-1], static_repr))


# ---------------------------------------------------------------------------
# Values a gradient program keeps for its backward that its backward can compute again.
#: Nodes one value's recomputation may take (GELU-tanh's residuals are 3-9 from the value its backward reads anyway).
MAX_RECOMPUTED = 16
_CHEAP = (OpClass.ELEMENTWISE, OpClass.BROADCAST)
_BARRIER = (OpClass.CONTRACTION, OpClass.OPAQUE)


def recompute_for_late_readers(graph: Graph) -> Graph:
    """The program with the elementwise values its backward reads computed again there, where what they are
    computed from is kept for the backward anyway (new nodes and value ids; nodes renumbered).

    `jax.grad` of GELU-tanh keeps g = x @ W + b and three more arrays of g's shape made from it (3g², 1 - tanh²,
    (1 + tanh) / 2) for its backward, which reads g too. A fused kernel must write every value a reader outside it
    needs, so the forward's GEMM + GELU group wrote five arrays where XLA's fusions write two and recompute the
    rest beside the backward's reader (GPT-2 medium's step: 4 x 128 MiB more per layer). Here each such value's
    elementwise chain is copied for its late readers, so that the forward's group writes g and GELU(g) only and
    the backward's group (or XLA's fusion) computes the rest from g. A reader is late when at least two GEMMs
    (or opaque calls) lie on a path into it beyond the value's own (the rest of the network, then the dgrad).
    A value is recomputed only where that costs no more reads than it saves: its chain starts from values the
    backward reads anyway (read late themselves), reductions' results (a row's statistics: small), and values
    written anyway (program inputs, values read across a GEMM or by one) of fewer bytes an element together than
    it has (a layer norm's float32 x - mean and (x - mean) * rstd, computed again from its bfloat16 input and the
    row sums: two float32 arrays neither written nor read again for one bfloat16 array read); and where no GEMM or
    opaque node reads the value itself, nor does the program return it (so the forward writes it anyway). Only
    elementwise and broadcast nodes are copied, at most `MAX_RECOMPUTED` per value; decisions use the graph's
    structure and dtypes alone (never sizes), so programs that differ in their sizes keep corresponding node ids.
    A program without such values is returned unchanged."""
    nodes, producer, index = graph.nodes, graph.producer, graph.node_index
    readers = {v: [index[i] for i in ids] for v, ids in graph.consumers.items()}
    kind = {n.id: op_class(n.name) for n in nodes}
    available = [*graph.inputs, *graph.consts]
    level: dict[int, int] = {v: 0 for v in available}  # a value's: the GEMMs and opaque calls on the longest path into it
    depth: dict[int, int] = {}  # a node's: its inputs' highest level
    for n in nodes:
        depth[n.id] = max((level.get(a, 0) for a in n.inputs if isinstance(a, int)), default=0)
        for v in n.outputs:
            level[v] = depth[n.id] + (kind[n.id] in _BARRIER and n.name not in IDENTITY_OPS)
    returned = graph.output_values

    def late(v: int) -> list[Node]:
        return [r for r in readers.get(v, ()) if depth[r.id] >= level[v] + 2]

    def written(v: int) -> bool:  # by any plan: read across a GEMM, or by one (or an opaque node)
        return any(depth[r.id] > level[v] or kind[r.id] in _BARRIER for r in readers.get(v, ()))

    kept: set[int] = {v for v in available if late(v)}  # values the backward reads as stored
    kept |= {v for n in nodes if kind[n.id] is OpClass.REDUCTION for v in n.outputs}  # a row's statistics: small
    written_anyway = {v for v in level if v in available or written(v)}
    chains: dict[int, list[int]] = {}  # a recomputed value -> the node ids its copy evaluates
    for n in nodes:
        for v in n.outputs:
            if not late(v):
                continue
            chain = None
            if (len(n.outputs) == 1 and kind[n.id] in _CHEAP and v not in returned
                    and all(kind[r.id] in _CHEAP for r in readers.get(v, ()))):
                chain = _chain(n, index, producer, kind, kept, written_anyway, chains, graph.avals)
            if chain is None:
                kept.add(v)
            else:
                chains[v] = chain
    if not chains:
        return graph
    avals = dict(graph.avals)
    return Graph(_with_copies(graph, avals, chains, late), avals, graph.inputs, graph.outputs, graph.consts,
                 graph.in_tree, graph.out_tree, graph.static_repr)


def _chain(n: Node, index: dict[int, Node], producer: dict[int, int], kind: dict[int, OpClass], kept: set[int],
           written: set[int], copied: dict[int, list[int]], avals: dict[int, Aval]) -> list[int] | None:
    """The ids of the cheap nodes that compute `n`'s value from kept values, literals and written values of fewer
    bytes an element together than the value (`copied`: values computed again, so no longer written), or None."""
    chain: set[int] = set()
    reads: set[int] = set()  # written values read for the copy that the backward did not read
    stack = [n]
    while stack:
        m = stack.pop()
        if m.id in chain:
            continue
        chain.add(m.id)
        if len(chain) > MAX_RECOMPUTED:
            return None
        for a in m.inputs:
            if isinstance(a, Lit) or a in kept:
                continue
            if a in written and a not in copied:
                reads.add(a)
                continue
            p = index.get(producer.get(a, -1))
            if p is None or kind[p.id] not in _CHEAP or len(p.outputs) != 1:
                return None
            stack.append(p)
    if sum(avals[a].dtype.itemsize for a in reads) >= avals[n.outputs[0]].dtype.itemsize:
        return None
    return sorted(chain)


def _with_copies(graph: Graph, avals: dict[int, Aval], chains: dict[int, list[int]],
                 late: Callable[[int], list[Node]]) -> list[Node]:
    """The graph's nodes with each chain copied (once per node; the copies' values added to `avals`) before the
    first late reader it feeds, the late readers reading the copies, and the originals no one reads any more dropped."""
    index = graph.node_index
    copied = sorted({i for chain in chains.values() for i in chain})
    chain_nodes = set(copied)
    copy_of: dict[int, int] = {}  # original value -> its copy's
    fresh = itertools.count(max(avals) + 1)
    for i in copied:
        for v in index[i].outputs:
            copy_of[v] = next(fresh)
            avals[copy_of[v]] = avals[v]
    copies = {i: Node(-1, index[i].primitive, index[i].params,
                      tuple(copy_of.get(a, a) if isinstance(a, int) else a for a in index[i].inputs),
                      tuple(copy_of[v] for v in index[i].outputs)) for i in copied}
    redirected: dict[int, set[int]] = {}  # late reader id -> the values it reads as copies
    for v in chains:
        for r in late(v):
            redirected.setdefault(r.id, set()).add(v)
    out: list[Node] = []
    placed: set[int] = set()
    for n in graph.nodes:
        if n.id in redirected:
            need = sorted({i for v in redirected[n.id] for i in chains[v]} - placed)
            placed.update(need)
            out.extend(copies[i] for i in need)
            n = Node(n.id, n.primitive, n.params, tuple(copy_of[a] if isinstance(a, int) and a in redirected[n.id] else a
                                                        for a in n.inputs), n.outputs)
        out.append(n)
    # the originals only the late readers read: gone
    count: dict[int, int] = {}
    for n in out:
        for a in dict.fromkeys(a for a in n.inputs if isinstance(a, int)):
            count[a] = count.get(a, 0) + 1
    dead: set[int] = set()
    for n in reversed(out):
        if n.id in chain_nodes and not any(count.get(v, 0) or v in graph.output_values for v in n.outputs):
            dead.add(n.id)
            for a in dict.fromkeys(a for a in n.inputs if isinstance(a, int)):
                count[a] -= 1
    return [Node(k, n.primitive, n.params, n.inputs, n.outputs) for k, n in enumerate(m for m in out if m.id not in dead)]


def _leaf_dtype(x: Any) -> np.dtype:
    if hasattr(x, "dtype"):
        return np.dtype(x.dtype)
    return np.asarray(x).dtype if not isinstance(x, (int, float, bool)) else jax.numpy.asarray(x).dtype


def flatten_args(graph: Graph, fn: Callable, args: tuple, kwargs: dict, static_argnums: Sequence[int] = (), static_argnames: Sequence[str] = ()) -> list:
    """The dynamic leaves of a call of `fn`, in the order of `graph.inputs`."""
    dyn_args, dyn_kwargs, _, _ = _split_static(fn, args, kwargs, static_argnums, static_argnames)
    leaves, tree = jax.tree_util.tree_flatten((dyn_args, dyn_kwargs))
    if tree != graph.in_tree:
        raise ValueError(f"argument structure {tree} does not match the captured {graph.in_tree}")
    return leaves


# ---------------------------------------------------------------------------
# Sub-graphs.
@dataclass(frozen=True, eq=False)
class Group:
    """A set of nodes of a graph, seen as one function of its external inputs.

    `inputs` are the values read from outside (graph inputs, constants or
    other nodes' outputs), in order of first use; `outputs` are the values it
    produces that something outside reads (or that the graph returns).
    """

    graph: Graph
    node_ids: tuple[int, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]

    @staticmethod
    def of(graph: Graph, node_ids: Sequence[int]) -> "Group":
        ids = tuple(sorted(set(node_ids)))
        members = set(ids)
        produced = {v for i in ids for v in graph.node_index[i].outputs}
        inputs: list[int] = []
        for i in ids:
            for a in graph.node_index[i].inputs:
                if isinstance(a, int) and a not in produced and a not in inputs:
                    inputs.append(a)
        cons = graph.consumers
        outs = [
            v
            for i in ids
            for v in graph.node_index[i].outputs
            if v in graph.output_values or any(c not in members for c in cons.get(v, ()))
        ]
        return Group(graph, ids, tuple(inputs), tuple(outs))

    def part(self, node_ids: Sequence[int]) -> "Group":
        """The group of some of this group's nodes, as this group sees it: its outputs are the values this group
        returns or its other nodes read (not every reader in the graph: a group whose nodes other code
        re-evaluates returns less than `Group.of` of its nodes would)."""
        sub = Group.of(self.graph, node_ids)
        rest = {a for n in self.nodes if n.id not in set(sub.node_ids) for a in n.inputs if isinstance(a, int)}
        return Group(self.graph, sub.node_ids, sub.inputs,
                     tuple(v for n in sub.nodes for v in n.outputs if v in self.outputs or v in rest))

    def alone(self) -> "Group":
        """The group on a graph of its own (the group's inputs and outputs its interface, the same value ids), so
        that a pass sees only the group's readers of a value (stage 1 of a pair, whose values stage 2 evaluates
        again, is the only reader of its chain)."""
        g = self.graph
        used = {a for n in self.nodes for a in n.inputs if isinstance(a, int)} | set(self.outputs)
        graph = Graph(list(self.nodes), g.avals, list(self.inputs), list(self.outputs),
                      {v: c for v, c in g.consts.items() if v in used}, None, None)
        return Group(graph, self.node_ids, self.inputs, self.outputs)

    @cached_property
    def nodes(self) -> tuple[Node, ...]:
        """The group's nodes in id order (made once: the templates' matching asks 250k times while enumerating SPLADE's
        small training step)."""
        return tuple(self.graph.node_index[i] for i in self.node_ids)

    @cached_property
    def signature(self) -> str:
        """Fingerprint of the group's own computation (ids renamed locally), for reuse across graphs."""
        rename: dict[int, int] = {v: k for k, v in enumerate(self.inputs)}
        for n in self.nodes:
            for v in n.outputs:
                rename.setdefault(v, len(rename))
        h = hashlib.sha256()
        h.update(",".join(str(self.graph.avals[v]) for v in self.inputs).encode())
        for n in self.nodes:
            h.update(node_text(n, self.graph.avals, rename).encode())
        h.update(",".join(str(rename[v]) for v in self.outputs).encode())
        return h.hexdigest()[:20]

    def evaluate(self, ins: Sequence[Any]) -> list:
        """Run the group with plain JAX primitives (its XLA reference)."""
        env: dict[int, Any] = dict(zip(self.inputs, ins))
        for node in self.nodes:
            env.update(zip(node.outputs, bind_node(node, [read_atom(env, a) for a in node.inputs])))
        return [env[v] for v in self.outputs]

    def input_avals(self) -> list[Aval]:
        return [self.graph.avals[v] for v in self.inputs]

    def output_avals(self) -> list[Aval]:
        return [self.graph.avals[v] for v in self.outputs]


def convex(graph: "Graph", members: set[int]) -> bool:
    """Whether no path leaves `members` and comes back (a forward and its backward in a training step never are:
    the cotangent depends on the output through the rest of the network and the loss; they run in stages)."""
    seen: set[int] = set()
    stack = [c for i in members for c in graph.succs(i) if c not in members]
    while stack:
        i = stack.pop()
        if i in seen:
            continue
        seen.add(i)
        for c in graph.succs(i):
            if c in members:
                return False
            stack.append(c)
    return True


def stage_groups(group: Group, stages: Sequence[Sequence[int]]) -> list[Group]:
    """The stages of a group that runs in stages (each a convex set of its nodes, the group itself need not
    be), as groups of their own: a stage's inputs are the group's inputs that its nodes read, its outputs the
    group's outputs that its nodes make. Values passing between stages inside the group exist in no stage's
    inputs or outputs: the template's stage functions hand them on privately (the executor keeps them)."""
    g = group.graph
    out = []
    for ids in stages:
        ids = tuple(sorted(ids))
        made = {v for i in ids for v in g.node_index[i].outputs}
        read = [a for i in ids for a in g.node_index[i].inputs if isinstance(a, int)]
        ins = tuple(v for v in group.inputs if v in set(read))
        outs = tuple(v for v in group.outputs if v in made)
        out.append(Group(g, ids, ins, outs))
    return out


# ---------------------------------------------------------------------------
# Order of a graph with groups contracted to single units.
Unit = tuple[str, int]  # ("node", node id) or ("group", index into the groups)


def _contracted(graph: Graph, groups: Sequence[frozenset[int]], chains: Sequence[Sequence[int]] = ()) -> dict[Unit, set[Unit]]:
    """Each unit's predecessors in the graph with every group contracted to one unit (graph order kept); each
    chain (group indices: the stages of one staged group) also runs in its order."""
    owner = {i: k for k, grp in enumerate(groups) for i in grp}
    unit = lambda i: ("group", owner[i]) if i in owner else ("node", i)  # noqa: E731
    deps: dict[Unit, set[Unit]] = {}
    for nd in graph.nodes:
        u = unit(nd.id)
        deps.setdefault(u, set()).update(p for p in map(unit, graph.preds(nd.id)) if p != u)
    for chain in chains:
        for a, b in itertools.pairwise(chain):
            deps.setdefault(("group", b), set()).add(("group", a))
    return deps


def execution_order(graph: Graph, groups: Sequence[frozenset[int]], chains: Sequence[Sequence[int]] = ()) -> list[Unit]:
    """Topological order of the graph with each group contracted: ("node", id) or ("group", index).

    A group that runs in stages is given as one unit per stage (each convex on its own; their union need not
    be), with its stages' indices as one of `chains`: each stage runs after the one before it.
    Raises ValueError when the groups depend on each other in a cycle (a group or stage that is not convex,
    or two groups that need each other's outputs).
    """
    try:
        return list(graphlib.TopologicalSorter(_contracted(graph, groups, chains)).static_order())
    except graphlib.CycleError:
        raise ValueError("fused groups depend on each other in a cycle") from None


def group_cycle(graph: Graph, groups: Sequence[frozenset[int]], chains: Sequence[Sequence[int]] = ()) -> list[int] | None:
    """Indices of the groups on one cycle of the contracted graph, or None when it is acyclic."""
    try:
        graphlib.TopologicalSorter(_contracted(graph, groups, chains)).prepare()
    except graphlib.CycleError as e:
        return sorted({k for kind, k in e.args[1] if kind == "group"})
    return None


def group_cycles(graph: Graph, groups: Sequence[frozenset[int]], chains: Sequence[Sequence[int]] = ()) -> list[list[int]]:
    """Cycles of the contracted graph that share no group (indices, as `group_cycle`): after each one found, its
    first group's nodes count as ungrouped and the rest is searched again. A program of repeated layers repeats its
    cycles once per layer; cutting one a round, a 2-layer checkpointed GPT-2 step ran out of rounds."""
    groups, found = list(groups), []
    while (cyc := group_cycle(graph, groups, chains)) is not None and cyc and groups[cyc[0]]:
        found.append(cyc)
        groups[cyc[0]] = frozenset()
    return found
