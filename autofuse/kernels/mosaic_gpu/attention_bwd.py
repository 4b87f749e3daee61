"""Mosaic GPU lowering of attention's backward (Hopper: TMA, wgmma, warp specialisation): dQ, dK and dV from the
output's cotangent and the forward's row logsumexp, the scores re-evaluated per tile from the group's own equations.

The two-kernel structure is the backward of JAX's `pallas/ops/gpu/attention_mgpu.py` (fwd+bwd at B8 H32 L2048
D128 in 1.10x cuDNN's time on an H100, against 1.38x with the Triton backward): each kernel a CTA of one memory
warpgroup streaming tiles by TMA into a ring of SMEM buffers and two compute warpgroups that each hold `bwd_held` rows.

- `dq`: a compute warpgroup holds `bwd_held` queries (Q, dO, the logsumexp and delta = rowsum(dO * O)) and steps
  through `bwd_step` keys at a time: S = Q Kᵀ, y = score work(S), P = exp(y - lse), dP = dO Vᵀ,
  dS = d score work / dS (P (dP - delta)), dQ += dS K.
- `dkdv`: a compute warpgroup holds `bwd_held` keys (K, V) and steps through `bwd_step` queries: the same tile
  transposed, Sᵀ = K Qᵀ (so that Pᵀ and dSᵀ are wgmma's A operand in registers, as attention_mgpu does),
  dV += Pᵀ dO, dPᵀ = V dOᵀ, dK += dSᵀ Q.

`bwd_fused` (the default where it applies, as FlashAttention-2/3 do): no `dq` kernel, five products instead of
seven. `dkdv` also computes each step's dQ = dS K: both compute warpgroups write their dSᵀ to SMEM, meet at a
barrier, and each computes half of it (64 of 128 stepped queries, or half of a head dim of two 128-byte tiles) and
adds it into a float32 buffer by TMA reduction. Both warpgroups then take every step of the CTA (in a block one of
them would skip, a causal CTA's first, it shares a dS of zeros without computing it). fwd+bwd 0.98x cuDNN's time at
D128, 0.95x at D64 on an H200 against 1.11x with two kernels (results/attention_bwd_fused_h200.md; in alternating
pairs 1.015-1.021x at D128, 0.93-0.95x at D64: results/attention_grad_pairs_h200.md). `bwd_overlap` issues the products in pairs
(Sᵀ with dPᵀ, dV with dK): better for two kernels, worse fused (registers spill). `bwd_persistent` runs the dK/dV
kernel one CTA per SM walking its (batch position, key block) tiles, as the forward's `persistent` does (searched;
~1% slower at D128 on an H200, so off by default: results/attention_persistent_h200.md).

What differs from attention_mgpu is that nothing of the score work is hand-written: its equations are the
group's jaxpr, evaluated on the register tiles (`attention.ScoreTiles`; `TransposedScoreTiles` on the transposed
tile of `dkdv`: queries along its columns), and dS is `jax.vjp` of that evaluation (a mask passes no gradient,
a scale its factor, soft-capping its derivative). Masks known at build time (causal, sliding windows) skip the
blocks they kill (`attention.block_ranges`, as the forward). GQA and heads split out of [B, L, H*D] are the
forward's TMA index arithmetic; the kernels write dQ, dK, dV per score batch position ([batch, L, D] in the
operands' dtype), and the template maps them back to the operands (GQA's heads summed there, by XLA).

Score work may read other inputs, as the forward's: a vector along the keys (a padding mask) is held with K in
`dkdv` and streamed with K in `dq`, one along the queries the other way round (each TMA'd beside the operand it
travels with, on its barrier), a scalar (lengths per batch, a slope per head) read per CTA, a [queries, keys] tile
(a fixed bias) streamed per step, in `dkdv` from a keys-first copy (with dQ fused its tiles do not fit). Key lengths
bound the blocks visited (`attention_masks.key_bound`): `dq` stops at the last live key block, a `dkdv` CTA past it
loads no query.

Declined (`Unsupported`, the Triton backward runs instead): what the Mosaic GPU forward declines, float32 attention,
tiles other than 64 held rows and 64 or 128 stepped ones. Interpret mode (CPU) has no wgmma with A in registers: P and dS go through SMEM there, one product at
a time; nor TMA reductions: there the fused dQ is read, added and written back (its CTAs run one at a time, and the
two warpgroups' halves do not overlap).
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
from ...graph import Group
from ..attention_masks import block_ranges, clip_ranges, key_block_ranges, key_bound
from ..attention_spec import AttentionSpec
from ..tiling import cdiv, needed
from . import attention as fwd
from .gemm import from_kernel, interpret_params, kernel_dtype, require_smem, smem_transforms
from .tiles import COLS, FULL, NONE, ROWS, Unsupported, layout

_LOG2E = math.log2(math.e)
# setmaxnreg: (the memory warpgroup's, each compute warpgroup's); 128 threads each share the SM's 64K registers.
# FA3's split: against (40, 232) the fused dK/dV/dQ kernel spills 12/12 bytes instead of 40/48 (D128; causal: 264/360
# instead of 400/496) and the backward runs 2-3% faster (results/attention_bwd_fused_h200.md, setmaxnreg)
_REGISTERS = (24, 240)


@dataclasses.dataclass(frozen=True)
class Config:
    held: int  # rows a compute warpgroup holds (queries in dq, keys in dkdv): wgmma's M
    step: int  # rows streamed per step (keys in dq, queries in dkdv)
    stages: int  # depth of the TMA ring
    fused: bool = False  # dQ in the dK/dV kernel (five products, not seven), reduced into float32 by TMA
    overlap: bool = False  # dK/dV: Sᵀ with dPᵀ and dV with dK issued together (more registers live)
    persistent: bool = False  # dK/dV: one CTA per SM walking the (batch position, key block) tiles, the ring running on
    # (searched; ~1% slower at D128 on an H200: results/attention_persistent_h200.md)

    @staticmethod
    def of(config: dict) -> "Config":
        return Config(int(config.get("bwd_held", 64)), int(config.get("bwd_step", 64)), int(config.get("bwd_stages", 2)),
                      bool(int(config.get("bwd_fused", 0))), bool(int(config.get("bwd_overlap", 0))),
                      bool(int(config.get("bwd_persistent", 0))))


class TransposedScoreTiles(fwd.ScoreTiles):
    """`ScoreTiles` on the transposed [held keys, stepped queries] tile of `dkdv`: rows are keys, columns queries. A value
    varying along the queries only is a column vector here (WGMMA.reduce(0)), one along the keys a row vector."""

    def __init__(self, spec: AttentionSpec, bq: int, bk: int):
        super().__init__(spec, bq, bk)
        self.bq, self.bk = bq, bk

    def shape(self, span) -> tuple[int, ...]:
        if span == FULL:
            return (self.bk, self.bq)
        return (self.bq,) if span == ROWS else (self.bk,) if span == COLS else ()

    def widen(self, x, have, want):
        if have == want:
            return x
        if (have.rows and not want.rows) or (have.cols and not want.cols):
            raise Unsupported(f"cannot narrow a {have} value to {want}")
        dims = () if have == NONE else ((1,) if have == ROWS else (0,))
        return lax.broadcast_in_dim(jnp.asarray(x), self.shape(want), dims)

    def iota(self, nd, r0, c0):
        """`r0`: the tile's first key, `c0`: its first query."""
        out = nd.outputs[0]
        a = self.spec.axes[out][nd.params["dimension"]]
        dt = ops.compute_dtype(nd.params["dtype"])
        if a == self.aspec.q_axis:
            x, have = plgpu.broadcasted_iota(jnp.int32, (self.bq,), 0, layout=layout(COLS)) + c0, ROWS
        elif a == self.aspec.k_axis:
            x, have = plgpu.broadcasted_iota(jnp.int32, (self.bk,), 0, layout=layout(ROWS)) + r0, COLS
        else:
            x, have = (jnp.zeros((), jnp.int32) if a is None else jnp.asarray(self.bidx[a], jnp.int32)), NONE
        return self.widen(x.astype(dt), have, self.spec.span[out])


def check_group(spec: AttentionSpec) -> None:
    fwd.check_group(spec)
    if fwd.tf32(spec):
        raise Unsupported("float32 attention (TF32): the Triton backward")


def check_config(spec: AttentionSpec, cfg: Config) -> None:
    if cfg.held != 64:
        raise Unsupported(f"bwd_held={cfg.held}: a compute warpgroup holds 64 rows (its float32 accumulators)")
    if cfg.step not in (64, 128):
        raise Unsupported(f"bwd_step={cfg.step}: 64 or 128 rows per step (wgmma N and K groups)")
    if not 2 <= cfg.stages <= 4:
        raise Unsupported(f"bwd_stages={cfg.stages}: 2 to 4 steps in flight")
    if cfg.fused:
        dq_split(spec, cfg)
    require_smem(max(smem_bytes(spec, cfg)))


def dq_split(spec: AttentionSpec, cfg: Config) -> str:
    """How the fused kernel's two compute warpgroups share a step's dQ += dS K ([step queries, 2 held blocks of
    keys] x [keys, D]; wgmma's M is 64 rows): "rows" (128 stepped queries: 64 each) or "cols" (64 stepped queries,
    D split in two halves of whole 128-byte swizzle tiles)."""
    if cfg.step == 128:
        return "rows"
    if spec.D * spec.dot_dtype1.itemsize % 256 == 0:
        return "cols"
    raise Unsupported(f"bwd_fused with bwd_step={cfg.step} at head dim {spec.D}: 128 stepped rows, or a head dim "
                      "of two whole 128-byte tiles")


def dq_share_cols(spec: AttentionSpec, cfg: Config) -> int:
    """The columns of each compute warpgroup's [64, cols] share of a step's fused dQ (`dq_split`)."""
    return spec.D if dq_split(spec, cfg) == "rows" else spec.D // 2


def smem_bytes(spec: AttentionSpec, cfg: Config) -> tuple[int, int]:
    """Shared memory of (dq, dkdv) on the GPU, each buffer in whole KiB as Mosaic GPU counts it, 8 bytes per
    barrier, 2 KiB of reduction scratch (interpret mode's SMEM copies of P and dS are not counted)."""
    i1, i2 = spec.dot_dtype1.itemsize, spec.dot_dtype2.itemsize
    h, s, st = cfg.held, cfg.step, cfg.stages

    def total(bufs, barriers):
        return sum(-(-b // 1024) * 1024 for b in bufs) + 8 * barriers + 2048

    dq = [2 * h * spec.D * i1, 2 * h * spec.Dv * i2, 2 * h * 4, 2 * h * 4, st * s * spec.D * i1, st * s * spec.Dv * i2]
    dkdv = [2 * h * spec.D * i1, 2 * h * spec.Dv * i2, st * s * spec.D * i1, st * s * spec.Dv * i2, st * s * 4, st * s * 4]
    for v, view in vector_views(spec).items():  # held beside Q (dq) or K (dkdv), streamed with K (dq) or Q (dkdv)
        held, streamed = 2 * h * view.dtype.itemsize, st * s * view.dtype.itemsize
        along_q = spec.tile.span[v] == ROWS
        dq.append(held if along_q else streamed)
        dkdv.append(streamed if along_q else held)
    for v in tile_inputs(spec):  # both warpgroups' [held, step] tiles of a bias, streamed
        tile = st * 2 * h * s * kernel_dtype(spec.group.graph.avals[v].dtype).itemsize
        dq.append(tile)
        dkdv.append(tile)
    if cfg.fused:  # dS for both warpgroups, double-buffered; each warpgroup's float32 share of dQ
        dkdv += [2 * 2 * h * s * i1, 2 * 64 * dq_share_cols(spec, cfg) * 4]
    return total(dq, 2 + 4 * st), total(dkdv, 2 + 4 * st + 2 * cfg.fused)


def vector_views(spec: AttentionSpec) -> dict:
    """The score work's vector inputs (along the queries or the keys: a padding mask, positions), as the kernels read
    them: widened where 64 of them would not make a 128-byte TMA copy (every tile here is a multiple of 64 rows)."""
    return {v: fwd._input_view(spec, v, 64) for v in fwd.score_inputs(spec) if spec.tile.span[v] in (ROWS, COLS)}


def tile_inputs(spec: AttentionSpec) -> list[int]:
    """The score work's [queries, keys] inputs (a bias): a tile of each per step, in `dkdv` from a copy with the keys
    first (XLA transposes it outside), so that it lands as the transposed tile's rows."""
    return [v for v in fwd.score_inputs(spec) if spec.tile.span[v] == FULL]


def _key_ranges(spec: AttentionSpec, bq: int, bk: int) -> np.ndarray | None:
    """As the forward's `_ranges_table`, transposed: per CTA (2 key blocks of bk) the [lo, full_lo, full_hi, hi) of
    query blocks (of bq) each key block sees (full: no position of the pair masked), then the CTA's [lo, hi)."""
    per = key_block_ranges(spec, bq, bk)
    return None if per is None else fwd.per_cta(per)


def lower(group: Group, spec: AttentionSpec, config: dict | None, *, interpret=False) -> Callable:
    """`bwd(ins, out, lse, dout) -> (dq, dk, dv)` as `triton.attention_bwd.lower` gives it: `ins` the group's
    inputs, `out` its output, `lse` the forward's [batch, Lq] row logsumexp, `dout` the output's cotangent; each
    gradient [batch, L, D] in its operand's dtype."""
    from ..triton.attention_bwd import to_canonical

    check_group(spec)
    cfg = Config.of(config or {})
    check_config(spec, cfg)
    g = group.graph
    interp = interpret_params(interpret)
    via_smem = interp is not None
    h, st_rows, stages = cfg.held, cfg.step, cfg.stages
    Lq, Lk, D, Dv, B = spec.Lq, spec.Lk, spec.D, spec.Dv, spec.batch
    dt1, dt2 = spec.dot_dtype1, spec.dot_dtype2
    scores, y_val = spec.dot1.outputs[0], spec.exp_branch[0].inputs[0]
    # bypassed in the blocks no position of which is masked (known only where the masks were analysed on the host,
    # or below the runtime masks' bound on the keys)
    bound = key_bound(spec)
    masked_nodes = (({**spec.mask_selects, **spec.mask_adds} if block_ranges(spec, h, st_rows) is not None else {})
                    | (bound.selects if bound else {}))
    score_nodes = {m: needed(spec.pre, {y_val}, set(), None if m else masked_nodes) for m in (True, False)}
    views = {r: fwd._operand_view(g, getattr(spec, r)) for r in ("q", "k", "v")}
    tf_d, tf_dv = fwd._tf(D, dt1.itemsize), fwd._tf(Dv, dt2.itemsize)  # q/k and v/dO tiles, held or streamed
    params = plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane)

    # the score work's other inputs: vectors along the queries (held with Q in dq, streamed with Q in dkdv) or the keys
    # (streamed with K in dq, held with K in dkdv), and scalars (read per CTA)
    side = fwd.score_inputs(spec)
    tiles_in = tile_inputs(spec)  # [queries, keys] (dq) and [keys, queries] (dkdv) tiles of st_rows columns
    in_views = {v: fwd._input_view(spec, v, st_rows if v in tiles_in else 64) for v in side}
    t_views = {v: fwd._input_view(spec, v, st_rows, keys_first=True) for v in tiles_in}
    tile_tf = {v: smem_transforms(fwd._tile_swizzle(st_rows, in_views[v].dtype.itemsize), in_views[v].dtype.itemsize)
               for v in tiles_in}
    q_vecs = [v for v in side if spec.tile.span[v] == ROWS]
    k_vecs = [v for v in side if spec.tile.span[v] == COLS]
    scalars = [v for v in side if spec.tile.span[v] == NONE]

    def operand_box(r: str, bidx, s0, n: int):
        v = views[r]
        return fwd._operand_index(v.operand, len(v.shape), bidx, s0, n, D if r != "v" else Dv)

    def vector_box(v: int, bidx, s0, n: int) -> tuple:
        """Vector input v's TMA box: n positions from s0 along its query or key axis, at the CTA's batch index."""
        return tuple(pl.ds(s0, n) if a in (spec.q_axis, spec.k_axis) else bidx[a] for a in in_views[v].axes)

    def tile_box(view, bidx, q0, nq: int, k0, nk: int) -> tuple:
        """A tile input's TMA box in `view` (either order): queries [q0, q0 + nq), keys [k0, k0 + nk)."""
        return tuple(pl.ds(q0, nq) if a == spec.q_axis else pl.ds(k0, nk) if a == spec.k_axis else bidx[a]
                     for a in view.axes)

    def tile_value(ref, v: int) -> jax.Array:
        return from_kernel(plgpu.load(ref, layout=layout(FULL)), g.avals[v].dtype)

    def scalar_env(in_refs: dict, bidx) -> dict:
        return fwd.read_scalars(g, in_refs, in_views, scalars, bidx)

    def vector(ref, v: int, span) -> jax.Array:
        return from_kernel(plgpu.load(ref, layout=layout(span)), g.avals[v].dtype)

    def score_work(tiles, s, r0, c0, masked: bool, inputs: dict):
        """y (float32, the exp's input) of the score tile `s`, and its VJP (`masked`: evaluate the masks; `inputs`:
        the score inputs' values on this tile)."""
        def f(x):
            env = {**inputs, scores: x}
            for nd in score_nodes[masked]:
                if not masked and nd.id in masked_nodes:
                    env[nd.outputs[0]] = env[masked_nodes[nd.id]]
                elif nd.name == "stop_gradient":
                    env[nd.outputs[0]] = lax.stop_gradient(env[nd.inputs[0]])
                else:
                    tiles.eval_node(nd, env, r0, c0)
            return tiles.full(env, y_val).astype(jnp.float32)

        return jax.vjp(f, s)

    whole = math.lcm(h, st_rows)

    def bounds_mask(q_ids, k_ids, shape, q_dim):
        """Positions past Lq / Lk (TMA zero-fills them; their p must be 0), or None."""
        ok = None
        if Lq % whole:
            ok = lax.broadcast_in_dim(q_ids < Lq, shape, (q_dim,))
        if Lk % whole:
            kk = lax.broadcast_in_dim(k_ids < Lk, shape, (1 - q_dim,))
            ok = kk if ok is None else ok & kk
        return ok

    def mma(acc, a, b, scratch=None):
        """acc + a @ b by wgmma (a: registers, or through `scratch` SMEM in interpret mode; b: SMEM)."""
        if via_smem:
            scratch[...] = a
            plgpu.commit_smem()

            def f(ref):
                plgpu.wgmma(ref, scratch, b)
                return ref[...]

            return acc + pl.run_scoped(f, plgpu.ACC(acc.shape, jnp.float32))

        def g_(ref):
            plgpu.wgmma(ref, a, b)

        return pl.run_state(g_)(plgpu.ACC.init(acc))

    def product(a_smem, b_smem, shape):
        def f(ref):
            plgpu.wgmma(ref, a_smem, b_smem)
            return ref[...]

        return pl.run_scoped(f, plgpu.ACC(shape, jnp.float32))

    # ----- dQ: 2 x h queries per CTA, keys streamed st_rows at a time.
    nq_cta, nk_steps = cdiv(Lq, 2 * h), cdiv(Lk, st_rows)
    q_tbl = fwd._ranges_table(spec, h, st_rows)

    def dq_body(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest):
        in_refs, rest = dict(zip(side, rest[:len(side)])), rest[len(side):]
        tbl_ref = rest[0] if q_tbl is not None else None
        dq_ref = rest[-1]
        scratch = dict(
            q_smem=plgpu.SMEM((2, h, D), dt1, transforms=tf_d), do_smem=plgpu.SMEM((2, h, Dv), dt2, transforms=tf_dv),
            lse_smem=plgpu.SMEM((2, h), jnp.float32), delta_smem=plgpu.SMEM((2, h), jnp.float32),
            k_smem=plgpu.SMEM((stages, st_rows, D), dt1, transforms=tf_d),
            v_smem=plgpu.SMEM((stages, st_rows, Dv), dt2, transforms=tf_dv),
            ds_smem=plgpu.SMEM((2, h, st_rows), dt1, transforms=fwd._tf(st_rows, dt1.itemsize)) if via_smem else None,
            qvec_smem=[plgpu.SMEM((2, h), in_views[v].dtype) for v in q_vecs],
            kvec_smem=[plgpu.SMEM((stages, st_rows), in_views[v].dtype) for v in k_vecs],
            ktile_smem=[plgpu.SMEM((stages, 2, h, st_rows), in_views[v].dtype, transforms=tile_tf[v]) for v in tiles_in],
            q_bar=plgpu.Barrier(num_arrivals=4 + len(q_vecs), num_barriers=2),
            k_bar=plgpu.Barrier(num_arrivals=1 + len(k_vecs) + 2 * len(tiles_in), num_barriers=stages),
            v_bar=plgpu.Barrier(num_barriers=stages),
            k_free=plgpu.Barrier(num_arrivals=2, num_barriers=stages), v_free=plgpu.Barrier(num_arrivals=2, num_barriers=stages))

        @functools.partial(pl.run_scoped, **scratch, collective_axes="wg")
        def _scope(q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, qvec_smem, kvec_smem, ktile_smem, q_bar,
                   k_bar, v_bar, k_free, v_free):
            qvec_smem, kvec_smem = dict(zip(q_vecs, qvec_smem)), dict(zip(k_vecs, kvec_smem))
            ktile_smem = dict(zip(tiles_in, ktile_smem))
            wg = lax.axis_index("wg")
            cta = lax.axis_index("q")
            if q_tbl is not None:
                cta = nq_cta - 1 - cta  # the longest rows (causal) first
            bidx = fwd.batch_index(spec)
            bflat = lax.axis_index("b")
            clo, chi = (0, nk_steps) if q_tbl is None else (tbl_ref[cta * 10 + 8], tbl_ref[cta * 10 + 9])
            if bound is not None:  # up to the last live key block; every one where none is live (`fwd.live_key_blocks`)
                live = fwd.live_key_blocks(spec, bound, scalar_env(in_refs, bidx), bidx, st_rows, nk_steps)
                clo, chi = clip_ranges((clo, chi), live, (0, nk_steps))

            def slot_of(j):
                return lax.rem(j - clo, stages)

            @pl.when(wg == 2)
            def _memory():
                plgpu.set_max_registers(_REGISTERS[0], action="decrease")

                def issue_k(j, slot):
                    k0 = j * st_rows + wg * 0  # a traced 0: box starts past an array's end are legal for TMA, not statically
                    plgpu.copy_gmem_to_smem(k_ref.at[operand_box("k", bidx, k0, st_rows)], k_smem.at[slot], k_bar.at[slot])
                    for v in k_vecs:
                        plgpu.copy_gmem_to_smem(in_refs[v].at[vector_box(v, bidx, k0, st_rows)], kvec_smem[v].at[slot],
                                                k_bar.at[slot])
                    for v in tiles_in:  # each compute warpgroup's [h queries, st_rows keys] tile
                        for w in range(2):
                            box = tile_box(in_views[v], bidx, cta * (2 * h) + w * h, h, k0, st_rows)
                            plgpu.copy_gmem_to_smem(in_refs[v].at[box], ktile_smem[v].at[slot, w], k_bar.at[slot])

                def issue_v(j, slot):
                    k0 = j * st_rows + wg * 0
                    plgpu.copy_gmem_to_smem(v_ref.at[operand_box("v", bidx, k0, st_rows)], v_smem.at[slot], v_bar.at[slot])

                fwd.memory_ring(clo, chi, stages, slot_of, [(k_free, issue_k), (v_free, issue_v)])

            @pl.when(wg < 2)
            def _compute():
                plgpu.set_max_registers(_REGISTERS[1], action="increase")
                tiles = fwd.ScoreTiles(spec, h, st_rows)
                tiles.bidx = bidx
                q0 = cta * (2 * h) + wg * h
                plgpu.copy_gmem_to_smem(q_ref.at[operand_box("q", bidx, q0, h)], q_smem.at[wg], q_bar.at[wg])
                plgpu.copy_gmem_to_smem(do_ref.at[bflat, pl.ds(q0, h)], do_smem.at[wg], q_bar.at[wg])
                plgpu.copy_gmem_to_smem(lse_ref.at[bflat, pl.ds(q0, h)], lse_smem.at[wg], q_bar.at[wg])
                plgpu.copy_gmem_to_smem(delta_ref.at[bflat, pl.ds(q0, h)], delta_smem.at[wg], q_bar.at[wg])
                for v in q_vecs:
                    plgpu.copy_gmem_to_smem(in_refs[v].at[vector_box(v, bidx, q0, h)], qvec_smem[v].at[wg], q_bar.at[wg])
                plgpu.barrier_wait(q_bar.at[wg])
                held_inputs = scalar_env(in_refs, bidx) | {v: vector(qvec_smem[v].at[wg], v, ROWS) for v in q_vecs}
                rows = layout(ROWS)
                lse = plgpu.load(lse_smem.at[wg], layout=rows) * _LOG2E
                delta = plgpu.load(delta_smem.at[wg], layout=rows)
                q_ids = plgpu.broadcasted_iota(jnp.int32, (h,), 0, layout=rows) + q0
                lo, flo, fhi, hi = (0, 0, nk_steps, nk_steps) if q_tbl is None else (tbl_ref[cta * 10 + 4 * wg + t] for t in range(4))
                if bound is not None:
                    lo, flo, fhi, hi = clip_ranges((lo, flo, fhi, hi), live, (0, 0, 0, nk_steps))

                def step(j, dq, masked: bool):
                    slot = slot_of(j)
                    k0 = j * st_rows
                    plgpu.barrier_wait(k_bar.at[slot])
                    s = product(q_smem.at[wg], k_smem.at[slot].T, (h, st_rows))
                    inputs = (held_inputs | {v: vector(kvec_smem[v].at[slot], v, COLS) for v in k_vecs}
                              | {v: tile_value(ktile_smem[v].at[slot, wg], v) for v in tiles_in})
                    y, pull = score_work(tiles, s, q0, k0, masked, inputs)
                    p = jnp.exp2(y * _LOG2E - lax.broadcast_in_dim(lse, (h, st_rows), (0,)))
                    ok = bounds_mask(q_ids, plgpu.broadcasted_iota(jnp.int32, (st_rows,), 0, layout=layout(COLS)) + k0,
                                     (h, st_rows), 0)
                    if ok is not None:
                        p = jnp.where(ok, p, 0.0)
                    plgpu.barrier_wait(v_bar.at[slot])
                    dp = product(do_smem.at[wg], v_smem.at[slot].T, (h, st_rows))
                    plgpu.barrier_arrive(v_free.at[slot])
                    (ds,) = pull(p * (dp - lax.broadcast_in_dim(delta, (h, st_rows), (0,))))
                    dq = mma(dq, ds.astype(dt1), k_smem.at[slot], None if ds_smem is None else ds_smem.at[wg])
                    plgpu.barrier_arrive(k_free.at[slot])
                    return dq

                def flush(j, _):  # a key block loaded for the other warpgroup only
                    slot = slot_of(j)
                    plgpu.barrier_wait(k_bar.at[slot])
                    plgpu.barrier_wait(v_bar.at[slot])
                    plgpu.barrier_arrive(k_free.at[slot])
                    plgpu.barrier_arrive(v_free.at[slot])

                if q_tbl is not None:
                    lax.fori_loop(clo, lo, flush, None)
                dq = plgpu.layout_cast(jnp.zeros((h, D), jnp.float32), layout(FULL))
                for a, b, masked in ((lo, flo, True), (flo, fhi, False), (fhi, hi, True)):
                    dq = lax.fori_loop(a, b, functools.partial(fwd._call, step, masked=masked), dq)
                if q_tbl is not None:
                    lax.fori_loop(hi, chi, flush, None)
                q_smem.at[wg][...] = dq.astype(dt1)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(q_smem.at[wg], dq_ref.at[bflat, pl.ds(q0, h)])
                plgpu.wait_smem_to_gmem(0)

    # ----- dK/dV (and dQ when fused): 2 x h keys per CTA, queries streamed st_rows at a time.
    nk_cta, nq_steps = cdiv(Lk, 2 * h), cdiv(Lq, st_rows)
    persistent = cfg.persistent
    n_tiles = B * nk_cta
    n_grid = min(n_tiles, fwd.sm_count(interp))
    k_tbl = _key_ranges(spec, st_rows, h)
    fused = cfg.fused
    split = dq_split(spec, cfg) if fused else None
    dq_cols = dq_share_cols(spec, cfg) if fused else None

    def dkdv_body(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest):
        in_refs, rest = dict(zip(side, rest[:len(side)])), rest[len(side):]
        dq_ref = rest[0] if fused else None  # float32 [batch, rows, D], zeros on entry: every step's dQ added into it
        tbl_ref = rest[int(fused)] if k_tbl is not None else None
        dk_ref, dv_ref = rest[-2], rest[-1]
        scratch = dict(
            k_smem=plgpu.SMEM((2 * h, D), dt1, transforms=tf_d), v_smem=plgpu.SMEM((2, h, Dv), dt2, transforms=tf_dv),
            q_smem=plgpu.SMEM((stages, st_rows, D), dt1, transforms=tf_d),
            do_smem=plgpu.SMEM((stages, st_rows, Dv), dt2, transforms=tf_dv),
            lse_smem=plgpu.SMEM((stages, st_rows), jnp.float32), delta_smem=plgpu.SMEM((stages, st_rows), jnp.float32),
            p_smem=plgpu.SMEM((2, h, st_rows), dt2, transforms=fwd._tf(st_rows, dt2.itemsize)) if via_smem else None,
            ds_smem=plgpu.SMEM((2, h, st_rows), dt1, transforms=fwd._tf(st_rows, dt1.itemsize)) if via_smem else None,
            kvec_smem=[plgpu.SMEM((2, h), in_views[v].dtype) for v in k_vecs],
            qvec_smem=[plgpu.SMEM((stages, st_rows), in_views[v].dtype) for v in q_vecs],
            qtile_smem=[plgpu.SMEM((stages, 2, h, st_rows), t_views[v].dtype, transforms=tile_tf[v]) for v in tiles_in],
            kv_bar=plgpu.Barrier(num_arrivals=2 + len(k_vecs), num_barriers=2),
            q_bar=plgpu.Barrier(num_arrivals=2 + len(q_vecs) + 2 * len(tiles_in), num_barriers=stages), do_bar=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            q_free=plgpu.Barrier(num_arrivals=2, num_barriers=stages), do_free=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            # fused: dSᵀ of both warpgroups ([keys, 64 queries] per 64 stepped queries), double-buffered, and when both
            # have written it; each warpgroup's float32 share of dQ on its way to the TMA reduction
            dst_smem=plgpu.SMEM((2, st_rows // 64, 2 * h, 64), dt1, transforms=fwd._tf(64, dt1.itemsize)) if fused else None,
            ds_ready=plgpu.Barrier(num_arrivals=2, num_barriers=2) if fused else None,
            dq_smem=plgpu.SMEM((2, 64, dq_cols), jnp.float32, transforms=fwd._tf(dq_cols, 4)) if fused else None,
            dq_bar=plgpu.Barrier(num_barriers=2) if fused and via_smem else None)

        @functools.partial(pl.run_scoped, **scratch, collective_axes="wg")
        def _scope(k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, p_smem, ds_smem, kvec_smem, qvec_smem, qtile_smem,
                   kv_bar, q_bar, do_bar, q_free, do_free, dst_smem, ds_ready, dq_smem, dq_bar):
            qvec_smem, kvec_smem = dict(zip(q_vecs, qvec_smem)), dict(zip(k_vecs, kvec_smem))
            qtile_smem = dict(zip(tiles_in, qtile_smem))
            wg = lax.axis_index("wg")
            if persistent:  # concurrent CTAs on neighbouring tiles (a head's key blocks)
                n_mine, tile_at = fwd.persistent_tiles(n_tiles, n_grid, snake=k_tbl is not None)

            def tile_of(t):
                """(flattened batch position, key block of 2 x h keys) of this CTA's tile t (its own when not persistent;
                causal: a head's first key blocks see the most queries, and go first)."""
                if persistent:
                    tile = tile_at(t)
                    return lax.div(tile, nk_cta), lax.rem(tile, nk_cta)
                return lax.axis_index("b"), lax.axis_index("k")

            def keys_live(cta, bidx, consts: dict):
                """(the CTA's keys are all past the last live one at batch position bidx, all before it, no key is live
                there) under the runtime masks' bound (`fwd.live_key_blocks`, from the scalar inputs `consts`): its
                query ranges are empty, mask-free in their middle, or every block masked."""
                live = fwd.live_key_blocks(spec, bound, consts, bidx, 2 * h, nk_cta)
                return (cta >= live.some) & ~live.none, cta < live.every, live.none

            def query_range(cta, state):
                """[clo, chi): the query blocks a CTA loads for key block `cta` (every one, or the table's; `state`:
                `keys_live`'s, None without a bound)."""
                clo, chi = (0, nq_steps) if k_tbl is None else (tbl_ref[cta * 10 + 8], tbl_ref[cta * 10 + 9])
                if state is None:
                    return clo, chi
                dead, _, none_live = state
                return jnp.where(none_live, 0, clo), jnp.where(none_live, nq_steps, jnp.where(dead, clo, chi))

            @pl.when(wg == 2)
            def _memory():
                plgpu.set_max_registers(_REGISTERS[0], action="decrease")

                def issue_q(bidx, bflat, cta, i, slot):
                    q0 = i * st_rows + wg * 0
                    plgpu.copy_gmem_to_smem(q_ref.at[operand_box("q", bidx, q0, st_rows)], q_smem.at[slot], q_bar.at[slot])
                    plgpu.copy_gmem_to_smem(lse_ref.at[bflat, pl.ds(q0, st_rows)], lse_smem.at[slot], q_bar.at[slot])
                    for v in q_vecs:
                        plgpu.copy_gmem_to_smem(in_refs[v].at[vector_box(v, bidx, q0, st_rows)], qvec_smem[v].at[slot],
                                                q_bar.at[slot])
                    for v in tiles_in:  # each compute warpgroup's [h keys, st_rows queries] tile, from the keys-first copy
                        for w in range(2):
                            box = tile_box(t_views[v], bidx, q0, st_rows, cta * (2 * h) + w * h, h)
                            plgpu.copy_gmem_to_smem(in_refs[v].at[box], qtile_smem[v].at[slot, w], q_bar.at[slot])

                def issue_do(bidx, bflat, cta, i, slot):  # noqa: ARG001 - as issue_q
                    q0 = i * st_rows + wg * 0
                    plgpu.copy_gmem_to_smem(do_ref.at[bflat, pl.ds(q0, st_rows)], do_smem.at[slot], do_bar.at[slot])
                    plgpu.copy_gmem_to_smem(delta_ref.at[bflat, pl.ds(q0, st_rows)], delta_smem.at[slot], do_bar.at[slot])

                if not persistent:
                    bflat, cta = tile_of(0)
                    bidx = fwd.batch_index(spec, bflat)
                    clo, chi = query_range(cta, None if bound is None else keys_live(cta, bidx, scalar_env(in_refs, bidx)))
                    fwd.memory_ring(clo, chi, stages, lambda i: lax.rem(i - clo, stages),
                                    [(do_free, functools.partial(issue_do, bidx, bflat, cta)),
                                     (q_free, functools.partial(issue_q, bidx, bflat, cta))])
                    return

                def blocks_of(t):
                    bflat, cta = tile_of(t)
                    bidx = fwd.batch_index(spec, bflat)
                    state = None if bound is None else keys_live(cta, bidx, scalar_env(in_refs, bidx))
                    return (*query_range(cta, state), (bidx, bflat, cta))

                fwd.persistent_ring(n_mine, blocks_of, stages, [(do_free, issue_do), (q_free, issue_q)])

            @pl.when(wg < 2)
            def _compute():
                plgpu.set_max_registers(_REGISTERS[1], action="increase")

                def run_tile(t, ring0):
                    """Tile t, its query blocks from the ring's `ring0`-th on: K and V held, dK and dV (and dQ's parts)
                    accumulated over the query blocks, stored. Returns the blocks it took."""
                    bflat, cta = tile_of(t)
                    bidx = fwd.batch_index(spec, bflat)
                    consts = scalar_env(in_refs, bidx)
                    state = None if bound is None else keys_live(cta, bidx, consts)
                    clo, chi = query_range(cta, state)

                    def slot_of(i):
                        return lax.rem(ring0 + i - clo, stages)


                    tiles = TransposedScoreTiles(spec, st_rows, h)
                    tiles.bidx = bidx
                    k0 = cta * (2 * h) + wg * h
                    held_k = k_smem.at[pl.ds(pl.multiple_of(wg * h, h), h)]
                    plgpu.copy_gmem_to_smem(k_ref.at[operand_box("k", bidx, k0, h)], held_k, kv_bar.at[wg])
                    plgpu.copy_gmem_to_smem(v_ref.at[operand_box("v", bidx, k0, h)], v_smem.at[wg], kv_bar.at[wg])
                    for v in k_vecs:
                        plgpu.copy_gmem_to_smem(in_refs[v].at[vector_box(v, bidx, k0, h)], kvec_smem[v].at[wg], kv_bar.at[wg])
                    plgpu.barrier_wait(kv_bar.at[wg])
                    # keys are the transposed tile's rows
                    held_inputs = consts | {v: vector(kvec_smem[v].at[wg], v, ROWS) for v in k_vecs}
                    cols = layout(COLS)
                    k_ids = plgpu.broadcasted_iota(jnp.int32, (h,), 0, layout=layout(ROWS)) + k0
                    lo, flo, fhi, hi = (0, 0, nq_steps, nq_steps) if k_tbl is None else (tbl_ref[cta * 10 + 4 * wg + t] for t in range(4))
                    if state is not None:  # a CTA holding the last live key evaluates the masks on every block
                        dead, whole, none_live = state
                        lo, flo, fhi, hi = (jnp.where(none_live, e, jnp.where(dead, clo, x))
                                            for x, e in zip((lo, flo, fhi, hi), (0, 0, 0, nq_steps)))
                        flo, fhi = jnp.where(whole, flo, lo), jnp.where(whole, fhi, lo)

                    def share_ds(i, ds_t):
                        """This warpgroup's dSᵀ of step i into SMEM beside the other's, for dQ."""
                        buf = lax.rem(i - clo, 2)
                        for c in range(st_rows // 64):
                            dst_smem.at[buf, c, pl.ds(pl.multiple_of(wg * h, h), h)][...] = ds_t[:, c * 64:(c + 1) * 64]
                        plgpu.commit_smem()
                        plgpu.barrier_arrive(ds_ready.at[buf])

                    def add_dq(i):
                        """dQ of step i's queries += dS K over the CTA's keys once both warpgroups have shared their dSᵀ: each
                        computes its share and adds it into dq_ref by a TMA reduction."""
                        buf = lax.rem(i - clo, 2)
                        plgpu.barrier_wait(ds_ready.at[buf])
                        if split == "rows":
                            a, b, r0, c0 = dst_smem.at[buf, wg].T, k_smem, i * st_rows + wg * 64, 0
                        else:
                            c0 = pl.multiple_of(wg * dq_cols, dq_cols)
                            a, b, r0 = dst_smem.at[buf, 0].T, k_smem.at[:, pl.ds(c0, dq_cols)], i * st_rows
                        part = product(a, b, (64, dq_cols))
                        box = dq_ref.at[bflat, pl.ds(r0, 64), pl.ds(c0, dq_cols)]
                        if via_smem:  # interpret mode has no TMA reduction: read, add, write (its CTAs run one at a time)
                            plgpu.copy_gmem_to_smem(box, dq_smem.at[wg], dq_bar.at[wg])
                            plgpu.barrier_wait(dq_bar.at[wg])
                            part = part + dq_smem.at[wg][...]
                        else:
                            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous step's reduction has read it
                        dq_smem.at[wg][...] = part
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(dq_smem.at[wg], box, reduction_op=None if via_smem else "add")
                        if via_smem:
                            plgpu.wait_smem_to_gmem(0)

                    def step(i, carry, masked: bool):
                        dk, dv = carry
                        slot = slot_of(i)
                        q0 = i * st_rows
                        plgpu.barrier_wait(q_bar.at[slot])
                        lse = plgpu.load(lse_smem.at[slot], layout=cols) * _LOG2E
                        inputs = (held_inputs | {v: vector(qvec_smem[v].at[slot], v, COLS) for v in q_vecs}
                                  | {v: tile_value(qtile_smem[v].at[slot, wg], v) for v in tiles_in})
                        ok = bounds_mask(plgpu.broadcasted_iota(jnp.int32, (st_rows,), 0, layout=cols) + q0, k_ids, (h, st_rows), 1)

                        def probabilities(s_t):
                            y, pull = score_work(tiles, s_t, k0, q0, masked, inputs)
                            p = jnp.exp2(y * _LOG2E - lax.broadcast_in_dim(lse, (h, st_rows), (1,)))
                            return (p if ok is None else jnp.where(ok, p, 0.0)), pull

                        def score_grads(p, pull, dp):
                            delta = plgpu.load(delta_smem.at[slot], layout=cols)
                            (ds,) = pull(p * (dp - lax.broadcast_in_dim(delta, (h, st_rows), (1,))))
                            return ds.astype(dt1)

                        if via_smem or not cfg.overlap:  # one product at a time (interpret mode: P and dS through SMEM)
                            p, pull = probabilities(product(held_k, q_smem.at[slot].T, (h, st_rows)))
                            plgpu.barrier_wait(do_bar.at[slot])
                            dv = mma(dv, p.astype(dt2), do_smem.at[slot], None if p_smem is None else p_smem.at[wg])
                            ds = score_grads(p, pull, product(v_smem.at[wg], do_smem.at[slot].T, (h, st_rows)))
                            dk = mma(dk, ds, q_smem.at[slot], None if ds_smem is None else ds_smem.at[wg])
                            if fused:
                                share_ds(i, ds)
                        else:
                            plgpu.barrier_wait(do_bar.at[slot])

                            def scores(s_ref, dp_ref):  # Sᵀ and dPᵀ issued together, P's exp beside dPᵀ's product
                                plgpu.wgmma(s_ref, held_k, q_smem.at[slot].T)
                                plgpu.wgmma(dp_ref, v_smem.at[wg], do_smem.at[slot].T)
                                p, pull = probabilities(plgpu.wgmma_accumulator_load(s_ref, wait_n=1))
                                return p, score_grads(p, pull, plgpu.wgmma_accumulator_load(dp_ref, wait_n=0))

                            p, ds = pl.run_scoped(scores, plgpu.ACC((h, st_rows), jnp.float32), plgpu.ACC((h, st_rows), jnp.float32))
                            p = p.astype(dt2)  # converted before the products reading them are issued (see the forward's keep_p)

                            def grads(refs):  # dV += Pᵀ dO and dK += dSᵀ Q issued together; dSᵀ shared meanwhile
                                plgpu.wgmma(refs[0], p, do_smem.at[slot])
                                plgpu.wgmma(refs[1], ds, q_smem.at[slot])
                                if fused:
                                    share_ds(i, ds)

                            dv, dk = pl.run_state(grads)((plgpu.ACC.init(dv), plgpu.ACC.init(dk)))
                        plgpu.barrier_arrive(do_free.at[slot])
                        plgpu.barrier_arrive(q_free.at[slot])
                        if fused:
                            add_dq(i)
                        return dk, dv

                    def flush(i, _):
                        """A query block loaded for the other warpgroup only. Fused, both warpgroups take every step of
                        the CTA (their dS meet in dQ): here this one's dSᵀ is zero (every position masked), shared
                        without its four products, and it computes its share of the step's dQ from the other's."""
                        slot = slot_of(i)
                        plgpu.barrier_wait(q_bar.at[slot])
                        plgpu.barrier_wait(do_bar.at[slot])
                        if fused:
                            share_ds(i, plgpu.layout_cast(jnp.zeros((h, st_rows), dt1), layout(FULL)))
                        plgpu.barrier_arrive(do_free.at[slot])
                        plgpu.barrier_arrive(q_free.at[slot])
                        if fused:
                            add_dq(i)

                    full = layout(FULL)
                    zero = (plgpu.layout_cast(jnp.zeros((h, D), jnp.float32), full), plgpu.layout_cast(jnp.zeros((h, Dv), jnp.float32), full))
                    if k_tbl is not None:
                        lax.fori_loop(clo, lo, flush, None)
                    dk_dv = zero
                    for a, b, masked in ((lo, flo, True), (flo, fhi, False), (fhi, hi, True)):
                        dk_dv = lax.fori_loop(a, b, functools.partial(fwd._call, step, masked=masked), dk_dv)
                    dk, dv = dk_dv
                    if k_tbl is not None:
                        lax.fori_loop(hi, chi, flush, None)
                    if fused:
                        plgpu.barrier_arrive(ds_ready.at[0])  # the other warpgroup's last dQ has read K: held_k is free
                        plgpu.barrier_wait(ds_ready.at[0])
                    held_k[...] = dk.astype(dt1)
                    v_smem.at[wg][...] = dv.astype(dt2)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(held_k, dk_ref.at[bflat, pl.ds(k0, h)])
                    plgpu.copy_smem_to_gmem(v_smem.at[wg], dv_ref.at[bflat, pl.ds(k0, h)])
                    return chi - clo

                if not persistent:
                    run_tile(0, 0)
                else:
                    def next_tile(t, ring0):
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the tile before's dK and dV read from K and V's buffers
                        return ring0 + run_tile(t, ring0)

                    lax.fori_loop(0, n_mine, next_tile, jnp.int32(0))
                plgpu.wait_smem_to_gmem(0)

    Lq_pad, Lk_pad = nq_cta * 2 * h, nk_cta * 2 * h
    rows_pad = max(Lq_pad, nq_steps * st_rows)  # dO, lse, delta: whole blocks of either kernel
    name = group.signature[:8]
    dq_call = plgpu.kernel(dq_body, out_type=jax.ShapeDtypeStruct((B, Lq_pad, D), dt1), grid=(B, nq_cta),
                           grid_names=("b", "q"), num_threads=3, thread_name="wg", compiler_params=params, interpret=interp,
                           kernel_name=f"autofuse_attention_bwd_dq_mgpu_{name}")
    dkdv_call = plgpu.kernel(dkdv_body, out_type=(jax.ShapeDtypeStruct((B, Lk_pad, D), dt1), jax.ShapeDtypeStruct((B, Lk_pad, Dv), dt2)),
                             grid=(n_grid,) if persistent else (B, nk_cta), grid_names=("s",) if persistent else ("b", "k"), num_threads=3, thread_name="wg", compiler_params=params,
                             interpret=interp, kernel_name=f"autofuse_attention_bwd_dkdv_mgpu_{name}")
    q_arg = None if q_tbl is None else np.ascontiguousarray(q_tbl.reshape(-1))
    k_arg = None if k_tbl is None else np.ascontiguousarray(k_tbl.reshape(-1))

    def bwd(ins: list, out, lse, dout) -> tuple:
        env = dict(zip(group.inputs, ins))
        qkv = [views[r].prepare(env[getattr(spec, r).value]) for r in ("q", "k", "v")]
        o, do = to_canonical(spec, out), to_canonical(spec, dout)
        delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
        pad = rows_pad - Lq
        do = jnp.pad(do.astype(dt2), ((0, 0), (0, pad), (0, 0)))
        lse, delta = (jnp.pad(x.astype(jnp.float32), ((0, 0), (0, pad))) for x in (lse, delta))
        tail = [do, lse, delta]
        dkdv_side = [(t_views if v in tiles_in else in_views)[v].prepare(env[v]) for v in side]
        k_tail = [jnp.asarray(k_arg)] if k_arg is not None else []
        if fused:  # the kernel adds every step's dQ into a float32 buffer of zeros (a Ref: written in place)
            dq_acc = jax.new_ref(jnp.zeros((B, rows_pad, D), jnp.float32))
            dk, dv = dkdv_call(*qkv, *tail, *dkdv_side, dq_acc, *k_tail)
            dq = dq_acc[...].astype(dt1)
        else:
            dq_side = [in_views[v].prepare(env[v]) for v in side]
            dq = dq_call(*qkv, *tail, *dq_side, *([jnp.asarray(q_arg)] if q_arg is not None else []))
            dk, dv = dkdv_call(*qkv, *tail, *dkdv_side, *k_tail)
        return dq[:, :Lq], dk[:, :Lk], dv[:, :Lk]

    return bwd

