"""Triton lowering of attention's backward (FlashAttention-2): dQ, dK and dV from the output, its cotangent and
the forward's row logsumexp, the scores re-evaluated per tile from the group's own equations.

Two kernels. `dkdv`: one program per (block of keys, batch position), a loop over the query blocks that see any
of its keys; `dq`: one program per (block of queries, batch position), a loop over the live key blocks (both
skip blocks the build-time mask analysis finds dead, `block_ranges`). Seven products per tile, not
FlashAttention-2's five: one kernel adding each tile's part of dQ into global memory with `plgpu.atomic_add` ran
5-8x slower on an H100 (results/attention_grad_h100.md), so dQ has its own kernel. Per [block_q, block_k] tile:

    s  = q k^T                     y = score work(s)   (the group's equations: scale, masks, bias, soft-capping)
    p  = exp(y - lse)              dv += p^T dO
    dp = dO v^T                    dy = p (dp - delta),  delta = rowsum(dO * O)
    ds = d score work / ds (dy)    dk += ds^T q,  dq += ds k

`ds` is `jax.vjp` of the score work on the tile: JAX differentiates the group's own equations (a masking select
passes no gradient, tanh soft-capping its derivative, a scale its factor), so nothing is written per pattern.
The max the forward subtracts is a constant here: the softmax does not depend on it. The kernels write dQ, dK,
dV per score batch position ([batch, L, D]); the template maps them back through the operands' broadcasts and
reshapes (GQA's repeated heads are summed there, by XLA).
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ...graph import Group
from ..attention import _dot_roles, _through_chain, _to_operand
from ..attention_masks import block_ranges, clip_ranges, key_block_ranges, key_bound
from ..attention_spec import AttentionEval, AttentionSpec
from ..attention_vjp import backward_config
from ..tiling import cdiv, needed, next_pow2
from . import attention as fwd_lowering
from .attention import _load_extra, _load_operand, live_key_blocks
from .tiles import bool_as_int8, kernel_name, load_tile, pallas_call


def lower(group: Group, spec: AttentionSpec, config: dict | None, *, interpret: bool) -> Callable:
    """`bwd(ins, out, lse, dout) -> (dq, dk, dv)`: `ins` the group's inputs, `out` its output, `lse` the forward's
    [batch, Lq] row logsumexp, `dout` the output's cotangent; each gradient is [batch, L, D] float32. `config`'s
    `bwd_` keys pick the tiles (`backward_config`): dK/dV hold `bwd_held` keys and step `bwd_step` queries at a
    time, dQ holds `bwd_held` queries and steps `bwd_step` keys."""
    g = group.graph
    cfg = backward_config(spec, config)
    held, step_rows = int(cfg["bwd_held"]), int(cfg["bwd_step"])
    warps, stages = int(cfg["bwd_warps"]), int(cfg["bwd_stages"])
    Lq, Lk, D, Dv, B = spec.Lq, spec.Lk, spec.D, spec.Dv, spec.batch
    Dp, Dvp = next_pow2(D), next_pow2(Dv)
    S = spec.score_shape
    bsizes = [S[a] for a in spec.batch_axes]
    qkv = {spec.q.value, spec.k.value, spec.v.value}
    extras = [v for v in spec.tile.group.inputs if v not in qkv and v != spec.dot1.outputs[0]]  # masks
    in_order = [spec.q.value, spec.k.value, spec.v.value] + extras
    scores, y_val = spec.dot1.outputs[0], spec.exp_branch[0].inputs[0]
    score_nodes = needed(spec.pre, {y_val}, set())
    dt1, dt2 = spec.dot_dtype1, spec.dot_dtype2

    def batch_index(bflat) -> list:
        bidx: list = [None] * len(S)
        rem = bflat
        for a, s in zip(reversed(spec.batch_axes), reversed(bsizes)):
            bidx[a] = rem % s
            rem = rem // s
        return bidx

    def tile(refs: dict, body: AttentionEval, bq: int, bk: int, bidx, q0, k0, q, kt, v_t, do, lse, delta):
        """p (float32) and ds for one [bq, bk] tile; the score work's VJP gives ds."""
        body.set_program(bidx, q0, k0)
        side = {v: _load_extra(refs[v], spec, v, bidx, q0, k0, bq, bk) for v in extras}

        def score_work(s):
            env = {scores: s, **side}
            for nd in score_nodes:
                if nd.name == "stop_gradient":
                    env[nd.outputs[0]] = jax.lax.stop_gradient(env[nd.inputs[0]])
                else:
                    body.eval_node(nd, env, 0, 0)
            return jnp.broadcast_to(env[y_val], (bq, bk)).astype(jnp.float32)

        s = jnp.dot(q, kt, preferred_element_type=jnp.float32)
        y, score_vjp = jax.vjp(score_work, s)
        p = jnp.exp(y - lse)
        ok = None
        if Lq % bq:
            ok = (q0 + jax.lax.broadcasted_iota(jnp.int32, (bq, 1), 0)) < Lq
        if Lk % bk:
            kok = (k0 + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)) < Lk
            ok = kok if ok is None else ok & kok
        if ok is not None:
            p = jnp.where(ok, p, 0.0)
        dp = jnp.dot(do, v_t, preferred_element_type=jnp.float32)  # [bq, bk]
        (ds,) = score_vjp(p * (dp - delta))
        return p, ds

    def rows(ref, bflat, q0, bq):
        m = (q0 + jax.lax.broadcasted_iota(jnp.int32, (bq,), 0)) < Lq if Lq % bq else None
        return load_tile(ref.at[bflat, pl.ds(q0, bq)], m).reshape(bq, 1)

    def load_do(ref, bflat, q0, bq):
        m = None
        if Lq % bq or Dvp != Dv:
            m = ((q0 + jax.lax.broadcasted_iota(jnp.int32, (bq, 1), 0)) < Lq) & (jax.lax.broadcasted_iota(jnp.int32, (1, Dvp), 1) < Dv)
        return load_tile(ref.at[bflat, pl.ds(q0, bq), pl.ds(0, Dvp)], m).astype(dt2)

    def in_bounds(s0, bs, L, Dpad, Dreal):
        if L % bs or Dpad != Dreal:
            return ((s0 + jax.lax.broadcasted_iota(jnp.int32, (bs, 1), 0)) < L) & (jax.lax.broadcasted_iota(jnp.int32, (1, Dpad), 1) < Dreal)
        return None

    def store(ref, bflat, s0, bs, L, Dpad, Dreal, x):
        plgpu.store(ref.at[bflat, pl.ds(s0, bs), pl.ds(0, Dpad)], x, mask=in_bounds(s0, bs, L, Dpad, Dreal))

    n_in = len(in_order)
    bound = key_bound(spec)

    bq, bk = step_rows, held  # dK/dV: a block of keys held, the queries stepped through
    nq_steps, nk = cdiv(Lq, bq), cdiv(Lk, bk)
    k_ranges = key_block_ranges(spec, bq, bk)
    k_ranges = None if k_ranges is None else np.ascontiguousarray(k_ranges[:, [0, 3]])  # [lo, hi): masks always evaluated

    def dkdv_kernel(*refs):
        ins = dict(zip(in_order, refs[:n_in]))
        do_ref, lse_ref, delta_ref = refs[n_in:n_in + 3]
        tbl = refs[n_in + 3] if k_ranges is not None else None
        dk_ref, dv_ref = refs[-2], refs[-1]
        body = AttentionEval(spec, bq, bk)
        kj, bflat = pl.program_id(0), pl.program_id(1)
        bidx = batch_index(bflat)
        k0 = kj * bk
        kt = _load_operand(ins[spec.k.value], spec.k, bidx, k0, bk, Lk, Dp, D, seq_first=False).astype(dt1)  # [Dp, bk]
        v_t = _load_operand(ins[spec.v.value], spec.v, bidx, k0, bk, Lk, Dvp, Dv, seq_first=False).astype(dt2)  # [Dvp, bk]

        def step(i, carry):
            dk, dv = carry
            q0 = i * bq
            q = _load_operand(ins[spec.q.value], spec.q, bidx, q0, bq, Lq, Dp, D, seq_first=True).astype(dt1)
            do = load_do(do_ref, bflat, q0, bq)
            p, ds = tile(ins, body, bq, bk, bidx, q0, k0, q, kt, v_t, do, rows(lse_ref, bflat, q0, bq), rows(delta_ref, bflat, q0, bq))
            dv = dv + jnp.dot(p.astype(dt2).T, do, preferred_element_type=jnp.float32)
            dk = dk + jnp.dot(ds.astype(dt1).T, q, preferred_element_type=jnp.float32)
            return dk, dv

        lo, hi = (0, nq_steps) if tbl is None else (tbl[kj * 2], tbl[kj * 2 + 1])
        if bound is not None:  # no query where the held keys are past the last live one; every one where none is live
            live = live_key_blocks(spec, bound, {v: ins[v] for v in extras}, body, bidx, bk, nk)
            # int32 operands: Pallas' Triton lowering makes a select of Python ints a select of i1
            lo, hi = jnp.asarray(lo, jnp.int32), jnp.asarray(hi, jnp.int32)
            hi = jnp.where(live.none, jnp.int32(nq_steps), jnp.where(kj >= live.some, lo, hi))
            if tbl is not None:  # (without a table it is 0 already)
                lo = jnp.where(live.none, jnp.int32(0), lo)
        dk, dv = jax.lax.fori_loop(lo, hi, step, (jnp.zeros((bk, Dp), jnp.float32), jnp.zeros((bk, Dvp), jnp.float32)))
        store(dk_ref, bflat, k0, bk, Lk, Dp, D, dk)
        store(dv_ref, bflat, k0, bk, Lk, Dvp, Dv, dv)

    qb, kb = held, step_rows  # dQ: a block of queries held, the keys stepped through
    nq, nk_steps = cdiv(Lq, qb), cdiv(Lk, kb)
    q_ranges = block_ranges(spec, qb, kb)

    def dq_kernel(*refs):
        ins = dict(zip(in_order, refs[:n_in]))
        do_ref, lse_ref, delta_ref = refs[n_in:n_in + 3]
        tbl = refs[n_in + 3] if q_ranges is not None else None
        dq_ref = refs[-1]
        body = AttentionEval(spec, qb, kb)
        qi, bflat = pl.program_id(0), pl.program_id(1)
        bidx = batch_index(bflat)
        q0 = qi * qb
        q = _load_operand(ins[spec.q.value], spec.q, bidx, q0, qb, Lq, Dp, D, seq_first=True).astype(dt1)
        do = load_do(do_ref, bflat, q0, qb)
        lse, delta = rows(lse_ref, bflat, q0, qb), rows(delta_ref, bflat, q0, qb)

        def step(j, dq):
            k0 = j * kb
            k = _load_operand(ins[spec.k.value], spec.k, bidx, k0, kb, Lk, Dp, D, seq_first=True).astype(dt1)
            v_t = _load_operand(ins[spec.v.value], spec.v, bidx, k0, kb, Lk, Dvp, Dv, seq_first=False).astype(dt2)
            _, ds = tile(ins, body, qb, kb, bidx, q0, k0, q, k.T, v_t, do, lse, delta)
            return dq + jnp.dot(ds.astype(dt1), k, preferred_element_type=jnp.float32)

        lo, hi = (0, nk_steps) if tbl is None else (tbl[qi * 4], tbl[qi * 4 + 3])
        if bound is not None:  # up to the last live key block; every one where none is live
            lo, hi = clip_ranges((lo, hi), live_key_blocks(spec, bound, {v: ins[v] for v in extras}, body, bidx, kb, nk_steps),
                                 (0, nk_steps))
        dq = jax.lax.fori_loop(lo, hi, step, jnp.zeros((qb, Dp), jnp.float32))
        store(dq_ref, bflat, q0, qb, Lq, Dp, D, dq)

    f32 = jnp.float32
    dq_shape = jax.ShapeDtypeStruct((B, Lq, D), f32)
    dkdv = pallas_call(dkdv_kernel, out_shape=(jax.ShapeDtypeStruct((B, Lk, D), f32), jax.ShapeDtypeStruct((B, Lk, Dv), f32)),
                       grid=(nk, B), name=kernel_name("attention_bwd_dkdv", group), interpret=interpret, num_warps=warps,
                       num_stages=stages)
    dq_call = pallas_call(dq_kernel, out_shape=dq_shape, grid=(nq, B),
                          name=kernel_name("attention_bwd_dq", group), interpret=interpret, num_warps=warps, num_stages=stages)
    k_tbl = None if k_ranges is None else np.ascontiguousarray(k_ranges.reshape(-1))
    q_tbl = None if q_ranges is None else np.ascontiguousarray(q_ranges.reshape(-1))

    def bwd(ins: list, out, lse, dout) -> tuple:
        env = dict(zip(group.inputs, ins))
        args = []
        for v in in_order:
            x = bool_as_int8(env[v])
            args.append(jnp.reshape(x, (1,)) if x.size == 1 else x)
        o, do = to_canonical(spec, out), to_canonical(spec, dout)
        delta = jnp.sum(o.astype(f32) * do.astype(f32), axis=-1)
        do = do.astype(g.avals[spec.out].dtype)
        tail = [do, lse, delta]
        k_arg = [jnp.asarray(k_tbl)] if k_tbl is not None else []
        dk, dv = dkdv(*args, *tail, *k_arg)
        dq = dq_call(*args, *tail, *([jnp.asarray(q_tbl)] if q_tbl is not None else []))
        return dq, dk, dv

    return bwd


def to_canonical(spec: AttentionSpec, x: jax.Array) -> jax.Array:
    """The group output (or its cotangent) as [batch, Lq, Dv], the batch axes flattened in score order."""
    roles = [r for r, s in zip(spec.out_roles, x.shape) if r is not None or s != 1]
    x = jnp.reshape(x, [s for r, s in zip(spec.out_roles, x.shape) if r is not None or s != 1])
    order = [roles.index(a) for a in spec.batch_axes if a in roles] + [roles.index("q"), roles.index("d")]
    return jnp.reshape(jnp.transpose(x, order), (spec.batch, spec.Lq, spec.Dv))


def flash_pair(group: Group, spec: AttentionSpec, fwd_config: dict, bwd_config: dict | None, *, interpret: bool,
               fwd_lower: Callable = fwd_lowering.lower, bwd_lower: Callable | None = None):
    """The flash pair for an attention group: `forward(ins) -> (out, lse)` (the forward emitting the row
    logsumexp: `fwd_lower`, a backend's `attention.lower` taking `emit_lse`, Triton's by default) and
    `backward(ins, out, lse, dout) -> cotangents` (one per group input, float32, None for inputs without one: the
    generated backward kernels, `bwd_lower` (a backend's `attention_bwd.lower`, this module's by default), then
    the VJP of the operands' broadcasts and reshapes).
    `bwd_config`: the backward's tiles (its `bwd_` keys, `backward_config`; None: the defaults)."""
    from ...differentiate import first_order_only

    forward_kernel = first_order_only(fwd_lower(group, spec, fwd_config, interpret=interpret, emit_lse=True),
                                      "the attention forward that emits the logsumexp")
    bwd_kernels = first_order_only((bwd_lower or lower)(group, spec, bwd_config, interpret=interpret), "the attention backward kernels")
    roles = _dot_roles(spec)
    g = group.graph

    def forward(ins):
        out, lse = forward_kernel(*ins)
        return out, lse

    def backward(ins, out, lse, dout) -> list:
        dq, dk, dv = bwd_kernels(list(ins), out, lse, dout)
        env = dict(zip(group.inputs, ins))
        grads: dict[int, jax.Array] = {}
        for name, d, op in (("q", dq, spec.q), ("k", dk, spec.k), ("v", dv, spec.v)):
            atom = roles["atoms"][name]
            ga = _to_operand(spec, d, roles[name], g.aval(atom).shape)
            gi = _through_chain(spec, atom, env[op.value], ga).astype(jnp.float32)
            grads[op.value] = grads[op.value] + gi if op.value in grads else gi
        return [grads.get(v) for v in group.inputs]

    return forward, backward


def flash_vjp_rule(group: Group, spec: AttentionSpec, fwd_config: dict, bwd_config: dict | None, *, interpret: bool,
                   fwd_lower: Callable = fwd_lowering.lower, bwd_lower: Callable | None = None):
    """The attention group's reverse-mode rule: the flash pair (residuals: the group's inputs, its output and the
    row logsumexp, no [Lq, Lk] array), lowered by `fwd_lower` and `bwd_lower` (see `flash_pair`)."""
    from ...differentiate import VJPRule

    forward, backward = flash_pair(group, spec, fwd_config, bwd_config, interpret=interpret, fwd_lower=fwd_lower, bwd_lower=bwd_lower)
    n_in = len(group.inputs)

    def fwd(kernel, ins):
        out, lse = forward(ins)
        return [out], (*ins, out, lse)

    def bwd(res, cts):
        return backward(res[:n_in], res[n_in], res[n_in + 1], cts[0])

    return VJPRule(fwd, bwd, "flash")
