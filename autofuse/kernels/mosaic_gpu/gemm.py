"""Pieces every Mosaic GPU wgmma lowering shares: how the operands and epilogue arrays meet TMA and SMEM, the wgmma
operand rules, the warp-specialised mainloop's block specs and its wgmma call, and how arrays are passed in.

Moved out of `matmul.py` (which imports them back under their old private names) so that `matmul_reduce.py` reuses
them instead of copying them. The rules are the ones `matmul.py`'s docstring explains: operands take the largest
swizzle (128, 64, 32 bytes) that their SMEM tiles, block_k and both arrays' minor dimensions allow, and are padded
outside the kernel only when none does; float32 runs as TF32 with K-major operands only (transposed by XLA outside).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ... import interpret_cpu
from ...graph import Group
from .tiles import Unsupported

SMEM_LIMIT = 232448  # bytes of shared memory per CTA on an H100/H200 (the Mosaic GPU error message's max_smem_bytes)
LOW = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
TMA_ALIGN = 16  # bytes: TMA strides (all but the innermost) must be multiples of this
SMEM_MARGIN = 2048  # barriers and alignment (`matmul.smem_bytes` is within ~1.1 KB of what Mosaic GPU counts with it)
SMEM_ALIGNMENT = 1024  # Mosaic GPU rounds every SMEM allocation (each ref of a run_scoped) up to this many bytes
BARRIER_BYTES = 8  # an mbarrier
REDUCTION_SCRATCH = 2048  # SMEM Mosaic GPU reserves when a kernel has any reduction (CompilerParams.reduction_scratch_bytes)


#: Primitives whose approximate form under `CompilerParams(approx_math=True)` is coarse: `tanh.approx.f32`, about
#: 2^-11 relative. The others it changes in a float32 epilogue are exp and log (`ex2.approx` / `lg2.approx` of the
#: argument times log2(e): about 2^-22 relative plus that product's rounding, a few float32 ulps).
COARSE_APPROX = frozenset({"tanh"})


def approximate_math(group: Group) -> bool:
    """Whether a Mosaic GPU epilogue may use the GPU's approximate transcendentals: where every output of the group
    is a 16-bit float, whose own rounding (2^-9 relative for bfloat16) is coarser than any of them; or where the
    group has none of the coarse ones (`COARSE_APPROX`) and every output is computed from a 16-bit float inside it,
    so that it carries that float's error and is checked at its bound (`runner.measure.cone_tolerances`): GPT-2's
    cross-entropy rows, float32 from bf16 logits. On an H100 the exact tanh made the GEMM + bias + GELU kernel 1.16x
    slower at K = 1024 (results/gemm_epilogue_h100.md); the exact exp was a quarter of the cross-entropy kernel's
    instructions. A float32 program keeps the exact functions."""
    avals = group.graph.avals
    low = lambda v: np.dtype(avals[v].dtype) in LOW  # noqa: E731
    if all(low(v) for v in group.outputs):
        return True
    if any(nd.name in COARSE_APPROX for nd in group.nodes):
        return False
    members = {nd.id for nd in group.nodes}
    producer = group.graph.producer

    def from_low(v: int) -> bool:
        seen, todo = set(), [v]
        while todo:
            x = todo.pop()
            if x in seen:
                continue
            seen.add(x)
            if low(x):
                return True
            nid = producer.get(x)
            if nid is not None and nid in members:
                todo.extend(a for a in group.graph.node_index[nid].inputs if isinstance(a, int))
        return False

    return all(isinstance(v, int) and from_low(v) for v in group.outputs)


def require_smem(need: int) -> None:
    """Refuse a config whose shared memory (as Mosaic GPU counts it) exceeds the limit, in Mosaic's own words."""
    if need > SMEM_LIMIT:
        from .tiles import Unsupported

        raise Unsupported(f"shared memory: smem_bytes={need} > max_smem_bytes={SMEM_LIMIT}")


def smem_alloc(nbytes: int) -> int:
    """The shared memory one SMEM allocation of `nbytes` takes, as Mosaic GPU counts it (for `smem_bytes=` in its
    'exceeds available shared memory' check)."""
    return -(-nbytes // SMEM_ALIGNMENT) * SMEM_ALIGNMENT


def swizzle(minor_elems: int, itemsize: int) -> int:
    """The largest swizzle (bytes) a tile with this many elements in its minor dimension allows."""
    return plgpu.find_swizzle(minor_elems * itemsize * 8)


def smem_transforms(swizzle_bytes: int, itemsize: int) -> tuple:
    """SMEM transforms for a swizzled tile: (8, swizzle bytes) tiles, as wgmma and the fast register stores want."""
    return (plgpu.TilingTransform((8, swizzle_bytes // itemsize)), plgpu.SwizzleTransform(swizzle_bytes))


def fits(n: int, tile: int) -> bool:
    """Mosaic GPU views a TMA'd array in its SMEM tiling: each tiled dimension must be a multiple of the tile
    (or smaller than it, which we do not rely on: the box would then be larger than the array)."""
    return n % tile == 0


def operand_layout(itemsize: int, a_shape, a_minor_tile: int, b_shape, b_minor_tile: int, block_k: int):
    """(swizzle, A's padded shape, B's padded shape) for the wgmma operands.

    The swizzle is the largest that both SMEM tiles' minor dimensions and block_k allow (wgmma issues K in groups
    of the swizzle's width, even for an M- or N-major operand; 128 bytes for a 64-wide bf16 K tile)
    and that both arrays' minor dimensions are multiples of (no padding); if none of 32, 64, 128 bytes fits the
    arrays, the tiles' swizzle is used and the arrays' minor dimensions are zero-padded to it. Rows are padded to a
    multiple of 8 (the tiling's other side) when needed. Padding is an XLA copy of that operand outside the kernel.
    """
    cap = min(swizzle(a_minor_tile, itemsize), swizzle(b_minor_tile, itemsize), swizzle(block_k, itemsize), 128)
    sw = next((s for s in (128, 64, 32) if s <= cap and all(fits(sh[1], s // itemsize) for sh in (a_shape, b_shape))), cap)

    def padded(shape):
        r, c = shape
        e = sw // itemsize
        return -(-r // 8) * 8, -(-c // e) * e

    return sw, padded(a_shape), padded(b_shape)


def tile_transforms(dtype, shape, minor_tile: int) -> tuple:
    """SMEM transforms for an epilogue input / output tile of an array of `shape`: swizzled when the array's shape
    allows a swizzle of at least 32 bytes, else none (plain SMEM: a slower register <-> SMEM copy, but no padding)."""
    isz = np.dtype(dtype).itemsize
    if not fits(shape[0], 8):
        return ()
    for s in (128, 64, 32):
        e = s // isz
        if minor_tile % e == 0 and fits(shape[1], e):
            return smem_transforms(s, isz)
    return ()


def check_operand_tiles(itemsize: int, a_km: bool, b_nk: bool, bm: int, bn: int, bk: int) -> None:
    """Raise `Unsupported` for warpgroup tiles [bm, bn] / K steps bk that break a wgmma or operand-swizzle rule.
    `a_km` / `b_nk`: the operands' stored orientation as the kernel reads them (K-major for float32)."""
    if bm % 64 or bm <= 0:
        raise Unsupported(f"block_m={bm}: a warpgroup's wgmma tile needs a multiple of 64 rows")
    if bn % 8 or not 8 <= bn <= 256:
        raise Unsupported(f"block_n={bn}: wgmma takes N in [8, 256], a multiple of 8")
    if (bk * itemsize) % 32:
        raise Unsupported(f"block_k={bk}: block_k * itemsize must be a multiple of 32 bytes (the operand swizzle)")
    sw = min(swizzle(bm if a_km else bk, itemsize), swizzle(bk if b_nk else bn, itemsize), swizzle(bk, itemsize))
    if sw < 32:
        raise Unsupported(f"operand tiles {bm}x{bk} / {bk}x{bn} allow only a {sw}-byte swizzle (wgmma needs >= 32)")


def kernel_dtype(dtype) -> np.dtype:
    """How an array is passed to the kernel: bool as int8 (TMA copies bytes)."""
    return np.dtype(np.int8) if np.dtype(dtype) == np.dtype(bool) else np.dtype(dtype)


def compute_dtype(dtype) -> np.dtype:
    d = np.dtype(dtype)
    return np.dtype(np.float32) if d in LOW else d


def from_kernel(x, dtype):
    """A loaded epilogue input in the dtype the tile evaluator holds it in (bool back from int8, low floats widened)."""
    if np.dtype(dtype) == np.dtype(bool):
        return x != 0
    return x.astype(compute_dtype(dtype))


def pad_to(n: int, itemsize: int) -> int:
    """`n` rounded up so that a row of n elements is a multiple of 16 bytes (a TMA stride)."""
    q = TMA_ALIGN // math.gcd(TMA_ALIGN, itemsize)
    return -(-n // q) * q


def pad(x, shape):
    """x zero-padded at the end of each dimension to `shape` (no copy when it already has that shape)."""
    if tuple(x.shape) == tuple(shape):
        return x
    return jnp.pad(x, [(0, t - s) for s, t in zip(x.shape, shape)])


def pad_2d(x, shape: tuple[int, int], padded: tuple[int, int]):
    """x (any rank, `shape` once flattened to 2-D) as the 2-D array `padded`, zero-padded. Where only the minor axis
    grows and x's own last axis is it, x is padded in its own shape and then reshaped: the same pad another group (or
    `aligned_dot`) makes of the same array, which XLA then makes once (GPT-2's step padded its logits' gradient twice,
    as [16384, 50304] and as [8, 2048, 50304]: 1.6 GB more at the peak)."""
    if padded[0] == shape[0] and x.ndim > 2 and x.shape[-1] == shape[1] and padded[1] != shape[1]:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, padded[1] - shape[1])])
        return jnp.reshape(x, padded)
    return pad(jnp.reshape(x, shape), padded)


def num_sms_default() -> int:
    """The SM count of the device the kernel will run on: the abstract mesh's device (export), else the default device."""
    dev = jax.sharding.get_abstract_mesh().abstract_device
    if dev is not None and getattr(dev, "num_cores", None):
        return int(dev.num_cores)
    d = jax.devices()[0]
    return int(getattr(d, "core_count", 0) or 0) or 132


def interpret_params(interpret):
    """`interpret=` of a lowering as `plgpu.kernel` takes it: None, or an InterpretGPUParams (True: the defaults).
    RuntimeError (one line) where this process's XLA:CPU could deadlock on the simulated warpgroups (`interpret_cpu`)."""
    if not interpret:
        return None
    if (why := interpret_cpu.unsafe_reason()) is not None:
        raise RuntimeError(why)
    return plgpu.InterpretGPUParams() if interpret is True else interpret


@dataclasses.dataclass(frozen=True)
class Operands:
    """The two wgmma operands of a warp-specialised mainloop: how they are stored, swizzled and padded.

    `a_km` / `b_nk` are the orientations the kernel reads (A [K, M] / B [N, K]); float32 (TF32) forces K-major
    operands, so `of` turns a stored [K, M] A / [K, N] B of float32 into transposes made outside (`prepare`).
    The CTA reads [cta_m, bk] of A and [bk, cta_n] of B per pipeline step; each compute warpgroup multiplies
    its `wg_m` rows by its `wg_n` columns of them.
    """

    itemsize: int
    stored_a_km: bool
    stored_b_nk: bool
    a_km: bool
    b_nk: bool
    M: int
    N: int
    K: int
    cta_m: int
    cta_n: int
    bk: int
    swizzle: int
    a_shape: tuple  # A as passed to the kernel (2-D, padded)
    b_shape: tuple

    @staticmethod
    def of(dtype, a_km: bool, b_nk: bool, M: int, N: int, K: int, *, wg_m: int, wg_n: int, cta_m: int, cta_n: int,
           bk: int) -> "Operands":
        isz = np.dtype(dtype).itemsize
        f32 = np.dtype(dtype) == np.dtype(jnp.float32)
        ka, kb = a_km and not f32, b_nk or f32
        a_rc = (K, M) if ka else (M, K)
        b_rc = (N, K) if kb else (K, N)
        sw, a_pad, b_pad = operand_layout(isz, a_rc, wg_m if ka else bk, b_rc, bk if kb else wg_n, bk)
        return Operands(isz, a_km, b_nk, ka, kb, M, N, K, cta_m, cta_n, bk, sw, a_pad, b_pad)

    @property
    def k_iters(self) -> int:
        return -(-self.K // self.bk)

    def ring_bytes(self, stages: int) -> int:
        """SMEM of the A/B ring of `stages` pipeline steps (two allocations) and its produced / consumed barriers."""
        tile = self.bk * self.itemsize
        return smem_alloc(stages * self.cta_m * tile) + smem_alloc(stages * self.cta_n * tile) + 2 * stages * BARRIER_BYTES

    def prepare(self, a, b) -> tuple:
        """(A, B) as the kernel reads them, from A stored [K, M] or [M, K] and B stored [N, K] or [K, N] (any
        leading shape that reshapes to those): reshaped, transposed for TF32, padded where TMA needs it."""
        a = jnp.reshape(a, (self.K, self.M) if self.stored_a_km else (self.M, self.K))
        if self.stored_a_km and not self.a_km:
            a = a.T
        b = jnp.reshape(b, (self.N, self.K) if self.stored_b_nk else (self.K, self.N))
        if self.b_nk and not self.stored_b_nk:
            b = b.T
        return pad(a, self.a_shape), pad(b, self.b_shape)

    def block_specs(self, a_index, b_index) -> list:
        """BlockSpecs of the A and B pipeline buffers; `a_index` / `b_index` map the pipeline's grid indices to
        (m block, k block) / (k block, n block) of the arrays (the views) given to the pipeline."""
        tf = smem_transforms(self.swizzle, self.itemsize)
        if self.a_km:
            a = plgpu.BlockSpec((self.bk, self.cta_m), lambda *i: a_index(*i)[::-1], transforms=tf, memory_space=plgpu.SMEM)
        else:
            a = plgpu.BlockSpec((self.cta_m, self.bk), a_index, transforms=tf, memory_space=plgpu.SMEM)
        if self.b_nk:
            b = plgpu.BlockSpec((self.cta_n, self.bk), lambda *i: b_index(*i)[::-1], transforms=tf, memory_space=plgpu.SMEM)
        else:
            b = plgpu.BlockSpec((self.bk, self.cta_n), b_index, transforms=tf, memory_space=plgpu.SMEM)
        return [a, b]

    def a_rows(self, a_gmem, r0):
        """The view of A's rows r0 .. r0 + cta_m (all of K) that the pipeline walks."""
        return a_gmem.at[:, pl.ds(r0, self.cta_m)] if self.a_km else a_gmem.at[pl.ds(r0, self.cta_m), :]

    def b_cols(self, b_gmem, c0, n: int):
        """The view of B's columns c0 .. c0 + n (all of K)."""
        return b_gmem.at[pl.ds(c0, n), :] if self.b_nk else b_gmem.at[:, pl.ds(c0, n)]

    def wgmma(self, acc_ref, a_smem, b_smem, wg_rows, wg_cols) -> None:
        """acc += A[wg_rows] @ B[:, wg_cols] from one pipeline step's SMEM buffers (transposed views where stored so)."""
        a = a_smem.at[:, wg_rows].T if self.a_km else a_smem.at[wg_rows]
        b = b_smem.at[wg_cols].T if self.b_nk else b_smem.at[:, wg_cols]
        plgpu.wgmma(acc_ref, a, b)
