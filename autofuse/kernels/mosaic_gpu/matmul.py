"""The `matmul` template lowered to Pallas Mosaic GPU (Hopper: TMA, wgmma, a warp-specialised pipeline).

The loop structure is the one of JAX's `pallas/ops/gpu/hopper_matmul_mgpu.py`
(799 TFLOP/s on bf16 8192^3 on an H100, above cuBLAS): a persistent grid of one
CTA per SM walks the output tiles in a planar snake order; each CTA runs three
warpgroups: a memory warpgroup issuing TMA loads of A and B tiles into a
`max_concurrent_steps`-deep ring of swizzled SMEM buffers, and two compute
warpgroups, each accumulating a [block_m, block_n] float32 tile with `wgmma`
(the two split the CTA tile along M or N: `wg_dimension`). What differs is
the epilogue: instead of storing the accumulator, each compute warpgroup walks
its tile in [epi_tile_m, epi_tile_n] pieces and evaluates the group's own
jaxpr on them (`tiles.RegisterTiles`: the accumulator in the WGMMA register
layout, a bias [N] as a column vector, a per-row scale [M, 1] as a row vector,
a residual [M, N] as a tile, all brought into SMEM by TMA), then writes each
output of the group through SMEM with a TMA store.

An epilogue that reduces over segments of a product row (GroupNorm: `MatmulSpec.seg`, the epilogue rewritten
onto [..., N / seg, seg] by `passes.split_columns`) runs one epilogue piece per segment (`epi_tile_n` = seg, so
block_n holds whole segments): a segment's statistics are row reductions of the [epi_tile_m, seg] WGMMA piece
(each row's columns are held by the four threads of one quad, so they stay within a warp), row vectors that
broadcast back over the piece, where the normalisation runs before the piece is stored.

An epilogue may also sum a value over all the product's rows (`TileSpec.col_sums`: a dgrad GEMM with its bias's
gradient): each piece's column sums (`RegisterTiles.column_partial`, rows past M left out) go out by TMA as one
float32 row of a [pieces along M, N] array that XLA adds up (spanning every piece the tiles cover: no TMA
store of a sum goes past its array's edge). That reduction crosses the warps of a warpgroup through
Mosaic GPU's one reduction scratch; where both compute warpgroups run epilogues they take turns at it (`in_turn`).

Ragged shapes: no masks, and no padding to the tile sizes. TMA loads zero-fill
whatever part of a box lies outside the array (so the K tail contributes zeros
to the product, and the epilogue of rows / columns past the edge runs on zeros),
and TMA stores drop the part of a box outside the array, so nothing past the
edge is ever written. Interpret mode does the same (it pads out-of-bounds TMA
reads with zeros and clips out-of-bounds TMA writes). Two TMA rules remain,
and padding outside the kernel (an XLA copy of that array) is the price where
a shape breaks them: (1) Mosaic GPU views a swizzled array in its SMEM tiling,
so its minor dimension must be a multiple of the swizzle width (64 bf16
elements at 128 bytes) and its rows a multiple of 8. The operands take the
largest swizzle (128, 64, 32 bytes) that their shapes allow and are padded
only when none does (bf16: a minor dimension not a multiple of 16); epilogue
inputs and outputs whose shape allows no swizzle use plain SMEM instead (a
slower register <-> SMEM copy, no padding). (2) Every stride but the innermost
must be a multiple of 16 bytes: a plain-SMEM epilogue array whose rows are not
(bf16 with N % 8 != 0) is padded (an output: written padded, then sliced).

A dual GEMM (`MatmulSpec.dot2`: SwiGLU's gate and up projections of one A) runs a second B through the same ring
(its own TMA copies beside B's) into a second accumulator in each compute warpgroup, both wgmma'd from the same A
tile; the epilogue reads the two products. Two float32 accumulators take twice the registers, so a warpgroup's
tile is at most 128 x 64 (or 64 x 128), and the epilogue runs inline (no epilogue warpgroup, no clusters).

Products whose rows are not 16-byte multiples (N = 50257, GPT-2's vocabulary: no TMA descriptor of the [M, N]
array exists) are written through the same bytes seen as [M / 8, 8 N] (`interleave` = 8), whose rows are.
Rows r = 8 q + j of the product are row q of that view at column j N + c, so a tile of rows that share j is a box of
the view once A's rows are permuted outside the kernel (class j's rows together); its columns start where j N + c is
a multiple of 8 elements (16 bytes), so each class's tiles are shifted by (-j N) mod 8 columns, the last one moved
back to end inside the row (overlapping its neighbour: the same values written twice). What no tile covers, at most
the first and last 8 columns of a row, XLA computes from the group's own epilogue and writes into the product
(`RowClasses`). B's tiles must start at a multiple of 8 rows, so B is handed over as copies shifted by the rows each
class needs (0..7 for an odd N; XLA writes them each call). The stores go through plain SMEM: a swizzled store from a box start that is not a
multiple of the swizzle's width came out wrong on an H200 (a [M / 64, 64 N] view, relative error 0.94).

Operand layouts: A [M, K] or [K, M], B [K, N] or [N, K] are read as they are and
given to `wgmma` as transposed SMEM views for 16-bit types. float32 runs as TF32
(`wgmma` with tf32 operands, as XLA's default-precision float32 dot on Hopper),
which supports only K-major operands: A [K, M] and B [K, N] are transposed by
XLA outside the kernel for float32.

Declined (`Unsupported`, a `NotImplementedError`: the tuner counts the config
as infeasible): batched dots, prologues (work on an operand before the dot) but those
affine in A's source (a layer norm's second half: `prologue_fold` folds them around the GEMM),
epilogue outputs that are neither full [M, N] tiles nor sums over the rows, primitives the Mosaic GPU
lowering lacks (log1p, expm1, pow, floor, ...: see `tiles.check_nodes`),
configs that break a wgmma / TMA / layout rule (`check_config`).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections import OrderedDict
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ...graph import Group
from .. import prologue_fold
from ..matmul import MatmulSpec, unaligned_rows
from ..tiling import NoMatch
from ..tile_eval import add_partials, product_tile
from .gemm import LOW as _LOW, REDUCTION_SCRATCH, SMEM_LIMIT, SMEM_MARGIN, check_operand_tiles
from .gemm import approximate_math, interpret_params, require_smem
from .gemm import from_kernel as _from_kernel, kernel_dtype as _kernel_dtype
from .gemm import num_sms_default as _num_sms_default, operand_layout as _operand_layout, pad as _pad, pad_2d, pad_to as _pad_to
from .gemm import smem_transforms as _tf, tile_transforms as _tile_tf
from .tiles import COLS, FULL, NONE, ROWS, Unsupported, RegisterTiles, check_nodes, layout

BACKEND = "mosaic_gpu"
M_DIM, N_DIM = 0, 1  # as hopper_matmul_mgpu.MatmulDimension

#: Config parameters and their defaults (hopper_matmul_mgpu's best bf16 config on an H100).
DEFAULTS = {
    "block_m": 128,  # rows of the accumulator tile of ONE compute warpgroup (a multiple of 64: wgmma's M)
    "block_n": 128,  # columns of that tile (a multiple of 8, at most 256: wgmma's N)
    "block_k": 64,  # K per pipeline step; block_k * itemsize must be a multiple of 32 bytes (its swizzle)
    "max_concurrent_steps": 4,  # depth of the TMA ring of A/B SMEM buffers (pipeline stages; clamped to the K steps)
    "epi_tile_m": 64,  # rows of one epilogue piece (a multiple of 64 dividing block_m)
    "epi_tile_n": 64,  # columns of one epilogue piece (dividing block_n; * itemsize a multiple of 32 bytes)
    "grid_tile_width": 8,  # planar snake: output tiles walked in bands this many tiles wide (L2 reuse)
    "grid_minor_dim": N_DIM,  # the snake's minor dimension: 0 (M) or 1 (N)
    "wg_dimension": M_DIM,  # the two compute warpgroups split the CTA tile along 0 (M: CTA tile 2*block_m x block_n) or 1 (N)
    "epilogue_wg": 0,  # 1: a third warpgroup runs the epilogue of tile t while the compute warpgroups run tile t+1's mainloop
    "cluster": 0,  # 2-CTA clusters sharing an operand by TMA multicast: 0 none, 1 along M (B shared), 2 along N (A shared)
    "pingpong": 0,  # 1: the compute warpgroups take turns at whole [block_m, block_n] tiles (the CTA tile), one's epilogue beside the other's mainloop
    "interleave": 0,  # 8: outputs written through their [M / 8, 8 N] view (rows of unaligned N; `RowClasses`)
}
PARAMS = tuple(DEFAULTS)
#: Registers per thread of the memory, epilogue and (each of two) compute warpgroups with `epilogue_wg` (the SM's
#: 64K registers are 512 per thread of one warpgroup; a compute warpgroup's [128, 128] float32 accumulator alone
#: takes 128).
EPI_WG_REGISTERS = (40, 96, 184)
#: Registers per thread of the memory and (each of two) compute warpgroups with `pingpong` (as Pallas' own
#: warp-specialised pipeline gives them: (512 - 40) / 2, rounded down to a multiple of 8).
PINGPONG_REGISTERS = (40, 232)
#: The longest K for which `default_config` takes the ping-pong schedule (an H200 measured it ahead up to K = 2048, even
#: at 4096 and behind at 8192, where a tile's mainloop is long against its epilogue and two warpgroups sharing the
#: CTA's A tile reuse it).
PINGPONG_MAX_K = 2048
#: The ping-pong default's tile width for 16-bit GEMMs at least 8 such tiles wide (a 4-deep ring that fits): on an H200
#: 128 x 192 tiles ran GPT-2's K = 1024 GEMMs with an epilogue (bias + GELU, the QKV split, a dgrad's GELU') 2-5%
#: faster than 128 x 128 in bursts and 2-4% under the power cap (results/gemm_clocks_h200.md); a 3-deep ring lost.
PINGPONG_WIDE_N = 192
#: The largest [block_m, block_n] of a dual GEMM's warpgroup: its two float32 accumulators take what one
#: [128, 128] accumulator does (128 registers per thread).
DUAL_TILE = 128 * 64
@dataclasses.dataclass(frozen=True)
class Config:
    block_m: int
    block_n: int
    block_k: int
    max_concurrent_steps: int
    epi_tile_m: int
    epi_tile_n: int
    grid_tile_width: int
    grid_minor_dim: int
    wg_dimension: int
    epilogue_wg: int
    cluster: int
    pingpong: int
    interleave: int

    @staticmethod
    def of(config: dict) -> "Config":
        vals = {k: config.get(k, v) for k, v in DEFAULTS.items()}
        for k in ("grid_minor_dim", "wg_dimension"):
            vals[k] = _dim(vals[k])
        return Config(**{k: int(v) for k, v in vals.items()})

    @property
    def cta_m(self) -> int:
        return self.block_m * (2 if self.wg_dimension == M_DIM and not self.pingpong else 1)

    @property
    def cta_n(self) -> int:
        return self.block_n * (2 if self.wg_dimension == N_DIM and not self.pingpong else 1)

    @property
    def cluster_m(self) -> int:
        """CTAs of a cluster along M (its tile is cluster_m * cta_m rows)."""
        return 2 if self.cluster == 1 else 1

    @property
    def cluster_n(self) -> int:
        return 2 if self.cluster == 2 else 1


def _dim(x) -> int:
    if isinstance(x, str):
        return {"m": M_DIM, "n": N_DIM}[x.lower()]
    return int(x)


def default_config(spec: MatmulSpec, pingpong: bool = True) -> dict:
    """`schedule_config`, with a product whose rows TMA cannot write (`unaligned_rows`) written through its [M / 8, 8 N]
    view where the shapes allow (`RowClasses`)."""
    cfg = _tallest(spec, pingpong)
    try:
        spec = plain(spec)
    except Unsupported:
        return cfg
    if not unaligned_rows(spec):
        return cfg
    try:
        check_interleave(spec, Config.of({**cfg, "interleave": 8}))
    except Unsupported:
        return cfg
    return {**cfg, "interleave": 8}


def _tallest(spec: MatmulSpec, pingpong: bool) -> dict:
    """`schedule_config` with epilogue pieces as tall as the warpgroup's tile where the epilogue sums over the rows
    and they cost the tile and the ring nothing (half the reductions across warps: GPT-2's dgrad with GELU' and its
    bias's gradient ran 0.3397 against 0.3639 ms on an H200), else with its own pieces: where the taller pieces' SMEM
    took a slot of the ring, GPT-2's dgrads with a layer norm's sums ran 0.2552 against 0.2181 ms and its LM head's
    3.79 against 3.27 (results/sum_scratch_h200.md)."""
    flat = schedule_config(spec, pingpong)
    if not (spec.epi.col_sums and not spec.seg):
        return flat
    tall = schedule_config(spec, pingpong, tall=True)
    size = lambda c: (c["block_m"], c["block_n"], c["block_k"] * c["max_concurrent_steps"])  # noqa: E731
    return tall if all(t >= f for t, f in zip(size(tall), size(flat))) else flat


def schedule_config(spec: MatmulSpec, pingpong: bool = True, tall: bool = False) -> dict:
    """A good config without tuning. Up to K = `PINGPONG_MAX_K` the ping-pong schedule, its 128-byte K steps in a
    4-deep ring, its tiles walked in bands 16 wide (and `PINGPONG_WIDE_N` columns wide where N allows): on an H200
    it ran GPT-2's and a UNet's GEMMs with an epilogue
    (bias + GELU, the QKV split, GELU' of a dgrad, GroupNorm; K = 1024-2048) 2-9% faster than the cooperative default
    and tied a K = 4096 GEMM with a residual (results/gemm_pingpong_h200.md); a dual GEMM's two accumulators lost with it,
    and so did a dgrad with its bias's gradient (0.4005 against 0.3701 ms: the sums' turns at the reduction scratch).
    `tall`: an epilogue that sums over the rows takes pieces as tall as the warpgroup's tile (128 x 32 rather than
    64 x 64: the same SMEM, half the reductions across warps; `_tallest` says when).
    Otherwise (or with `pingpong` False) the cooperative schedule. On an H100 (bf16, bias+GELU 8192x4096x8192) K steps of 256 bytes in a 2-deep
    ring ran 0.830 ms against 0.882 for hopper_matmul_mgpu's 128-byte steps in a 4-deep ring (the ring's bytes are
    the same); where the epilogue's buffers leave no room for that, the 4-, 3-, 2-deep 128-byte rings (before the
    2-deep one, narrower epilogue pieces for a 3-deep ring: `_deeper_ring`), then
    narrower tiles, then smaller epilogue pieces and shorter tiles (a training step's epilogues with several outputs
    and inputs needed 242-274 KB at the narrowest tile: their first trial was infeasible, their plan of defaults did
    not bind)."""
    try:
        spec = plain(spec)
    except Unsupported:
        pass  # (check_group says why)
    cfg = dict(DEFAULTS)
    itemsize = np.dtype(spec.group.graph.avals[spec.a].dtype).itemsize
    if spec.N <= 64:
        cfg["block_n"] = 64
    if spec.M <= 128:
        cfg["wg_dimension"] = N_DIM if spec.N > 64 else M_DIM
        cfg["block_m"] = 64
    if cfg["wg_dimension"] == N_DIM and spec.N <= 128:
        cfg["block_n"] = 64
    if spec.dot2 is not None:  # two accumulators: one [64, 128] tile each per warpgroup (wgmma's widest N of the two)
        cfg["block_m"], cfg["block_n"] = 64, min(cfg["block_n"], 128)
    cfg["epi_tile_m"] = min(cfg["epi_tile_m"], cfg["block_m"])
    cfg["epi_tile_n"] = min(cfg["epi_tile_n"], cfg["block_n"])
    firsts = [first for parts in spec.windows.values() for _, first, _ in parts]
    while any(f % cfg["epi_tile_n"] for f in firsts) and cfg["epi_tile_n"] > 8:  # no piece across two split parts
        cfg["epi_tile_n"] //= 2
    if tall and spec.epi.col_sums and not spec.seg:  # pieces the height of the warpgroup's tile: one reduction across warps per column piece
        cfg["epi_tile_m"], cfg["epi_tile_n"] = cfg["block_m"], min(cfg["epi_tile_n"], 64 * 64 // cfg["block_m"])
    if spec.seg:  # one epilogue piece per segment, whole segments per tile
        cfg["block_n"] = max(cfg["block_n"], spec.seg) // spec.seg * spec.seg
        cfg["epi_tile_n"] = spec.seg
    wide = 128 // itemsize  # K elements of one 128-byte swizzle row
    if pingpong and spec.dot2 is None and not spec.epi.col_sums and 4 * wide <= spec.K <= PINGPONG_MAX_K:
        pp = {**cfg, "pingpong": 1, "grid_tile_width": 16, "block_k": wide}
        wide_n = itemsize == 2 and not spec.seg and cfg["block_n"] == 128 and spec.N >= 8 * PINGPONG_WIDE_N
        wider = [(PINGPONG_WIDE_N, 4)] if wide_n else []
        for bn, steps in wider + [(cfg["block_n"], 4), (cfg["block_n"], 3)]:
            pp["block_n"], pp["max_concurrent_steps"] = bn, steps
            if smem_bytes(spec, Config.of(pp)) <= SMEM_LIMIT:
                return pp
    rings = ([(2 * wide, 2)] if spec.K >= 4 * wide else []) + [(wide, 4), (wide, 3), (wide, 2)] if spec.K > wide else [(64 // itemsize, 4)]
    start = dict(cfg)
    while True:
        for bk, steps in rings:
            cfg["block_k"], cfg["max_concurrent_steps"] = bk, steps
            # (K of two such steps or fewer: no third step to hold)
            if (bk, steps) == (wide, 2) and spec.K > 2 * wide and (deeper := _deeper_ring(spec, cfg)):
                return deeper
            if smem_bytes(spec, Config.of(cfg)) <= SMEM_LIMIT:
                return cfg
        if not _shrink(cfg, spec.seg):
            if spec.epi.col_sums and not start["epilogue_wg"]:  # one epilogue warpgroup's buffers, not two
                cfg = start = {**start, "epilogue_wg": 1}
                continue
            return cfg  # the lowering's own check says why it does not fit


def _deeper_ring(spec: MatmulSpec, cfg: dict) -> dict | None:
    """`cfg` with a 3-deep ring of its K steps bought by narrower epilogue pieces (down to 32 columns; the tile kept),
    or None where none fits. Asked before settling for a 2-deep ring of 128-byte steps: on an H200 Llama's SwiGLU dual
    GEMM in the training step (three [8192, 8192] outputs) ran 0.774 ms with 32-column pieces and a 3-deep ring
    against 0.882 with 64-column pieces and a 2-deep one (XLA 0.788; results/dual_ring_h200.md)."""
    if spec.seg:
        return None
    deeper = {**cfg, "max_concurrent_steps": 3}
    while deeper["epi_tile_n"] > 32:
        deeper["epi_tile_n"] //= 2
        if smem_bytes(spec, Config.of(deeper)) <= SMEM_LIMIT:
            return deeper
    return None


def _shrink(cfg: dict, seg: int) -> bool:
    """The next smaller tile for `default_config`: a narrower block, then a narrower and a shorter epilogue piece,
    then a shorter block (each within its space's choices, whole segments kept); False when none is left."""
    if cfg["block_n"] > max(64, seg) and not (seg and (cfg["block_n"] // 2) % seg):
        cfg["block_n"] //= 2
        cfg["epi_tile_n"] = min(cfg["epi_tile_n"], cfg["block_n"])
    elif not seg and cfg["epi_tile_n"] > 32:
        cfg["epi_tile_n"] //= 2
    elif cfg["epi_tile_m"] > 64:
        cfg["epi_tile_m"] //= 2
    elif cfg["block_m"] > 64:
        cfg["block_m"] //= 2
    else:
        return False
    return True


# ---------------------------------------------------------------------------
# What is supported.
def plain(spec: MatmulSpec) -> MatmulSpec:
    """The spec the kernel runs: `spec` itself, or, for a group with an A prologue, the folded group's
    (`prologue_fold`: a layer norm's elementwise half folded around the GEMM); `Unsupported` where it does not fold
    (the Mosaic GPU lowering evaluates no prologue on operand tiles)."""
    return folded(spec).spec if spec.pro else spec


_FOLDS: OrderedDict[int, tuple[MatmulSpec, prologue_fold.PrologueFold | str]] = OrderedDict()  # id(spec) -> the fold or why none


def folded(spec: MatmulSpec) -> prologue_fold.PrologueFold:
    """`prologue_fold.fold(spec)`, made once per spec (the lowering's checks and `lower` each ask)."""
    hit = _FOLDS.get(id(spec))
    if hit is None or hit[0] is not spec:
        try:
            hit = (spec, prologue_fold.fold(spec))
        except NoMatch as e:
            hit = (spec, f"a prologue that does not fold around the GEMM: {e}")
        _FOLDS[id(spec)] = hit
        while len(_FOLDS) > 64:
            _FOLDS.popitem(last=False)
    if isinstance(hit[1], str):
        raise Unsupported(hit[1])
    return hit[1]


def check_group(spec: MatmulSpec) -> None:
    """Raise `Unsupported` if this lowering cannot implement the matched group at all (whatever the config)."""
    g = spec.group.graph
    dt = np.dtype(g.avals[spec.a].dtype)
    if spec.batch > 1:
        raise Unsupported("batched dot (spec.batch > 1): not yet in the Mosaic GPU lowering")
    spec = plain(spec)
    if spec.exact_f32:
        raise Unsupported("a float32 dot at precision=HIGHEST: wgmma runs float32 only as TF32 (the Triton lowering runs it as three-pass TF32)")
    if spec.epi.outer:
        raise Unsupported("an epilogue input over the leading row axes only (one row per outer index): not yet in the Mosaic GPU lowering")
    if dt not in _LOW and dt != np.dtype(jnp.float32):
        raise Unsupported(f"operand dtype {dt}: wgmma takes bf16, f16 and float32 (as TF32)")
    check_nodes([n for n in spec.epi_nodes if n.id not in spec.epi.col_sum_nodes], reductions=bool(spec.seg))
    if spec.seg and any(n.name == "iota" for n in spec.epi_nodes):
        raise Unsupported("an iota in an epilogue over segments of a row: not in the Mosaic GPU lowering")
    if spec.windows and spec.seg:
        raise Unsupported("a split product with an epilogue over segments of a row")
    if spec.dot2 is not None and (spec.seg or spec.windows or spec.epi.col_sums):
        raise Unsupported("a dual GEMM's epilogue is elementwise: no segments, split or sums over the rows")
    for v in full_outputs(spec):  # (a sum over the rows is none: a partial per epilogue piece, `RegisterTiles.column_partial`)
        if v not in spec.products and spec.epi.layout_span(v) != FULL:
            raise Unsupported(f"output %{v} {g.avals[v]} is not a full [M, N] tile of the product")
        if np.dtype(g.avals[v].dtype) == np.dtype(bool):
            raise Unsupported(f"bool output %{v}")
    for v in epi_inputs(spec):
        if v in (spec.a, spec.b, spec.b2):
            raise Unsupported("an operand of the dot read again by the epilogue")
        if np.dtype(g.avals[v].dtype).itemsize > 4:
            raise Unsupported(f"64-bit epilogue input %{v}")
    if spec.dot2 is not None and (need := smem_bytes(spec, Config.of(default_config(spec)))) > SMEM_LIMIT:
        # (no epilogue warpgroup to fall back on: the narrowest tile `default_config` finds is the narrowest there is)
        raise Unsupported(f"a dual GEMM with {len(full_outputs(spec))} outputs: shared memory even at the narrowest tile "
                          f"{need} > {SMEM_LIMIT}")


def full_outputs(spec: MatmulSpec) -> list[int]:
    """The values written as [M, N] tiles: the group's outputs but its sums over the rows, a split value
    (`MatmulSpec.windows`) in place of its parts."""
    part_of = {p: u for u, parts in spec.windows.items() for p, _, _ in parts}
    out: list[int] = []
    for v in spec.group.outputs:
        w = part_of.get(v, v)
        if v not in spec.epi.col_sums and w not in out:
            out.append(w)
    return out


def targets(spec: MatmulSpec, v: int) -> tuple[tuple[int, int, int], ...]:
    """Where a written value goes: ((array, first column, columns), ...), its split's parts, else itself whole."""
    return spec.windows.get(v) or ((v, 0, spec.N),)


def epi_inputs(spec: MatmulSpec) -> list[int]:
    """The epilogue's inputs from outside the group, in first-use order (the dots' outputs excluded)."""
    return [v for v in spec.epi.group.inputs if v not in spec.products] if spec.epi_nodes else []


def check_config(spec: MatmulSpec, cfg: Config) -> None:
    """Raise `Unsupported` for a config that breaks a wgmma, TMA, layout or shared-memory rule."""
    spec = plain(spec)
    itemsize = np.dtype(spec.group.graph.avals[spec.a].dtype).itemsize
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    f32 = itemsize == 4
    check_operand_tiles(itemsize, spec.a_km and not f32, spec.b_nk or f32, bm, bn, bk)
    if cfg.epi_tile_m % 64 or bm % cfg.epi_tile_m:
        raise Unsupported(f"epi_tile_m={cfg.epi_tile_m} must be a multiple of 64 dividing block_m={bm}")
    if bn % cfg.epi_tile_n or cfg.epi_tile_n % 8:
        raise Unsupported(f"epi_tile_n={cfg.epi_tile_n} must divide block_n={bn} and be a multiple of 8")
    if spec.seg and cfg.epi_tile_n != spec.seg:
        raise Unsupported(f"epi_tile_n={cfg.epi_tile_n}: the epilogue reduces over segments of {spec.seg} columns, "
                          "one epilogue piece per segment (epi_tile_n = the segment length)")
    if cfg.max_concurrent_steps < 1 or cfg.grid_tile_width < 1:
        raise Unsupported("max_concurrent_steps and grid_tile_width must be >= 1")
    if cfg.wg_dimension not in (M_DIM, N_DIM) or cfg.grid_minor_dim not in (M_DIM, N_DIM):
        raise Unsupported("wg_dimension / grid_minor_dim must be 0 (M) or 1 (N)")
    if cfg.epilogue_wg not in (0, 1):
        raise Unsupported("epilogue_wg must be 0 or 1")
    if cfg.epilogue_wg and spec.seg:
        raise Unsupported("epilogue_wg=1: an epilogue over segments of a row runs in the compute warpgroups")
    if cfg.cluster not in (0, 1, 2):
        raise Unsupported("cluster must be 0 (none), 1 (M) or 2 (N)")
    if cfg.epilogue_wg and cfg.cluster:
        raise Unsupported("epilogue_wg=1 runs its own pipeline: no clusters")
    if cfg.pingpong not in (0, 1):
        raise Unsupported("pingpong must be 0 or 1")
    if cfg.pingpong and cfg.epilogue_wg:
        raise Unsupported("pingpong=1 runs its own pipeline, the epilogues inline: no epilogue warpgroup")
    if spec.dot2 is not None and (cfg.epilogue_wg or cfg.cluster or bm * bn > DUAL_TILE):
        raise Unsupported(f"a dual GEMM keeps two float32 accumulators per warpgroup: block_m * block_n <= {DUAL_TILE} "
                          f"(here {bm} x {bn}), the epilogue inline (epilogue_wg=0), no clusters")
    g = spec.group.graph
    for v in tuple(full_outputs(spec)) + tuple(v for v in epi_inputs(spec) if spec.epi.span[v] == FULL):
        if (cfg.epi_tile_n * np.dtype(g.avals[v].dtype).itemsize) % 32 and np.dtype(g.avals[v].dtype) != np.dtype(bool):
            raise Unsupported(f"epi_tile_n={cfg.epi_tile_n}: epilogue tiles of %{v} ({g.avals[v].dtype}) need rows of 32-byte multiples")
    for v in epi_inputs(spec):
        sp = spec.epi.span[v]
        n = bm if sp == ROWS else bn if sp == COLS else 0
        if n and (n * _kernel_dtype(g.avals[v].dtype).itemsize) % 128:
            raise Unsupported(f"a {'row' if sp == ROWS else 'column'} vector input %{v} of {n} x {g.avals[v].dtype} per warpgroup: "
                              "TMA copies here must move a multiple of 128 bytes")
    for u, parts in spec.windows.items():
        for _, first, cols in parts:
            if first % cfg.epi_tile_n:
                raise Unsupported(f"a split part at columns {first}..{first + cols} is not a whole number of epi_tile_n={cfg.epi_tile_n} "
                                  "pieces: a piece would straddle two parts")
    check_interleave(spec, cfg)
    require_smem(smem_bytes(spec, cfg))


def tile_slots(spec: MatmulSpec, cfg: Config) -> int:
    """SMEM slots per epilogue warpgroup for the [M, N] inputs of its pieces: two (the next piece's land during this
    one's math) where the warpgroup runs more than one piece and they fit, else one."""
    spec = plain(spec)
    pieces = (cfg.block_m // cfg.epi_tile_m) * (cfg.block_n // cfg.epi_tile_n) * (2 if cfg.epilogue_wg else 1)
    return 2 if pieces > 1 and smem_bytes(spec, cfg, 2) <= SMEM_LIMIT else 1


def smem_bytes(spec: MatmulSpec, cfg: Config, slots: int | None = None) -> int:
    """Shared memory the kernel allocates (the A/B ring, the epilogue's input and output buffers, barriers), roughly;
    `slots` per [M, N] input (`tile_slots`; None: as many as the kernel will take)."""
    spec = plain(spec)
    g = spec.group.graph
    itemsize = np.dtype(g.avals[spec.a].dtype).itemsize
    k_steps = -(-spec.K // cfg.block_k)
    stages = min(cfg.max_concurrent_steps, k_steps)
    ring = stages * (cfg.cta_m + len(spec.products) * cfg.cta_n) * cfg.block_k * itemsize  # (pingpong: one warpgroup's tile)
    em, en = cfg.epi_tile_m, cfg.epi_tile_n
    out_slots = min(2, (cfg.block_m * cfg.block_n) // (em * en))
    copies = 1 if cfg.epilogue_wg else 2  # per warpgroup that runs an epilogue
    slots = tile_slots(spec, cfg) if slots is None else slots
    outs = sum(copies * out_slots * em * en * np.dtype(g.avals[v].dtype).itemsize for v in full_outputs(spec))
    outs += copies * out_slots * en * 4 * len(spec.epi.col_sums)  # a sum's float32 partials, staged for their TMA store
    ins = 0
    for v in epi_inputs(spec):
        sp, isz = spec.epi.span[v], _kernel_dtype(g.avals[v].dtype).itemsize
        vec = (cfg.cta_m if sp == ROWS else cfg.cta_n) if cfg.epilogue_wg else 2 * (em if sp == ROWS else en)
        ins += isz * (copies * slots * em * en if sp == FULL else vec if sp in (ROWS, COLS) else 0)
    if cfg.epilogue_wg:  # the product handed from the compute warpgroups to the epilogue's, in the dot's own dtype
        ins += cfg.cta_m * cfg.cta_n * np.dtype(g.avals[spec.dot.outputs[0]].dtype).itemsize
    scratch = REDUCTION_SCRATCH if spec.seg or spec.epi.col_sums else 0  # Mosaic GPU reserves it in a kernel with reductions
    return ring + outs + ins + scratch + SMEM_MARGIN  # barriers and alignment (the estimate is within ~1.1 KB of what Mosaic GPU counts)


# ---------------------------------------------------------------------------
# Products with unaligned rows.
def check_interleave(spec: MatmulSpec, cfg: Config) -> None:
    """Raise `Unsupported` where the outputs cannot be written through their [M / 8, 8 N] view (`RowClasses`)."""
    G = cfg.interleave
    if not G:
        return
    g = spec.group.graph
    if G != 8:
        raise Unsupported(f"interleave={G}: 0 or 8 rows per view row (a wider view's swizzled stores from 8-column "
                          "boundaries came out wrong on an H200)")
    if spec.M % G or (spec.M // G) % (cfg.cta_m * cfg.cluster_m):
        raise Unsupported(f"interleave={G}: M = {spec.M} is not G x a multiple of the CTA's {cfg.cta_m * cfg.cluster_m} rows")
    if spec.N < cfg.cta_n + 2 * RowClasses.BORDER:
        raise Unsupported(f"interleave={G}: N = {spec.N} is narrower than a tile and its border columns")
    if cfg.cluster == 1:
        raise Unsupported("interleave: the CTAs of a cluster along M would read B at different columns")
    if spec.dot2 is not None or spec.seg or spec.windows or spec.epi.col_sums:
        raise Unsupported("interleave: a dual GEMM, segments, a split product or sums over the rows")
    if any(spec.epi.span[v] == FULL for v in epi_inputs(spec)):
        raise Unsupported("interleave: an epilogue input of the product's shape")
    if any(n.name == "iota" for n in spec.epi_nodes):
        raise Unsupported("interleave: an iota in the epilogue (the rows are permuted)")
    if any(np.dtype(g.avals[v].dtype).itemsize < 2 for v in full_outputs(spec)):
        raise Unsupported("interleave: an output of 1-byte elements")


@dataclasses.dataclass(frozen=True)
class RowClasses:
    """Where the tiles of a product written through its [M / G, G N] view go (`interleave` = G).

    Row r = G q + j of the product is row q of the view at column j N + c. A's rows are permuted outside the kernel so
    that class j's M / G rows are rows j M / G.. of the A the kernel reads (`permute`), and a tile (whose rows share j)
    is one box of the view. TMA writes a box from a 16-byte boundary, i.e. where j N + c is a multiple of 8: class j's
    tiles start at `first(j)` = (-j N) mod 8 and every `width` columns after it, the last moved back to end inside the
    row. The columns before first(j) and after the last tile (fewer than `BORDER` at each end) XLA fills in. Mosaic GPU
    reads a B tile only from a multiple of 8 rows (from any other its values come out wrong on the GPU, not in interpret
    mode), so B and the column vectors are handed over as copies shifted by d rows for each shift d = (j N) mod 8 some
    class needs (`shifted`: 8 / gcd(N, 8) of them), and class j reads the copy shifted by its own: up to 8 x B written
    by XLA each call (GPT-2's tied embedding, N odd: 0.8 GB; a vocabulary of 32002: 4 copies)."""
    G: int
    M: int
    N: int
    width: int  # columns of a CTA tile
    BORDER = 8  # columns at each end of a row that XLA writes

    @property
    def rows(self) -> int:
        """Rows of each class."""
        return self.M // self.G

    def cls(self, r0):
        return lax.div(r0, self.rows)

    def first(self, j):
        return lax.rem(8 - lax.rem(j * self.N, 8), 8)

    def col0(self, r0, n_idx):
        """The first column of the tile at A row r0 (of the permuted A), the n_idx-th of its row of tiles."""
        a = self.first(self.cls(r0))
        return jnp.minimum(a + n_idx * self.width, a + 8 * lax.div(self.N - self.width - a, 8))

    def out_at(self, ref, r0, c0, rows: int, cols: int):
        """The view's box of the tile piece at (permuted) A row r0, product column c0."""
        j = self.cls(r0)
        return ref.at[pl.ds(r0 - j * self.rows, rows), pl.ds(j * self.N + c0, cols)]

    @property
    def step(self) -> int:
        """The shifts the classes need are the multiples of this below 8 (`shifted` makes one copy per shift)."""
        return math.gcd(self.N, 8)

    def shift(self, r0):
        """How far class cls(r0)'s copy of B and of the column vectors is shifted (`shifted`): its tiles' first columns
        + this are multiples of 8."""
        return lax.rem(self.cls(r0) * self.N, 8)

    def vec_at(self, ref, r0, c0, cols: int):
        """A column vector's slice for the tile at (r0, c0), from its `shifted` copies, at a 16-byte boundary."""
        d = self.shift(r0)
        return ref.at[lax.div(d, self.step), pl.ds(c0 + d, cols)]

    def b_at(self, ref, r0, c0, rows: int, ks=slice(None)):
        """B's rows c0.. (the tile's columns) from its `shifted` copies [copies, N + 8, K], at a multiple of 8 rows: Mosaic
        GPU reads a B tile (8-row swizzle atoms) only from such a row (from any other its values come out wrong)."""
        d = self.shift(r0)
        return ref.at[lax.div(d, self.step), pl.ds(c0 + d, rows), ks]

    # outside the kernel
    def permute(self, x, axis: int):
        """x with its `axis` (the product's M) in class order."""
        x = jnp.moveaxis(x, axis, 0)
        x = jnp.reshape(jnp.swapaxes(jnp.reshape(x, (self.rows, self.G) + x.shape[1:]), 0, 1), x.shape)
        return jnp.moveaxis(x, 0, axis)

    def shifted(self, v):
        """A column vector [N] or B [N, K] as copies [8 / step, N + 8 (, K)], the i-th shifted by i x step (`vec_at`,
        `b_at`)."""
        n = -(-(self.N + 8) // 8) * 8 if v.ndim == 2 else _pad_to(self.N + 8, v.dtype.itemsize)
        v = v[:self.N]
        return jnp.stack([jnp.pad(v, [(d, n - self.N - d)] + [(0, 0)] * (v.ndim - 1)) for d in range(0, 8, self.step)])

    def fill_borders(self, out, border: Callable):
        """The product [M, N] from the view, its first and last `BORDER` columns replaced by `border(c0, cols)`."""
        out = jnp.reshape(out, (self.M, self.N))
        b = self.BORDER
        out = lax.dynamic_update_slice(out, border(0, b).astype(out.dtype), (0, 0))
        return lax.dynamic_update_slice(out, border(self.N - b, b).astype(out.dtype), (0, self.N - b))


def _border_columns(spec: MatmulSpec, a, b, vecs: dict, v: int, dtype, c0: int, cols: int):
    """Output `v`'s columns c0.. c0 + cols by XLA: A [M, K] times those rows of B [N, K], then the group's own
    epilogue on that [M, cols] tile (`RowClasses`: the columns no tile of the kernel writes)."""
    g = spec.group.graph
    acc = lax.dot_general(a, lax.slice_in_dim(b, c0, c0 + cols, axis=0), (((1,), (1,)), ((), ())),
                          preferred_element_type=jnp.float32)
    tiles = RegisterTiles(spec.epi, spec.M, cols)
    env = {spec.products[0]: product_tile(acc, spec)}
    for u, x in vecs.items():
        sp = spec.epi.span[u]
        env[u] = _from_kernel(x[0] if sp == NONE else x[c0:c0 + cols] if sp == COLS else x, g.avals[u].dtype)
    for nd in spec.epi_nodes:
        tiles.eval_node(nd, env)
    return tiles.store_value(env, v, dtype)


# ---------------------------------------------------------------------------
# The lowering.
def lower(group: Group, spec: MatmulSpec, config: dict, *, interpret=False, num_sms: int | None = None,
          approx_math: bool | None = None) -> Callable:
    """A function of the group's inputs (in `group.inputs` order) giving its outputs (in `group.outputs` order).

    `config`: the parameters in `DEFAULTS` (missing ones take their defaults).
    `interpret`: True runs under Mosaic GPU interpret mode (CPU; simulates GMEM/SMEM, warpgroups, barriers, TMA);
    a `plgpu.InterpretGPUParams` runs it with those parameters (e.g. `detect_races=True`).
    `num_sms`: CTAs of the persistent grid (at most one per output tile); None: the device's SM count
    (132 on an H100), read when the function is traced. Interpret mode runs the CTAs one after another, so
    a small number there only changes which CTA does which tile.
    `approx_math`: None decides by the group's dtypes (`gemm.approximate_math`); a bool forces it (benchmarks).
    Raises `Unsupported` (a NotImplementedError) for what this lowering does not do.
    """
    if spec is None:
        raise Unsupported("the group is not a matmul")
    if approx_math is None:
        approx_math = approximate_math(group)
    if spec.pro:  # the GEMM on the prologue's source, the prologue's factors in its epilogue
        fold = folded(spec)
        return fold.around(lower(fold.spec.group, fold.spec, config, interpret=interpret, num_sms=num_sms, approx_math=approx_math))
    check_group(spec)
    cfg = Config.of(config)
    check_config(spec, cfg)
    g = group.graph
    dt = np.dtype(g.avals[spec.a].dtype)
    itemsize = dt.itemsize
    f32 = dt == np.dtype(jnp.float32)
    M, N, K = spec.M, spec.N, spec.K
    rc = RowClasses(cfg.interleave, M, N, cfg.cta_n) if cfg.interleave else None
    # float32 (TF32) wgmma: K-major operands only; row classes read B's rows from any column (B [K, N] transposed outside)
    a_km, b_nk = spec.a_km and not f32, spec.b_nk or f32 or rc is not None
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    cta_m, cta_n = cfg.cta_m, cfg.cta_n
    em, en = cfg.epi_tile_m, cfg.epi_tile_n
    m_iters, n_iters, k_iters = -(-M // cta_m), -(-N // cta_n), -(-K // bk)
    stages = min(cfg.max_concurrent_steps, k_iters)
    wg_m = cfg.wg_dimension == M_DIM

    out_v = spec.dot.outputs[0]
    dual = spec.dot2 is not None
    epi_nodes = spec.epi_nodes
    ein = epi_inputs(spec)
    espan = {v: spec.epi.span[v] for v in ein}
    tile_in = [v for v in ein if espan[v] == FULL]  # fetched per epilogue piece
    vec_in = [v for v in ein if espan[v] in (ROWS, COLS)]  # fetched once per output tile (a warpgroup's bm rows / bn columns)
    scalar_in = [v for v in ein if espan[v] == NONE]
    tiles = RegisterTiles(spec.epi, em, en)
    outs = full_outputs(spec)
    out_dt = [np.dtype(g.avals[v].dtype) for v in outs]
    sums = [v for v in group.outputs if v in spec.epi.col_sums]  # written as float32 partials, one row per piece
    n_stores = len(outs) + len(sums)  # TMA stores per piece

    # How each array meets TMA: operands swizzled (wgmma requires it, one swizzle for both), epilogue tiles swizzled
    # where the array's shape allows, else plain SMEM; padded outside only where a TMA rule leaves no choice.
    a_rows, a_cols = (K, M) if a_km else (M, K)
    b_rows, b_cols = (N, K) if b_nk else (K, N)
    swizzle, a_pad, b_pad = _operand_layout(itemsize, (a_rows, a_cols), bm if a_km else bk, (b_rows, b_cols), bk if b_nk else bn, bk)
    op_tf = _tf(swizzle, itemsize)
    in_tf = {v: _tile_tf(_kernel_dtype(g.avals[v].dtype), (M, N), en) for v in ein if espan[v] == FULL}
    in_cols = {v: _pad_to(N, _kernel_dtype(g.avals[v].dtype).itemsize) for v in in_tf}
    out_shape = (M // rc.G, rc.G * N) if rc else (M, N)  # as the kernel writes the outputs
    # through the view, plain SMEM: a swizzled TMA store from a box start that is not a multiple of the swizzle's width
    # came out wrong on an H200 (`check_interleave`)
    out_tf = [() if rc else _tile_tf(d, out_shape, en) for d in out_dt]

    chain = k_iters % stages == 0  # Pallas chains the tiles' pipelines only when the ring's depth divides the K steps
    cl_m_iters, cl_n_iters = -(-m_iters // cfg.cluster_m), -(-n_iters // cfg.cluster_n)  # cluster tiles
    PP = plgpu.PipelinePipeline
    n_pieces = (bm // em) * (bn // en)
    out_slots = min(2, n_pieces)
    n_tile_slots = tile_slots(spec, cfg)

    def cta_origin(lin):
        """The first row and column of this CTA's output tile, the `lin`-th of its walk (a planar snake over the
        clusters' tiles; a cluster's CTAs take neighbouring tiles along its dimension)."""
        m_idx, n_idx = plgpu.planar_snake(lin, (cl_m_iters, cl_n_iters), cfg.grid_minor_dim, cfg.grid_tile_width)
        if cfg.cluster:
            cta = lax.axis_index("cluster")
            m_idx, n_idx = (m_idx * 2 + cta, n_idx) if cfg.cluster == 1 else (m_idx, n_idx * 2 + cta)
        if rc is not None:
            return m_idx * cta_m, rc.col0(m_idx * cta_m, n_idx)
        return m_idx * cta_m, n_idx * cta_n

    def vec_src(ref, v, r0, c0, rows: int, cols: int):
        """The slice of vector input `v` for the rows r0.. or columns c0.. of a tile."""
        if espan[v] == ROWS:
            return ref.at[pl.ds(r0, rows)]
        return rc.vec_at(ref, r0, c0, cols) if rc is not None else ref.at[pl.ds(c0, cols)]

    def wgmma_step(acc_refs, a_smem, b_smems, wg_rows, wg_cols) -> None:
        """acc += A[wg_rows] @ B[:, wg_cols] from one ring slot (transposed views where stored so), waited for; a
        dual GEMM's second accumulator from the same A and its own B. (`gemm.Operands.wgmma` is the same for
        `matmul_reduce`; this lowering keeps its own operand layout.)"""
        a = a_smem.at[:, wg_rows].T if a_km else a_smem.at[wg_rows]
        for acc_ref, b_smem in zip(acc_refs, b_smems):
            plgpu.wgmma(acc_ref, a, b_smem.at[wg_cols].T if b_nk else b_smem.at[:, wg_cols])
        plgpu.wgmma_wait(0)

    def epilogue_piece(products: list, scalars: dict, vec_part: Callable, tile_ref: Callable, tile_bar, out_slots_at: list, out_gmem,
                       r0, c0, fetch_next: Callable | None, sum_slots_at: tuple = (), sum_gmem: tuple = (),
                       in_turn: Callable | None = None) -> None:
        """One [em, en] piece of the epilogue at rows r0.., columns c0..: the group's jaxpr on the products and the
        inputs' pieces (`vec_part(v)`, `tile_ref(v)`: their SMEM, the tiles behind `tile_bar`), its outputs written
        into `out_slots_at` (its sums' partials into `sum_slots_at`, row r0 // em of theirs) and stored from there
        by TMA; `fetch_next` issues the tiles of the piece after the next into this piece's SMEM slot once every
        thread has read these (after the commit's barrier): double-buffered, the next piece's tiles land during this
        one's math instead of after it (a dgrad GEMM's GELU' reads h [M, N] per piece). `in_turn(make)` runs the
        sums' reductions across warps when this warpgroup's turn comes (two warpgroups share Mosaic GPU's one
        reduction scratch)."""
        env = {**dict(zip(spec.products, products)), **scalars}
        for v in vec_in:
            env[v] = _from_kernel(plgpu.load(vec_part(v), layout=layout(espan[v])), g.avals[v].dtype)
        if tile_in:
            plgpu.barrier_wait(tile_bar)
            for v in tile_in:
                # plain (unswizzled) SMEM has no bank-conflict-free plan: allow the slower one
                env[v] = _from_kernel(plgpu.load(tile_ref(v), layout=layout(FULL), optimized=bool(in_tf[v])), g.avals[v].dtype)
        for nd in epi_nodes:
            if nd.id not in spec.epi.col_sum_nodes:
                tiles.eval_node(nd, env, r0, c0)
        make = lambda: [tiles.column_partial(env, v, r0, M) for v in sums]  # noqa: E731
        parts = in_turn(make) if in_turn is not None and sums else make()
        plgpu.wait_smem_to_gmem(n_stores * (out_slots - 1), wait_read_only=True)
        for v, d, sm in zip(outs, out_dt, out_slots_at):
            sm[...] = tiles.store_value(env, v, d)
        for part, sm in zip(parts, sum_slots_at):
            sm[...] = part
        plgpu.commit_smem()
        if fetch_next is not None:
            fetch_next()
        for sm, dests in zip(out_slots_at, out_gmem):
            store_piece(sm, dests, r0, c0)
        for sm, o in zip(sum_slots_at, sum_gmem):
            plgpu.copy_smem_to_gmem(sm, o.at[r0 // em, pl.ds(c0, en)])

    def store_piece(sm, dests: list, r0, c0) -> None:
        """TMA one [em, en] piece from SMEM to its array: the one split part whose columns hold it (the last part
        takes what lies past the edge, which TMA drops), else the whole value's."""
        if len(dests) == 1:
            ref = dests[0][0]
            plgpu.copy_smem_to_gmem(sm, rc.out_at(ref, r0, c0, em, en) if rc is not None else ref.at[pl.ds(r0, em), pl.ds(c0, en)])
            return
        for k, (ref, first, cols) in enumerate(dests):
            inside = c0 >= first if k == len(dests) - 1 else (c0 >= first) & (c0 < first + cols)

            @pl.when(inside)
            def _(ref=ref, first=first):
                plgpu.copy_smem_to_gmem(sm, ref.at[pl.ds(r0, em), pl.ds(c0 - first, en)])

    n_refs = sum(len(targets(spec, v)) for v in outs)

    def dests_of(refs) -> list[list]:
        """The kernel's output refs, per written value, as [(ref, first column, columns), ...] (`targets`)."""
        it = iter(refs)
        return [[(next(it), first, cols) for _, first, cols in targets(spec, v)] for v in outs]

    kdt = {v: _kernel_dtype(g.avals[v].dtype) for v in ein}  # the epilogue's inputs as the kernel holds them

    def refs_after_operands(rest) -> tuple:
        """The kernel's refs after its operands: the epilogue's inputs (by value), the written values' refs
        (`dests_of`), the sums' partials."""
        return dict(zip(ein, rest[: len(ein)])), dests_of(rest[len(ein):len(ein) + n_refs]), rest[len(ein) + n_refs:]

    def operand_rings(n_b: int) -> dict:
        """The hand-written pipelines' SMEM rings of A [cta_m] and of each of `n_b` Bs [cta_n], swizzled for wgmma."""
        return {"a_ring": plgpu.SMEM((stages, *((bk, cta_m) if a_km else (cta_m, bk))), dt, transforms=op_tf),
                "b_rings": [plgpu.SMEM((stages, *((cta_n, bk) if b_nk else (bk, cta_n))), dt, transforms=op_tf) for _ in range(n_b)]}

    def epilogue_scratch() -> dict:
        """SMEM and barriers of the epilogues run by the two compute warpgroups (one slot set per warpgroup)."""
        return {
            "out_smem": [plgpu.SMEM((2, out_slots, em, en), d, transforms=tf) for d, tf in zip(out_dt, out_tf)],
            "tile_smem": [plgpu.SMEM((2 * n_tile_slots, em, en), kdt[v], transforms=in_tf[v]) for v in tile_in],
            "vec_smem": [plgpu.SMEM((2, bm if espan[v] == ROWS else bn), kdt[v]) for v in vec_in],
            "tile_barrier": plgpu.Barrier(num_arrivals=len(tile_in), num_barriers=2 * n_tile_slots) if tile_in else None,
            "vec_barrier": plgpu.Barrier(num_arrivals=len(vec_in), num_barriers=2) if vec_in else None,
            "sum_smem": [plgpu.SMEM((2, out_slots, en), jnp.float32) for _ in sums],
            "turns": plgpu.Barrier(num_arrivals=1, num_barriers=2) if sums else None,  # warpgroup w's reduction done
        }

    @dataclasses.dataclass
    class WarpgroupEpilogue:
        """The epilogue of one compute warpgroup's [bm, bn] tile at rows wg_r0.., columns wg_c0.., run inline by that
        warpgroup: `prefetch()` issues its inputs' TMA loads (before the mainloop, so that they overlap it), `run(accs)`
        evaluates the pieces on the accumulators and stores them. The refs are the `epilogue_scratch` ones."""
        in_gmem: dict
        out_gmem: list
        sum_gmem: tuple
        out_smem: list
        tile_smem: dict
        vec_smem: dict
        tile_barrier: object
        vec_barrier: object
        sum_smem: list
        in_turn: Callable | None
        wg: object
        wg_r0: object
        wg_c0: object

        def piece_origin(self, i: int):
            return self.wg_r0 + (i // (bn // en)) * em, self.wg_c0 + (i % (bn // en)) * en

        def tile_slot(self, i: int):
            return self.wg * n_tile_slots + i % n_tile_slots

        def fetch_tiles(self, i: int) -> None:
            """TMA the epilogue's [M, N] inputs of piece i into this warpgroup's SMEM slot of it (zero past the edges)."""
            r0, c0 = self.piece_origin(i)
            for v in tile_in:
                plgpu.copy_gmem_to_smem(self.in_gmem[v].at[pl.ds(r0, em), pl.ds(c0, en)], self.tile_smem[v].at[self.tile_slot(i)],
                                        self.tile_barrier.at[self.tile_slot(i)])

        def prefetch(self) -> None:
            for v in vec_in:
                src = vec_src(self.in_gmem[v], v, self.wg_r0, self.wg_c0, bm, bn)
                plgpu.copy_gmem_to_smem(src, self.vec_smem[v].at[self.wg], self.vec_barrier.at[self.wg])
            for i in range(n_tile_slots if tile_in else 0):
                self.fetch_tiles(i)

        def run(self, accs: list, first) -> None:
            """`first`: this is the CTA's first tile (no reduction turn of the other warpgroup before it)."""
            wg = self.wg
            scalars = {v: _from_kernel(self.in_gmem[v][0], g.avals[v].dtype) for v in scalar_in}
            if vec_in:
                plgpu.barrier_wait(self.vec_barrier.at[wg])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            for i in range(n_pieces):
                mi, ni = divmod(i, bn // en)
                epilogue_piece(
                    [product_tile(acc[mi * em:(mi + 1) * em, ni * en:(ni + 1) * en], spec) for acc in accs], scalars,
                    lambda v: self.vec_smem[v].at[wg, pl.ds(mi * em, em)] if espan[v] == ROWS else self.vec_smem[v].at[wg, pl.ds(ni * en, en)],
                    lambda v, i=i: self.tile_smem[v].at[self.tile_slot(i)], self.tile_barrier.at[self.tile_slot(i)] if tile_in else None,
                    [sm.at[wg, i % out_slots] for sm in self.out_smem], self.out_gmem, *self.piece_origin(i),
                    functools.partial(self.fetch_tiles, i + n_tile_slots) if tile_in and i + n_tile_slots < n_pieces else None,
                    tuple(sm.at[wg, i % out_slots] for sm in self.sum_smem), self.sum_gmem,
                    functools.partial(self.in_turn, first=first & (i == 0)) if self.in_turn is not None else None)

    def body(a_gmem, b_gmem, *rest):
        b_gmems, rest = (b_gmem, *rest[:int(dual)]), rest[int(dual):]  # a dual GEMM's second B comes next
        in_gmem, out_gmem, sum_gmem = refs_after_operands(rest)

        def pipeline(mma_body, compute_context, state=None):
            # In a cluster along N both CTAs read the same A rows (multicast to both), along M the same B columns.
            a_spec = plgpu.BlockSpec((bk, cta_m) if a_km else (cta_m, bk), (lambda k: (k, 0)) if a_km else (lambda k: (0, k)),
                                     transforms=op_tf, memory_space=plgpu.SMEM,
                                     collective_axes=("cluster",) if cfg.cluster == 2 else ())
            b_spec = plgpu.BlockSpec((cta_n, bk) if b_nk else (bk, cta_n), (lambda k: (0, k)) if b_nk else (lambda k: (k, 0)),
                                     transforms=op_tf, memory_space=plgpu.SMEM,
                                     collective_axes=("cluster",) if cfg.cluster == 1 else ())
            return plgpu.emit_pipeline_warp_specialized(
                mma_body, grid=(k_iters,), memory_registers=40, in_specs=[a_spec] + [b_spec] * len(b_gmems), wg_axis="wg", num_compute_wgs=2,
                max_concurrent_steps=stages, compute_context=compute_context, pipeline_state=state)

        ignore = lambda *_, **__: None  # noqa: E731
        scratch = {"pipeline_allocs": pipeline(ignore, ignore).get_allocations(a_gmem, *b_gmems), **epilogue_scratch()}

        @functools.partial(pl.run_scoped, **scratch, collective_axes="wg")
        def _scope(pipeline_allocs, out_smem, tile_smem, vec_smem, tile_barrier, vec_barrier, sum_smem, turns):
            wg = lax.axis_index("wg")

            def in_turn(make: Callable, first) -> list:
                """`make()` (the sums' reductions across warps) in this warpgroup's turn: warpgroup 1 after warpgroup
                0's of the same piece, warpgroup 0 after warpgroup 1's of the piece before (none before `first`)."""
                @pl.when(wg == 1)
                def _():
                    plgpu.barrier_wait(turns.at[0])

                @pl.when((wg == 0) & jnp.logical_not(first))
                def _():
                    plgpu.barrier_wait(turns.at[1])

                parts = make()
                plgpu.barrier_arrive(turns.at[wg])
                return parts
            tile_smem = dict(zip(tile_in, tile_smem))
            vec_smem = dict(zip(vec_in, vec_smem))

            @plgpu.nd_loop((cl_m_iters * cl_n_iters,), collective_axes="sm")
            def _tile_loop(info: plgpu.NDLoopInfo):
                cta_r0, cta_c0 = cta_origin(info.index[0])
                wg_rows = pl.ds(wg * bm, bm) if wg_m else slice(None)
                wg_cols = slice(None) if wg_m else pl.ds(wg * bn, bn)
                epi = WarpgroupEpilogue(in_gmem, out_gmem, sum_gmem, out_smem, tile_smem, vec_smem, tile_barrier, vec_barrier,
                                        sum_smem, in_turn, wg, cta_r0 + (wg * bm if wg_m else 0), cta_c0 + (0 if wg_m else wg * bn))

                def compute_context(eval_pipeline):
                    epi.prefetch()

                    @functools.partial(pl.run_scoped, acc_refs=[plgpu.ACC((bm, bn), jnp.float32) for _ in b_gmems])
                    def _acc_scope(acc_refs):
                        eval_pipeline(tuple(acc_refs))
                        epi.run([r[...] for r in acc_refs], info.local_index == 0)

                def mma_body(_, a_smem, *b_smems_and_accs):
                    *b_smems, acc_refs = b_smems_and_accs
                    wgmma_step(acc_refs, a_smem, b_smems, wg_rows, wg_cols)
                    return acc_refs

                a_view = a_gmem.at[:, pl.ds(cta_r0, cta_m)] if a_km else a_gmem.at[pl.ds(cta_r0, cta_m), :]
                b_views = [rc.b_at(b, cta_r0, cta_c0, cta_n) if rc is not None else b.at[pl.ds(cta_c0, cta_n), :] if b_nk
                           else b.at[:, pl.ds(cta_c0, cta_n)] for b in b_gmems]
                state = None
                if chain:  # one pipeline over the CTA's tiles: the producer fetches the next tile's operands during the epilogue
                    first, last = info.local_index == 0, info.local_index == info.num_local_steps - 1
                    state = jnp.where(first, int(PP.START), jnp.where(last, int(PP.STOP), int(PP.STEADY)))
                pipeline(mma_body, compute_context, state)(a_view, *b_views, allocations=pipeline_allocs)

            if sums:  # the last turn of warpgroup 1, observed like the others (every phase of a barrier is waited on)
                @pl.when(wg == 0)
                def _():
                    plgpu.barrier_wait(turns.at[1])

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    def tiles_loop(fn):
        """Run fn(info, row0, col0) on each of this CTA's output tiles (the same walk in every warpgroup, and in
        both CTAs of a cluster: the clusters' tiles, each CTA its part of one)."""
        @plgpu.nd_loop((cl_m_iters * cl_n_iters,), collective_axes="sm")
        def _loop(info: plgpu.NDLoopInfo):
            fn(info, *cta_origin(info.index[0]))

    def produce(a_gmem, b_gmems, a_ring, b_rings, full_at: Callable, empty_at: Callable) -> None:
        """The memory warpgroup of a hand-written pipeline: each K step of each of the CTA's tiles, its A rows and B
        columns by TMA into the step's ring slot (arriving on `full_at(step, slot)`), once the step that used the
        slot before released it (`empty_at(that step, slot)`); at the end the ring's last releases are waited on too
        (every phase of a barrier is waited on)."""
        @tiles_loop
        def _(info, r0, c0):
            @pl.loop(0, k_iters)
            def _k(k):
                step = info.local_index * k_iters + k
                slot = lax.rem(step, stages)

                @pl.when(step >= stages)
                def _():
                    plgpu.barrier_wait(empty_at(step - stages, slot))

                ks = pl.ds(k * bk, bk)
                bar = full_at(step, slot)
                plgpu.copy_gmem_to_smem(a_gmem.at[ks, pl.ds(r0, cta_m)] if a_km else a_gmem.at[pl.ds(r0, cta_m), ks], a_ring.at[slot], bar,
                                        collective_axes="cluster" if cfg.cluster == 2 else None)
                for b, ring in zip(b_gmems, b_rings):
                    src = rc.b_at(b, r0, c0, cta_n, ks) if rc is not None else b.at[pl.ds(c0, cta_n), ks] if b_nk else b.at[ks, pl.ds(c0, cta_n)]
                    plgpu.copy_gmem_to_smem(src, ring.at[slot], bar,
                                            collective_axes="cluster" if cfg.cluster == 1 else None)

            @pl.when(info.local_index == info.num_local_steps - 1)
            def _drain():
                @pl.loop(0, stages)
                def _(j):
                    step = (info.local_index + 1) * k_iters - stages + j
                    plgpu.barrier_wait(empty_at(step, lax.rem(step, stages)))

    def body_pingpong(a_gmem, b_gmem, *rest):
        """Three warpgroups: a memory one (TMA) and two compute ones that take turns at the CTA's output tiles (its
        j-th to warpgroup j % 2), each running a whole [block_m, block_n] tile and then its epilogue inline, so that
        one warpgroup's epilogue runs while the other's mainloop keeps the tensor cores busy (CUTLASS's ping-pong
        schedule; the cooperative one above stops the tensor cores for every tile's epilogue).

        One ring of operand slots filled in the walk's order, so the next tile's first steps land while this one's
        last run and the warpgroups' mainloops follow each other. Its barriers are per warpgroup (`full` / `empty`
        at w * stages + slot): a barrier's phase is tracked by each thread that waits on it, so a warpgroup may wait
        only on a barrier every phase of which it observes. An epilogue that sums over the rows takes Mosaic GPU's one
        reduction scratch after the tile before's (`turns`: the warpgroups' epilogues follow each other in the walk's
        order anyway, a mainloop apart). Each warpgroup keeps one step's wgmma in flight while it
        issues the next, releasing a slot a step late (waiting for each step before releasing its slot lost 5-12% on
        an H200, results/gemm_pingpong_h200.md), so the ring needs a third slot for the producer to run ahead.

        In a 2-CTA cluster (cuBLAS's schedule at K = 1024 on an H100/H200: ping-pong, 2 x 1 clusters) the CTAs walk the
        same cluster tiles in step, the shared operand's slot filled in both by one multicast copy, so a slot's
        `empty` barrier is the cluster's: refilled once the owning warpgroup of each CTA released it."""
        b_gmems, rest = (b_gmem, *rest[:int(dual)]), rest[int(dual):]
        in_gmem, out_gmem, sum_gmem = refs_after_operands(rest)
        scratch = {
            **operand_rings(len(b_gmems)),
            "full": plgpu.Barrier(num_arrivals=1 + len(b_gmems), num_barriers=2 * stages),
            # in a cluster a slot is refilled (by multicast, in every CTA of it) once both CTAs' warpgroups released it
            "empty": plgpu.ClusterBarrier(collective_axes=("cluster",), num_arrivals=1, num_barriers=2 * stages) if cfg.cluster
            else plgpu.Barrier(num_arrivals=1, num_barriers=2 * stages),
            **epilogue_scratch(),
        }
        groups = len(b_gmems)  # wgmma commit groups per step

        @functools.partial(pl.run_scoped, **scratch, collective_axes="wg")
        def _scope(a_ring, b_rings, full, empty, out_smem, tile_smem, vec_smem, tile_barrier, vec_barrier, sum_smem, turns):
            wg = lax.axis_index("wg")
            tile_smem = dict(zip(tile_in, tile_smem))
            vec_smem = dict(zip(vec_in, vec_smem))

            def owner(step):
                return lax.rem(lax.div(step, k_iters), 2)

            @pl.when(wg == 2)
            def _memory():
                plgpu.set_max_registers(PINGPONG_REGISTERS[0], action="decrease")
                produce(a_gmem, b_gmems, a_ring, b_rings, lambda step, slot: full.at[owner(step) * stages + slot],
                        lambda step, slot: empty.at[owner(step) * stages + slot])

            @pl.when(wg < 2)
            def _compute():
                plgpu.set_max_registers(PINGPONG_REGISTERS[1], action="increase")

                @tiles_loop
                def _(info, r0, c0):
                    @pl.when(lax.rem(info.local_index, 2) == wg)
                    def _mine():
                        epi = WarpgroupEpilogue(in_gmem, out_gmem, sum_gmem, out_smem, tile_smem, vec_smem, tile_barrier,
                                                vec_barrier, sum_smem, None, wg, r0, c0)
                        epi.prefetch()

                        @functools.partial(pl.run_scoped, acc_refs=[plgpu.ACC((bm, bn), jnp.float32) for _ in b_gmems])
                        def _acc_scope(acc_refs):
                            def release(k):  # the slot of this tile's k-th step, whose wgmma has completed
                                plgpu.barrier_arrive(empty.at[wg * stages + lax.rem(info.local_index * k_iters + k, stages)])

                            @pl.loop(0, k_iters)
                            def _k(k):
                                slot = lax.rem(info.local_index * k_iters + k, stages)
                                plgpu.barrier_wait(full.at[wg * stages + slot])
                                a = a_ring.at[slot]
                                a = a.T if a_km else a
                                for acc_ref, ring in zip(acc_refs, b_rings):
                                    plgpu.wgmma(acc_ref, a, ring.at[slot].T if b_nk else ring.at[slot])
                                plgpu.wgmma_wait(groups)  # the step before this one is done: its slot is free

                                @pl.when(k > 0)
                                def _():
                                    release(k - 1)

                            plgpu.wgmma_wait(0)
                            release(k_iters - 1)
                            accs = [r[...] for r in acc_refs]
                            if sums:  # the reduction scratch: after the tile before's epilogue (the other warpgroup's)
                                @pl.when(info.local_index > 0)
                                def _():
                                    plgpu.barrier_wait(turns.at[1 - wg])
                            epi.run(accs, info.local_index < 2)
                            if sums:
                                plgpu.barrier_arrive(turns.at[wg])

                    if sums:  # the last tile's turn, observed by the other warpgroup too (every phase is waited on)
                        last = info.num_local_steps - 1

                        @pl.when((info.local_index == last) & (lax.rem(last, 2) != wg))
                        def _():
                            plgpu.barrier_wait(turns.at[1 - wg])

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    dot_dt = np.dtype(g.avals[out_v].dtype)
    stage_tf = _tile_tf(dot_dt, (bm, bn), en)
    pieces_per_wg = [(w, i) for w in range(2) for i in range(n_pieces)]

    def body_epilogue_wg(a_gmem, b_gmem, *rest):
        """Four warpgroups: two compute (wgmma into [block_m, block_n] accumulators), one epilogue, one memory (TMA).

        The compute warpgroups hand each tile's product to the epilogue warpgroup through SMEM (in the dot's own
        dtype, the value the program's next equation reads) and go on to the next tile's mainloop at once, so the
        epilogue (the group's jaxpr on the tile, the stores) runs beside the tensor cores instead of between their
        tiles. Barriers: `full`/`empty` per ring slot (TMA landed / both compute warpgroups done with it), `staged`
        (both halves of a product written), `free` (the epilogue has read them all)."""
        in_gmem, out_gmem, sum_gmem = refs_after_operands(rest)
        scratch = {
            **operand_rings(1),
            "stage": plgpu.SMEM((2, bm, bn), dot_dt, transforms=stage_tf),
            "out_smem": [plgpu.SMEM((out_slots, em, en), d, transforms=tf) for d, tf in zip(out_dt, out_tf)],
            "sum_smem": [plgpu.SMEM((out_slots, en), jnp.float32) for _ in sums],
            "tile_smem": [plgpu.SMEM((n_tile_slots, em, en), kdt[v], transforms=in_tf[v]) for v in tile_in],
            "vec_smem": [plgpu.SMEM((cta_m if espan[v] == ROWS else cta_n,), kdt[v]) for v in vec_in],
            "full": plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            "empty": plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            "staged": plgpu.Barrier(num_arrivals=2),
            "free": plgpu.Barrier(num_arrivals=1),
            "tile_barrier": plgpu.Barrier(num_arrivals=len(tile_in), num_barriers=n_tile_slots) if tile_in else None,
            "vec_barrier": plgpu.Barrier(num_arrivals=len(vec_in)) if vec_in else None,
        }

        @functools.partial(pl.run_scoped, **scratch, collective_axes="wg")
        def _scope(a_ring, b_rings, stage, out_smem, sum_smem, tile_smem, vec_smem, full, empty, staged, free, tile_barrier, vec_barrier):
            wg = lax.axis_index("wg")
            tile_smem = dict(zip(tile_in, tile_smem))
            vec_smem = dict(zip(vec_in, vec_smem))

            @pl.when(wg == 3)
            def _memory():
                plgpu.set_max_registers(EPI_WG_REGISTERS[0], action="decrease")
                produce(a_gmem, [b_gmem], a_ring, b_rings, lambda step, slot: full.at[slot], lambda step, slot: empty.at[slot])

            @pl.when(wg < 2)
            def _compute():
                plgpu.set_max_registers(EPI_WG_REGISTERS[2], action="increase")
                wg_rows = pl.ds(wg * bm, bm) if wg_m else slice(None)
                wg_cols = slice(None) if wg_m else pl.ds(wg * bn, bn)

                @tiles_loop
                def _(info, r0, c0):
                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((bm, bn), jnp.float32))
                    def _acc_scope(acc_ref):
                        @pl.loop(0, k_iters)
                        def _k(k):
                            slot = lax.rem(info.local_index * k_iters + k, stages)
                            plgpu.barrier_wait(full.at[slot])
                            wgmma_step((acc_ref,), a_ring.at[slot], (b_rings[0].at[slot],), wg_rows, wg_cols)
                            plgpu.barrier_arrive(empty.at[slot])

                        acc = acc_ref[...].astype(dot_dt)

                        @pl.when(info.local_index > 0)
                        def _():
                            plgpu.barrier_wait(free)  # the epilogue has read the previous tile's product

                        stage[wg] = acc
                        plgpu.barrier_arrive(staged)

                        @pl.when(info.local_index == info.num_local_steps - 1)
                        def _():
                            plgpu.barrier_wait(free)  # the last tile's hand-over, observed like the others

            @pl.when(wg == 2)
            def _epilogue():
                plgpu.set_max_registers(EPI_WG_REGISTERS[1], action="decrease")

                @tiles_loop
                def _(info, r0, c0):
                    def origin(w: int, i: int):
                        mi, ni = divmod(i, bn // en)
                        return (w * bm if wg_m else 0) + mi * em, (0 if wg_m else w * bn) + ni * en

                    def fetch_tiles(j: int):
                        """TMA the [M, N] inputs of the j-th piece (`pieces_per_wg`) into slot j % n_tile_slots."""
                        pr, pc = origin(*pieces_per_wg[j])
                        for v in tile_in:
                            plgpu.copy_gmem_to_smem(in_gmem[v].at[pl.ds(r0 + pr, em), pl.ds(c0 + pc, en)], tile_smem[v].at[j % n_tile_slots],
                                                    tile_barrier.at[j % n_tile_slots])

                    for v in vec_in:  # issued before the product is ready, so that they overlap the mainloop
                        plgpu.copy_gmem_to_smem(vec_src(in_gmem[v], v, r0, c0, cta_m, cta_n), vec_smem[v], vec_barrier)
                    for j in range(n_tile_slots if tile_in else 0):
                        fetch_tiles(j)
                    scalars = {v: _from_kernel(in_gmem[v][0], g.avals[v].dtype) for v in scalar_in}
                    plgpu.barrier_wait(staged)
                    if vec_in:
                        plgpu.barrier_wait(vec_barrier)
                    for j, (w, i) in enumerate(pieces_per_wg):
                        pr, pc = origin(w, i)
                        mi, ni = divmod(i, bn // en)
                        x = plgpu.load(stage.at[w, pl.ds(mi * em, em), pl.ds(ni * en, en)], layout=layout(FULL),
                                       optimized=bool(stage_tf))
                        if j == len(pieces_per_wg) - 1:
                            plgpu.barrier_arrive(free)  # every piece of the product is in registers
                        epilogue_piece(
                            [x.astype(jnp.float32)], scalars,
                            lambda v: vec_smem[v].at[pl.ds(pr, em)] if espan[v] == ROWS else vec_smem[v].at[pl.ds(pc, en)],
                            lambda v, j=j: tile_smem[v].at[j % n_tile_slots], tile_barrier.at[j % n_tile_slots] if tile_in else None,
                            [sm.at[j % out_slots] for sm in out_smem], out_gmem, r0 + pr, c0 + pc,
                            functools.partial(fetch_tiles, j + n_tile_slots) if tile_in and j + n_tile_slots < len(pieces_per_wg) else None,
                            tuple(sm.at[j % out_slots] for sm in sum_smem), sum_gmem)

                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    # Arrays as the kernel sees them: 2-D operands, epilogue inputs as [M, N] / [M] / [N] / [1]; padded where TMA needs it.
    if rc is not None:
        out_type = [jax.ShapeDtypeStruct(out_shape, d) for d in out_dt]
    else:
        out_type = [jax.ShapeDtypeStruct((M, _pad_to(cols, d.itemsize)), d) for v, d in zip(outs, out_dt) for _, _, cols in targets(spec, v)]
    # one row of partials per piece, for every piece of every tile the walk visits: a piece wholly past N still stores
    # its partials (a TMA store to columns past the array's edge put wrong sums in its last columns on an H200 where
    # N = 1024 met 192-column tiles, right in interpret mode), so the array spans them; read back to M and N only
    sum_shape = (cl_m_iters * cfg.cluster_m * cta_m // em, cl_n_iters * cfg.cluster_n * cta_n)
    out_type += [jax.ShapeDtypeStruct(sum_shape, jnp.float32) for _ in sums]
    name = f"autofuse_matmul_mgpu_{group.signature[:8]}"
    interp = interpret_params(interpret)  # True, or an InterpretGPUParams (e.g. with detect_races=True)

    def run(*xs):
        env = dict(zip(group.inputs, xs))
        a0 = jnp.reshape(env[spec.a], (K, M) if spec.a_km else (M, K))
        if rc is None and spec.a_km == a_km:  # as stored: padded in its own shape where it can be (`pad_2d`)
            args = [pad_2d(env[spec.a], (a_rows, a_cols), a_pad)]
        else:
            a = a0.T if spec.a_km and not a_km else a0
            args = [_pad(a if rc is None else rc.permute(a, 1 if a_km else 0), a_pad)]
        bs = []
        for bv in (spec.b, spec.b2)[:1 + dual]:
            b = jnp.reshape(env[bv], (N, K) if spec.b_nk else (K, N))
            if b_nk and not spec.b_nk:
                b = b.T
            bs.append(b)
            if rc is None and b_nk == spec.b_nk:
                args.append(pad_2d(env[bv], (b_rows, b_cols), b_pad))
            else:
                args.append(_pad(b, b_pad) if rc is None else rc.shifted(_pad(b, b_pad)))
        vecs = {}
        for v in ein:
            x = env[v]
            if np.dtype(x.dtype) == np.dtype(bool):
                x = x.astype(jnp.int8)
            sp = espan[v]
            x = vecs[v] = jnp.reshape(x, (M, N) if sp == FULL else (M,) if sp == ROWS else (N,) if sp.cols else (1,))
            if rc is not None and sp in (ROWS, COLS):
                x = rc.permute(x, 0) if sp == ROWS else rc.shifted(x)
            args.append(_pad(x, (M, in_cols[v])) if sp == FULL else x)
        sms = num_sms if num_sms is not None else _num_sms_default()
        csize = cfg.cluster_m * cfg.cluster_n
        cluster = dict(cluster=(csize,), cluster_names=("cluster",)) if csize > 1 else {}
        call = plgpu.kernel(
            body_epilogue_wg if cfg.epilogue_wg else body_pingpong if cfg.pingpong else body, out_type=out_type,
            grid=(max(1, min(sms // csize, cl_m_iters * cl_n_iters)),), grid_names=("sm",), **cluster,
            num_threads=4 if cfg.epilogue_wg else 3, thread_name="wg",
            compiler_params=plgpu.CompilerParams(approx_math=approx_math, lowering_semantics=plgpu.LoweringSemantics.Lane),
            interpret=interp,
            kernel_name=name)
        res = call(*args)
        res = res if isinstance(res, (list, tuple)) else [res]
        if rc is not None:
            def border(v, d):
                return lambda c0, cols: _border_columns(spec, a0.T if spec.a_km else a0, bs[0], vecs, v, d, c0, cols)
            res = [rc.fill_borders(r, border(v, d)) for v, d, r in zip(outs, out_dt, res)]
        parts = [(p, cols) for v in outs for p, _, cols in targets(spec, v)]
        done = {p: jnp.reshape(r[:, :cols], g.avals[p].shape) for (p, cols), r in zip(parts, res)}
        done.update({v: add_partials(spec.epi, v, r[:-(-M // em), :N]) for v, r in zip(sums, res[n_refs:])})
        return [done[v] for v in group.outputs]

    return run
