"""Template `matmul`: a 2-D `dot_general` with its elementwise epilogue, in one kernel.

Each program computes one [block_m, block_n] output tile: a loop over K in
block_k steps accumulates in float32 (bf16/f16 operands use the tensor cores
and float32 runs at the default TF32 precision, as XLA's own float32 matmul
does), then the group's epilogue (bias, scale, residual, activations: whatever
elementwise work the jaxpr applies to the product) is evaluated on the
accumulator tile by the same tile evaluator as the other templates, and only
the epilogue's results are written. Operands may come in either layout the
jaxpr gives ([M, K] or [K, M]; [K, N] or [N, K]). Programs walk the output
tiles in groups of `group_m` row blocks for L2 reuse. A batched dot (one
leading batch dimension on both operands, as `einsum('bij,bjk->bik')` gives)
runs its batch entries on a second grid axis; an A of shape [..., K] (h @ W
with h [B, S, D]) is a matrix of its flattened rows. A prologue (elementwise
work on an operand before the dot: a scale, a cast) runs on each operand tile
as it is loaded.

Precision is the program's, read from the dot (`precision=`, or a `jax.default_matmul_precision` around it, which
the trace records there), never a searched knob: a float32 dot at default precision runs as TF32, as XLA's does on
this GPU; one at `precision=HIGHEST` (where XLA is exact: 5.7e-7 against TF32's 2.9e-4 on an H100,
results/precision_h100.md) runs as three-pass TF32 (`DotAlgorithmPreset.TF32_TF32_F32_X3`: a float32 product to
about 1e-6) on the Triton backend, and is checked at float32's bound; the Mosaic GPU lowering declines it. A 16-bit
dot's products are exact in its float32 accumulator at any precision. `precision=HIGH` stays in XLA.

An epilogue may also sum a value over all the product's rows where the group returns the sum (a bias's gradient:
`db = Σ dy` over batch and sequence, beside the dgrad GEMM whose epilogue makes dy, e.g. `(dz @ W^T) * gelu'(h)`):
`TileSpec.col_sums`, each tile writing its rows' partial sums ([row blocks, N] float32) that a small XLA sum adds
up, so dy is not read again for them (XLA fuses that sum with dy's elementwise producer, which a kernel that makes
dy would otherwise take from it).

An epilogue may also end in a `split` of its [M, N] value along N (a fused QKV projection split into queries, keys
and values): `MatmulSpec.windows`, each part written as its own array by the tiles over its columns. XLA slices
such a product into three copies (cuDNN attention reads each contiguous: 1.5 ms of GPT-2 medium's forward on an
H200); the kernel writes them where the program reads them.

Two dots may share their A operand and meet in one epilogue (a dual GEMM: SwiGLU's `silu(h @ W_gate) * (h @ W_up)`,
GeGLU): `MatmulSpec.b2`/`dot2`, both products accumulated from the same A tiles and combined before anything is
written. XLA writes both [M, N] products and reads them back for the combine; the kernel reads A once and writes
only the combination. The two B operands have the same shape and layout.

An epilogue may also reduce over segments of a product row (GroupNorm: a reshape of [..., N] into
[..., G, N / G], reductions over the last axis, broadcasts back, a reshape back): `passes.split_columns` rewrites
it so that every value carrying the product's columns carries them as [G, seg] (seg = N / G), and
`tiling.analyze_segments` tiles that (`MatmulSpec.seg`). A tile then holds whole segments (block_n a multiple of
seg: a search-space constraint), so each segment's statistics are computed inside the tile, from the float32
accumulator, and only the normalised result is written.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import jax.numpy as jnp
import numpy as np

from .. import costmodel
from ..costmodel import H200, GPUModel
from ..graph import Graph, Group, Node
from ..ops import OpClass, dot_precision, op_class
from .passes import segment_length, split_columns
from .template import NoMatch, Template
from .tiling import (
    Span,
    TileSpec,
    analyze,
    analyze_segments,
    cdiv,
    needed,
)

DOT_DTYPES = {np.dtype("float32"), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)}  # operand dtypes the dot templates take


@dataclass
class MatmulSpec:
    group: Group
    dot: Node
    a: int
    b: int
    M: int
    N: int
    K: int
    a_km: bool  # A is stored [K, M]
    b_nk: bool  # B is stored [N, K]
    epi: TileSpec  # the epilogue on [M, N] (batched: [batch, M, N]) tiles (its group excludes the dot)
    batch: int = 1  # batch entries (a leading batch dimension of both operands), 1 when not batched
    pro: dict = field(default_factory=dict)  # operand (a or b) -> (its prologue's nodes, their TileSpec on the operand's shape)
    round_product: bool = False  # the epilogue reads the product rounded to the dot's dtype (not the float32 accumulator)
    exact_f32: bool = False  # a float32 dot at precision=HIGHEST: three-pass TF32 (Triton), not TF32
    windows: dict = field(default_factory=dict)  # a split value -> ((part, first column, columns), ...) along N
    dot2: Node | None = None  # a second dot of the same A (a dual GEMM), its B `b2` laid out as `b`
    b2: int | None = None

    @property
    def products(self) -> tuple[int, ...]:
        """The dots' outputs, which the epilogue reads: one, or two for a dual GEMM."""
        return (self.dot.outputs[0],) + ((self.dot2.outputs[0],) if self.dot2 is not None else ())

    @property
    def seg(self) -> int:
        """Segment length of an epilogue that reduces over segments of a product row (GroupNorm), else 0."""
        return self.epi.seg

    @property
    def outer_rows(self) -> int:
        """The rows per outer index that a tile must stay within (an epilogue input over the leading row axes
        only: their gcd), else 0."""
        return self.epi.outer_rows

    @property
    def epi_nodes(self) -> list[Node]:
        """The epilogue's equations, in order (on `epi.group`'s graph: a segmented epilogue's own rewritten one)."""
        return [] if self.epi.group.node_ids == (self.dot.id,) and self.epi.group.graph is self.group.graph else self.epi.group.nodes


class MatmulTemplate(Template[MatmulSpec]):
    name = "matmul"
    backends = ("triton", "mosaic_gpu")
    offers_row_sums = True  # a dgrad GEMM with its bias's gradient

    def match(self, group: Group) -> MatmulSpec | None:
        """A matmul spec when the group is one plain (2-D or batched) dot plus an elementwise epilogue of it."""
        g = group.graph
        dots = [n for n in group.nodes if op_class(n.name) is OpClass.CONTRACTION]
        splits = [n for n in group.nodes if n.name == "split"]
        if not 1 <= len(dots) <= 2 or len(splits) > 1 or any(op_class(n.name) is OpClass.OPAQUE and n.name != "split" for n in group.nodes):
            return None  # (reductions: only over segments of a product row, which the epilogue's analysis checks)
        dot, dot2 = dots[0], (dots[1] if len(dots) == 2 else None)
        if dot2 is not None and (splits or not _shares_a(g, dot, dot2) or dot2.inputs[1] not in group.inputs):
            return None
        windows = _windows(group, splits[0]) if splits else {}
        if windows is None:
            return None
        a, b = dot.inputs
        if not (isinstance(a, int) and isinstance(b, int)):
            return None
        (lc, rc), (lb, rb) = dot.params["dimension_numbers"]
        av, bv = g.avals[a], g.avals[b]
        nb = len(lb)
        if tuple(lb) != tuple(range(nb)) or tuple(rb) != tuple(range(nb)) or nb > 1 or len(lc) != 1 or len(rc) != 1:
            return None
        flat_a = nb == 0 and len(av.shape) > 2 and lc[0] == len(av.shape) - 1  # A [..., K]: its free axes are the rows
        if (len(av.shape) != 2 + nb and not flat_a) or len(bv.shape) != 2 + nb or av.shape[:nb] != bv.shape[:nb]:
            return None
        if av.dtype != bv.dtype or np.dtype(av.dtype) not in DOT_DTYPES:
            return None
        prec = dot_precision(dot, av.dtype)
        if prec in ("high", "other"):
            return None  # precision=HIGH (bf16_3x in XLA) or another algorithm: left to XLA
        exact_f32 = prec == "highest" and np.dtype(av.dtype) == np.dtype(jnp.float32)
        a_km, b_nk = lc[0] == nb, rc[0] == nb + 1
        M, K = (av.shape[nb + 1], av.shape[nb]) if a_km else (math.prod(av.shape[nb:-1]), av.shape[-1])
        N = bv.shape[nb] if b_nk else bv.shape[nb + 1]
        if min(M, N, K) < 16:
            return None
        batch = av.shape[0] if nb else 1
        try:
            pro = {v: _prologue(group, dot, v) for v in (a, b) if v not in group.inputs}
            if pro and (nb or dot2 is not None):
                raise NoMatch("a prologue on a batched dot or a dual GEMM")
            in_pro = {nd.id for nodes, _ in pro.values() for nd in nodes}
            dot_ids = {d.id for d in dots}
            rest = [n.id for n in group.nodes if n.id not in dot_ids and n.id not in in_pro and n.name != "split"]
            epi = _epilogue_spec(group, dots, rest, g.avals[dot.outputs[0]].shape)
            for v in set(group.inputs) - {a, b}:  # an input read by two parts must have one 2-D layout
                shapes = {sp.layout2d(v) for sp in [epi] + [t for _, t in pro.values()] if v in sp.group.inputs}
                if len(shapes) > 1:
                    raise NoMatch(f"input %{v} is read with two layouts")
        except NoMatch:
            return None
        if windows and (batch > 1 or next(iter(windows)) not in epi.group.outputs + (dot.outputs[0],)):
            return None
        if dot2 is not None and (nb or not rest):
            return None  # a dual GEMM is two batched dots, or two products returned as they are: XLA's
        return MatmulSpec(group, dot, a, b, M, N, K, a_km, b_nk, epi, batch, pro, exact_f32=exact_f32, windows=windows,
                          dot2=dot2, b2=dot2.inputs[1] if dot2 is not None else None)

    def candidate_groups(self, graph: Graph, fusible) -> list[tuple[Group, MatmulSpec, tuple]]:
        """Each dot with the elementwise epilogue whose value a `split` along N cuts into parts, and the split
        (`MatmulSpec.windows`): the partitioner grows no group through a split (XLA's own copy of each part); each
        also with the elementwise work that makes its A operand and nothing else (a layer norm's second half, which
        `prologue_fold` folds around the GEMM).
        And each dual GEMM: two dots of the same A with the elementwise work up to where their products meet
        (the partitioner grows a group from one dot, never two)."""
        out = []
        for sp in graph.nodes:
            if sp.name != "split" or not isinstance(sp.inputs[0], int):
                continue
            nodes = _epilogue_chain(graph, sp.inputs[0], fusible)
            if nodes is None:
                continue
            dot = next(i for i in nodes if op_class(graph.node_index[i].name) is OpClass.CONTRACTION)
            for extra in ({sp.id}, {sp.id} | _a_prologue(graph, graph.node_index[dot], fusible)):
                group = Group.of(graph, sorted(nodes | extra))
                spec = self.match(group)
                if spec is not None and all(group.node_ids != g.node_ids for g, _, _ in out):
                    out.append((group, spec, ()))
        return out + self._dual_groups(graph, fusible)

    def _dual_groups(self, graph: Graph, fusible) -> list[tuple[Group, MatmulSpec, tuple]]:
        """The groups of two dots sharing A that end where their products first meet (SwiGLU's product of the
        gate's activation and the up-projection), and the elementwise work after it that only it reads."""
        by_a: dict[int, list[Node]] = {}
        for nd in graph.nodes:
            if op_class(nd.name) is OpClass.CONTRACTION and isinstance(nd.inputs[0], int):
                by_a.setdefault(nd.inputs[0], []).append(nd)
        if not any(len(ds) > 1 for ds in by_a.values()):
            return []
        out, seen = [], set()
        for nd in graph.nodes:
            if op_class(nd.name) is not OpClass.ELEMENTWISE or len(nd.outputs) != 1:
                continue
            nodes = _epilogue_chain(graph, nd.outputs[0], fusible, dots=2)
            if nodes is None or frozenset(nodes) in seen:
                continue
            seen.add(frozenset(nodes))
            group = Group.of(graph, sorted(nodes))
            spec = self.match(group)
            if spec is not None and spec.dot2 is not None:
                out.append((group, spec, ()))
        return out

    def facts(self, group: Group, spec: MatmulSpec) -> dict:
        """What search_spaces/matmul[.<backend>].toml's constraints read."""
        itemsize = np.dtype(group.graph.avals[spec.a].dtype).itemsize
        return {"M": spec.M, "N": spec.N, "K": spec.K, "itemsize": itemsize, "smem_bytes": H200.smem_bytes,
                "seg": spec.seg, "outer_rows": spec.outer_rows, "dual": int(spec.dot2 is not None),
                "unaligned": int(unaligned_rows(spec)), "sums": int(bool(spec.epi.col_sums))}

    def model_time_ms(self, spec: MatmulSpec, config: dict, model: GPUModel = H200) -> float:
        """Roofline with a tile-efficiency factor: small tiles reuse operands less and issue smaller MMAs.

        A Mosaic GPU config (`config["backend"] == "mosaic_gpu"`) is costed by its CTA tile (two warpgroups' tiles)
        and pipeline depth, at the efficiency measured against Triton's on an H100 (bias+GELU, 8192x4096x8192 bf16:
        663 vs 570 TFLOP/s)."""
        bm, bn, bk = int(config["block_m"]), int(config["block_n"]), int(config["block_k"])
        low = np.dtype(spec.group.graph.avals[spec.a].dtype) != np.dtype("float32")
        flops = 2.0 * spec.batch * spec.M * spec.N * spec.K * len(spec.products)
        if config.get("backend") == "mosaic_gpu":
            wg_m = int(config["wg_dimension"]) == 0  # (a dual GEMM's A tile meets two B tiles: as wide a tile's reuse)
            bm, bn, reuse = bm * (2 if wg_m else 1), bn * (1 if wg_m else 2) * len(spec.products), int(config["grid_tile_width"])
            eff = 1.15 * min(1.0, (bm * bn) / (256 * 128)) ** 0.5 * min(1.0, bk / 64) ** 0.25 * min(1.0, int(config["max_concurrent_steps"]) / 3) ** 0.25
        else:
            eff, reuse = min(1.0, (bm * bn) / (128 * 256)) ** 0.5 * min(1.0, bk / 64) ** 0.25, int(config["group_m"])
        tiles_m, tiles_n = spec.batch * cdiv(spec.M, bm), cdiv(spec.N, bn)
        a_bytes = spec.batch * spec.M * spec.K * np.dtype(spec.group.graph.avals[spec.a].dtype).itemsize
        b_bytes = (len(spec.products) - 1) * spec.batch * spec.N * spec.K * np.dtype(spec.group.graph.avals[spec.b].dtype).itemsize
        bytes_moved = a_bytes * tiles_n / max(1, reuse) ** 0.5 + b_bytes + sum(a.nbytes for a in spec.group.output_avals())
        t = costmodel.kernel_time_ms(bytes_moved, flops / max(eff, 0.05), model, low) * max(1.0, 132 / max(1, tiles_m * tiles_n)) ** 0.5
        return t + (self._fold_ms(spec, model) if spec.pro and config.get("backend") == "mosaic_gpu" else 0.0)

    @staticmethod
    def _fold_ms(spec: MatmulSpec, model: GPUModel) -> float:
        """What folding an A prologue around the GEMM (`prologue_fold`, the Mosaic GPU lowering's) adds outside the
        kernel: W' made from W (read and written once), and a pass of its own over x for the row statistics that the
        prologue's XLA fusion had taken with it (a layer norm is one pass in XLA: statistics and the normalised
        write; GPT-2's on an H200 took 17.5 us, its statistics alone two reduction passes, results/norm_gemm_h200.md)."""
        itemsize = np.dtype(spec.group.graph.avals[spec.b].dtype).itemsize
        return costmodel.kernel_time_ms(2.0 * spec.K * spec.N * itemsize, 0.0, model) + costmodel.kernel_time_ms(
            spec.batch * spec.M * spec.K * itemsize, 0.0, model)


def unaligned_rows(spec: MatmulSpec) -> bool:
    """An output of the product's [M, N] shape whose rows are not 16-byte multiples (TMA cannot write that array)."""
    g = spec.group.graph
    full = spec.batch * spec.M * spec.N
    return any(v not in spec.epi.col_sums and g.avals[v].shape[-1:] == (spec.N,) and math.prod(g.avals[v].shape) == full
               and (spec.N * np.dtype(g.avals[v].dtype).itemsize) % 16 for v in spec.group.outputs)


def _windows(group: Group, split: Node) -> dict | None:
    """The split's parts as column windows of its input, {input: ((part, first column, columns), ...)}, or None
    where the split is not the group's last step along the last axis with every part returned whole."""
    g = group.graph
    (u,) = split.inputs
    if not isinstance(u, int) or split.params["axis"] % len(g.avals[u].shape) != len(g.avals[u].shape) - 1:
        return None
    if any(c != split.id for c in g.consumers.get(u, ())) or u in g.output_values or u in group.outputs:
        return None  # the whole value is read elsewhere too
    if any(v not in group.outputs for v in split.outputs) or u in group.inputs:
        return None
    parts, col = [], 0
    for v, size in zip(split.outputs, split.params["sizes"]):
        parts.append((v, col, int(size)))
        col += int(size)
    return {u: tuple(parts)}


def _epilogue_chain(graph: Graph, v: int, fusible, dots: int = 1) -> set[int] | None:
    """The nodes from one dot to value `v` (every node that is the dot's descendant and v's producer's ancestor),
    with the broadcasts only they read; None where v is not made from exactly one dot by elementwise work (`dots`:
    from exactly that many, each reached by v's producers)."""
    anc: set[int] = set()
    todo = [graph.producer[v]] if v in graph.producer else []
    while todo:
        i = todo.pop()
        if i in anc:
            continue
        anc.add(i)
        if len(anc) > 2 * MAX_CHAIN:
            return None  # v's producers reach far past one dot (a residual): no epilogue chain of one dot
        nd = graph.node_index[i]
        if op_class(nd.name) is not OpClass.CONTRACTION:
            todo += [graph.producer[a] for a in nd.inputs if isinstance(a, int) and a in graph.producer]
    found = [i for i in anc if op_class(graph.node_index[i].name) is OpClass.CONTRACTION]
    if len(found) != dots or not all(fusible(i) for i in anc):
        return None
    keep = set(found)
    for i in sorted(anc):  # descendants of the dot among v's ancestors (ids are topological)
        nd = graph.node_index[i]
        if any(isinstance(a, int) and graph.producer.get(a) in keep for a in nd.inputs):
            keep.add(i)
    for i in anc - keep:  # a bias's broadcast read only inside
        nd = graph.node_index[i]
        if op_class(nd.name) is OpClass.BROADCAST and all(c in keep for o in nd.outputs for c in graph.consumers.get(o, ())):
            keep.add(i)
    if len(keep) > MAX_CHAIN or any(op_class(graph.node_index[i].name) not in CHAIN_OPS for i in keep):
        return None
    if dots > 1 and any(graph.producer.get(a) in keep for i in found for a in graph.node_index[i].inputs):
        return None  # one dot reads the other's work: a chain of GEMMs, not two beside each other
    return keep


def _a_prologue(graph: Graph, dot: Node, fusible) -> set[int]:
    """The elementwise nodes that make `dot`'s A operand and whose values nothing else reads (walked back from the
    operand, up to values that something outside reads: a layer norm's `x - mean` after its statistics)."""
    keep: set[int] = set()
    reads = {dot.id}
    a = dot.inputs[0]
    todo = [graph.producer[a]] if isinstance(a, int) and a in graph.producer else []
    while todo:
        i = max(todo)  # (ids are topological: a node after every reader of its values)
        todo.remove(i)
        nd = graph.node_index[i]
        if i in keep or op_class(nd.name) is not OpClass.ELEMENTWISE or not fusible(i) or len(keep) >= MAX_CHAIN:
            continue
        if any(v in graph.output_values or any(c not in reads for c in graph.consumers.get(v, ())) for v in nd.outputs):
            continue
        keep.add(i)
        reads.add(i)
        todo += [graph.producer[v] for v in nd.inputs if isinstance(v, int) and v in graph.producer and graph.producer[v] not in todo]
    return keep


def _shares_a(g: Graph, d1: Node, d2: Node) -> bool:
    """Whether two dots read the same A with the same dimension numbers and B operands of one shape and dtype."""
    b1, b2 = d1.inputs[1], d2.inputs[1]
    return (d1.inputs[0] == d2.inputs[0] and d1.params["dimension_numbers"] == d2.params["dimension_numbers"]
            and d1.params.get("precision") == d2.params.get("precision") and isinstance(b1, int) and isinstance(b2, int)
            and g.avals[b1].shape == g.avals[b2].shape and g.avals[b1].dtype == g.avals[b2].dtype
            and g.avals[d1.outputs[0]].dtype == g.avals[d2.outputs[0]].dtype)


MAX_CHAIN = 32  # nodes of an epilogue chain (a bias, an activation): more is no epilogue this template writes
CHAIN_OPS = (OpClass.CONTRACTION, OpClass.ELEMENTWISE, OpClass.BROADCAST, OpClass.LAYOUT)


def _prologue(group: Group, dot: Node, operand: int) -> tuple[list[Node], TileSpec]:
    """The elementwise work inside the group that produces a dot operand, tiled on the operand's shape."""
    g = group.graph
    nodes = needed(group.nodes, {operand}, set())
    if any(op_class(nd.name) not in (OpClass.ELEMENTWISE, OpClass.BROADCAST, OpClass.LAYOUT) for nd in nodes):
        raise NoMatch("a prologue does more than elementwise work")
    sub = Group.of(g, [nd.id for nd in nodes])
    if list(sub.outputs) != [operand] or any(c != dot.id for c in g.consumers.get(operand, ())):
        raise NoMatch("a prologue value is also used elsewhere")
    shape = g.avals[operand].shape
    return nodes, analyze(sub, shape, len(shape) - 1)


def default_precision(dot: Node, operand_dtype: Any = None) -> bool:
    """Whether the dot runs at default precision (what a Triton dot does: TF32 for float32, as XLA's own), or at an
    algorithm that takes its `operand_dtype` operands as they are and accumulates in float32 (`ops.dot_precision`)."""
    return dot_precision(dot, operand_dtype) == "default"


def _epilogue_spec(group: Group, dots: list[Node], rest: list[int], S: tuple[int, ...]) -> TileSpec:
    """The epilogue tiled with rows = all but the last axis of the product (batch entries stacked), columns = N;
    the products of `dots` (one, or a dual GEMM's two) are full tiles."""
    dot = dots[0]
    out, n = dot.outputs[0], len(S)
    sub = group.part(rest) if rest else None
    if sub is None:
        return TileSpec(Group.of(group.graph, [dot.id]), S, n - 1, {out: tuple(range(n))}, {out: Span(True, True)}, [])
    if {a for d in dots for a in d.inputs} & set(sub.inputs):
        raise NoMatch("an operand of the dot is also read by the epilogue")
    seg = segment_length(sub, out)
    if seg is not None and len(dots) > 1:
        raise NoMatch(f"a dual GEMM's epilogue over segments of {seg} columns")
    if seg is not None:  # reductions over segments of a product row (GroupNorm): S = (*rows, N / seg, seg)
        seg_sub = split_columns(sub, out, seg)
        spec = analyze_segments(seg_sub, S[:-1] + (S[-1] // seg, seg), n - 1)
        spec.axes[out], spec.span[out] = tuple(range(n + 1)), Span(True, True)
        return spec
    spec = analyze(sub, S, n - 1, outer=True, column_sums=True)
    if spec.reductions:
        raise NoMatch("reductions belong to matmul_reduce")
    if spec.col_sums and spec.outer:
        raise NoMatch("sums over the rows beside an input over the leading row axes")
    for d in dots:
        spec.axes[d.outputs[0]], spec.span[d.outputs[0]] = tuple(range(n)), Span(True, True)
    return spec


TEMPLATE = MatmulTemplate()
match, default_config, space, model_time_ms, build = (TEMPLATE.match, TEMPLATE.default_config, TEMPLATE.space,
                                                      TEMPLATE.model_time_ms, TEMPLATE.build)
