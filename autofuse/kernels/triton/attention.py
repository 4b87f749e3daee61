"""Triton lowering of `attention`: one program per (block of queries, batch position), a loop over key blocks with
a running max, a running sum and a float32 accumulator (FlashAttention-2); key blocks that `block_ranges` finds
masked out are skipped, and mask-free ones skip the mask arithmetic."""
from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ... import ops
from ...graph import Group, Node
from ..attention_masks import LiveKeys, block_ranges, bound_blocks, clip_ranges, key_bound, scale_fold
from ..attention_spec import AttentionEval, AttentionSpec, KeyBound, Operand
from ..tile_eval import edge_mask
from ..tiling import cdiv, needed, next_pow2
from .tiles import bool_as_int8, kernel_name, load_tile, pallas_call

_LOG2E = math.log2(math.e)



PARAMS = ("block_q", "block_k", "num_warps", "num_stages")


def default_config(spec: AttentionSpec) -> dict:
    """128x128 tiles, 8 warps, 3 stages: the best or within 4% of it for D=128 on the H200 (results/attention_h200.md);
    no block longer than its sequence (the space's rule), so that a short sequence's default is a config of the
    space (a plan of defaults then adapts to other shapes, and a study's first trial is measured)."""
    big = spec.Lq >= 128 and spec.Lk >= 128
    fit = lambda block, length: min(block, max(16, next_pow2(length)))  # noqa: E731
    return {"block_q": fit(128 if big else 64, spec.Lq), "block_k": fit(64 if max(spec.D, spec.Dv) > 128 or not big else 128, spec.Lk),
            "num_warps": 8 if big else 4, "num_stages": 3 if big else 2}


def _exp2(x, *, fast_math: bool):
    """2^x: the approximate hardware instruction on the GPU (as Triton's own attention uses)."""
    x = x.astype(jnp.float32)
    if not fast_math:
        return jnp.exp2(x)
    return plgpu.elementwise_inline_asm("ex2.approx.ftz.f32 $0, $1;", args=[x], constraints="=r,r", pack=1,
                                        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])[0]


def lower(group: Group, spec: AttentionSpec, config: dict, *, interpret: bool, emit_lse: bool = False) -> Callable:
    """The forward kernel; with `emit_lse` it also returns each query row's logsumexp of the exp branch's input
    (float32, [batch, Lq] with the batch axes flattened): the residual the flash backward recomputes the
    probabilities from (`triton/attention_bwd.py`)."""
    g = group.graph
    bq, bk = int(config["block_q"]), int(config["block_k"])
    warps, stages = int(config["num_warps"]), int(config["num_stages"])
    Lq, Lk, D, Dv = spec.Lq, spec.Lk, spec.D, spec.Dv
    Dp, Dvp = next_pow2(D), next_pow2(Dv)
    nq, nk = cdiv(Lq, bq), cdiv(Lk, bk)
    S = spec.score_shape
    bsizes = [S[a] for a in spec.batch_axes]
    ranges = block_ranges(spec, bq, bk)
    bound = key_bound(spec)
    qkv = {spec.q.value, spec.k.value, spec.v.value}
    body_in = [v for v in spec.tile.group.inputs if v not in qkv and v != spec.dot1.outputs[0]]  # bias, masks
    in_order = [spec.q.value, spec.k.value, spec.v.value] + body_in
    masked_nodes = {**spec.mask_selects, **spec.mask_adds} | (bound.selects if bound else {})

    def plan_nodes(nodes: list[Node], targets: set[int], unmasked: bool) -> list[Node]:
        # where nothing is masked, a mask op passes its score operand through
        return needed(nodes, targets, set(), masked_nodes if unmasked else None)

    step_nodes = {um: plan_nodes(spec.pre, {spec.x} | {a for nd in spec.exp_branch for a in nd.inputs if isinstance(a, int)}, um)
                  for um in (False, True)}
    ragged_k = Lk % bk != 0
    fold = scale_fold(spec)
    scale = 1.0 if fold is None else fold[2]
    exp2 = functools.partial(_exp2, fast_math=not interpret)

    def kernel(*refs):
        n_in = len(in_order)
        ins = dict(zip(in_order, refs[:n_in]))
        tbl = refs[n_in] if ranges is not None else None
        o_ref, lse_ref = (refs[-2], refs[-1]) if emit_lse else (refs[-1], None)
        body = AttentionEval(spec, bq, bk)
        qi = pl.program_id(0)
        if ranges is not None:
            qi = nq - 1 - qi  # the longest rows first
        bflat = pl.program_id(1)
        bidx = [None] * len(S)
        rem = bflat
        for a, s in zip(reversed(spec.batch_axes), reversed(bsizes)):
            bidx[a] = rem % s
            rem = rem // s
        q0 = qi * bq
        q = _load_operand(ins[spec.q.value], spec.q, bidx, q0, bq, Lq, Dp, D, seq_first=True).astype(spec.dot_dtype1)
        rows_ok = (q0 + jax.lax.broadcasted_iota(jnp.int32, (bq, 1), 0)) < Lq

        def step(j, carry, unmasked):
            acc, m_i, msub, l_i = carry
            k0 = j * bk
            body.set_program(bidx, q0, k0)
            kt = _load_operand(ins[spec.k.value], spec.k, bidx, k0, bk, Lk, Dp, D, seq_first=False).astype(spec.dot_dtype1)
            s = jnp.dot(q, kt, preferred_element_type=jnp.float32)
            env = {spec.dot1.outputs[0]: s}
            for v in body_in:
                env[v] = _load_extra(ins[v], spec, v, bidx, q0, k0, bq, bk)
            for nd in step_nodes[unmasked]:
                if unmasked and nd.id in masked_nodes:
                    env[nd.outputs[0]] = env[masked_nodes[nd.id]]
                elif fold is not None and nd.id == fold[0]:
                    env[nd.outputs[0]] = env[fold[1]]  # x / c: the scale goes into the max and the exp's FMA
                else:
                    body.eval_node(nd, env, 0, 0)
            x = jnp.broadcast_to(env[spec.x], (bq, bk)).astype(jnp.float32)
            if ragged_k and not unmasked:
                x = jnp.where((k0 + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)) < Lk, x, -jnp.inf)
                env[spec.x] = x
            m_new = jnp.maximum(m_i, jnp.max(x, axis=1, keepdims=True) * scale)
            env[spec.max_node.outputs[0]] = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            for nd in spec.row_m:
                body.eval_node(nd, env, 0, 0)
            msub_new = jnp.broadcast_to(env[spec.sub_row], (bq, 1)).astype(jnp.float32)
            # exp(y - m) as 2^(y*log2e - m*log2e): one FMA and the hardware ex2 per score
            y = env[spec.exp_branch[0].inputs[0]]
            env[spec.exp_branch[1].outputs[0]] = exp2(y * (scale * _LOG2E) - msub_new * _LOG2E)
            for nd in spec.exp_branch[2:]:
                body.eval_node(nd, env, 0, 0)
            alpha = jnp.where(m_i == -jnp.inf, 0.0, exp2((msub - msub_new) * _LOG2E))
            e_sum = jnp.broadcast_to(env[spec.e_sum], (bq, bk)).astype(jnp.float32)
            p = jnp.broadcast_to(env[spec.e_dot], (bq, bk))
            if ragged_k and not unmasked:  # keys past the end weigh nothing
                kok = (k0 + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)) < Lk
                e_sum, p = jnp.where(kok, e_sum, 0.0), jnp.where(kok, p, 0.0)
            l_new = alpha * l_i + jnp.sum(e_sum, axis=1, keepdims=True)
            p = p.astype(spec.dot_dtype2)
            vt = _load_operand(ins[spec.v.value], spec.v, bidx, k0, bk, Lk, Dvp, Dv, seq_first=True).astype(spec.dot_dtype2)
            acc = alpha * acc + jnp.dot(p, vt, preferred_element_type=jnp.float32)
            return acc, m_new, msub_new, l_new

        carry = (jnp.zeros((bq, Dvp), jnp.float32), jnp.full((bq, 1), -jnp.inf, jnp.float32),
                 jnp.zeros((bq, 1), jnp.float32), jnp.zeros((bq, 1), jnp.float32))
        if ranges is None and bound is None:
            carry = jax.lax.fori_loop(0, nk, lambda j, c: step(j, c, False), carry)
        else:  # the masks' mask-free middle: known at build time, or below the runtime bound on the keys
            lo, flo, fhi, hi = (0, 0, nk - int(ragged_k), nk) if ranges is None else (tbl[qi * 4 + t] for t in range(4))
            if bound is not None:
                live = live_key_blocks(spec, bound, {v: ins[v] for v in body_in}, body, bidx, bk, nk)
                lo, flo, fhi, hi = clip_ranges((lo, flo, fhi, hi), live, (0, 0, 0, nk))
            carry = jax.lax.fori_loop(lo, flo, lambda j, c: step(j, c, False), carry)
            carry = jax.lax.fori_loop(flo, fhi, lambda j, c: step(j, c, True), carry)
            carry = jax.lax.fori_loop(fhi, hi, lambda j, c: step(j, c, False), carry)
        acc, _, msub, l_i = carry
        if lse_ref is not None:  # P = exp(y - msub) / l = exp(y - lse); a row with no live key: P = 0
            lse = jnp.where(l_i > 0, msub + jnp.log(jnp.where(l_i > 0, l_i, 1.0)), jnp.inf)
            qok = (q0 + jax.lax.broadcasted_iota(jnp.int32, (bq,), 0)) < Lq if Lq % bq else None
            plgpu.store(lse_ref.at[bflat, pl.ds(q0, bq)], lse.reshape(bq), mask=qok)
        env = {spec.sum_node.outputs[0]: l_i}
        for nd in spec.row_l:
            body.eval_node(nd, env, 0, 0)
        c = env[spec.l_row]
        args = [acc, c] if spec.e_first else [c, acc]
        o = ops.eval_elementwise(spec.combine.primitive, spec.combine.params, jnp.float32, args)
        odt = g.avals[spec.out].dtype
        o = jnp.where(rows_ok, o, 0.0).astype(odt)
        _store_out(o_ref, spec, bidx, o, q0, bq, Lq, Dvp, Dv)

    out_aval = g.avals[spec.out]
    out_shape = jax.ShapeDtypeStruct(out_aval.shape, out_aval.dtype)
    if emit_lse:
        out_shape = (out_shape, jax.ShapeDtypeStruct((spec.batch, Lq), jnp.float32))
    call = pallas_call(kernel, out_shape=out_shape, grid=(nq, spec.batch),
                       name=kernel_name("attention", group), interpret=interpret, num_warps=warps, num_stages=stages)
    table = None if ranges is None else np.ascontiguousarray(ranges.reshape(-1))  # made a jax array per call: a
    # build-time jax array would be a tracer of whatever trace built the kernel (a jax.custom_vjp cannot close over it)

    def run(*xs):
        env = dict(zip(group.inputs, xs))
        args = []
        for v in in_order:
            x = bool_as_int8(env[v])
            if x.size == 1:
                x = jnp.reshape(x, (1,))
            args.append(x)
        if table is not None:
            args.append(jnp.asarray(table))
        return list(call(*args)) if emit_lse else [call(*args)]

    return run


def _load_operand(ref, op: Operand, bidx: list, s0, bs: int, L: int, Dp: int, D: int, *, seq_first: bool):
    """A [bs, Dp] (seq_first) or [Dp, bs] tile of q/k/v: rows past L and head columns past D read as 0."""
    idx: list = []
    for a in range(len(ref.shape)):
        off = jnp.int32(0)  # a Python int index breaks masked loads in interpret mode
        for sa, div, mod, mul in op.batch.get(a, ()):
            off = off + (bidx[sa] // div) % mod * mul
        idx.append(pl.ds(off + s0, bs) if a == op.seq_axis else pl.ds(off, Dp) if a == op.d_axis else off)
    seq_before = op.seq_axis < op.d_axis
    sshape = (bs, 1) if seq_before else (1, bs)
    dshape = (1, Dp) if seq_before else (Dp, 1)
    sok = (s0 + jax.lax.broadcasted_iota(jnp.int32, sshape, 0 if seq_before else 1)) < L if L % bs else None
    dok = jax.lax.broadcasted_iota(jnp.int32, dshape, 1 if seq_before else 0) < D if Dp != D else None
    t = load_tile(ref.at[tuple(idx)], edge_mask((bs, Dp) if seq_before else (Dp, bs), sok, dok))
    return t if seq_before == seq_first else t.T


def live_key_blocks(spec: AttentionSpec, bound: KeyBound, refs: dict, body: AttentionEval, bidx: list, block: int,
                    n_blocks: int) -> LiveKeys:
    """`attention_masks.live_blocks` of the runtime masks' bound (`key_bound`) at batch position `bidx`, evaluated from
    the score work's scalar inputs there (`refs`: each score input -> its kernel ref), loaded as [1, 1] tiles."""
    body.set_program(bidx, 0, 0)
    env = {v: _load_extra(refs[v], spec, v, bidx, 0, 0, 1, 1) for v in refs
           if v in spec.tile.span and not spec.tile.span[v].rows and not spec.tile.span[v].cols}
    return bound_blocks(spec, bound, env, lambda nd, e: body.eval_node(nd, e, 0, 0),
                        lambda x: jnp.min(x).astype(jnp.int32), block, n_blocks)


def _load_extra(ref, spec: AttentionSpec, v: int, bidx: list, q0, k0, bq: int, bk: int):
    """A score-space input (bias, mask) as a [bq|1, bk|1] tile in its compute dtype."""
    g = spec.group.graph
    av = g.avals[v]
    if av.size == 1:
        x = plgpu.load(ref.at[pl.ds(0, 1)]).reshape(1, 1)
    else:
        ax = spec.tile.axes[v]
        idx, kept = [], []
        for d, a in enumerate(ax):
            if a == spec.q_axis:
                idx.append(pl.ds(q0, bq))
                kept.append(a)
            elif a == spec.k_axis:
                idx.append(pl.ds(k0, bk))
                kept.append(a)
            elif a is None:
                idx.append(jnp.int32(0))
            else:
                idx.append(bidx[a])
        masks = []
        for a in kept:
            L, b, s0 = (spec.Lq, bq, q0) if a == spec.q_axis else (spec.Lk, bk, k0)
            if L % b:
                shp = [1] * len(kept)
                shp[kept.index(a)] = b
                masks.append((s0 + jax.lax.broadcasted_iota(jnp.int32, tuple(shp), kept.index(a))) < L)
        x = load_tile(ref.at[tuple(idx)], edge_mask(tuple(bq if a == spec.q_axis else bk for a in kept), *masks))
        if kept == [spec.k_axis, spec.q_axis]:
            x = x.T
        x = x.reshape(bq if spec.q_axis in kept else 1, bk if spec.k_axis in kept else 1)
    if av.dtype == np.bool_:
        return x != 0
    return x.astype(ops.compute_dtype(av.dtype))


def _store_out(ref, spec: AttentionSpec, bidx: list, o, q0, bq: int, Lq: int, Dvp: int, Dv: int) -> None:
    idx: list = []
    for r in spec.out_roles:
        idx.append(pl.ds(q0, bq) if r == "q" else pl.ds(0, Dvp) if r == "d" else jnp.int32(0) if r is None else bidx[r])
    q_first = spec.out_roles.index("q") < spec.out_roles.index("d")
    qok = (q0 + jax.lax.broadcasted_iota(jnp.int32, (bq, 1), 0)) < Lq if Lq % bq else None
    dok = jax.lax.broadcasted_iota(jnp.int32, (1, Dvp), 1) < Dv if Dvp != Dv else None
    m = edge_mask((bq, Dvp), qok, dok)
    if not q_first:
        o, m = o.T, (None if m is None else m.T)
    plgpu.store(ref.at[tuple(idx)], o, mask=m)
