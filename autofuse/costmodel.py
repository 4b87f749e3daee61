"""An analytic roofline model of a named GPU, for planning without one.

Time of a kernel = max(bytes moved / bandwidth, flops / peak) + launch cost.
Used where no GPU is present (`measure="model"`), and on the GPU to order
and prune the tile search before anything is timed. Its numbers are
estimates and are always labelled as such.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from . import ops
from .graph import Aval, Graph, Group
from .ops import OpClass


@dataclass(frozen=True)
class GPUModel:
    name: str
    bandwidth_Bps: float  # device copy, bytes read + written per second
    flops_bf16: float
    flops_f32: float
    launch_s: float
    smem_bytes: int


# Measured on the project's H200 (GPU_NOTES.md).
H200 = GPUModel("NVIDIA H200", 4.26e12, 790e12, 361e12, 3e-6, 227 * 1024)
MODELS = {"h200": H200}


def get_model(name: str = "h200") -> GPUModel:
    try:
        return MODELS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown GPU model {name!r}; known: {sorted(MODELS)}") from None


def node_flops(graph: Graph, node_id: int) -> float:
    nd = graph.node_index[node_id]
    cls = ops.op_class(nd.name)
    if cls is OpClass.CONTRACTION:
        dims = nd.params["dimension_numbers"]
        (lc, _), _ = dims
        a = graph.aval(nd.inputs[0])
        out = graph.avals[nd.outputs[0]]
        k = int(np.prod([a.shape[d] for d in lc])) if lc else 1
        return 2.0 * out.size * k
    if cls is OpClass.ELEMENTWISE:
        return float(graph.avals[nd.outputs[0]].size)
    if cls is OpClass.REDUCTION:
        return float(graph.aval(nd.inputs[0]).size)
    return 0.0


def kernel_time_ms(bytes_moved: float, flops: float, model: GPUModel = H200, low_precision: bool = True) -> float:
    peak = model.flops_bf16 if low_precision else model.flops_f32
    return 1e3 * (max(bytes_moved / model.bandwidth_Bps, flops / peak) + model.launch_s)


def group_bytes(group: Group, passes: int = 1) -> float:
    """Fewest bytes a fused kernel moves: inputs read (`passes` times), outputs written once."""
    return passes * sum(a.nbytes for a in group.input_avals()) + sum(a.nbytes for a in group.output_avals())


def group_time_ms(group: Group, model: GPUModel = H200, passes: int = 1) -> float:
    flops = sum(node_flops(group.graph, i) for i in group.node_ids)
    return kernel_time_ms(group_bytes(group, passes), flops, model)


def node_time_ms(graph: Graph, node_id: int, model: GPUModel = H200) -> float:
    """A node run alone: reads its operands and writes its results."""
    nd = graph.node_index[node_id]
    if ops.op_class(nd.name) in (OpClass.BROADCAST, OpClass.LAYOUT):
        return 0.0  # XLA folds these into their consumers
    b = sum(graph.aval(a).nbytes for a in nd.inputs if isinstance(a, int)) + sum(graph.avals[v].nbytes for v in nd.outputs)
    return kernel_time_ms(b, node_flops(graph, node_id), model)


def floor_ms(graph: Graph, model: GPUModel = H200) -> float:
    """The memory/compute floor of the whole program: inputs read once, outputs written once."""
    b = sum(graph.avals[v].nbytes for v in graph.inputs) + sum(graph.aval(a).nbytes for a in graph.outputs)
    flops = sum(node_flops(graph, n.id) for n in graph.nodes if ops.op_class(n.name) is OpClass.CONTRACTION)
    return 1e3 * max(b / model.bandwidth_Bps, flops / model.flops_bf16)


# How far from the floor each kind of XLA kernel runs: the medians of XLA/floor measured in
# results/core_default_h200.md (elementwise chains ~1.2, row reductions ~1.35). Generated kernels are
# modelled by their templates (`Template.model_time_ms`).
# matmul: GPU_NOTES (XLA's GEMM fusions). attention: XLA writes and re-reads the B*H*L*L scores and
# computes masked blocks too; it reaches about 225 of 790 bf16 TFLOP/s on plain-jnp attention (GPU_NOTES).
XLA_FACTOR = {"elementwise": 1.2, "row_reduce": 1.35, "matmul": 1.1, "attention": 3.5, "matmul_reduce": 1.1}


ALIGN_BYTES = 16  # a TMA descriptor's row stride, and cuBLAS's fast paths
#: XLA's GEMMs reading rows that are not ALIGN_BYTES apart, and writing them only: GPT-2's LM head at its vocabulary
#: (50257 bf16 columns), as bare dots in the program's own layouts, took 7.10 and 5.43 ms (dx and dW, reading the
#: logits' gradient) and 3.29 ms (the logits, written) against 2.13, 2.14 and 2.38 padded to 50304 (H200,
#: results/models_cudnn_h200.md §4): 3.3x, 2.5x and 1.4x.
XLA_UNALIGNED_READ = 2.5
XLA_UNALIGNED_WRITE = 1.4


def unaligned_rows(aval: Aval) -> bool:
    """Whether an array's rows (its last axis) are not ALIGN_BYTES apart."""
    return len(aval.shape) >= 2 and (aval.shape[-1] * np.dtype(aval.dtype).itemsize) % ALIGN_BYTES != 0


def unaligned_dot(graph: Graph, node: Any) -> bool:
    """Whether a dot_general reads or writes a floating array whose last dimension's rows are not ALIGN_BYTES apart."""
    if ops.op_class(node.name) is not OpClass.CONTRACTION:
        return False
    avals = [graph.aval(a) for a in node.inputs] + [graph.avals[v] for v in node.outputs]
    if not all("float" in np.dtype(a.dtype).name for a in avals):  # bfloat16 is not an np.floating
        return False
    return any(unaligned_rows(a) for a in avals)


def as_xla_reads(graph: Graph, atom: Any) -> Aval:
    """An operand as XLA's GEMM reads it in the program: a transposed array in its own layout (XLA folds the transpose
    into the GEMM; `x @ w.T` reads `w`)."""
    while isinstance(atom, int) and atom in graph.producer and graph.node_index[graph.producer[atom]].name == "transpose":
        atom = graph.node_index[graph.producer[atom]].inputs[0]
    return graph.aval(atom)


def xla_unaligned_factor(graph: Graph, node: Any) -> float:
    """How much slower XLA runs a dot for its unaligned rows: reading them (`XLA_UNALIGNED_READ`), writing them only
    (`XLA_UNALIGNED_WRITE`), or neither (1)."""
    if not unaligned_dot(graph, node):
        return 1.0
    if any(unaligned_rows(as_xla_reads(graph, a)) for a in node.inputs):
        return XLA_UNALIGNED_READ
    return XLA_UNALIGNED_WRITE if any(unaligned_rows(graph.avals[v]) for v in node.outputs) else 1.0


def _reduced_then_read(group: Group) -> tuple[list[int], list[int]] | None:
    """For a group with one dot whose product is reduced and read again after the reductions (a cross-entropy with
    its backward): (what the reductions need, with the row work after them; the rest), else None."""
    g, members = group.graph, set(group.node_ids)
    dots = [n for n in group.nodes if ops.op_class(n.name) is OpClass.CONTRACTION]
    if len(dots) != 1:
        return None
    shape = g.avals[dots[0].outputs[0]].shape
    first: set[int] = set()
    stack = [n.id for n in group.nodes if ops.op_class(n.name) is OpClass.REDUCTION]
    while stack:
        i = stack.pop()
        if i not in first:
            first.add(i)
            stack.extend(p for p in g.preds(i) if p in members)
    rest = [i for i in group.node_ids if i not in first]
    if not any(g.avals[v].shape == shape for i in rest for v in g.node_index[i].outputs):
        return None
    return sorted(first), rest


def _levels_over_middle_axes(group: Group) -> list[list[int]] | None:
    """For a group without dots whose reductions run over one middle axis (neither the first nor the last) and whose results are
    read again by later work (SPLADE's max over the sequence, the count of positions at it, the backward): one
    fusion per reduction depth, each with the elementwise work it recomputes from the group's inputs (XLA
    duplicates cheap producers; it does not fuse a reduction with a reader that needs it whole), else None."""
    g, members = group.graph, set(group.node_ids)
    reds = [n for n in group.nodes if ops.op_class(n.name) is OpClass.REDUCTION]
    if not reds or any(ops.op_class(n.name) is OpClass.CONTRACTION for n in group.nodes):
        return None
    axes = {(tuple(n.params["axes"]), len(g.aval(n.inputs[0]).shape)) for n in reds}
    axes = {(a, rank) for a, rank in axes if a != tuple(range(rank - 1))}  # a column's sum (a bias's gradient) aside
    if len(axes) != 1 or not all(len(a) == 1 and 0 < a[0] < rank - 1 for a, rank in axes):
        return None  # a row's reductions, a column's sums (a norm's dγ): `row_reduce`'s factor covers XLA's kernels
    depth: dict[int, int] = {}
    for nd in group.nodes:  # program order: producers first
        depth[nd.id] = max((depth[p] + (ops.op_class(g.node_index[p].name) is OpClass.REDUCTION)
                            for p in g.preds(nd.id) if p in members), default=0)
    if max(depth.values()) == 0:
        return None
    levels = []
    for k in range(max(depth.values()) + 1):
        ids, stack = set(), [i for i, d in depth.items() if d == k]
        while stack:  # the level's nodes with the non-reduction producers they recompute
            i = stack.pop()
            if i not in ids:
                ids.add(i)
                stack.extend(p for p in g.preds(i) if p in members and depth[p] < k
                             and ops.op_class(g.node_index[p].name) is not OpClass.REDUCTION)
        levels.append(sorted(ids))
    return levels


def _level_time_ms(group: Group, ids: list[int], model: GPUModel) -> float:
    """One of `_levels_over_middle_axes`' fusions: it reads what it does not make (the group's inputs, earlier
    reductions) and writes the group's outputs and the reductions that later levels read."""
    g, inside, members = group.graph, set(ids), set(group.node_ids)
    made = {v for i in ids for v in g.node_index[i].outputs}
    read = {a for i in ids for a in g.node_index[i].inputs if isinstance(a, int)} - made
    written = {v for v in made if v in group.outputs or any(c in members and c not in inside for c in g.consumers.get(v, ()))
               and ops.op_class(g.node_index[g.producer[v]].name) is OpClass.REDUCTION}
    b = sum(g.avals[v].nbytes for v in read | written)
    return kernel_time_ms(b, sum(node_flops(g, i) for i in ids), model)


def _kind(group: Group) -> str:
    classes = {ops.op_class(n.name) for n in group.nodes}
    if sum(ops.op_class(n.name) is OpClass.CONTRACTION for n in group.nodes) >= 2 and OpClass.REDUCTION in classes:
        return "attention"
    if OpClass.CONTRACTION in classes and OpClass.REDUCTION in classes:
        return "matmul_reduce"
    return "matmul" if OpClass.CONTRACTION in classes else "row_reduce" if OpClass.REDUCTION in classes else "elementwise"


def xla_group_time_ms(group: Group, model: GPUModel = H200) -> float:
    """Modelled time of XLA's own fusion of the group."""
    kind = _kind(group)
    cats = [n for n in group.nodes if n.name == "concatenate"]
    if cats and len(group.nodes) > 1:  # a concatenation read inside the group (`concat_sink`'s groups)
        g = group.graph
        rest = [g.node_index[n.id] for n in group.nodes if n.name != "concatenate"]
        readers = [n for n in rest if ops.op_class(n.name) is not OpClass.ELEMENTWISE]
        dots = sum(ops.op_class(n.name) is OpClass.CONTRACTION for n in readers)
        # XLA writes the concatenation once for each GEMM that reads it, in the layout that GEMM wants (GPT-2's QKV
        # gradient: twice, 1.1 ms each in its step on an H200), and fuses it into its other readers (a sum)
        return (max(1, dots) * sum(node_time_ms(g, n.id, model) for n in cats)
                + sum(xla_group_time_ms(Group.of(g, [n.id]), model) for n in readers))
    if kind == "matmul_reduce":
        parts = _reduced_then_read(group)
        if parts is not None:  # two fusions at least: the reductions', then the later reader's (each reads the product)
            return sum(xla_group_time_ms(Group.of(group.graph, ids), model) for ids in parts)
    levels = _levels_over_middle_axes(group) if kind == "row_reduce" else None
    if levels is not None:
        return sum(_level_time_ms(group, ids, model) * XLA_FACTOR[kind] for ids in levels)
    t = group_time_ms(group, model) - 1e3 * model.launch_s
    if kind == "matmul_reduce":  # XLA writes the product, then reads it back to reduce it in a second kernel (GPU_NOTES)
        t += 1e3 * model.launch_s + 1e3 * 2 * sum(group.graph.avals[v].nbytes for n in group.nodes if ops.op_class(n.name) is OpClass.CONTRACTION
                           for v in n.outputs) / model.bandwidth_Bps
    if kind == "matmul":
        t *= max(xla_unaligned_factor(group.graph, n) for n in group.nodes)
    launches = 3 if kind == "attention" else 1  # attention: the scores' GEMM, the softmax, the second GEMM
    made = {v for n in group.nodes for v in n.outputs}
    for n in group.nodes:  # an op no fusion takes (a split's parts: copies): its operand written, read back, its kernel
        if ops.op_class(n.name) is OpClass.OPAQUE:
            t += 1e3 * 2 * sum(group.graph.avals[a].nbytes for a in n.inputs if isinstance(a, int) and a in made) / model.bandwidth_Bps
            launches += len(n.outputs)
    if kind == "attention":  # the scores' round trips through memory, where they outweigh the floor
        t = max(t, 1e3 * _score_traffic(group) / model.bandwidth_Bps)
    return t * XLA_FACTOR[kind] + launches * 1e3 * model.launch_s


def _score_traffic(group: Group) -> float:
    """Bytes XLA moves for an attention group's score-shaped arrays ([B, H, L, L], the largest a dot makes or
    reads): each one a dot makes or reads is in memory, written once and read once (XLA fuses no softmax into a
    GEMM). On an H100, SPLADE's (L = 256, D = 64) took ~0.65 ms per layer where the group's floor is 0.03 ms
    (its softmax alone 0.16 ms for 100 MB); GPT-2 medium's (L = 2048) ~7 ms where the floor is 0.5 ms."""
    g = group.graph
    dots = [n for n in group.nodes if ops.op_class(n.name) is OpClass.CONTRACTION]
    edges = [(a, n.id) for n in dots for a in (*n.inputs, *n.outputs) if isinstance(a, int)]
    if not edges:
        return 0.0
    big = max(g.avals[a].size for a, _ in edges)
    return float(sum(2 * g.avals[a].nbytes for a in {a for a, _ in edges if g.avals[a].size == big}))


def cut_outputs_ms(group: Group, model: GPUModel = H200) -> float:
    """What fusing `group` costs its neighbours in the program beyond what timing it alone shows: each output that
    XLA would keep inside its own fusion (no reader reaches it only through a dot or an opaque op, and it is not a
    program output) is written by the fused kernel and read back by its readers, 2 x its bytes at the model's
    bandwidth. Timed alone, XLA writes it too, so the group's saving alone never shows this. GPT-2's first half of
    a layer norm (its float32 x - mean and square as outputs, 128 MB a layer) saved 0.77 ms alone and lost 1.86 ms
    in the program (results/composition_h100.md)."""
    graph, members = group.graph, set(group.node_ids)
    cut = [v for v in group.outputs if v not in graph.output_values and not _read_past_a_barrier(graph, v, members)]
    return 1e3 * 2 * sum(_bytes_beyond_xlas(graph, v, members) for v in cut) / model.bandwidth_Bps


def _bytes_beyond_xlas(graph: Graph, value: int, members: set[int]) -> int:
    """The bytes of `value` that XLA would not write. A product of a dot XLA writes too (its GEMM's output, or its
    epilogue's: an elementwise reader fused in), except where every reader outside narrows it (a float32 product
    converted to bf16: XLA writes the bf16); GPT-2's forward logits GEMM padded (`aligned_dot`), read by a widening
    conversion to float32 that XLA's GEMM writes, was charged 0.77 ms for the bf16 logits and never tried. Any other
    value XLA keeps inside its fusion is written only by the group: all its bytes."""
    aval = graph.avals[value]
    made_by = graph.node_index[graph.producer[value]]
    if ops.op_class(made_by.name) is not OpClass.CONTRACTION:
        return aval.nbytes
    readers = _through_layouts(graph, [r for r in graph.consumers.get(value, ()) if r not in members])
    converted = [graph.avals[graph.node_index[r].outputs[0]] for r in readers if graph.node_index[r].name == "convert_element_type"]
    if readers and len(converted) == len(readers):  # XLA's GEMM writes the widest of them (no saving where they widen)
        return max(0, aval.nbytes - max(a.nbytes for a in converted))
    return 0


def _barrier(graph: Graph, node_id: int) -> bool:
    """A node XLA does not fuse its operands' producers into: a dot (its operands are materialised, but for small
    prologues) or an op no fusion takes."""
    cls = ops.op_class(graph.node_index[node_id].name)
    return cls is OpClass.CONTRACTION or cls not in ops.FUSIBLE


def _through_layouts(graph: Graph, readers: list[int]) -> list[int]:
    """`readers` with each reshape among them replaced by its own readers (XLA folds a layout op into them: a split
    part reshaped into heads for cuDNN attention is read by the attention)."""
    out: list[int] = []
    todo = list(readers)
    while todo:
        r = todo.pop()
        nd = graph.node_index[r]
        if ops.op_class(nd.name) is OpClass.LAYOUT and not any(v in graph.output_values for v in nd.outputs):
            todo.extend(c for v in nd.outputs for c in graph.consumers.get(v, ()))
        elif r not in out:
            out.append(r)
    return out


def _read_past_a_barrier(graph: Graph, value: int, members: set[int]) -> bool:
    """Whether XLA must materialise `value`: some reader outside `members` is a barrier, or is reached from `value`
    also through a barrier (a residual sum read again after the GEMMs it feeds)."""
    readers = _through_layouts(graph, [r for r in graph.consumers.get(value, ()) if r not in members])
    if any(_barrier(graph, r) for r in readers):
        return True
    last = max(readers, default=-1)
    crossed: set[int] = set()  # nodes reached from `value` through a barrier (ids are in program order)
    todo = [(c, _barrier(graph, c)) for c in graph.consumers.get(value, ())]
    seen: set[tuple[int, bool]] = set()
    while todo:
        n, through = todo.pop()
        if (n, through) in seen or n > last:
            continue
        seen.add((n, through))
        if through:
            crossed.add(n)
        for v in graph.node_index[n].outputs:
            todo.extend((c, through or _barrier(graph, c)) for c in graph.consumers.get(v, ()))
    return any(r in crossed for r in readers)
