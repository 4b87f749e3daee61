"""The `matmul_reduce` template lowered to Pallas Mosaic GPU (Hopper: TMA, wgmma, a warp-specialised pipeline).

One loop structure serves both of the template's reduced axes, because the
reduction is always made along the *columns* of the kernel's wgmma tile, where
a row reduction stays inside a warp (register shuffles; a reduction across the
rows of a WGMMA tile needs SMEM scratch that Mosaic GPU shares between
warpgroups):

- over N (logsumexp, cross-entropy over a vocabulary): the kernel's product is
  A @ B itself, kernel rows are M, and the loop runs over N;
- over L (the SPLADE head, max over the sequence): the kernel computes the
  transposed product B^T @ A^T (both operands are read as they are stored,
  through transposed SMEM views), kernel rows are N, and the loop runs over
  L, one outer index p at a time.

A CTA (one per SM, persistent) takes *units* in turn: a block of 2 x block rows
(the two compute warpgroups own one half each) and, over N with `split` > 1,
one of `split` ranges of N; over L, one p. For each step of the loop (block
columns of the kernel tile) it runs the mainloop of the Mosaic GPU matmul
(`gemm.Operands`: TMA ring of A/B tiles filled by a producer warpgroup, wgmma
into a float32 accumulator) and then, in the compute warpgroups, the group's
own jaxpr on the accumulator (`tiles.RegisterTiles` on WGMMA-layout register
arrays), walked in [rows, epi_tile] pieces, each folded into the running
reductions with the online rescaling the spec describes (`spec.scale`:
`sum(exp(x - max))` rescales by exp(max_old - max_new), as in
attention_mgpu). Columns past the loop's extent (ragged N or L, TMA
zero-filled) are masked to the reduction's identity, in the steps that reach
past it only (a branch per step). The running values live
in SMEM between steps (a few hundred bytes per warpgroup); the step pipelines
of one CTA are chained (`pipeline_state` START / STEADY / STOP) so the
producer fetches the next step's tiles while the consumers run the epilogue
(Pallas allows that when the ring's depth divides the K steps; otherwise each
step's pipeline fills and drains the ring on its own).
After a unit's last step the work after the reductions runs once, on row
vectors, and each output row vector goes out by TMA (rows past the edge are
dropped). With `split` > 1 each range writes its running values instead
([split, M] float32 per reduction) and `matmul_reduce.merge_ranges` merges them
in XLA (a few row-sized ops).

Epilogue inputs are vectors (a target index per row, a bias per column, a
mask per sequence position) or scalars: vectors are copied by TMA into SMEM
each step and read in the WGMMA row / column layouts; `is_finite` (in every
logsumexp) and `log1p` (SPLADE), which the Mosaic GPU lowering lacks, are
computed from primitives it has. Transcendentals are the GPU's approximate ones where the
group's dtypes allow (`gemm.approximate_math`).

float32 operands run as TF32, which takes K-major operands only: XLA transposes
a [K, N] B (over L: a [K, N] W read as the kernel's A) outside the kernel.
`smem_bytes` counts shared memory as Mosaic GPU does (each allocation rounded
up to 1 KB), so `check_config` declines exactly what would not fit.

Declined (`Unsupported`): `split` > 1 over L, epilogue inputs that vary along
both the kept and the reduced axis (an [M, N] array read per product tile:
as much traffic as the product the template avoids writing), bool outputs,
primitives the Mosaic GPU lowering lacks (see `tiles.check_nodes`), operand
dtypes other than bf16 / f16 / f32 (TF32), and configs that break a wgmma,
TMA, register or shared-memory rule (`check_config`).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ... import ops
from ...graph import Group, Node
from ...ops import OpClass
from ..matmul_reduce import MatmulReduceSpec, merge_ranges, rescale_factor
from ..tile_eval import product_tile
from ..tiling import Span, TileSpec, cdiv
from .gemm import (BARRIER_BYTES, LOW, REDUCTION_SCRATCH, SMEM_LIMIT, Operands, check_operand_tiles, compute_dtype,
                   from_kernel, interpret_params, kernel_dtype, num_sms_default, pad, pad_to, smem_alloc)
from .gemm import approximate_math, require_smem
from .tiles import COLS, FULL, ROWS, RegisterTiles, Unsupported, check_nodes, layout

BACKEND = "mosaic_gpu"
N_SMS = 132  # H100 SXM: what default_config plans the persistent grid for

#: Config parameters and their defaults. block_m / block_n are the product tile's sides as the template names them
#: (rows of A x columns of B): over N, block_m rows per warpgroup and block_n columns per loop step; over L, block_m
#: rows of L per loop step and block_n columns of N per warpgroup.
DEFAULTS = {
    "block_m": 128,  # over N: rows of M per compute warpgroup (a multiple of 64); over L: positions of L per step (<= 256)
    "block_n": 128,  # over N: columns of N per step (a multiple of 8, <= 256); over L: columns of N per warpgroup (x 64)
    "block_k": 64,  # K per pipeline step; block_k * itemsize must be a multiple of 32 bytes (its swizzle)
    "max_concurrent_steps": 4,  # depth of the TMA ring of A/B tiles (steps are chained across the loop when it divides K's)
    "epi_tile": 64,  # columns of the reduced axis per epilogue piece (divides the step; fewer live registers)
    "split": 1,  # over N: ranges of N per row block, merged by XLA after the kernel (more CTAs for few row blocks)
}
PARAMS = tuple(DEFAULTS)
_ACC_ELEMS = 128 * 128  # a warpgroup's float32 accumulator: 128 registers per thread at most, the epilogue needs the rest


@dataclasses.dataclass(frozen=True)
class Config:
    block_m: int
    block_n: int
    block_k: int
    max_concurrent_steps: int
    epi_tile: int
    split: int

    @staticmethod
    def of(config: dict) -> "Config":
        return Config(**{k: int(config.get(k, v)) for k, v in DEFAULTS.items()})

    def rows(self, spec: MatmulReduceSpec) -> int:
        """Kernel rows per compute warpgroup (the kept axis: M over N, N over L)."""
        return self.block_m if spec.over_n else self.block_n

    def step(self, spec: MatmulReduceSpec) -> int:
        """Kernel columns per loop step (the reduced axis: N over N, L over L)."""
        return self.block_n if spec.over_n else self.block_m


# ---------------------------------------------------------------------------
# The kernel's view of the group: which axis is which, how each epilogue value is laid out.
def _dtype(spec: MatmulReduceSpec) -> np.dtype:
    return np.dtype(spec.group.graph.avals[spec.a].dtype)


def _extents(spec: MatmulReduceSpec) -> tuple[int, int, int]:
    """(Q, R, C): outer indices (P over L, 1 over N), kernel rows (M / N), reduced extent (N / L)."""
    return (1, spec.M, spec.N) if spec.over_n else (spec.P, spec.N, spec.L)


def _orient(spec: MatmulReduceSpec, s: Span) -> Span:
    """A span of the spec's [rows of the product, N] view in the kernel's [kept axis, reduced axis] orientation."""
    return s if spec.over_n else Span(s.cols, s.rows)


def kernel_spans(spec: MatmulReduceSpec) -> dict[int, Span]:
    """What each value of the epilogue varies along in the kernel tile. A reduction's result is a row vector
    (kept axis), even where the spec's view has it a scalar (a reduction of a value constant along the kept axis,
    e.g. SPLADE's count of unmasked positions): it is computed as a row reduction of the widened value."""
    sub = spec.tile.group
    span = {v: _orient(spec, spec.tile.span[v]) for v in sub.inputs}
    span[spec.dot.outputs[0]] = FULL
    for nd in sub.nodes:
        cls = ops.op_class(nd.name)
        out = nd.outputs[0]
        if cls is OpClass.REDUCTION:
            span[out] = ROWS
        elif cls is OpClass.SOURCE:
            span[out] = _orient(spec, spec.tile.span[out])
        else:
            ins = [span[a] for a in nd.inputs if isinstance(a, int)]
            span[out] = Span(any(s.rows for s in ins), any(s.cols for s in ins))
    return span


@dataclasses.dataclass(frozen=True)
class _Input:
    """An epilogue input as the kernel reads it: a vector along the kernel rows ("rows") or the reduced axis
    ("cols"), or a scalar; `outer`: one per outer index p (over L), else one for all."""

    v: int
    kind: str  # "rows" | "cols" | "scalar"
    outer: bool
    extent: int  # elements along the vector (1 for a scalar)


def epi_inputs(spec: MatmulReduceSpec) -> list[_Input]:
    """The epilogue's inputs from outside the group (the product excluded), in the tile group's order."""
    out_v = spec.dot.outputs[0]
    _, R, C = _extents(spec)
    res = []
    for v in spec.tile.group.inputs:
        if v == out_v:
            continue
        rows, cols = spec.layout[v]
        if spec.over_n:  # rows: "M" (the kept axis) or None; cols: N (reduced)
            along_kept, along_red, outer = rows == "M", cols, False
        else:  # rows: "M" (P and L: reduced, per p) / "P" (per p) / None; cols: N (kept)
            along_kept, along_red, outer = cols, rows == "M", rows in ("M", "P")
        if along_kept and along_red:
            raise Unsupported(f"epilogue input %{v} {spec.tile.group.graph.avals[v]} varies along both the kept and the "
                              "reduced axis: an array read per product tile is not supported by the Mosaic GPU lowering")
        kind = "rows" if along_kept else "cols" if along_red else "scalar"
        res.append(_Input(v, kind, outer, R if kind == "rows" else C if kind == "cols" else 1))
    return res


def _vec_dtype(dtype, n: int) -> np.dtype:
    """The dtype a vector input travels in: its own, or widened to 4 bytes where n elements of it are not a
    multiple of 128 bytes (a TMA copy's unit here; bool and int8 vectors of 64)."""
    d = kernel_dtype(dtype)
    if (n * d.itemsize) % 128 == 0:
        return d
    return np.dtype(np.float32) if np.issubdtype(d, np.floating) else np.dtype(np.int32)


# ---------------------------------------------------------------------------
# What is supported.
_EMULATED = {"is_finite", "log1p"}


def check_group(spec: MatmulReduceSpec) -> None:
    """Raise `Unsupported` if this lowering cannot implement the matched group at all (whatever the config)."""
    g = spec.group.graph
    dt = _dtype(spec)
    if dt not in LOW and dt != np.dtype(jnp.float32):
        raise Unsupported(f"operand dtype {dt}: wgmma takes bf16, f16 and float32 (as TF32)")
    sub = spec.tile.group
    check_nodes([nd for nd in sub.nodes if nd.name not in _EMULATED and ops.op_class(nd.name) is not OpClass.REDUCTION])
    for v in spec.group.outputs:
        if np.dtype(g.avals[v].dtype) == np.dtype(bool):
            raise Unsupported(f"bool output %{v}")
    for nd in sub.nodes:
        if ops.op_class(nd.name) is OpClass.REDUCTION and np.dtype(sub.graph.avals[nd.outputs[0]].dtype).itemsize > 4:
            raise Unsupported(f"64-bit reduction {nd.name}")
    for x in epi_inputs(spec):
        if x.v in (spec.a, spec.b):
            raise Unsupported("an operand of the dot read again by the epilogue")
        if np.dtype(sub.graph.avals[x.v].dtype).itemsize > 4:
            raise Unsupported(f"64-bit epilogue input %{x.v}")


def _operands(spec: MatmulReduceSpec, cfg: Config) -> Operands:
    """The kernel's wgmma operands: A @ B over N; B^T @ A^T over L (kernel A = B, kernel B = A, as stored)."""
    Q, R, C = _extents(spec)
    bm, step = cfg.rows(spec), cfg.step(spec)
    if spec.over_n:
        a_km, b_nk, n = spec.a_km, spec.b_nk, spec.N
    else:  # kernel A [R=N, K] is B: stored [K, N] (K-major for the kernel) or [N, K]; kernel B [K, P*L] is A
        a_km, b_nk, n = not spec.b_nk, not spec.a_km, Q * C
    return Operands.of(_dtype(spec), a_km, b_nk, R, n, spec.K, wg_m=bm, wg_n=step, cta_m=2 * bm, cta_n=step,
                       bk=cfg.block_k)


def _ranges(spec: MatmulReduceSpec, cfg: Config) -> tuple[int, int]:
    """(loop steps per unit, ranges of the reduced axis): `split` ranges of whole steps, none of them empty."""
    n_c = cdiv(_extents(spec)[2], cfg.step(spec))
    per = cdiv(n_c, cfg.split)
    return per, cdiv(n_c, per)


def _stages(spec: MatmulReduceSpec, cfg: Config) -> int:
    return max(1, min(cfg.max_concurrent_steps, cdiv(spec.K, cfg.block_k)))


def check_config(spec: MatmulReduceSpec, cfg: Config) -> None:
    """Raise `Unsupported` for a config that breaks a wgmma, TMA, register or shared-memory rule."""
    ops_ = _operands(spec, cfg)
    bm, step = cfg.rows(spec), cfg.step(spec)
    kept, red = ("block_m", "block_n") if spec.over_n else ("block_n", "block_m")
    try:
        check_operand_tiles(ops_.itemsize, ops_.a_km, ops_.b_nk, bm, step, cfg.block_k)
    except Unsupported as e:  # name the template's parameters, not the kernel's
        msg = re.sub(r"block_[mn]=", lambda m: {"block_m=": f"{kept}=", "block_n=": f"{red}="}[m.group(0)], str(e))
        raise Unsupported(msg) from None
    if bm * step > _ACC_ELEMS:
        raise Unsupported(f"registers: a warpgroup's {bm}x{step} float32 accumulator ({kept} x {red}) exceeds "
                          f"{_ACC_ELEMS} elements (128 registers per thread)")
    if step % cfg.epi_tile or cfg.epi_tile % 8 or cfg.epi_tile <= 0:
        raise Unsupported(f"epi_tile={cfg.epi_tile} must be a multiple of 8 dividing {red}={step}")
    if cfg.max_concurrent_steps < 1:
        raise Unsupported("max_concurrent_steps must be >= 1")
    if cfg.split < 1 or (cfg.split > 1 and not spec.over_n):
        raise Unsupported(f"split={cfg.split}: ranges of the reduced axis are merged over N only (split=1 over L)")
    g = spec.tile.group.graph
    for x in epi_inputs(spec):
        n = bm if x.kind == "rows" else step if x.kind == "cols" else 0
        if n and (n * _vec_dtype(g.avals[x.v].dtype, n).itemsize) % 128:
            raise Unsupported(f"a vector input %{x.v} of {n} x {g.avals[x.v].dtype} per step: TMA copies here must move "
                              f"a multiple of 128 bytes ({red} a multiple of 32)")
    require_smem(smem_bytes(spec, cfg))


def smem_bytes(spec: MatmulReduceSpec, cfg: Config) -> int:
    """Shared memory the kernel allocates, counted as Mosaic GPU counts it (each allocation rounded up to 1 KB;
    equal to its `smem_bytes=` on the configs tried): the A/B ring, vector inputs, running values and outputs (a
    buffer per warpgroup each), the reduction scratch, barriers."""
    g = spec.tile.group.graph
    bm, step = cfg.rows(spec), cfg.step(spec)
    total = _operands(spec, cfg).ring_bytes(_stages(spec, cfg)) + REDUCTION_SCRATCH
    vec = [x for x in epi_inputs(spec) if x.kind != "scalar"]
    for x in vec:
        n = bm if x.kind == "rows" else step
        total += smem_alloc(2 * n * _vec_dtype(g.avals[x.v].dtype, n).itemsize)
    reds = [g.node_index[r] for r in spec.reductions]
    total += sum(smem_alloc(2 * bm * compute_dtype(g.avals[nd.outputs[0]].dtype).itemsize) for nd in reds)
    outs = [np.dtype(np.float32)] * len(reds) if _ranges(spec, cfg)[1] > 1 else [np.dtype(a.dtype) for a in spec.group.output_avals()]
    total += sum(smem_alloc(2 * bm * d.itemsize) for d in outs)
    return total + (2 * BARRIER_BYTES if vec else 0)


def _split(n_rb: int, n_c: int, sms: int = N_SMS) -> int:
    """Ranges of N per row block that fill the SMs best (whole waves of units; the fewest ranges among equals)."""
    best, score = 1, 0.0
    for s in (1, 2, 4, 8, 16, 32):
        if s > n_c:
            break
        units = n_rb * s
        eff = units / (cdiv(units, sms) * sms)
        if eff > score + 1e-9:
            best, score = s, eff
    return best


def default_config(spec: MatmulReduceSpec) -> dict:
    """hopper_matmul_mgpu's tile (128 x 128 per warpgroup, 64-wide K steps, 4 stages) where the shapes allow, smaller
    steps for a short reduced axis; over N, enough ranges of N that the units fill the SMs; the ring's depth chosen
    to divide the K steps (so that the loop's step pipelines chain), then fewer stages or a shorter step until shared
    memory fits."""
    isz = _dtype(spec).itemsize
    Q, R, C = _extents(spec)
    cfg = dict(DEFAULTS)
    cfg["block_k"] = 128 // isz if spec.K > 64 // isz else 64 // isz
    rows = 128 if R >= 2048 else 64
    step = 128 if C > 64 else 64 if C > 32 else 32

    def place(step: int) -> None:
        cfg["block_m"], cfg["block_n"] = (rows, step) if spec.over_n else (step, rows)
        cfg["epi_tile"] = min(32 if rows == 128 else 64, step)  # 128 accumulator registers leave ~100 for the epilogue
        cfg["split"] = _split(cdiv(R, 2 * rows), cdiv(C, step)) if spec.over_n else 1

    place(step)
    k_iters = cdiv(spec.K, cfg["block_k"])
    cfg["max_concurrent_steps"] = next((s for s in (4, 3, 5, 6, 2) if k_iters % s == 0), min(4, k_iters))
    while smem_bytes(spec, Config.of(cfg)) > SMEM_LIMIT and cfg["max_concurrent_steps"] > 2:
        cfg["max_concurrent_steps"] -= 1
    while smem_bytes(spec, Config.of(cfg)) > SMEM_LIMIT and step > 32:
        step //= 2
        place(step)
    return cfg


# ---------------------------------------------------------------------------
# Register-array evaluation with the two emulated primitives and the kernel's own iota placement.
class _Tiles(RegisterTiles):
    """`RegisterTiles` on [rows, epi_tile] pieces of the kernel tile (`spec.span` in the kernel's orientation)."""

    def __init__(self, kspec: TileSpec, bm: int, en: int, over_n: bool):
        super().__init__(kspec, bm, en)
        self.over_n = over_n

    def eval_node(self, nd: Node, env: dict, r0=0, c0=0) -> None:
        if nd.name not in _EMULATED:
            return super().eval_node(nd, env, r0, c0)
        out = nd.outputs[0]
        want = self.spec.span[out]
        (x,) = [self.widen(self.atom(env, a), self.span_of(a), want) for a in nd.inputs]
        if nd.name == "is_finite":
            env[out] = jnp.abs(x) < jnp.inf
        else:  # log1p(x) = log(u) * x / (u - 1), u = 1 + x (exact where u rounds to 1; Goldberg's formula)
            u = x + 1.0
            d = u - 1.0
            r = jnp.where(d == 0.0, x, jnp.log(u) * (x / jnp.where(d == 0.0, 1.0, d)))
            env[out] = jnp.where(u == jnp.inf, u, r)

    def iota(self, nd: Node, r0, c0):
        """The index along the iota's S-axis of each kernel row (r0: the first row's kept index) or column (c0: the
        first column's index in the reduced space: N over N, p * L + l over L)."""
        S = self.spec.shape
        n = len(S)
        d = self.spec.axes[nd.outputs[0]][nd.params["dimension"]]
        dt = ops.compute_dtype(nd.params["dtype"])
        if d is None:
            return jnp.zeros((), dt)
        spec_cols = d == n - 1
        along_cols = spec_cols == self.over_n
        size = self.bn if along_cols else self.bm
        idx = plgpu.broadcasted_iota(jnp.int32, (size,), 0, layout=layout(COLS if along_cols else ROWS))
        idx = idx + (c0 if along_cols else r0)
        stride = 1 if spec_cols else math.prod(S[d + 1 : n - 1])
        return ((idx // stride) % S[d]).astype(dt)


# ---------------------------------------------------------------------------
# The lowering.
def lower(group: Group, spec: MatmulReduceSpec, config: dict, *, interpret=False, num_sms: int | None = None) -> Callable:
    """A function of the group's inputs (in `group.inputs` order) giving its outputs (in `group.outputs` order).

    `config`: the parameters in `DEFAULTS` (missing ones take their defaults).
    `interpret`: True runs under Mosaic GPU interpret mode (CPU); a `plgpu.InterpretGPUParams` runs it with those
    parameters (e.g. `detect_races=True`).
    `num_sms`: CTAs of the persistent grid (at most one per unit); None: the device's SM count, read when the
    function is traced.
    Raises `Unsupported` (a NotImplementedError) for what this lowering does not do.
    """
    if spec is None:
        raise Unsupported("the group is not a matmul_reduce")
    check_group(spec)
    cfg = Config.of(config)
    check_config(spec, cfg)
    return _Kernel(group, spec, cfg).build(interpret_params(interpret), num_sms)


class _Kernel:
    def __init__(self, group: Group, spec: MatmulReduceSpec, cfg: Config):
        self.group, self.spec, self.cfg = group, spec, cfg
        sub = spec.tile.group
        self.g = g = sub.graph
        self.over_n = spec.over_n
        self.Q, self.R, self.C = _extents(spec)
        self.bm, self.step, self.en = cfg.rows(spec), cfg.step(spec), cfg.epi_tile
        self.ops = _operands(spec, cfg)
        self.stages = _stages(spec, cfg)
        self.k_iters = self.ops.k_iters
        self.n_rb = cdiv(self.R, 2 * self.bm)
        self.per, self.n_s = _ranges(spec, cfg)  # loop steps per unit, ranges of N
        self.units = self.n_rb * (self.n_s if self.over_n else self.Q)
        self.chain = self.k_iters % self.stages == 0  # the step pipelines of a CTA form one pipeline

        # The epilogue: spans in the kernel's orientation; equations by when they run (as the Triton lowering).
        self.kspan = kernel_spans(spec)
        kspec = TileSpec(sub, spec.tile.shape, spec.tile.split, spec.tile.axes, self.kspan, spec.tile.reductions)
        self.tiles = _Tiles(kspec, self.bm, self.en, self.over_n)
        self.out_v = spec.dot.outputs[0]
        lvl = spec.level
        loop = lambda nd: any(self.kspan[v].cols for v in nd.outputs)  # noqa: E731
        self.reds = [g.node_index[r] for r in spec.reductions]
        red_ids = set(spec.reductions)
        self.kinds = [ops.reduction_kind(nd.name) for nd in self.reds]
        self.maxlvl = max(lvl[r] for r in spec.reductions)
        self.hoisted = [nd for nd in sub.nodes if lvl[nd.id] < 0 and not loop(nd)]
        hoisted = {nd.id for nd in self.hoisted}
        self.stage_nodes = [[nd for nd in sub.nodes if lvl[nd.id] == k - 1 and nd.id not in hoisted and nd.id not in red_ids]
                            for k in range(self.maxlvl + 1)]
        self.late = [nd for nd in sub.nodes if lvl[nd.id] >= 0 and nd.id not in red_ids and not loop(nd)]
        need = {v for terms in spec.scale.values() for _, v, _ in terms}  # the late values a rescale reads
        self.old_nodes = []
        for nd in reversed(self.late):
            if need & set(nd.outputs):
                self.old_nodes.insert(0, nd)
                need |= {a for a in nd.inputs if isinstance(a, int)}
        self.carry_dt = [compute_dtype(g.avals[nd.outputs[0]].dtype) for nd in self.reds]
        self.inputs = epi_inputs(spec)
        self.vec_in = [x for x in self.inputs if x.kind != "scalar"]
        self.scalar_in = [x for x in self.inputs if x.kind == "scalar"]
        self.vdt = {x.v: _vec_dtype(g.avals[x.v].dtype, self.bm if x.kind == "rows" else self.step) for x in self.vec_in}
        self.split_out = self.n_s > 1
        self.outs = list(group.outputs)
        self.out_dt = [np.dtype(np.float32)] * len(self.reds) if self.split_out else [np.dtype(g.avals[v].dtype) for v in self.outs]
        # Mask the reduced axis where it runs past its extent (ragged, or a range running past N).
        self.masked = self.C % self.en != 0 or self.per * self.n_s * self.step != self.C

    # -- arrays as the kernel sees them ------------------------------------------------------------------------------
    def _vec_shape(self, x: _Input) -> tuple[int, int]:
        return self.Q if x.outer else 1, pad_to(x.extent, self.vdt[x.v].itemsize)  # TMA: rows of 16-byte multiples

    def _out_shape(self) -> list[tuple[int, int]]:
        """[outer index or range, kept axis] per output, the kept axis padded to whole row blocks: a TMA store of a
        row block past the end of a row of a 2-D output is not clipped on the H100 but spills into the next row
        (another unit's output; interpret mode drops it), so every store must stay inside its row."""
        rows = self.n_rb * 2 * self.bm  # a multiple of 64 elements: rows of 16-byte multiples for TMA
        return [(self.n_s if self.split_out else self.Q, rows)] * len(self.out_dt)

    # -- the kernel body ------------------------------------------------------------------------------------------
    def body(self, a_gmem, b_gmem, *rest):
        n_vec, n_sc = len(self.vec_in), len(self.scalar_in)
        vec_gmem = dict(zip([x.v for x in self.vec_in], rest[:n_vec]))
        sc_gmem = dict(zip([x.v for x in self.scalar_in], rest[n_vec:n_vec + n_sc]))
        out_gmem = rest[n_vec + n_sc:]
        bm, step, ops_ = self.bm, self.step, self.ops
        PP = plgpu.PipelinePipeline

        def pipeline(mma_body, compute_context, state=None):
            return plgpu.emit_pipeline_warp_specialized(
                mma_body, grid=(self.k_iters,), memory_registers=40, in_specs=ops_.block_specs(lambda k: (0, k), lambda k: (k, 0)),
                wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=self.stages, compute_context=compute_context,
                pipeline_state=state)

        ignore = lambda *_, **__: None  # noqa: E731
        scratch = {
            "pipeline_allocs": pipeline(ignore, ignore).get_allocations(a_gmem, b_gmem),
            "vec_smem": [plgpu.SMEM((2, bm if x.kind == "rows" else step), self.vdt[x.v]) for x in self.vec_in],
            "carry_smem": [plgpu.SMEM((2, bm), d) for d in self.carry_dt],
            "out_smem": [plgpu.SMEM((2, bm), d) for d in self.out_dt],
            "vec_barrier": plgpu.Barrier(num_arrivals=n_vec, num_barriers=2) if n_vec else None,
        }

        @functools.partial(pl.run_scoped, **scratch, collective_axes="wg")
        def _scope(pipeline_allocs, vec_smem, carry_smem, out_smem, vec_barrier):
            wg = lax.axis_index("wg")
            vec_smem = dict(zip([x.v for x in self.vec_in], vec_smem))

            @plgpu.nd_loop((self.units,), collective_axes="sm")
            def _unit_loop(info: plgpu.NDLoopInfo):
                (u,) = info.index
                if self.over_n:  # (row block, range of N), ranges minor: concurrent CTAs share B's columns in L2
                    rb, s = u // self.n_s, u % self.n_s
                    q, col_base, pos0 = 0, 0, s * (self.per * step)
                else:  # (row block of N, p), p minor: concurrent CTAs share B's columns, A (all p) stays in L2
                    rb, q = u // self.Q, u % self.Q
                    s, col_base, pos0 = 0, q * self.C, 0
                r0 = rb * (2 * bm)
                wg_r0 = r0 + wg * bm

                def mma_body(_, a_smem, b_smem, acc_ref):
                    ops_.wgmma(acc_ref, a_smem, b_smem, pl.ds(wg * bm, bm), slice(None))
                    plgpu.wgmma_wait(0)
                    return acc_ref

                @pl.loop(0, self.per)
                def _step(j):
                    pos = pos0 + j * step  # this step's first position along the reduced axis

                    def compute_context(eval_pipeline):
                        if self.vec_in:
                            plgpu.commit_smem()  # the last step's reads of the vector buffers before TMA overwrites them
                        for x in self.vec_in:  # issued before the mainloop, so that they overlap it
                            src = vec_gmem[x.v].at[q if x.outer else 0]
                            src = src.at[pl.ds(wg_r0, bm)] if x.kind == "rows" else src.at[pl.ds(pos, step)]
                            plgpu.copy_gmem_to_smem(src, vec_smem[x.v].at[wg], vec_barrier.at[wg])

                        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((bm, step), jnp.float32))
                        def _acc_scope(acc_ref):
                            eval_pipeline(acc_ref)
                            acc = acc_ref[...]
                            if self.vec_in:
                                plgpu.barrier_wait(vec_barrier.at[wg])
                            self.epilogue(acc, j, q, s, wg, wg_r0, col_base + pos, pos, vec_smem, sc_gmem, carry_smem,
                                          out_smem, out_gmem)

                    state = None
                    if self.chain:
                        first = (info.local_index == 0) & (j == 0)
                        last = (info.local_index == info.num_local_steps - 1) & (j == self.per - 1)
                        state = jnp.where(first, int(PP.START), jnp.where(last, int(PP.STOP), int(PP.STEADY)))
                    a_view = ops_.a_rows(a_gmem, r0)
                    b_view = ops_.b_cols(b_gmem, col_base + pos, step)
                    pipeline(mma_body, compute_context, state)(a_view, b_view, allocations=pipeline_allocs)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    def epilogue(self, acc, j, q, s, wg, wg_r0, col0, pos, vec_smem, sc_gmem, carry_smem, out_smem, out_gmem):
        """Fold one step's [bm, step] product tile into the running reductions (kept in SMEM between steps); after
        the unit's last step, run the work after the reductions and write the outputs (or this range's values)."""
        g, tiles = self.g, self.tiles
        env = {x.v: from_kernel(sc_gmem[x.v][q if x.outer else 0], g.avals[x.v].dtype) for x in self.scalar_in}
        for x in self.vec_in:
            if x.kind == "rows":
                env[x.v] = from_kernel(plgpu.load(vec_smem[x.v].at[wg], layout=layout(ROWS)), g.avals[x.v].dtype)
        for nd in self.hoisted:
            tiles.eval_node(nd, env, wg_r0, col0)
        first = j == 0
        carry = []
        for nd, kind, dt, sm in zip(self.reds, self.kinds, self.carry_dt, carry_smem):
            ident = jnp.asarray(ops.reduction_identity(kind, dt))
            carry.append(jnp.where(first, ident, plgpu.load(sm.at[wg], layout=layout(ROWS))))
        fold = functools.partial(self._fold, env, carry, acc, j, q, s, wg, wg_r0, col0, pos, vec_smem, carry_smem, out_smem, out_gmem)
        if not self.masked:
            fold(False)
            return
        # Only a step that runs past the reduced axis's extent masks its columns (three selects per element in the
        # cross-entropy's epilogue, every step, before): the branch is per step, the same for the whole warpgroup.
        ragged = pos + self.step > self.C
        pl.when(ragged)(functools.partial(fold, True))
        pl.when(jnp.logical_not(ragged))(functools.partial(fold, False))

    def _fold(self, env, carry, acc, j, q, s, wg, wg_r0, col0, pos, vec_smem, carry_smem, out_smem, out_gmem, masked: bool):
        """`epilogue`'s work on the step's product: each piece folded into the running reductions (`carry`, loaded),
        kept in SMEM; after the unit's last step the outputs. `masked`: the columns past the extent count as the
        reductions' identities."""
        g, tiles, bm, en = self.g, self.tiles, self.bm, self.en
        for i in range(self.step // en):
            c0 = col0 + i * en  # the piece's first column in the reduced space (iota)
            local = dict(env)
            local[self.out_v] = product_tile(acc[:, i * en:(i + 1) * en], self.spec)
            for x in self.vec_in:
                if x.kind == "cols":
                    part = plgpu.load(vec_smem[x.v].at[wg, pl.ds(i * en, en)], layout=layout(COLS))
                    local[x.v] = from_kernel(part, g.avals[x.v].dtype)
            ok = None
            if masked:
                idx = plgpu.broadcasted_iota(jnp.int32, (en,), 0, layout=layout(COLS)) + (pos + i * en)
                ok = lax.broadcast_in_dim(idx < self.C, (bm, en), (1,))
            old = None
            if self.spec.scale:
                old = dict(env)
                old.update({nd.outputs[0]: c for nd, c in zip(self.reds, carry)})
                for nd in self.old_nodes:
                    tiles.eval_node(nd, old, wg_r0, c0)
            new = list(carry)
            for k in range(self.maxlvl + 1):
                for nd in self.stage_nodes[k]:
                    tiles.eval_node(nd, local, wg_r0, c0)
                for r, nd in enumerate(self.reds):
                    if self.spec.level[nd.id] != k:
                        continue
                    part = self._reduce(self.kinds[r], local, nd, ok, self.carry_dt[r])
                    if k == 0:
                        new[r] = ops.combine(self.kinds[r], carry[r], part)
                    else:
                        f = rescale_factor(self.spec.scale[nd.id], old, local)
                        new[r] = (jnp.where(carry[r] == 0, 0.0, carry[r] * f) + part).astype(self.carry_dt[r])
                    local[nd.outputs[0]] = new[r]
            carry = new
        for c, sm in zip(carry, carry_smem):
            sm[wg] = c

        @pl.when(j == self.per - 1)
        def _finish():
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous unit's outputs have left out_smem
            if self.split_out:
                vals = carry
                dst = [o.at[s, pl.ds(wg_r0, bm)] for o in out_gmem]
            else:
                fin = dict(env)
                fin.update({nd.outputs[0]: c for nd, c in zip(self.reds, carry)})
                for nd in self.late:
                    tiles.eval_node(nd, fin, wg_r0, col0)
                vals = [tiles.widen(jnp.asarray(fin[v]), self.kspan[v], ROWS) for v in self.outs]
                dst = [o.at[q, pl.ds(wg_r0, bm)] for o in out_gmem]
            for x, d, sm in zip(vals, self.out_dt, out_smem):
                sm[wg] = x.astype(d)
            plgpu.commit_smem()
            for sm, o in zip(out_smem, dst):
                plgpu.copy_smem_to_gmem(sm.at[wg], o)

    def _reduce(self, kind: str, env: dict, nd: Node, ok, dt):
        """The piece's reduction of `nd`'s operand along the kernel columns (a row vector); masked columns count as
        the identity. The operand is widened to the full piece first (a value constant along a side still counts
        once per column, as XLA's reduction does)."""
        a = nd.inputs[0]
        x = self.tiles.widen(jnp.asarray(self.tiles.atom(env, a)), self.tiles.span_of(a), FULL).astype(dt)
        if ok is not None:
            x = jnp.where(ok, x, jnp.asarray(ops.reduction_identity(kind, dt)))
        return {"sum": jnp.sum, "max": jnp.max, "min": jnp.min}[kind](x, axis=1)

    # -- the launch ---------------------------------------------------------------------------------------------------
    def build(self, interp, num_sms: int | None) -> Callable:
        spec, g, group = self.spec, self.g, self.group
        out_shapes = self._out_shape()
        out_type = [jax.ShapeDtypeStruct(sh, d) for sh, d in zip(out_shapes, self.out_dt)]
        name = f"autofuse_matmul_reduce_mgpu_{group.signature[:8]}"
        units = self.units

        def run(*xs):
            env = dict(zip(group.inputs, xs))
            if self.over_n:
                a, b = self.ops.prepare(env[spec.a], env[spec.b])
            else:  # kernel A is B, kernel B is A
                a, b = self.ops.prepare(env[spec.b], env[spec.a])
            args = [a, b]
            for x in self.vec_in:
                q, n = self._vec_shape(x)
                v = jnp.reshape(env[x.v], (q, x.extent)).astype(self.vdt[x.v])
                args.append(pad(v, (q, n)))
            for x in self.scalar_in:
                args.append(jnp.reshape(env[x.v], (self.Q if x.outer else 1,)).astype(kernel_dtype(g.avals[x.v].dtype)))
            sms = num_sms if num_sms is not None else num_sms_default()
            call = plgpu.kernel(
                self.body, out_type=out_type, grid=(max(1, min(sms, units)),), grid_names=("sm",), num_threads=3,
                thread_name="wg",
                compiler_params=plgpu.CompilerParams(approx_math=approximate_math(group), lowering_semantics=plgpu.LoweringSemantics.Lane),
                interpret=interp, kernel_name=name)
            res = call(*args)
            res = list(res) if isinstance(res, (list, tuple)) else [res]
            if self.split_out:
                return merge_ranges(spec, [r[:, : self.R] for r in res], env)
            return [jnp.reshape(r[:, : self.R], g.avals[v].shape) for v, r in zip(self.outs, res)]

        return run

