"""The `attention` template lowered to Pallas Mosaic GPU (Hopper: TMA, wgmma, warp specialisation).

The loop structure is the forward of JAX's `pallas/ops/gpu/attention_mgpu.py`
(FlashAttention-3 style; 653 TFLOP/s f16 on an H100 against cuDNN's 630):
a CTA per (block of `compute_wgs` * block_q queries, batch position) runs a
memory warpgroup and two (or three) compute warpgroups. The memory warpgroup
streams [block_kv, D] tiles of K and V by TMA into a `max_concurrent_steps`-deep
ring of swizzled SMEM buffers (and, with
them, the score work's per-step inputs: a bias tile, a key-padding vector).
Each compute warpgroup owns block_q query rows: Q by TMA into SMEM,
then per key block S = Q K^T by `wgmma` into a float32 [block_q, block_kv]
register accumulator (WGMMA layout), the group's own score work on it, an
online softmax (running max / sum as WGMMA row vectors, `exp2` with the scale
folded into one FMA per score) and O += P V by `wgmma` with P taken from
registers. A two-party "schedule barrier" makes the two compute warpgroups
alternate, so one's softmax overlaps the other's tensor-core work.

`overlap` adds FlashAttention-3's intra-warpgroup pipelining: each step issues
the key block's S = Q K^T together with the previous block's O += P V and runs
the softmax of the first while the second is on the tensor cores (the first
and last steps peeled off the loop; P converted to its dtype only after the
P V reading the previous P has completed, else ptxas serialises the wgmmas);
with the schedule barrier the warpgroups take turns at issuing, round all of
them. `persistent` launches one CTA per SM instead of one per tile: each walks
its (batch position, query block) tiles round by round, grouped by head, the
K/V ring running on from one tile into the next and the next tile's Q loaded
into a second buffer meanwhile; where masks give tiles unequal work (causal),
each takes its key range from the ranges table, longest rows first, the CTAs
snaking back on odd rounds. The defaults (`default_config`) are what measured
fastest on an H200: the overlap without the schedule barrier for 16-bit head
dims up to 128, persistent, and three compute warpgroups at head dims up to 64
(results/attention_overlap_h200.md, attention_persistent_h200.md).

What differs from attention_mgpu is that nothing of the score work is
hand-written: the equations between the two dots are the group's jaxpr,
evaluated on the WGMMA-layout score tile by `ScoreTiles` (`tiles.RegisterTiles`
with attention coordinates: an `iota` along the query
axis is a WGMMA row vector offset by the block's first query, along the key
axis a column vector offset by the key block's first key, along a batch axis the
CTA's batch index). Scale, causal / sliding-window masks from iota, an
additive bias [.., Lq, Lk], key-padding masks [B, Lk], soft-capping (tanh),
whatever elementwise work Mosaic GPU can lower. Masks that depend on iota
alone are analysed on the host (`attention.block_ranges`): key blocks masked
out for a whole block of queries are never loaded nor visited, and key blocks
with nothing masked skip the mask arithmetic. GQA and heads split out of a
[B, L, H*D] array are the spec's index arithmetic on the TMA coordinates.

bf16: attention_mgpu 0.11.2 refuses bfloat16 only because its SMEM scratch
buffers are declared float16 (the TMA copy then fails "Expected dtypes to
match"); wgmma takes bf16 for A from registers as for f16 (PTX `wgmma.mma_async`
.bf16 with a float32 accumulator; Mosaic's `wgmma` accepts bf16 register
operands). Here every buffer has its operand's dtype, so bf16 and f16 both run.

Ragged shapes: TMA zero-fills what a box reads past an array's end (Q rows,
K/V rows past L), TMA stores drop what lies outside, and the key block at the
end of the sequence masks its columns past Lk to -inf. One TMA rule forces a
copy: Mosaic GPU views a swizzled TMA'd array in its SMEM tiling, so an axis
tiled by 8 rows (the sequence axis of q/k/v and of the output) must be a
multiple of 8 long, and the minor axis of a [.., Lq, Lk] score input a multiple
of its swizzle's width: such arrays are zero-padded by XLA outside the kernel
(the output written padded, then sliced). L % 8 == 0 (every real model) needs none.

CTA order: the grid is (batch, query CTAs). Pallas Mosaic GPU reverses a grid
onto CUDA's axes, so the query CTAs are blockIdx.x, the fastest-varying in the
order CTAs are issued, and the CTAs resident at once (one per SM) share the
K/V of a few heads: each head's K/V comes from DRAM about once and then hits
in L2. In the opposite order (batch fastest: each of the 132 resident CTAs
reads a different head's 1 MiB of K/V at B8 H32 L2048 D128) K/V is read from
DRAM once per query CTA: 4 GiB for that shape, about 1.3 ms at the H100's
bandwidth, which was most of the kernel's 1.545 ms, whatever the tiling.
attention_mgpu's grid (heads, q blocks, batch) shares K/V the same way: its
resident CTAs are every query block of a few (batch, head) pairs. (The loop
body itself is attention_mgpu's, op for op on tiles: see the tests.)

Lowering semantics are a config parameter: Warpgroup (layouts inferred by
Mosaic GPU; what attention_mgpu's forward compiles with in jax 0.11, the
measured 653 TFLOP/s) or Lane (the explicit WGMMA layouts `RegisterTiles`
gives, as the matmul lowering uses); both lower every supported group.

Interpret mode (CPU) cannot run wgmma with an operand in registers nor
`pl.run_state` over an accumulator: there P goes through SMEM and P V into a
fresh accumulator that is added to O (same numbers; `export_for_cuda` checks the
register path).

Float32 (both dots at default precision, as XLA's own on this GPU) runs as TF32
(`tf32`): TF32 wgmma reads A from SMEM only and both operands K-major, so P goes
through SMEM and V reaches the kernel transposed ([.., Dv, Lk], its keys padded
to whole 128-byte rows by XLA outside); its flash pair's backward is Triton's.

Declined (`Unsupported`): dots of mixed widths (16-bit scores, float32 values),
head dims that are not a multiple of 32 bytes or above 256, score work the
Mosaic GPU lowering cannot run (`tiles.check_nodes`: e.g. `pow`, `log1p`), a
batch of more than 65535 (the launch grid's y axis), a sequence axis
merged with a batch axis (an operand read from [B*L, D]) whose length is not a
multiple of 8, configs that break a wgmma / TMA / shared-memory rule
(`check_config`). Operands whose head dim is not their minor axis, outputs
stored [.., D, Lq] (the [B, L, H, D] einsum form) and score inputs laid out
[.., Lk, Lq] are transposed by XLA outside the kernel.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ... import ops
from ...graph import Group, Lit, Node
from ..attention_masks import LiveKeys, block_ranges, bound_blocks, clip_ranges, key_bound, scale_fold
from ..attention_spec import AttentionSpec, KeyBound, Operand, score_literal
from ..tiling import cdiv, needed
from .gemm import LOW, SMEM_LIMIT, from_kernel, interpret_params, kernel_dtype, pad_to, smem_transforms, swizzle
from .gemm import num_sms_default, require_smem
from .tiles import COLS, FULL, NONE, ROWS, RegisterTiles, Unsupported, check_nodes, layout

BACKEND = "mosaic_gpu"
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_MAX_GRID_Y = 65535
# setmaxnreg per number of compute warpgroups: (the memory warpgroup's, each compute one's); 128 threads each share
# the SM's 64K registers
_REGISTERS = {2: (40, 232), 3: (32, 160)}

#: Config parameters and their defaults (attention_mgpu's best forward config on an H100, D=128).
DEFAULTS = {
    "block_q": 64,  # query rows of ONE compute warpgroup (a multiple of 64: wgmma's M); a CTA covers compute_wgs * block_q
    "block_kv": 128,  # keys per step (a multiple of 64, at most 256: wgmma's N for S, its K groups for P V)
    "max_concurrent_steps": 2,  # depth of the TMA ring of K/V buffers (clamped to the key blocks)
    "schedule_barrier": 1,  # 1: the two compute warpgroups alternate tensor-core and softmax phases
    "semantics": 0,  # Mosaic GPU lowering semantics: 0 Lane (0.999 vs 1.028 ms non-causal on an H100), 1 Warpgroup (attention_mgpu's)
    "overlap": 0,  # 1: each step issues S of its key block with P V of the one before, the softmax beside the second (FA3);
    # 2: the same with O rescaled by the block before's alpha between the two issues (FA3's order), not after its wait
    "compute_wgs": 2,  # compute warpgroups per CTA, block_q query rows each (3: FA3's choice at head dim 64; 160 registers)
    "persistent": 0,  # 1: one CTA per SM walking the (batch, query block) tiles: the K/V ring runs on from one tile into
    # the next, the next tile's Q lands during this one (a second Q buffer), no CTA launched per tile (FA3's scheduler)
}
PARAMS = tuple(DEFAULTS)
@dataclasses.dataclass(frozen=True)
class Config:
    block_q: int
    block_kv: int
    max_concurrent_steps: int
    schedule_barrier: int
    semantics: int
    overlap: int
    compute_wgs: int
    persistent: int

    @staticmethod
    def of(config: dict) -> "Config":
        return Config(**{k: int(config.get(k, v)) for k, v in DEFAULTS.items()})


# ---------------------------------------------------------------------------
# The score tile evaluator.
class ScoreTiles(RegisterTiles):
    """`RegisterTiles` on a [block_q, block_kv] score tile: rows are queries, columns keys.

    `iota` along the query / key axis gives global positions (`r0` = the block's first query, `c0` = the key
    block's first key), along a batch axis the CTA's batch index (`bidx`, a scalar). Float-to-float converts
    keep float32 (excess precision, as XLA allows and the Triton lowering does): rounding each score to
    bfloat16 and back would cost two instructions per score in the inner loop. A boolean `select_n(p, False,
    True)` (how `jnp.tril` of a mask of ones reads) is `p` itself, not a select per score.
    """

    def __init__(self, spec: AttentionSpec, bq: int, bk: int):
        super().__init__(spec.tile, bq, bk)
        self.aspec = spec
        self.bidx: list = []
        self.members = {nd.id for nd in spec.tile.group.nodes}

    def atom(self, env: dict, a) -> jax.Array:
        return score_literal(a) if isinstance(a, Lit) else env[a]

    def eval_node(self, nd: Node, env: dict, r0=0, c0=0) -> None:
        out = nd.outputs[0]
        if nd.name == "convert_element_type":
            src, dst = self.g.aval(nd.inputs[0]).dtype, self.g.avals[out].dtype
            if jnp.issubdtype(src, jnp.floating) and jnp.issubdtype(dst, jnp.floating):
                env[out] = jnp.asarray(self.atom(env, nd.inputs[0])).astype(ops.compute_dtype(dst))
                return
        if nd.name == "select_n" and len(nd.inputs) == 3 and self.g.avals[out].dtype == np.dtype(bool):
            cases = [self._const(a) for a in nd.inputs[1:]]
            pred = nd.inputs[0]
            if cases in ([False, True], [True, False]) and self.g.aval(pred).dtype == np.dtype(bool):
                x = self.widen(self.atom(env, pred), self.span_of(pred), self.spec.span[out])
                env[out] = x if cases[1] else ~x
                return
        super().eval_node(nd, env, r0, c0)

    def _const(self, a):
        """The value of a scalar constant operand (a literal, possibly broadcast or converted in the group), else None."""
        while not isinstance(a, Lit):
            nid = self.g.producer.get(a)
            if nid not in self.members or self.g.node_index[nid].name not in ("broadcast_in_dim", "convert_element_type"):
                return None
            a = self.g.node_index[nid].inputs[0]
        v = np.asarray(a.value)
        return bool(v) if v.dtype == np.bool_ and v.size == 1 else None

    def iota(self, nd: Node, r0, c0):
        out = nd.outputs[0]
        a = self.spec.axes[out][nd.params["dimension"]]
        dt = ops.compute_dtype(nd.params["dtype"])
        if a == self.aspec.q_axis:
            x, have = plgpu.broadcasted_iota(jnp.int32, (self.bm,), 0, layout=layout(ROWS)) + r0, ROWS
        elif a == self.aspec.k_axis:
            x, have = plgpu.broadcasted_iota(jnp.int32, (self.bn,), 0, layout=layout(COLS)) + c0, COLS
        else:
            x, have = (jnp.zeros((), jnp.int32) if a is None else jnp.asarray(self.bidx[a], jnp.int32)), NONE
        # the value's span says where it lives (an iota over [Lq, Lk] along q is a full tile)
        return self.widen(x.astype(dt), have, self.spec.span[out])

    def full(self, env: dict, v: int):
        """Value `v` as a [block_q, block_kv] tile."""
        return self.widen(env[v], self.spec.span[v], FULL)


# ---------------------------------------------------------------------------
# What is supported.
def score_inputs(spec: AttentionSpec) -> list[int]:
    """The score work's inputs from outside the group (bias, masks, scalars), in first-use order."""
    qkv = {spec.q.value, spec.k.value, spec.v.value}
    return [v for v in spec.tile.group.inputs if v not in qkv and v != spec.dot1.outputs[0]]


def _score_nodes(spec: AttentionSpec) -> list[Node]:
    return list(spec.pre) + list(spec.row_m) + list(spec.exp_branch[2:]) + list(spec.row_l)


def check_group(spec: AttentionSpec) -> None:
    """Raise `Unsupported` if this lowering cannot implement the matched group at all (whatever the config)."""
    g = spec.group.graph
    d1, d2 = np.dtype(spec.dot_dtype1), np.dtype(spec.dot_dtype2)
    if not (d1 in LOW and d2 in LOW or tf32(spec)):
        raise Unsupported(f"dot dtypes {d1}/{d2}: the Mosaic GPU attention takes bf16 / f16, or float32 for both dots "
                          "(as TF32)")
    if np.dtype(g.avals[spec.v.value].dtype) != d2:
        raise Unsupported(f"values {g.avals[spec.v.value].dtype} multiplied in {d2}: a conversion of V inside the group")
    for name, n, isz in (("D", spec.D, d1.itemsize), ("Dv", spec.Dv, d2.itemsize)):
        if (n * isz) % 32 or n > 256:
            raise Unsupported(f"head dim {name}={n}: needs a multiple of 32 bytes ({32 // isz} elements) up to 256 "
                              "(the SMEM swizzle wgmma reads)")
    if spec.batch > _MAX_GRID_Y:
        raise Unsupported(f"batch {spec.batch} > {_MAX_GRID_Y} (the launch grid's y axis)")
    for op in (spec.q, spec.k, spec.v):
        _operand_view(g, op)  # raises for a layout TMA cannot read
    check_nodes([nd for nd in _score_nodes(spec)] + [spec.combine])
    for v in score_inputs(spec):
        if np.dtype(g.avals[v].dtype).itemsize > 4:
            raise Unsupported(f"64-bit score input %{v}")
    if "q" not in spec.out_roles or "d" not in spec.out_roles:
        raise Unsupported("the output lacks a query or a head axis")
    if not jnp.issubdtype(g.avals[spec.out].dtype, jnp.floating):
        raise Unsupported(f"output dtype {g.avals[spec.out].dtype}")


def tf32(spec: AttentionSpec) -> bool:
    """Both dots float32: wgmma runs them as TF32 (XLA's own float32 dots at default precision do too, the only
    precision the template matches). TF32 wgmma reads A from shared memory only and both operands K-major: P goes
    through SMEM, and V reaches the kernel transposed, [.., Dv, Lk] (XLA transposes it outside)."""
    return np.dtype(spec.dot_dtype1) == np.dtype(spec.dot_dtype2) == np.dtype(np.float32)


def check_config(spec: AttentionSpec, cfg: Config, *, emit_lse: bool = False) -> None:
    """Raise `Unsupported` for a config that breaks a wgmma, TMA, register-layout or shared-memory rule (`emit_lse`:
    the forward of a flash pair, with the logsumexp's buffer)."""
    bq, bk = cfg.block_q, cfg.block_kv
    if bq not in (64, 128):
        raise Unsupported(f"block_q={bq}: a compute warpgroup's wgmma tile has 64 or 128 rows here (64 * n; more "
                          "would not fit the registers)")
    if bk % 64 or not 64 <= bk <= 256:
        raise Unsupported(f"block_kv={bk}: needs a multiple of 64 in [64, 256] (wgmma N for S, K groups for P V)")
    if cfg.max_concurrent_steps < 1:
        raise Unsupported("max_concurrent_steps must be >= 1")
    if cfg.schedule_barrier not in (0, 1) or cfg.semantics not in (0, 1) or cfg.overlap not in (0, 1, 2):
        raise Unsupported("schedule_barrier and semantics must be 0 or 1, overlap 0, 1 or 2")
    if cfg.compute_wgs not in (2, 3):
        raise Unsupported(f"compute_wgs={cfg.compute_wgs}: 2 or 3 compute warpgroups")
    if cfg.persistent not in (0, 1):
        raise Unsupported("persistent must be 0 or 1")
    if cfg.persistent and any(spec.tile.span[v] == ROWS for v in score_inputs(spec)):
        raise Unsupported("persistent: a row-vector score input (loaded with Q) is not double-buffered")
    if cfg.compute_wgs == 3 and (bq != 64 or (cfg.schedule_barrier and not cfg.overlap)):
        raise Unsupported("3 compute warpgroups: 64 rows each (160 registers a thread), and the schedule barrier only "
                          "with the overlap (its turns go round; without it the barrier pairs two warpgroups)")
    if cfg.compute_wgs == 3 and cfg.overlap and bk > 192:
        raise Unsupported(f"3 compute warpgroups with the overlap at block_kv={bk}: a block's 64 x {bk} float32 scores in "
                          "flight beside the block before's P and the output do not fit 160 registers a thread (the GPU "
                          "compile fails: 'Pass pipeline failed', H200); 192 keys a step at most")
    if cfg.overlap and _stages(spec, cfg) < 2 and cdiv(spec.Lk, bk) > 1:
        raise Unsupported("overlap needs max_concurrent_steps >= 2: a step issues its key block's K beside the block "
                          "before's V, both in the ring")
    g = spec.group.graph
    for v in score_inputs(spec):
        sp = spec.tile.span[v]
        if sp in (ROWS, COLS):
            n = bq if sp == ROWS else bk
            if (n * _vector_dtype(g.avals[v].dtype, n).itemsize) % 128:
                raise Unsupported(f"a {'row' if sp == ROWS else 'column'} vector input %{v} of {n} x {g.avals[v].dtype}: "
                                  "TMA copies here must move a multiple of 128 bytes")
    require_smem(smem_bytes(spec, cfg, emit_lse=emit_lse))


def _stages(spec: AttentionSpec, cfg: Config) -> int:
    return max(1, min(cfg.max_concurrent_steps, cdiv(spec.Lk, cfg.block_kv)))


def smem_bytes(spec: AttentionSpec, cfg: Config, *, emit_lse: bool = False) -> int:
    """Shared memory the kernel allocates on the GPU, as Mosaic GPU counts it: each buffer (Q/O, the K/V ring, the
    score inputs' buffers) in whole KiB, 8 bytes per barrier, the reduction scratch (CompilerParams' 2 KiB).
    Matches the `smem_bytes` of Mosaic GPU's error message exactly on the configs tried."""
    g = spec.group.graph
    bq, bk, n = cfg.block_q, cfg.block_kv, cfg.compute_wgs
    s = _stages(spec, cfg)
    i1, i2 = spec.dot_dtype1.itemsize, spec.dot_dtype2.itemsize
    out_dt = np.dtype(g.avals[spec.out].dtype)
    bufs = [(1 + cfg.persistent) * n * bq * spec.D * i1, s * bk * spec.D * i1, s * bk * spec.Dv * i2] + ([n * bq * 4] if emit_lse else [])
    if tf32(spec):
        bufs.append(n * bq * bk * i2)  # P through SMEM
    if not _o_in_q(spec):
        bufs.append(n * bq * spec.Dv * out_dt.itemsize)
    for v in score_inputs(spec):
        sp = spec.tile.span[v]
        if sp == FULL:
            bufs.append(s * n * bq * bk * kernel_dtype(g.avals[v].dtype).itemsize)
        elif sp == COLS:
            bufs.append(s * bk * _vector_dtype(g.avals[v].dtype, bk).itemsize)
        elif sp == ROWS:
            bufs.append(n * bq * _vector_dtype(g.avals[v].dtype, bq).itemsize)
    barriers = 4 * s + (1 + cfg.persistent) * n + ((n if cfg.overlap else 1) if cfg.schedule_barrier else 0)
    return sum(-(-b // 1024) * 1024 for b in bufs) + 8 * barriers + 2048


# The persistent grid's static walk of the tiles gains up to 64 key blocks a query block (causal, H200: 4k 0.93x the
# CTA-per-tile grid's time, 8k 0.97x) and loses past it (16k: 1.51x at D128, 1.19x at D64; 1.05x without a mask)
PERSISTENT_MAX_STEPS = 64


def default_config(spec: AttentionSpec) -> dict:
    """attention_mgpu's best forward config (block_q 64, block_kv 128, 2 stages) with what measured better on an H200
    (results/attention_overlap_h200.md): 16-bit head dims up to 128 overlap each step's two dots, without the
    schedule barrier (B8 H32 L2048 D128: 890 -> 830 us, causal 541 -> 532), and up to 64, where the queries fill
    them, with three compute warpgroups (D64: 662 -> 566 us, causal 408 -> 358; FA3's choice there), persistent (D128
    822 -> 810 us, causal 522 -> 477: results/attention_persistent_h200.md) where a query block walks at most
    `PERSISTENT_MAX_STEPS` key blocks (results/attention_long_h200.md). Each shrunk until it fits; the first of these
    that the lowering takes (score inputs' buffers can leave the overlap one step in flight, which it cannot run),
    else attention_mgpu's shrunk."""
    wanted = []
    if not tf32(spec) and max(spec.D, spec.Dv) <= 128:
        persistent = [1, 0] if cdiv(spec.Lk, DEFAULTS["block_kv"]) <= PERSISTENT_MAX_STEPS else [0]
        if max(spec.D, spec.Dv) <= 64 and spec.Lq >= 512:
            wanted += [{"overlap": 1, "schedule_barrier": 0, "compute_wgs": 3, "persistent": p} for p in persistent]
        wanted += [{"overlap": 1, "schedule_barrier": 0, "persistent": p} for p in persistent]
    for changes in wanted + [{}]:
        cfg = _shrunk({**DEFAULTS, **changes}, spec)
        try:
            check_config(spec, Config.of(cfg))
        except Unsupported:
            continue
        return cfg
    return cfg


def _shrunk(cfg: dict, spec: AttentionSpec) -> dict:
    """`cfg` with fewer keys a step (not fewer than 64), then fewer steps in flight, until it fits shared memory."""
    if spec.Lk <= 64:
        cfg["block_kv"] = 64
    while smem_bytes(spec, Config.of(cfg)) > SMEM_LIMIT and cfg["block_kv"] > 64:
        cfg["block_kv"] -= 64
    while smem_bytes(spec, Config.of(cfg)) > SMEM_LIMIT and cfg["max_concurrent_steps"] > 1:
        cfg["max_concurrent_steps"] -= 1
    return cfg


def sm_count(interp) -> int:
    """The CTAs of a persistent grid: one per SM of the GPU (132 on an H100 or H200); 3 in interpret mode, where a
    test's CTAs then each walk several tiles."""
    if interp is not None:
        return 3
    return num_sms_default()


def _o_in_q(spec: AttentionSpec) -> bool:
    """The output tile reuses its warpgroup's Q buffer (same shape and dtype), as attention_mgpu does."""
    return spec.Dv == spec.D and np.dtype(spec.group.graph.avals[spec.out].dtype) == spec.dot_dtype1


def _vector_dtype(dtype, n: int) -> np.dtype:
    """How a row / column vector input is passed: widened (bool, int8, 16-bit floats: to 32 bits) when n of its own
    type would not make the 128-byte TMA copy the WGMMA row/column layouts load from (values are unchanged)."""
    d = kernel_dtype(dtype)
    if (n * d.itemsize) % 128 == 0:
        return d
    if jnp.issubdtype(d, jnp.floating):
        return np.dtype(np.float32)
    return np.dtype(np.int32)


def _tf(minor_elems: int, itemsize: int) -> tuple:
    """SMEM transforms of a swizzled tile whose rows hold `minor_elems` elements: (8, swizzle bytes) tiles."""
    return smem_transforms(min(swizzle(minor_elems, itemsize), 128), itemsize)


# ---------------------------------------------------------------------------
# How arrays reach the kernel.
@dataclasses.dataclass
class _View:
    """A kernel argument: the group input permuted / reshaped / converted / padded (outside, by XLA) so that TMA
    boxes are [rows, minor]; `operand` (q/k/v) or `axes` (score inputs: S-axis of each kernel dim) index it."""

    perm: tuple | None
    shape: tuple
    dtype: np.dtype
    pad: tuple | None
    operand: Operand | None = None
    axes: tuple = ()

    def prepare(self, x):
        if self.perm is not None:
            x = jnp.transpose(x, self.perm)
        x = jnp.reshape(x, self.shape)
        if np.dtype(x.dtype) != self.dtype:
            x = x.astype(self.dtype)
        if self.pad is not None:
            x = jnp.pad(x, [(0, t - s) for s, t in zip(x.shape, self.pad)])
        return x


def _round8(n: int) -> int:
    return -(-n // 8) * 8


def _operand_view(g, op: Operand, *, seq_minor: bool = False) -> _View:
    """q/k/v with the head dim as the minor axis (permuted by XLA if it is not) and the sequence axis a multiple of
    8 long (zero-padded by XLA if it is not: Mosaic GPU views a TMA'd array in its SMEM tiling of 8-row tiles).
    `seq_minor`: the sequence axis minor and the head dim just before it (V for TF32: `tf32`)."""
    aval = g.avals[op.value]
    n = len(aval.shape)
    perm, op2 = None, op
    last = (op.d_axis, op.seq_axis) if seq_minor else (op.d_axis,)
    order = tuple(a for a in range(n) if a not in last) + last
    if order != tuple(range(n)):
        perm = order
        new = {old: i for i, old in enumerate(perm)}
        op2 = Operand(op.value, new[op.seq_axis], new[op.d_axis], {new[a]: t for a, t in op.batch.items()})
    shape = tuple(aval.shape[a] for a in perm) if perm else tuple(aval.shape)
    pad = None
    mult = 128 // np.dtype(aval.dtype).itemsize if seq_minor else 8  # minor: whole rows of the 128-byte swizzle
    if shape[op2.seq_axis] % mult:
        if op2.batch.get(op2.seq_axis):
            raise Unsupported(f"sequence axis of %{op.value} {aval} merges a batch axis and is not a multiple of {mult} long")
        pad = tuple(-(-d // mult) * mult if a == op2.seq_axis else d for a, d in enumerate(shape))
    return _View(perm, shape, np.dtype(aval.dtype), pad, op2)


def _input_view(spec: AttentionSpec, v: int, n: int, *, keys_first: bool = False) -> _View:
    """A score input as [batch dims (in order)..., q?, k?] (unit dims dropped), bool as int8, vectors widened to
    whole 128-byte copies, the minor dim padded to 16 bytes; a [.., Lq, Lk] tile input padded to whole swizzled
    SMEM tiles (8 rows, a multiple of its swizzle's width), as the swizzled TMA copy views it. `n`: block_kv for
    column vectors and tiles, block_q for row vectors. `keys_first`: a tile input as [.., Lk, Lq] (the backward's
    transposed dK/dV tile; `n` then its queries)."""
    g = spec.group.graph
    aval = g.avals[v]
    ax = spec.tile.axes[v]
    dims = [d for d, a in enumerate(ax) if a is not None]
    if not dims:
        return _View(None, (1,), kernel_dtype(aval.dtype), None, axes=())
    batch = [d for d in dims if ax[d] not in (spec.q_axis, spec.k_axis)]
    qk = [d for d in dims if ax[d] == spec.q_axis] + [d for d in dims if ax[d] == spec.k_axis]
    if keys_first:
        qk = qk[::-1]
    order = batch + qk
    rest = [d for d in range(len(ax)) if d not in order]  # unit dims
    perm = tuple(rest + order)
    shape = tuple(aval.shape[d] for d in order)
    sp = spec.tile.span[v]
    dt = _vector_dtype(aval.dtype, n) if sp in (ROWS, COLS) else kernel_dtype(aval.dtype)
    pad = list(shape)
    if sp != NONE:
        pad[-1] = pad_to(shape[-1], dt.itemsize)  # TMA: strides of 16-byte multiples
    if sp == FULL:
        pad[-2] = _round8(shape[-2])  # the query axis: whole 8-row tiles
        e = _tile_swizzle(n, dt.itemsize) // dt.itemsize
        pad[-1] = -(-shape[-1] // e) * e
    pad = tuple(pad) if tuple(pad) != shape else None
    return _View(None if perm == tuple(range(len(ax))) else perm, shape, dt, pad, axes=tuple(ax[d] for d in order))


def _operand_index(op: Operand, ndim: int, bidx: list, s0, bs: int, D: int) -> tuple:
    """Index of the [bs, D] TMA box at sequence position s0 of operand `op` (batch index terms added)."""
    idx = []
    for a in range(ndim):
        off = 0
        for sa, div, mod, mul in op.batch.get(a, ()):
            off = off + (bidx[sa] // div) % mod * mul
        if a == op.seq_axis:
            idx.append(pl.ds(off + s0, bs))
        elif a == op.d_axis:
            idx.append(pl.ds(off, D))
        else:
            idx.append(off)
    return tuple(idx)


def _ranges_table(spec: AttentionSpec, bq: int, bk: int, *, one_block: bool = False, n: int = 2) -> np.ndarray | None:
    """Per CTA (n query blocks): [lo, full_lo, full_hi, hi] of each block, then the CTA's [lo, hi); None without
    build-time masks (every block visits every key block; the last one masks its columns past Lk). `one_block`: see
    `per_cta`."""
    r = block_ranges(spec, bq, bk)
    return None if r is None else per_cta(r, one_block=one_block, n=n)


def per_cta(r: np.ndarray, *, one_block: bool = False, n: int = 2) -> np.ndarray:
    """Per-block [lo, full_lo, full_hi, hi) ranges packed per CTA of n blocks (one per compute warpgroup): the
    blocks' ranges (a dead block or one past the end: empty, at the CTA's lo), then the CTA's [lo, hi) (what its
    memory warpgroup loads). `one_block` (the overlapped schedule, whose first and last steps are peeled off its
    loop): a dead block visits the CTA's first key block instead, all of it masked (its P is zero, its l zero, as
    with no block at all), and a CTA with no live block loads key block 0 for it."""
    nb = len(r)
    out = np.zeros((cdiv(nb, n), 4 * n + 2), np.int32)
    for c in range(len(out)):
        blocks = [tuple(int(t) for t in r[n * c + w]) if n * c + w < nb else None for w in range(n)]
        live = [b for b in blocks if b is not None and b[3] > b[0]]
        clo = min(b[0] for b in live) if live else 0
        chi = max(b[3] for b in live) if live else int(one_block)
        dead = (clo, clo, clo, clo + int(one_block))
        for w, b in enumerate(blocks):
            out[c, 4 * w:4 * w + 4] = b if b is not None and b[3] > b[0] else dead
        out[c, 4 * n:] = (clo, chi)
    return out


def live_key_blocks(spec: AttentionSpec, bound: KeyBound, scalars: dict, bidx: list, block: int, n_blocks: int) -> LiveKeys:
    """`attention_masks.live_blocks` of the runtime masks' bound (`key_bound`) at batch position `bidx`, evaluated from
    the score work's scalar inputs there."""
    tiles = ScoreTiles(spec, 64, block)
    tiles.bidx = bidx
    return bound_blocks(spec, bound, scalars, tiles.eval_node, lambda x: jnp.asarray(x, jnp.int32), block, n_blocks)


def read_scalars(g, refs: dict, views: dict, values, bidx: list) -> dict:
    """The score work's scalar inputs `values` at batch position bidx, read from their kernel refs: a literal-like
    input, or one that varies along batch axes only (ALiBi slopes [H], key lengths [B])."""
    return {v: from_kernel(refs[v][tuple(bidx[a] for a in views[v].axes) or (0,)], g.avals[v].dtype) for v in values}


def batch_index(spec: AttentionSpec, flat=None) -> list:
    """Per score axis, the CTA's index along it (its flattened batch position `flat`, by default grid axis "b", split
    over the batch axes; None for the others)."""
    S = spec.score_shape
    bidx: list = [None] * len(S)
    rem = lax.axis_index("b") if flat is None else flat
    for a in reversed(spec.batch_axes):
        bidx[a] = lax.rem(rem, S[a])
        rem = lax.div(rem, S[a])
    return bidx


# ---------------------------------------------------------------------------
# The lowering.
def lower(group: Group, spec: AttentionSpec, config: dict, *, interpret=False, emit_lse: bool = False) -> Callable:
    """A function of the group's inputs (in `group.inputs` order) giving its outputs (in `group.outputs` order);
    with `emit_lse` also each query row's logsumexp of the exp branch's input (float32, [batch, Lq], the batch axes
    flattened; +inf for a row with no live key), the residual the flash backward (`triton/attention_bwd.py`) reads,
    as the Triton forward's `emit_lse` gives it.

    `config`: the parameters in `DEFAULTS` (missing ones take their defaults).
    `interpret`: True runs under Mosaic GPU interpret mode (CPU; simulates GMEM/SMEM, warpgroups, barriers, TMA);
    a `plgpu.InterpretGPUParams` runs it with those parameters (e.g. `detect_races=True`).
    Raises `Unsupported` (a NotImplementedError) for what this lowering does not do.
    """
    if spec is None:
        raise Unsupported("the group is not an attention")
    check_group(spec)
    cfg = Config.of(config)
    check_config(spec, cfg, emit_lse=emit_lse)
    g = group.graph
    interp = interpret_params(interpret)
    tf = tf32(spec)
    p_via_smem = interp is not None or tf  # interpret mode: no wgmma with A in registers, no run_state over an ACC

    bq, bk = cfg.block_q, cfg.block_kv
    Lq, Lk, D, Dv = spec.Lq, spec.Lk, spec.D, spec.Dv
    dt1, dt2 = spec.dot_dtype1, spec.dot_dtype2
    out_dt = np.dtype(g.avals[spec.out].dtype)
    nw = cfg.compute_wgs  # compute warpgroups; the memory one is warpgroup nw
    nq, nk = cdiv(Lq, bq), cdiv(Lk, bk)
    n_cta = cdiv(nq, nw)
    stages = _stages(spec, cfg)
    use_sched = bool(cfg.schedule_barrier)
    overlap, late_rescale = bool(cfg.overlap), cfg.overlap == 2
    row_stride = 4 * nw + 2  # of the ranges table
    persistent = cfg.persistent
    n_tiles = spec.batch * n_cta
    n_grid = min(n_tiles, sm_count(interp)) if persistent else 0  # the persistent grid: one CTA per SM, at most one a tile
    ragged_k = Lk % bk != 0

    table = _ranges_table(spec, bq, bk, one_block=overlap, n=nw)
    bound = key_bound(spec)
    fold = scale_fold(spec)
    scale = 1.0 if fold is None else fold[2]
    masked_nodes = ({**spec.mask_selects, **spec.mask_adds} if table is not None else {}) | (bound.selects if bound else {})
    y_val = spec.exp_branch[0].inputs[0]
    targets = {spec.x, y_val}
    plan = {m: needed(spec.pre, targets, set(), None if m else masked_nodes) for m in (True, False)}

    # Kernel arguments.
    views = {"q": _operand_view(g, spec.q), "k": _operand_view(g, spec.k), "v": _operand_view(g, spec.v, seq_minor=tf)}
    ins = score_inputs(spec)
    ispan = {v: spec.tile.span[v] for v in ins}
    iviews = {v: _input_view(spec, v, bq if ispan[v] == ROWS else bk) for v in ins}
    full_in = [v for v in ins if ispan[v] == FULL]  # a [compute_wgs * block_q, block_kv] tile per step (memory warpgroup)
    cols_in = [v for v in ins if ispan[v] == COLS]  # a [block_kv] vector per step (memory warpgroup)
    rows_in = [v for v in ins if ispan[v] == ROWS]  # a [block_q] vector per compute warpgroup
    scalar_in = [v for v in ins if ispan[v] == NONE]
    roles = list(spec.out_roles)
    o_perm = None
    if roles.index("d") != len(roles) - 1:  # stored [.., Lq, .., Dv]; XLA moves the head axis back outside
        o_perm = tuple(i for i in range(len(roles)) if roles[i] != "d") + (roles.index("d"),)
        roles = [roles[i] for i in o_perm]
    out_shape = tuple(g.avals[spec.out].shape[i] for i in o_perm) if o_perm else tuple(g.avals[spec.out].shape)
    q_dim = roles.index("q")
    out_rows = _round8(out_shape[q_dim])  # written in whole 8-row tiles (then sliced by XLA if Lq % 8)
    k_out_shape = out_shape[:q_dim] + (out_rows,) + out_shape[q_dim + 1:]

    q_tf, k_tf, v_tf = _tf(D, dt1.itemsize), _tf(D, dt1.itemsize), _tf(bk if tf else Dv, dt2.itemsize)
    o_tf = _tf(Dv, out_dt.itemsize)
    full_tf = {v: smem_transforms(_tile_swizzle(bk, iviews[v].dtype.itemsize), iviews[v].dtype.itemsize) for v in full_in}
    o_in_q = _o_in_q(spec)

    def body(q_ref, k_ref, v_ref, *rest):
        in_refs = dict(zip(ins, rest[:len(ins)]))
        tbl_ref = rest[len(ins)] if table is not None else None
        out_ref, lse_ref = (rest[-2], rest[-1]) if emit_lse else (rest[-1], None)
        scratch = dict(
            q_smem=plgpu.SMEM((1 + persistent, nw, bq, D), dt1, transforms=q_tf),  # persistent: this tile's and the next's
            o_smem=None if o_in_q else plgpu.SMEM((nw, bq, Dv), out_dt, transforms=o_tf),
            k_smem=plgpu.SMEM((stages, bk, D), dt1, transforms=k_tf),
            v_smem=plgpu.SMEM((stages, Dv, bk) if tf else (stages, bk, Dv), dt2, transforms=v_tf),  # TF32: V^T
            p_smem=plgpu.SMEM((nw, bq, bk), dt2, transforms=_tf(bk, dt2.itemsize)) if p_via_smem else None,
            full_smem=[plgpu.SMEM((stages, nw, bq, bk), iviews[v].dtype, transforms=full_tf[v]) for v in full_in],
            cols_smem=[plgpu.SMEM((stages, bk), iviews[v].dtype) for v in cols_in],
            rows_smem=[plgpu.SMEM((nw, bq), iviews[v].dtype) for v in rows_in],
            lse_smem=plgpu.SMEM((nw, bq), jnp.float32) if emit_lse else None,
            k_bar=plgpu.Barrier(num_arrivals=1 + nw * len(full_in) + len(cols_in), num_barriers=stages),
            v_bar=plgpu.Barrier(num_barriers=stages),
            q_bar=plgpu.Barrier(num_arrivals=1 + len(rows_in), num_barriers=(1 + persistent) * nw),
            k_free=plgpu.Barrier(num_arrivals=nw, num_barriers=stages),
            v_free=plgpu.Barrier(num_arrivals=nw, num_barriers=stages),
            sched_bar=plgpu.Barrier(num_arrivals=2) if use_sched and not overlap else None,
            turn=plgpu.Barrier(num_barriers=nw) if use_sched and overlap else None,  # turn[w]: warpgroup w may issue
        )

        @functools.partial(pl.run_scoped, **scratch, collective_axes="wg")
        def _scope(q_smem, o_smem, k_smem, v_smem, p_smem, full_smem, cols_smem, rows_smem, lse_smem, k_bar, v_bar,
                   q_bar, k_free, v_free, sched_bar, turn):
            full_smem, cols_smem = dict(zip(full_in, full_smem)), dict(zip(cols_in, cols_smem))
            rows_smem = dict(zip(rows_in, rows_smem))
            wg = lax.axis_index("wg")
            if persistent:  # concurrent CTAs on neighbouring tiles (a head's query blocks, sharing its K and V in L2)
                n_mine, tile_at = persistent_tiles(n_tiles, n_grid, snake=table is not None)

            def tile_of(t):
                """(flattened batch position, query block) of this CTA's tile t (the CTA's own when not persistent).
                Masks known at build time (causal): a head's longest rows first."""
                if persistent:
                    tile = tile_at(t)
                    if table is None:
                        return lax.div(tile, n_cta), lax.rem(tile, n_cta)
                    return lax.div(tile, n_cta), n_cta - 1 - lax.rem(tile, n_cta)
                cta = lax.axis_index("q")
                return lax.axis_index("b"), (cta if table is None else n_cta - 1 - cta)

            def scalars(bidx) -> dict:
                return read_scalars(g, in_refs, iviews, scalar_in, bidx)

            def live_of(bidx, consts: dict) -> LiveKeys | None:
                """The runtime masks' bound at batch position bidx (`key_bound`), from its scalar inputs, or None."""
                return None if bound is None else live_key_blocks(spec, bound, consts, bidx, bk, nk)

            def key_range(cta, live: LiveKeys | None):
                """[clo, chi): the key blocks a CTA loads for query block `cta` (every one, or the table's), up to the
                last live one (`live_of`)."""
                clo, chi = (0, nk) if table is None else (tbl_ref[cta * row_stride + 4 * nw], tbl_ref[cta * row_stride + 4 * nw + 1])
                return (clo, chi) if live is None else clip_ranges((clo, chi), live, (0, nk))

            dyn = lax.axis_index("wg") * 0  # a traced 0: box starts past an array's end are legal for TMA, not statically

            def traced(x):
                return x + dyn if isinstance(x, int) else x

            def sched():
                if use_sched:
                    plgpu.barrier_arrive(sched_bar)
                    plgpu.barrier_wait(sched_bar)

            def in_index(v, bidx, q0, nq_rows, k0):
                idx = []
                for a in iviews[v].axes:
                    idx.append(pl.ds(q0, nq_rows) if a == spec.q_axis else pl.ds(k0, bk) if a == spec.k_axis else bidx[a])
                return tuple(idx)

            @pl.when(wg == nw)
            def _memory_wg():
                plgpu.set_max_registers(_REGISTERS[nw][0], action="decrease")

                def issue_k(bidx, q_cta0, j, slot):
                    k0 = traced(j * bk)
                    kv = views["k"]
                    plgpu.copy_gmem_to_smem(k_ref.at[_operand_index(kv.operand, len(kv.shape), bidx, k0, bk, D)],
                                            k_smem.at[slot], k_bar.at[slot])
                    for v in full_in:
                        for w in range(nw):
                            plgpu.copy_gmem_to_smem(in_refs[v].at[in_index(v, bidx, q_cta0 + w * bq, bq, k0)],
                                                    full_smem[v].at[slot, w], k_bar.at[slot])
                    for v in cols_in:
                        plgpu.copy_gmem_to_smem(in_refs[v].at[in_index(v, bidx, 0, 0, k0)], cols_smem[v].at[slot], k_bar.at[slot])

                def issue_v(bidx, q_cta0, j, slot):  # noqa: ARG001 - as issue_k
                    vv = views["v"]
                    plgpu.copy_gmem_to_smem(v_ref.at[_operand_index(vv.operand, len(vv.shape), bidx, traced(j * bk), bk, Dv)],
                                            v_smem.at[slot], v_bar.at[slot])

                if not persistent:
                    fb, cta = tile_of(0)
                    bidx, q_cta0 = batch_index(spec, fb), cta * (nw * bq)
                    clo, chi = key_range(cta, live_of(bidx, scalars(bidx)))
                    memory_ring(clo, chi, stages, lambda j: lax.rem(j - clo, stages),
                                [(k_free, functools.partial(issue_k, bidx, q_cta0)), (v_free, functools.partial(issue_v, bidx, q_cta0))])
                    return

                def blocks_of(t):
                    fb, cta = tile_of(t)
                    bidx = batch_index(spec, fb)
                    return (*key_range(cta, live_of(bidx, scalars(bidx))), (bidx, cta * (nw * bq)))

                persistent_ring(n_mine, blocks_of, stages, [(k_free, issue_k), (v_free, issue_v)])

            @pl.when(wg < nw)
            def _compute_wg():
                plgpu.set_max_registers(_REGISTERS[nw][1], action="increase")
                qv = views["q"]

                def load_q(t, buf):
                    """Tile t's Q (and row-vector score inputs) for this warpgroup into Q buffer `buf`."""
                    fb, cta = tile_of(t)
                    bidx, q0 = batch_index(spec, fb), cta * (nw * bq) + wg * bq
                    bar = q_bar.at[buf * nw + wg]
                    plgpu.copy_gmem_to_smem(q_ref.at[_operand_index(qv.operand, len(qv.shape), bidx, q0, bq, D)],
                                            q_smem.at[buf, wg], bar)
                    for v in rows_in:
                        plgpu.copy_gmem_to_smem(in_refs[v].at[in_index(v, bidx, q0, bq, 0)], rows_smem[v].at[wg], bar)

                def run_tile(t, buf, ring0):
                    """Tile t, its Q in buffer `buf` (loading or loaded), its key blocks from the ring's `ring0`-th on:
                    the online softmax over them, O (and the logsumexp) stored. Returns the blocks it took."""
                    fb, cta = tile_of(t)
                    bidx = batch_index(spec, fb)
                    q0 = cta * (nw * bq) + wg * bq
                    q_tile = q_smem.at[buf]
                    o_tile = q_tile if o_smem is None else o_smem
                    consts = scalars(bidx)
                    live = live_of(bidx, consts)
                    clo, chi = key_range(cta, live)

                    def slot_of(j):
                        return lax.rem(ring0 + j - clo, stages)

                    tiles = ScoreTiles(spec, bq, bk)
                    tiles.bidx = bidx

                    plgpu.barrier_wait(q_bar.at[buf * nw + wg])
                    for v in rows_in:
                        consts[v] = from_kernel(plgpu.load(rows_smem[v].at[wg], layout=layout(ROWS)), g.avals[v].dtype)
                    if table is None:
                        lo, flo, fhi, hi = 0, 0, nk - int(ragged_k), nk
                    else:
                        base = cta * row_stride + wg * 4
                        lo, flo, fhi, hi = (tbl_ref[base + t] for t in range(4))
                    if live is not None:  # up to the last live key block, or every block masked where none is live
                        lo, flo, fhi, hi = clip_ranges((lo, flo, fhi, hi), live, (0, 0, 0, nk))

                    def score_work(j, s, m_i, msub, masked: bool):
                        """Key block j's score work and online softmax on its S tile (the block's score inputs read from
                        its K slot, which is then released): (P in float32, alpha, the new running max and its log2 form,
                        the e tile whose rows sum into l)."""
                        slot = slot_of(j)
                        k0 = j * bk
                        env = dict(consts)
                        env[spec.dot1.outputs[0]] = s
                        for v in full_in:
                            env[v] = from_kernel(plgpu.load(full_smem[v].at[slot, wg], layout=layout(FULL)), g.avals[v].dtype)
                        for v in cols_in:
                            env[v] = from_kernel(plgpu.load(cols_smem[v].at[slot], layout=layout(COLS)), g.avals[v].dtype)
                        plgpu.barrier_arrive(k_free.at[slot])
                        for nd in plan[masked]:
                            if not masked and nd.id in masked_nodes:
                                env[nd.outputs[0]] = env[masked_nodes[nd.id]]
                            elif fold is not None and nd.id == fold[0]:
                                env[nd.outputs[0]] = env[fold[1]]  # x / c: c goes into the max and the exp's FMA
                            else:
                                tiles.eval_node(nd, env, q0, k0)
                        x = tiles.full(env, spec.x).astype(jnp.float32)
                        kok = None
                        if masked and ragged_k:
                            cols = plgpu.broadcasted_iota(jnp.int32, (bk,), 0, layout=layout(COLS)) + k0
                            kok = lax.broadcast_in_dim(cols < Lk, (bq, bk), (1,))
                            x = jnp.where(kok, x, -jnp.inf)
                        y = x if y_val == spec.x else tiles.full(env, y_val).astype(jnp.float32)
                        m_new = jnp.maximum(m_i, x.max(axis=1) * scale)
                        env[spec.max_node.outputs[0]] = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                        for nd in spec.row_m:
                            tiles.eval_node(nd, env, q0, k0)
                        msub_new = jnp.broadcast_to(env[spec.sub_row], (bq,)).astype(jnp.float32) * _LOG2E
                        # exp(y - m) as 2^(y*c*log2e - m*log2e): one FMA and one ex2 per score
                        p = jnp.exp2(y * (scale * _LOG2E) - lax.broadcast_in_dim(msub_new, (bq, bk), (0,)))
                        if kok is not None and y_val != spec.x:
                            p = jnp.where(kok, p, 0.0)
                        env[spec.exp_branch[1].outputs[0]] = p
                        for nd in spec.exp_branch[2:]:
                            tiles.eval_node(nd, env, q0, k0)
                        alpha = jnp.where(m_i == -jnp.inf, 0.0, jnp.exp2(msub - msub_new))
                        e_sum = tiles.full(env, spec.e_sum).astype(jnp.float32)
                        return tiles.full(env, spec.e_dot).astype(jnp.float32), alpha, m_new, msub_new, e_sum

                    def step(j, carry, masked: bool):
                        acc, m_i, msub, l_i = carry
                        slot = slot_of(j)

                        def compute_qk(acc_ref):
                            plgpu.wgmma(acc_ref, q_tile.at[wg], k_smem.at[slot].T)
                            sched()
                            return acc_ref[...]

                        s = pl.run_scoped(compute_qk, plgpu.ACC((bq, bk), jnp.float32))
                        p, alpha, m_new, msub_new, e_sum = score_work(j, s, m_i, msub, masked)
                        p16 = p.astype(dt2)
                        acc = acc * lax.broadcast_in_dim(alpha, (bq, Dv), (0,))

                        def end_softmax():
                            if use_sched:
                                plgpu.barrier_arrive(sched_bar)  # done with the softmax
                            plgpu.barrier_wait(v_bar.at[slot])
                            if use_sched:
                                plgpu.barrier_wait(sched_bar)  # the tensor cores are free

                        # attention_mgpu's order ("empirically [it] influences the performance quite significantly"):
                        # the row sum before the barriers for head dims up to 128, after them for larger ones
                        if Dv <= 128:
                            l_new = l_i * alpha + e_sum.sum(axis=1)
                            acc, l_new, m_new, msub_new, p16 = lax.optimization_barrier((acc, l_new, m_new, msub_new, p16))
                            end_softmax()
                        else:
                            end_softmax()
                            l_new = l_i * alpha + e_sum.sum(axis=1)

                        def wait_next_k():
                            @pl.when(j + 1 < hi)
                            def _():
                                plgpu.barrier_wait(k_bar.at[slot_of(j + 1)])

                        if p_via_smem:
                            p_smem.at[wg][...] = p16
                            plgpu.commit_smem()
                        p_op = p_smem.at[wg] if p_via_smem else p16
                        v_op = v_smem.at[slot].T if tf else v_smem.at[slot]
                        if interp is not None:  # no run_state over an ACC: P V into a fresh accumulator, added to O
                            def compute_pv(acc_ref):
                                plgpu.wgmma(acc_ref, p_op, v_op)
                                wait_next_k()
                                return acc_ref[...]

                            acc = acc + pl.run_scoped(compute_pv, plgpu.ACC((bq, Dv), jnp.float32))
                        else:  # O accumulated in place (TF32: P read from SMEM)
                            def compute_pv(acc_ref):
                                plgpu.wgmma(acc_ref, p_op, v_op)
                                wait_next_k()

                            acc = pl.run_state(compute_pv)(plgpu.ACC.init(acc))
                        plgpu.barrier_arrive(v_free.at[slot])
                        return acc, m_new, msub_new, l_new

                    # FlashAttention-3's intra-warpgroup overlap (`overlap`): each step issues the next key block's
                    # S = Q K^T and the previous block's O += P V together, then runs the softmax of the first while the
                    # second is on the tensor cores; O is rescaled by the new block's alpha once that P V has landed
                    # (overlap 2: at the next step, between its two issues, beside S's MMA, as FA3 does). With the
                    # schedule barrier the warpgroups take turns at issuing, round all of them (FA3's warp scheduler barrier).
                    def take_turn():
                        if use_sched:
                            plgpu.barrier_wait(turn.at[wg])

                    def give_turn():  # to the next warpgroup round the CTA's
                        if use_sched:
                            plgpu.barrier_arrive(turn.at[lax.rem(wg + 1, nw)])

                    def pv_operands(slot, p_prev):
                        return (p_smem.at[wg] if p_via_smem else p_prev), (v_smem.at[slot].T if tf else v_smem.at[slot])

                    def keep_p(p):
                        """P of this block (float32) for the next step's P V, in its dtype: in registers, or through SMEM
                        (interpret mode, TF32). Called once the P V reading the previous one has completed: the barrier
                        keeps the conversion after that wait, else ptxas serialises the wgmmas (C7513: the registers of an
                        in-flight wgmma's A operand redefined)."""
                        p16 = lax.optimization_barrier(p).astype(dt2)
                        if p_via_smem:
                            p_smem.at[wg][...] = p16
                            plgpu.commit_smem()
                            return None
                        return p16

                    def with_o(acc, scale, issue, after_issue=lambda: None):
                        """`issue(o_ref, init)` (O += P V; `init()` puts acc * scale, a row vector or None, into the
                        accumulator: called before the wgmma), `after_issue()` meanwhile; returns (O after the dot, what
                        after_issue returned). Interpret mode cannot initialise an accumulator from a value: there the dot
                        goes into a fresh one that is added to acc * scale."""
                        def scaled():
                            return acc if scale is None else acc * lax.broadcast_in_dim(scale, (bq, Dv), (0,))

                        def body(o_ref):
                            def init():
                                if interp is None:
                                    o_ref[...] = scaled()

                            issue(o_ref, init)
                            res = after_issue()
                            return plgpu.wgmma_accumulator_load(o_ref, wait_n=0), res

                        o, res = pl.run_scoped(body, plgpu.ACC((bq, Dv), jnp.float32))
                        return (o if interp is None else scaled() + o), res

                    def first_block(j, carry):
                        acc, m_i, msub, l_i = carry
                        slot = slot_of(j)
                        plgpu.barrier_wait(k_bar.at[slot])

                        def dot(s_ref):
                            take_turn()
                            plgpu.wgmma(s_ref, q_tile.at[wg], k_smem.at[slot].T)
                            give_turn()
                            # masked: the first block's kind varies by warpgroup; the masked work is right for any block
                            return score_work(j, plgpu.wgmma_accumulator_load(s_ref, wait_n=0), m_i, msub, True)

                        p, alpha, m_new, msub_new, e_sum = pl.run_scoped(dot, plgpu.ACC((bq, bk), jnp.float32))
                        # O is zero: any scale pending on it (overlap 2) is fine, alpha's as well
                        return acc, m_new, msub_new, l_i * alpha + e_sum.sum(axis=1), keep_p(p), alpha if late_rescale else None

                    def overlapped(j, carry, masked: bool):
                        acc, m_i, msub, l_i, p_prev, pending = carry
                        slot, pslot = slot_of(j), slot_of(j - 1)
                        plgpu.barrier_wait(k_bar.at[slot])
                        plgpu.barrier_wait(v_bar.at[pslot])

                        def dots(s_ref):
                            def issue(o_ref, init):
                                if not late_rescale:
                                    init()
                                take_turn()
                                plgpu.wgmma(s_ref, q_tile.at[wg], k_smem.at[slot].T)
                                if late_rescale:
                                    init()
                                plgpu.wgmma(o_ref, *pv_operands(pslot, p_prev))
                                give_turn()

                            def softmax():  # beside the P V: everything but P's conversion (see keep_p)
                                p, alpha, m_new, msub_new, e_sum = score_work(
                                    j, plgpu.wgmma_accumulator_load(s_ref, wait_n=1), m_i, msub, masked)
                                return p, alpha, m_new, msub_new, l_i * alpha + e_sum.sum(axis=1)

                            return with_o(acc, pending, issue, softmax)

                        o, (p, alpha, m_new, msub_new, l_new) = pl.run_scoped(dots, plgpu.ACC((bq, bk), jnp.float32))
                        plgpu.barrier_arrive(v_free.at[pslot])
                        if late_rescale:
                            return o, m_new, msub_new, l_new, keep_p(p), alpha
                        return o * lax.broadcast_in_dim(alpha, (bq, Dv), (0,)), m_new, msub_new, l_new, keep_p(p), None

                    def last_block(j, carry):
                        acc, m_i, msub, l_i, p_prev, pending = carry
                        slot = slot_of(j)
                        plgpu.barrier_wait(v_bar.at[slot])

                        def issue(o_ref, init):
                            init()
                            take_turn()
                            plgpu.wgmma(o_ref, *pv_operands(slot, p_prev))
                            give_turn()

                        acc, _ = with_o(acc, pending, issue)
                        plgpu.barrier_arrive(v_free.at[slot])
                        return acc, m_i, msub, l_i

                    def flush(j, _):
                        # A key block the CTA loads for the other warpgroup only: observe its loads (barrier phases are
                        # tracked per thread, in order), release its buffers, keep the schedule barrier's count.
                        slot = slot_of(j)
                        plgpu.barrier_wait(k_bar.at[slot])
                        plgpu.barrier_wait(v_bar.at[slot])
                        plgpu.barrier_arrive(k_free.at[slot])
                        plgpu.barrier_arrive(v_free.at[slot])
                        if overlap:
                            take_turn()
                            give_turn()
                        else:
                            sched()
                            sched()

                    row = layout(ROWS)
                    carry = (plgpu.layout_cast(jnp.zeros((bq, Dv), jnp.float32), layout(FULL)),
                             plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), row),
                             plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), row),
                             plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), row))
                    if overlap and use_sched:
                        # warpgroup 0 issues first (before any flush takes a turn); a persistent CTA's turns go on round
                        # from one tile into the next: a give per tile would let the last warpgroup give twice before
                        # warpgroup 0 took the first (a one-arrival barrier two phases ahead of its waiter)
                        pl.when((wg == nw - 1) & (t == 0) if persistent else wg == nw - 1)(give_turn)
                    if table is not None:
                        lax.fori_loop(clo, lo, flush, None)
                    if overlap:
                        carry = first_block(lo, carry)
                        after = lo + 1  # the blocks after the first: [lo + 1, hi) in the table's three ranges
                        carry = lax.fori_loop(after, lax.max(flo, after), functools.partial(_call, overlapped, masked=True), carry)
                        carry = lax.fori_loop(lax.max(flo, after), lax.max(fhi, after),
                                              functools.partial(_call, overlapped, masked=False), carry)
                        carry = lax.fori_loop(lax.max(fhi, after), hi, functools.partial(_call, overlapped, masked=True), carry)
                        carry = last_block(hi - 1, carry)
                    else:
                        @pl.when(lo < hi)
                        def _first_k():
                            plgpu.barrier_wait(k_bar.at[slot_of(lo)])

                        if use_sched:
                            pl.when(wg == 1)(sched)
                        carry = lax.fori_loop(lo, flo, functools.partial(_call, step, masked=True), carry)
                        carry = lax.fori_loop(flo, fhi, functools.partial(_call, step, masked=False), carry)
                        carry = lax.fori_loop(fhi, hi, functools.partial(_call, step, masked=True), carry)
                    if table is not None:
                        lax.fori_loop(hi, chi, flush, None)
                    if use_sched:
                        if overlap:
                            pl.when((wg == 0) & (t == n_mine - 1) if persistent else wg == 0)(take_turn)
                        else:
                            pl.when(wg == 0)(sched)

                    acc, _, msub, l_i = carry
                    if emit_lse:  # P = exp(y - msub) / l = exp(y - lse); msub is in log2 units here
                        live = l_i > 0
                        lse_smem.at[wg][...] = jnp.where(live, msub * _LN2 + jnp.log(jnp.where(live, l_i, 1.0)), jnp.inf)
                    env = {spec.sum_node.outputs[0]: l_i}
                    for nd in spec.row_l:
                        tiles.eval_node(nd, env, q0, 0)
                    c = jnp.broadcast_to(env[spec.l_row], (bq,)).astype(jnp.float32)
                    comb = spec.combine
                    if comb.name == "div" and spec.e_first:
                        o = acc * lax.broadcast_in_dim(1.0 / c, (bq, Dv), (0,))  # one division per row
                    else:
                        cb = lax.broadcast_in_dim(c, (bq, Dv), (0,))
                        o = ops.eval_elementwise(comb.primitive, comb.params, jnp.float32, [acc, cb] if spec.e_first else [cb, acc])
                    o_tile.at[wg][...] = o.astype(out_dt)
                    plgpu.commit_smem()
                    oidx = tuple(pl.ds(q0, bq) if r == "q" else slice(None) if r == "d" else 0 if r is None else bidx[r]
                                 for r in roles)

                    @pl.when(q0 < Lq)
                    def _store():
                        plgpu.copy_smem_to_gmem(o_tile.at[wg], out_ref.at[oidx])

                    if emit_lse:  # whole blocks: the array is padded to them, the rows past Lq sliced off by XLA
                        plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[fb, pl.ds(q0, bq)])
                    return chi - clo

                load_q(0, 0)
                if not persistent:
                    run_tile(0, 0, 0)
                else:
                    def next_tile(t, ring0):
                        buf = lax.rem(t, 2)
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # tile t-1's O and logsumexp are read from SMEM

                        @pl.when(t + 1 < n_mine)
                        def _prefetch():  # the next tile's Q into the other buffer (tile t-1's O was there)
                            load_q(t + 1, 1 - buf)

                        return ring0 + run_tile(t, buf, ring0)

                    lax.fori_loop(0, n_mine, next_tile, jnp.int32(0))
                plgpu.wait_smem_to_gmem(0)

    name = f"autofuse_attention_mgpu_{group.signature[:8]}"
    semantics = plgpu.LoweringSemantics.Warpgroup if cfg.semantics else plgpu.LoweringSemantics.Lane
    out_type = jax.ShapeDtypeStruct(k_out_shape, out_dt)
    if emit_lse:
        out_type = (out_type, jax.ShapeDtypeStruct((spec.batch, n_cta * nw * bq), jnp.float32))
    kernel = plgpu.kernel(
        body, out_type=out_type, grid=(n_grid,) if persistent else (spec.batch, n_cta), grid_names=("s",) if persistent else ("b", "q"),
        num_threads=nw + 1, thread_name="wg", compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=semantics), interpret=interp,
        kernel_name=name)
    tbl = None if table is None else np.ascontiguousarray(table.reshape(-1))  # a jax array per call (see triton/attention)

    def run(*xs):
        env = dict(zip(group.inputs, xs))
        args = [views[r].prepare(env[getattr(spec, r).value]) for r in ("q", "k", "v")]
        args += [iviews[v].prepare(env[v]) for v in ins]
        if tbl is not None:
            args.append(jnp.asarray(tbl))
        o = kernel(*args)
        lse = None
        if emit_lse:
            o, lse = o
            lse = lse[:, :Lq] if lse.shape[1] != Lq else lse
        if out_rows != out_shape[q_dim]:
            o = lax.slice_in_dim(o, 0, out_shape[q_dim], axis=q_dim)
        if o_perm is not None:
            o = jnp.transpose(o, np.argsort(o_perm))
        o = jnp.reshape(o, g.avals[spec.out].shape)
        return [o, lse] if emit_lse else [o]

    return run


def persistent_tiles(n_tiles: int, n_grid: int, snake: bool) -> tuple:
    """A persistent CTA's share of `n_tiles` tiles taken round by round by the `n_grid` CTAs of grid axis "s", in tile
    order: (how many it takes, traced; `tile(t)`, the tile it takes in round t). `snake`: tiles of unequal work,
    longest first: on odd rounds the CTAs take their places in reverse, so the one that took the longest tile of a
    round takes the shortest of the next."""
    sm = lax.axis_index("s")

    def place(t):
        return lax.select(lax.rem(t, 2) == 0, sm, n_grid - 1 - sm) if snake else sm

    rounds, left = divmod(n_tiles, n_grid)
    return rounds + (place(rounds) < left).astype(jnp.int32), lambda t: t * n_grid + place(t)


def persistent_ring(n_mine, blocks_of: Callable, stages: int, buffers: list[tuple]) -> None:
    """`memory_ring` over a persistent CTA's `n_mine` tiles: tile t's blocks [lo, hi) in order (`blocks_of(t)` gives
    (lo, hi, ctx)), each `(free barrier, issue(*ctx, block, slot))` in order, the slots counted on across tiles (a
    slot is issued again once the compute warpgroups freed its block before), and the last releases observed."""
    def tile_loads(t, c):
        lo, hi, ctx = blocks_of(t)

        def load(j, c):
            slot = lax.rem(c, stages)
            for free, issue in buffers:
                @pl.when(c >= stages)
                def _wait():
                    plgpu.barrier_wait(free.at[slot])

                issue(*ctx, j, slot)
            return c + 1

        return lax.fori_loop(lo, hi, load, c)

    total = lax.fori_loop(0, n_mine, tile_loads, jnp.int32(0))

    @pl.loop(lax.max(total - stages, 0), total)
    def _drain(c):
        for free, _ in buffers:
            plgpu.barrier_wait(free.at[lax.rem(c, stages)])


def memory_ring(lo, hi, stages: int, slot_of: Callable, buffers: list[tuple]) -> None:
    """The memory warpgroup's TMA ring over blocks [lo, hi) (this kernel's and the backward's): the first `stages`
    blocks issued at once, then each block's buffers issued again as soon as the compute warpgroups free them, each
    `(free barrier, issue(block, slot))` in order, and the last releases observed too (barrier phases are tracked
    per thread, in order)."""
    for i in range(stages):
        @pl.when(lo + i < hi)
        def _prologue():
            for _, issue in buffers:
                issue(lo + i, i)

    @pl.loop(lo, hi - stages)
    def _ring(j):
        slot = slot_of(j)
        for free, issue in buffers:
            plgpu.barrier_wait(free.at[slot])
            issue(j + stages, slot)

    @pl.loop(lax.max(lo, hi - stages), hi)
    def _drain(j):
        for free, _ in buffers:
            plgpu.barrier_wait(free.at[slot_of(j)])


def _call(step, j, carry, *, masked):
    return step(j, carry, masked)


def _tile_swizzle(bk: int, itemsize: int) -> int:
    """The swizzle (bytes) of a score input's [block_q, block_kv] SMEM tile (block_kv is a multiple of 64: >= 64 B)."""
    return min(swizzle(bk, itemsize), 128)
