"""The `attention` template: plain-jnp attention programs become one flash-style kernel (interpret mode),
every kernel passes the CUDA lowering guard, masks known at build time skip key blocks, and what the
template cannot do stays in XLA and stays right."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autofuse
from autofuse.runner.evaluator import lowering_guard
from autofuse.kernels import attention, attention_masks
from autofuse.runner.measure import check, cone_tolerances
from autofuse.tuning.partition import enumerate_candidates
from autofuse.plan import plan_from_choices
from autofuse.tuning.select import default_plan
from benchmarks.workloads import attention_bhld, attention_bhld_causal, attention_blhd
from tests.attention_programs import key_lengths_blhd, key_lengths_causal_blhd
from tests.attention_programs import (causal_iota_minus_1e9, bias_blhd, padding_mask, gqa_repeat, gqa_broadcast, heads_split_causal, softcap_then_causal, causal_then_softcap, sliding_window,
                                     library_xla, library_xla_causal, library_xla_gqa)
from tests.quick import slow_except

F32, BF16 = jnp.float32, jnp.bfloat16
S = jax.ShapeDtypeStruct
SMALL = {"block_q": 16, "block_k": 32, "num_warps": 4, "num_stages": 2}  # several blocks, ragged last ones


BHLD, BLHD = (2, 2, 50, 32), (2, 50, 2, 32)
CASES = [
    pytest.param(attention_bhld, (BHLD,) * 3, BF16, id="bhld-bf16"),
    pytest.param(attention_bhld, ((1, 2, 40, 64),) * 3, F32, id="bhld-f32-d64"),
    pytest.param(attention_blhd, (BLHD,) * 3, BF16, id="blhd-bf16"),
    pytest.param(attention_bhld_causal, (BHLD,) * 3, BF16, id="causal-tril-bf16"),
    pytest.param(causal_iota_minus_1e9, ((1, 2, 45, 32),) * 3, F32, id="causal-iota-matmul-B1-f32"),
    pytest.param(bias_blhd, (BLHD, BLHD, BLHD, (2, 50, 50)), BF16, id="bias-blhd-bf16"),
    pytest.param(padding_mask, (BHLD, BHLD, BHLD, (2, 50)), BF16, id="padding-mask-bf16"),
    pytest.param(gqa_repeat, ((2, 50, 4, 32), (2, 50, 2, 32), (2, 50, 2, 32)), BF16, id="gqa-repeat-bf16"),
    pytest.param(gqa_broadcast, ((1, 40, 4, 32), (1, 40, 1, 32), (1, 40, 1, 32)), BF16, id="gqa-broadcast-bf16"),
    pytest.param(heads_split_causal, ((2, 50, 64),) * 3, BF16, id="heads-split-from-BL(HD)-causal-bf16"),
    pytest.param(softcap_then_causal, (BHLD,) * 3, BF16, id="softcap-causal-bf16"),
    pytest.param(attention_bhld_causal, ((1, 2, 50, 48),) * 3, BF16, id="causal-head-dim-48-padded"),
    pytest.param(library_xla_causal, (BLHD,) * 3, BF16, id="jax-nn-dot-product-attention-xla-causal-bf16"),
    pytest.param(library_xla, (BLHD,) * 3, F32, id="jax-nn-dot-product-attention-xla-f32"),
    pytest.param(library_xla_gqa, ((1, 40, 4, 32), (1, 40, 2, 32), (1, 40, 2, 32)), F32, id="jax-nn-dot-product-attention-xla-gqa-f32"),
]


def _specs(shapes, dtype):
    return [S(s, jnp.bool_ if len(s) == 2 and s[0] == 2 and s[1] == 50 else dtype) for s in shapes]


def _attention_candidate(graph):
    cands = [c for c in enumerate_candidates(graph) if c.template == "attention"]
    assert cands, "an attention candidate is enumerated"
    return max(cands, key=lambda c: len(c.nodes))


def _matches_xla(fn, graph, plan):
    fused = autofuse.jit(fn, plan=plan)
    res = check(lambda *a: jax.tree_util.tree_leaves(fused(*a)), lambda *a: jax.tree_util.tree_leaves(jax.jit(fn)(*a)),
                [graph.avals[v] for v in graph.inputs], (1,), cone_tolerances(graph, [n.id for n in graph.nodes], graph.outputs))
    assert res.ok, res.reason
    return fused


@pytest.mark.parametrize("fn,shapes,dtype", slow_except(CASES, "causal-tril-bf16"))
def test_attention_matches_xla_and_lowers(fn, shapes, dtype):
    g = autofuse.capture(fn, *_specs(shapes, dtype))
    cand = _attention_candidate(g)
    assert {g.node_index[i].name for i in set(range(len(g.nodes))) - cand.nodes} <= {"transpose", "reshape"}, "one group: all but layout ops"
    fused = _matches_xla(fn, g, plan_from_choices(g, [(cand.group, "attention", SMALL)]))  # many blocks, ragged edges
    assert fused.last_status.startswith("plan:")
    for cfg in (attention.default_config(cand.spec), SMALL):
        kernel = attention.build(cand.group, cfg, interpret=False, spec=cand.spec)
        lowering_guard(kernel, [S(a.shape, a.dtype) for a in cand.group.input_avals()])


@pytest.mark.slow
def test_default_config_one_block_matches_xla():
    g = autofuse.capture(attention_bhld_causal, *[S((1, 2, 40, 64), BF16)] * 3)
    cand = _attention_candidate(g)
    _matches_xla(attention_bhld_causal, g, plan_from_choices(g, [(cand.group, "attention", attention.default_config(cand.spec))]))


def test_causal_masks_skip_key_blocks():
    g = autofuse.capture(attention_bhld_causal, *[S((1, 2, 100, 32), BF16)] * 3)
    spec = _attention_candidate(g).spec
    r = attention.block_ranges(spec, 16, 32)
    nq = -(-100 // 16)
    for i in range(nq):
        last_q = min(100, 16 * i + 16) - 1
        lo, flo, fhi, hi = r[i]
        assert lo == 0 and hi == last_q // 32 + 1, "visit key blocks up to the diagonal only"
        assert fhi == (16 * i + 1) // 32 or fhi == 16 * i // 32, "blocks wholly below the diagonal skip the mask"
    assert attention.live_fraction(spec, 16, 32) < 0.7


def _ranges_of(live: np.ndarray, bq: int, bk: int) -> list[list[int]]:
    """Key block ranges [lo, full_lo, full_hi, hi) per query block, straight from a dense [Lq, Lk] live mask."""
    Lq, Lk = live.shape
    nk, out = -(-Lk // bk), []
    for i in range(-(-Lq // bq)):
        rows = live[i * bq:(i + 1) * bq]
        some = [rows[:, j * bk:(j + 1) * bk].any() for j in range(nk)]
        every = [rows[:, j * bk:(j + 1) * bk].all() and (j + 1) * bk <= Lk for j in range(nk)]
        idx = [j for j in range(nk) if some[j]]
        lo, hi = (idx[0], idx[-1] + 1) if idx else (0, 0)
        full = [j for j in range(lo, hi) if every[j]]
        out.append([lo, *((full[0], full[-1] + 1) if full and all(every[full[0]:full[-1] + 1]) else (lo, lo)), hi])
    return out


@pytest.mark.parametrize("strip", [1 << 22, 32 * 300], ids=["one-strip", "ten-strips"])
def test_band_ranges_match_the_dense_mask_in_strips_of_rows(monkeypatch, strip):
    """The mask is evaluated on the host in strips of rows and kept per 16 x 16 block (`LiveBlocks`): the key block
    ranges of every tiling are the dense mask's (a band of 24 keys over 300 positions: ragged against every tile; ten
    strips of 32 rows, the last of 12)."""
    monkeypatch.setattr(attention_masks, "_STRIP", strip)
    g = autofuse.capture(sliding_window, *[S((1, 2, 300, 32), F32)] * 3)
    spec = _attention_candidate(g).spec
    i, j = np.arange(300)[:, None], np.arange(300)[None, :]
    live = (i >= j) & (i - j < 24)
    for bq, bk in [(16, 16), (16, 32), (64, 64), (128, 64), (64, 192)]:
        assert attention.block_ranges(spec, bq, bk).tolist() == _ranges_of(live, bq, bk), (bq, bk)


@pytest.mark.slow
def test_a_causal_mask_past_8k_positions_still_skips_key_blocks():
    """At 9000 positions (81M scores: more than the host analysis took before, whose dense grid stopped at 64M) the
    causal mask is still known, so the kernels visit key blocks up to the diagonal only (at 16k, an H200 ran the
    Mosaic GPU kernel 2.1x slower than cuDNN without this, results/attention_long_h200.md)."""
    g = autofuse.capture(attention_bhld_causal, *[S((1, 1, 9000, 32), BF16)] * 3)
    spec = _attention_candidate(g).spec
    i, j = np.arange(9000)[:, None], np.arange(9000)[None, :]
    assert attention.block_ranges(spec, 128, 128).tolist() == _ranges_of(i >= j, 128, 128)


def test_split_heads_are_read_in_place_and_the_causal_mask_skips():
    g = autofuse.capture(heads_split_causal, *[S((2, 50, 64), BF16)] * 3)
    spec = _attention_candidate(g).spec
    assert spec.q.value in g.inputs and spec.q.batch == {0: [(0, 1, 2, 1)], 2: [(1, 1, 2, 32)]}  # head h reads columns 32h..32h+31
    assert attention.block_ranges(spec, 16, 16) is not None and attention_masks.scale_fold(spec) is not None


@pytest.mark.slow
def test_sliding_window_skips_blocks_before_the_band():
    g = autofuse.capture(sliding_window, *[S((1, 2, 100, 32), F32)] * 3)
    cand = _attention_candidate(g)
    r = attention.block_ranges(cand.spec, 16, 16)
    assert r[-1][0] > 0, "the last query block starts after key block 0"
    _matches_xla(sliding_window, g, plan_from_choices(g, [(cand.group, "attention", {**SMALL, "block_k": 16})]))


def test_mask_after_soft_capping_still_skips():
    g = autofuse.capture(softcap_then_causal, *[S(BHLD, BF16)] * 3)
    assert attention.block_ranges(_attention_candidate(g).spec, 16, 16) is not None


@pytest.mark.slow
def test_mask_before_soft_capping_is_not_skipped_but_right():
    g = autofuse.capture(causal_then_softcap, *[S(BHLD, BF16)] * 3)
    cand = _attention_candidate(g)
    assert attention.block_ranges(cand.spec, 16, 16) is None
    _matches_xla(causal_then_softcap, g, plan_from_choices(g, [(cand.group, "attention", SMALL)]))


def softmax_over_queries(q, k, v):
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-2), v)


def probabilities_returned(q, k, v):
    p = jax.nn.softmax(jnp.einsum("bhqd,bhkd->bhqk", q, k), axis=-1)
    return jnp.einsum("bhqk,bhkd->bhqd", p, v), p


def highest_precision(q, k, v):
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k, precision=jax.lax.Precision.HIGHEST)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v, precision=jax.lax.Precision.HIGHEST)


def gqa_query_reshape(q, k, v):
    # GQA by reshaping the queries: the einsum puts a transpose between the scores and the softmax,
    # and transposes are not fusible, so this form stays in XLA
    b, l, h, d = q.shape
    hk = k.shape[2]
    s = jnp.einsum("blhgd,bshd->bhgls", q.reshape(b, l, hk, h // hk, d), k)
    return jnp.einsum("bhgls,bshd->blhgd", jax.nn.softmax(s, axis=-1), v).reshape(b, l, h, d)


@pytest.mark.parametrize("fn", slow_except([pytest.param(f, id=f.__name__) for f in (softmax_over_queries, probabilities_returned, highest_precision,
                                                                            gqa_query_reshape)], "gqa_query_reshape"))
def test_unsupported_variants_stay_in_xla_and_stay_right(fn):
    shapes = [(1, 40, 4, 32), (1, 40, 2, 32), (1, 40, 2, 32)] if fn is gqa_query_reshape else [(1, 2, 40, 32)] * 3
    g = autofuse.capture(fn, *[S(s, F32) for s in shapes])
    assert not [c for c in enumerate_candidates(g) if c.template == "attention"]
    _matches_xla(fn, g, default_plan(g))


def test_tune_in_model_mode_picks_the_attention_group():
    specs = [S((1, 4, 256, 64), BF16)] * 3
    rep = autofuse.tune(attention_bhld_causal, *specs, trials=3, measure="model", quiet=True, store=False, isolate=False)
    assert [g.template for g in rep.plan.groups] == ["attention"]
    att = next(c for c in rep.candidates if c.template == "attention")
    assert att.best_ms < att.xla_ms


def test_positive_scale_folds_into_the_exp_only_when_it_commutes():
    g = autofuse.capture(attention_bhld_causal, *[S(BHLD, BF16)] * 3)
    fold = attention_masks.scale_fold(_attention_candidate(g).spec)
    assert fold is not None and fold[2] == pytest.approx(32 ** -0.5, rel=1e-2)  # through the mask select and the convert
    g = autofuse.capture(bias_blhd, *_specs((BLHD, BLHD, BLHD, (2, 50, 50)), BF16))
    assert attention_masks.scale_fold(_attention_candidate(g).spec) is None  # (c * s + bias) is not c * (s + bias)


@pytest.mark.parametrize("fn", slow_except([pytest.param(key_lengths_blhd, id="key-lengths"),
                                            pytest.param(key_lengths_causal_blhd, id="key-lengths-causal")], "key-lengths-causal"))
def test_key_lengths_bound_the_key_blocks_the_triton_pair_visits(fn):
    """The Triton forward, dK/dV and dQ kernels read each row's key length (`attention_masks.key_bound`) and stop at its
    last live key block (NaN planted past them stays out of the output and the gradients); causal joined with the
    lengths keeps its blocks known at build time; where no key is live every block is visited, as XLA weighs every
    key alike there. Values and gradients against XLA's on zeros in place of the NaN."""
    from autofuse.kernels.triton.attention_bwd import flash_pair
    from tests.test_mosaic_gpu_attention import key_lengths_inputs

    g = autofuse.capture(fn, *[S((4, 256, 2, 32), BF16)] * 3, S((4,), jnp.int32))
    cand = _attention_candidate(g)
    group, spec = cand.group, cand.spec
    assert attention_masks.key_bound(spec) is not None
    assert (attention.block_ranges(spec, 32, 64) is not None) == (fn is key_lengths_causal_blhd)
    forward, backward = flash_pair(group, spec, {"block_q": 32, "block_k": 64, "num_warps": 4, "num_stages": 2},
                                   {"bwd_held": 64, "bwd_step": 32, "bwd_warps": 4, "bwd_stages": 2}, interpret=True)
    floats = [i for i, a in enumerate(group.input_avals()) if a.dtype == BF16]
    for lengths, block in (([37, 128, 256, 200], 64), ([0, 1, 255, 64], 0)):
        planted, zeros = key_lengths_inputs(group, spec, lengths, block)

        def ref(*xs):
            args = list(zeros)
            for i, x in zip(floats, xs):
                args[i] = x
            return group.evaluate(args)[0]

        want, pull = jax.vjp(ref, *[zeros[i] for i in floats])
        out, lse = forward(planted)
        dout = jax.random.normal(jax.random.key(1), out.shape, F32).astype(out.dtype)
        grads = backward(planted, out, lse, dout)
        for name, a, b in [("out", out, want)] + list(zip(("dq", "dk", "dv"), [grads[i] for i in floats], pull(dout))):
            a, b = a.astype(F32), b.astype(F32)
            err = float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
            assert not jnp.isnan(a).any() and err < 2e-2, (lengths, name, err)
    # the real Triton lowering of the three kernels, each module verified as XLA parses it (a select of Python ints
    # once made a loop bound i1: the export passed and the GPU refused "'scf.for' op failed to verify")
    forward, backward = flash_pair(group, spec, {"block_q": 64, "block_k": 64, "num_warps": 4, "num_stages": 2},
                                   {"bwd_held": 64, "bwd_step": 64, "bwd_warps": 4, "bwd_stages": 2}, interpret=False)

    def pair(*xs):
        out, lse = forward(list(xs))
        return out, backward(list(xs), out, lse, out)

    lowering_guard(pair, [S(a.shape, a.dtype) for a in group.input_avals()])


def test_key_bound_is_read_only_where_skipping_keys_changes_nothing():
    """`key_bound` reads key lengths (alone, or joined with causal in one predicate, whose causal part is then known at
    build time), and nothing where a visit could matter: query lengths beside them (a row of a short query has no
    live key), a sliding window (a late row's window can lie wholly past the length), a boolean padding mask. Its
    blocks: the live ones, the wholly live ones (mask-free), every block where no key is live."""
    from tests.attention_programs import library_xla_lengths, padding_mask as bool_mask

    def lengths_window(q, k, v, n):
        return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=n, is_causal=True, local_window_size=(16, 0))

    def mask_causal(q, k, v, m):  # a boolean mask joined with causal in one predicate: its causal half stays unread
        return jax.nn.dot_product_attention(q, k, v, mask=m, is_causal=True)

    shapes = [S((2, 128, 2, 32), BF16)] * 3
    cases = [(key_lengths_blhd, [S((2,), jnp.int32)], True, False), (key_lengths_causal_blhd, [S((2,), jnp.int32)], True, True),
             (library_xla_lengths, [S((2,), jnp.int32)] * 2, False, False), (lengths_window, [S((2,), jnp.int32)], False, True),
             (bool_mask, [S((2, 128), jnp.bool_)], False, False), (mask_causal, [S((2, 1, 128, 128), jnp.bool_)], False, False)]
    for fn, extra, bounded, known in cases:
        ins = [S((2, 2, 128, 32), BF16)] * 3 + extra if fn is bool_mask else shapes + extra
        spec = _attention_candidate(autofuse.capture(fn, *ins)).spec
        assert (attention_masks.key_bound(spec) is not None) == bounded, fn
        assert (attention.block_ranges(spec, 32, 32) is not None) == known, fn
    # numbers too: left padding leaves the first causal rows no live key, whose keys XLA weighs alike (a kernel that
    # skipped the blocks past the diagonal there was 0.40 off)
    g = autofuse.capture(mask_causal, *shapes, S((2, 1, 128, 128), jnp.bool_))
    fused = autofuse.jit(mask_causal, plan=plan_from_choices(g, [(_attention_candidate(g).group, "attention", SMALL)]))
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v = [jax.random.normal(key, (2, 128, 2, 32), F32).astype(BF16) for key in keys[:3]]
    m = jax.random.bernoulli(keys[3], 0.5, (2, 1, 128, 128)).at[:, :, :8].set(False)
    got, want = fused(q, k, v, m), jax.jit(mask_causal)(q, k, v, m)
    assert fused.last_status.startswith("plan:") and float(jnp.abs(got.astype(F32) - want.astype(F32)).max()) < 3e-2
    live = attention_masks.live_blocks([jnp.int32(200), jnp.int32(250)], 64, 4)
    assert (int(live.some), int(live.every), bool(live.none)) == (4, 3, False)
    assert [int(x) for x in attention_masks.clip_ranges((0, 0, 4, 4), live, (0, 0, 0, 4))] == [0, 0, 3, 4]
    live = attention_masks.live_blocks([jnp.int32(37)], 64, 4)
    assert [int(x) for x in attention_masks.clip_ranges((0, 0, 4, 4), live, (0, 0, 0, 4))] == [0, 0, 0, 1]
    assert [int(x) for x in attention_masks.clip_ranges((0, 4), live, (0, 4))] == [0, 1]
    live = attention_masks.live_blocks([jnp.int32(0)], 64, 4)
    assert bool(live.none) and [int(x) for x in attention_masks.clip_ranges((0, 1, 2, 3), live, (0, 0, 0, 4))] == [0, 0, 0, 4]


def test_a_key_lengths_group_is_timed_at_full_length(monkeypatch):
    """Kernels that stop at each row's key length are timed alone with every key live (`timing_inputs`): random
    small lengths would stop them after a block and flatter them against XLA, whose work does not depend on them.
    Checked, the lengths stay random (the masks exercised); a group without a bound keeps every input random."""
    from autofuse.kernels import TEMPLATES
    from autofuse.runner import evaluator
    from autofuse.runner.evaluator import Evaluator
    from autofuse.runner.protocol import TrialRequest, TrialStatus

    g = autofuse.capture(key_lengths_blhd, *[S((2, 64, 2, 32), BF16)] * 3, S((2,), jnp.int32))
    cand = _attention_candidate(g)
    lengths = next(v for v in cand.group.inputs if g.avals[v].dtype == jnp.int32)
    assert TEMPLATES["attention"].timing_inputs(cand.group, cand.spec) == {lengths: 64}
    timed = []

    def fake_time_kernels(fn, sets, **kw):
        timed.append(sets)
        return evaluator.Timing(1.0, 1.0, 1.0, 1.0, 1.0)

    monkeypatch.setattr(evaluator, "time_kernels", fake_time_kernels)
    ev = Evaluator(g, measure="device", interpret=True, n_input_sets=2, repeats=1, target_ms=1.0)
    res = ev.handle(TrialRequest(cand.group.node_ids, "attention", {**SMALL, "backend": "triton"}))
    assert res.status is TrialStatus.OK, res.error
    pos = ev._view(cand.group).inputs.index(lengths)
    assert [np.asarray(s[pos]).tolist() for s in timed[-1]] == [[64, 64]] * 2
    plain = _attention_candidate(autofuse.capture(attention_bhld, *[S((1, 2, 64, 32), BF16)] * 3))
    assert TEMPLATES["attention"].timing_inputs(plain.group, plain.spec) == {}
