"""The `matmul_reduce` template (dot + epilogue + online reduction in one kernel) in interpret mode, its CUDA
lowering, and the tuning job choosing it."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import autofuse
from autofuse.runner.evaluator import lowering_guard
from autofuse.kernels import matmul_reduce
from autofuse.runner.measure import check, compare, cone_tolerances
from autofuse.tuning.partition import enumerate_candidates
from autofuse.plan import build_group, plan_from_choices
from tests.quick import slow_except

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
S = jax.ShapeDtypeStruct


def row_logsumexp(x, w):
    return jax.nn.logsumexp(x @ w, axis=-1)


def row_logsumexp_bt(x, w):
    return jax.nn.logsumexp(jnp.einsum("mk,nk->mn", x, w), axis=-1)


def cross_entropy(h, w, target):
    logits = h @ w
    hit = jnp.arange(logits.shape[-1])[None, :] == target[:, None]
    return jax.nn.logsumexp(logits, axis=-1) - jnp.sum(jnp.where(hit, logits, 0), axis=-1)


def cross_entropy_take_along_axis(h, w, target):
    logits = h @ w  # the gather (take_along_axis) is folded into the kernel as a one-hot sum
    return jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, target[:, None], axis=-1)[:, 0]


def cross_entropy_one_hot_mean(h, w, target):
    logits = (h @ w).astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    return jnp.mean(lse - jnp.sum(jax.nn.one_hot(target, logits.shape[-1], dtype=logits.dtype) * logits, axis=-1))


def softmax_weighted_sum(x, w, v):
    return jnp.sum(jax.nn.softmax(x @ w, axis=-1) * v, axis=-1)


def row_max_and_sumexp(x, w):
    logits = x @ w
    m = jnp.max(logits, axis=-1, keepdims=True)
    return m[:, 0], jnp.sum(jnp.exp(logits - m), axis=-1)


def splade_head(h, w, bias, mask):
    return jnp.max(jnp.log1p(jax.nn.relu(h @ w + bias)) * mask[..., None], axis=1)


def col_sum_tanh(x, w):
    return jnp.sum(jnp.tanh(x @ w), axis=0)


def row_max_monotone_chain(x, w, b, r):
    return jnp.max(jnp.exp(jnp.tanh(x @ w + b) * 2.0 - r[:, None]), axis=-1)  # the add of b (varies along N) stays per tile


def col_min_masked(x, w, keep):
    return jnp.min(jnp.where(keep[:, None], jax.nn.sigmoid(x @ w) / 4.0, 3.0), axis=0)


def masked_log_max(h, w, mask):
    return jnp.max(jnp.where(mask[..., None], jnp.log(h @ w + 100.0), -jnp.inf), axis=1)  # log(-inf) is NaN


def row_max_unknown_sign(x, w, s):
    return jnp.max(jnp.exp(x @ w) * s[:, None], axis=-1)  # s may be negative: exp stays per tile


def row_max_and_sum_tanh(x, w):
    y = jnp.tanh(x @ w)  # read by two reductions: needed per tile
    return jnp.max(y, axis=-1), jnp.sum(y, axis=-1)


CASES = [
    pytest.param(row_logsumexp, ((50, 40), (40, 300)), F32, id="logsumexp-f32"),
    pytest.param(row_logsumexp_bt, ((50, 40), (300, 40)), BF16, id="logsumexp-bf16-Bt"),
    pytest.param(cross_entropy, ((50, 40), (40, 300), ("i32", (50,))), F32, id="ce-f32"),
    pytest.param(cross_entropy, ((50, 40), (40, 300), ("i32", (50,))), BF16, id="ce-bf16"),
    pytest.param(cross_entropy_one_hot_mean, ((33, 48), (48, 200), ("i32", (33,))), BF16, id="ce-one-hot-mean-bf16"),
    pytest.param(cross_entropy_take_along_axis, ((50, 40), (40, 300), ("i32", (50,))), F32, id="ce-take-along-axis-f32"),
    pytest.param(cross_entropy_take_along_axis, ((50, 40), (40, 300), ("i32", (50,))), BF16, id="ce-take-along-axis-bf16"),
    pytest.param(row_max_and_sumexp, ((40, 24), (24, 130)), BF16, id="max-and-sumexp-two-outputs-bf16"),
    pytest.param(softmax_weighted_sum, ((40, 24), (24, 100), (100,)), F32, id="softmax-then-sum-f32"),
    pytest.param(splade_head, ((2, 37, 40), (40, 70), (70,), (2, 37)), F32, id="splade-f32"),
    pytest.param(splade_head, ((3, 20, 24), (24, 90), (90,), (3, 20)), BF16, id="splade-bf16"),
    pytest.param(col_sum_tanh, ((45, 20), (20, 50)), F32, id="column-sum-f32"),
    pytest.param(splade_head, ((2, 37, 40), (40, 70), (70,), ("bool", (2, 37))), F32, id="splade-bool-mask-f32"),
    pytest.param(splade_head, ((3, 20, 24), (24, 90), (90,), ("bool", (3, 20))), BF16, id="splade-bool-mask-bf16"),
    pytest.param(row_max_monotone_chain, ((50, 40), (40, 300), (300,), (50,)), F32, id="max-monotone-chain-f32"),
    pytest.param(row_max_monotone_chain, ((50, 40), (40, 300), (300,), (50,)), BF16, id="max-monotone-chain-bf16"),
    pytest.param(col_min_masked, ((45, 20), (20, 50), ("bool", (45,))), F32, id="column-min-masked-f32"),
    pytest.param(row_max_unknown_sign, ((40, 24), (24, 130), (40,)), F32, id="max-unknown-sign-f32"),
    pytest.param(row_max_and_sum_tanh, ((40, 24), (24, 130)), BF16, id="max-and-sum-of-one-chain-bf16"),
    pytest.param(row_logsumexp, ((30, 20), (20, 100)), F16, id="logsumexp-f16"),
]
SMALL = {"block_m": 16, "block_n": 32, "block_k": 16, "num_warps": 4, "num_stages": 2, "split": 1}


def _specs(shapes, dtype):
    """Argument specs: ("i32", shape) is an integer (target) argument, ("bool", shape) a mask, any other shape has `dtype`."""
    kinds = {"i32": jnp.int32, "bool": jnp.bool_}
    return [S(s[1], kinds[s[0]]) if s[0] in kinds else S(s, dtype) for s in shapes]


def _candidate(graph):
    cands = [c for c in enumerate_candidates(graph) if c.template == "matmul_reduce"]
    assert cands, "a matmul_reduce candidate is enumerated"
    return max(cands, key=lambda c: len(c.nodes))


def _check_plan(fn, g, group, cfg):
    plan = plan_from_choices(g, [(group, "matmul_reduce", cfg)])
    fused = autofuse.jit(fn, plan=plan)
    res = check(lambda *a: jax.tree_util.tree_leaves(fused(*a)), lambda *a: jax.tree_util.tree_leaves(jax.jit(fn)(*a)),
                [g.avals[v] for v in g.inputs], (1, 2), cone_tolerances(g, [n.id for n in g.nodes], g.outputs))
    assert res.ok, (cfg, res.reason)
    assert fused.last_status.startswith("plan:")


@pytest.mark.parametrize("fn,shapes,dtype", slow_except(CASES, "ce-bf16", "column-min-masked-f32"))
def test_matmul_reduce_matches_xla(fn, shapes, dtype):
    g = autofuse.capture(fn, *_specs(shapes, dtype))
    cand = _candidate(g)
    if fn is not cross_entropy_one_hot_mean:  # (its mean over the rows stays outside)
        assert set(g.outputs) <= set(cand.group.outputs), "the program's results come out of the fused group"
    configs = [matmul_reduce.default_config(cand.spec), SMALL]  # one block, and many blocks with ragged edges
    if cand.spec.over_n:
        configs.append({**SMALL, "split": 4})  # ranges of N merged outside the kernel
    for cfg in configs:
        _check_plan(fn, g, cand.group, cfg)


def test_loop_structure_follows_the_reduced_axis():
    g = autofuse.capture(splade_head, *_specs(((2, 37, 40), (40, 70), (70,), (2, 37)), F32))
    spec = _candidate(g).spec
    assert (spec.over_n, spec.P, spec.L, spec.N, spec.K) == (False, 2, 37, 70, 40)
    g = autofuse.capture(cross_entropy, *_specs(((50, 40), (40, 300), ("i32", (50,))), F32))
    spec = _candidate(g).spec
    assert (spec.over_n, spec.M, spec.N) == (True, 50, 300)
    assert [k for terms in spec.scale.values() for k, _, _ in terms] == ["exp"]  # sum(exp(x - max)) rescales by exp


def test_only_a_row_pick_gather_is_folded():
    x, w, t = S((32, 32), F32), S((32, 64), F32), S((32,), jnp.int32)
    g = autofuse.capture(cross_entropy_take_along_axis, x, w, t)
    assert len(_candidate(g).nodes) == len(g.nodes)  # the gather is inside the fused group
    # a gather of whole rows (x[t]) is no row pick: it stays in XLA
    g = autofuse.capture(lambda a, b, i: jnp.max((a @ b)[i], axis=-1), x, w, t)
    assert all(n.name != "gather" for c in enumerate_candidates(g) for n in c.group.nodes)


def test_unrescalable_and_high_precision_groups_stay_out():
    x, w = S((32, 32), F32), S((32, 64), F32)
    # max(x * s) with s an earlier sum can change sign: no online form
    g = autofuse.capture(lambda a, b: jnp.max((a @ b) * jnp.sum(a @ b, axis=-1, keepdims=True), axis=-1), x, w)
    assert all(c.template != "matmul_reduce" or len([n for n in c.group.nodes if n.name.startswith("reduce")]) < 2
               for c in enumerate_candidates(g))
    g = autofuse.capture(lambda a, b: jnp.sum(jnp.dot(a, b, precision=jax.lax.Precision.HIGHEST), axis=-1), x, w)
    assert not [c for c in enumerate_candidates(g) if c.template == "matmul_reduce"]


LOWER = [
    pytest.param(row_logsumexp, ((300, 200), (200, 260)), id="logsumexp"),
    pytest.param(cross_entropy, ((300, 200), (200, 260), ("i32", (300,))), id="ce"),
    pytest.param(cross_entropy_take_along_axis, ((300, 200), (200, 260), ("i32", (300,))), id="ce-take-along-axis"),
    pytest.param(splade_head, ((2, 100, 64), (64, 300), (300,), (2, 100)), id="splade"),
    pytest.param(splade_head, ((2, 100, 64), (64, 300), (300,), ("bool", (2, 100))), id="splade-bool-mask"),
    pytest.param(row_max_monotone_chain, ((300, 200), (200, 260), (260,), (300,)), id="max-monotone-chain"),
]


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("fn,shapes", LOWER)
def test_matmul_reduce_kernels_pass_the_cuda_lowering_guard(fn, shapes, dtype):
    g = autofuse.capture(fn, *_specs(shapes, dtype))
    cand = _candidate(g)
    big = {"block_m": 128, "block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 3, "split": 2 if cand.spec.over_n else 1}
    for cfg in (SMALL, big):
        kernel = build_group(cand.group, "matmul_reduce", cfg, interpret=False)
        lowering_guard(kernel, [S(g.avals[v].shape, g.avals[v].dtype) for v in cand.group.inputs])


@pytest.mark.parametrize("fn,shapes", [
    pytest.param(splade_head, ((2, 64, 32), (32, 1024), (1024,), (2, 64)), id="splade"),
    pytest.param(cross_entropy, ((1024, 32), (32, 4096), ("i32", (1024,))), id="ce"),
])
@pytest.mark.slow
def test_model_tuning_picks_the_fused_reduction(fn, shapes):
    rep = autofuse.tune(fn, *_specs(shapes, BF16), trials=4, quiet=True, store=False, isolate=False, measure="model")
    assert [g.template for g in rep.plan.groups] == ["matmul_reduce"]
    g = autofuse.capture(fn, *_specs(shapes, BF16))
    assert len(rep.plan.groups[0].nodes) == len(g.nodes)  # the whole program: the product is never written


def _per_tile_and_once(spec):
    """Names of the epilogue's equations run on every product tile, and of those run once on the final values."""
    sub = spec.tile.group
    tile = [nd.name for nd in sub.nodes if any(spec.loop(v) for v in nd.outputs)]
    once = [nd.name for nd in sub.nodes if spec.level[nd.id] >= 0 and nd.id not in spec.reductions
            and not any(spec.loop(v) for v in nd.outputs)]
    return tile, once


def test_monotone_work_moves_after_the_max():
    g = autofuse.capture(splade_head, *_specs(((2, 37, 40), (40, 70), (70,), ("bool", (2, 37))), BF16))
    cand = _candidate(g)
    spec = cand.spec
    tile, once = _per_tile_and_once(spec)
    assert not {"add", "max", "log1p", "mul"} & set(tile), tile  # per tile: only the mask's select
    assert once.count("log1p") == 1 and once.count("add") == 1  # the chain, once on the reduced values
    assert sorted(spec.tile.group.graph.node_index[r].name for r in spec.reductions) == ["reduce_max", "reduce_sum"]  # + live count
    assert spec.tile.group.outputs == cand.group.outputs and spec.group is cand.group  # the group itself is unchanged
    # over N: the chain above the add of a per-column bias follows the max
    g = autofuse.capture(row_max_monotone_chain, *_specs(((50, 40), (40, 300), (300,), (50,)), F32))
    tile, once = _per_tile_and_once(_candidate(g).spec)
    assert "add" in tile and not {"tanh", "mul", "sub", "exp"} & set(tile)
    assert {"tanh", "mul", "sub", "exp"} <= set(once)


@pytest.mark.parametrize("fn,shapes,dtype", [
    pytest.param(splade_head, ((2, 37, 40), (40, 70), (70,), (2, 37)), F32, id="factor-of-unknown-sign"),
    pytest.param(row_max_unknown_sign, ((40, 24), (24, 130), (40,)), F32, id="mul-by-unknown-sign"),
    pytest.param(row_max_and_sum_tanh, ((40, 24), (24, 130)), F32, id="chain-read-twice"),
])
def test_monotone_rewrite_declines(fn, shapes, dtype):
    tile, _ = _per_tile_and_once(_candidate(autofuse.capture(fn, *_specs(shapes, dtype))).spec)
    assert {"log1p", "exp", "tanh"} & set(tile)


@pytest.mark.parametrize("fn,dtype", [(splade_head, F32), (splade_head, BF16), (masked_log_max, F32)])
@pytest.mark.slow
def test_fully_masked_slices_keep_their_value(fn, dtype):
    # batch element 1 is all padding: SPLADE gives 0 there (relu then * 0), the masked log -inf, though the
    # rewritten chain on the empty max would give log1p(relu(-inf)) or log(-inf) = NaN
    B, L, K, N = 3, 37, 24, 70
    mask = jnp.arange(L)[None, :] < jnp.array([20, 0, L])[:, None]
    h = jax.random.normal(jax.random.PRNGKey(0), (B, L, K), F32).astype(dtype)
    w = jax.random.normal(jax.random.PRNGKey(1), (K, N), F32).astype(dtype)
    args = [h, w, jax.random.normal(jax.random.PRNGKey(2), (N,), F32).astype(dtype), mask]
    if fn is masked_log_max:
        args = [h, w, mask]
    g = autofuse.capture(fn, *[S(a.shape, a.dtype) for a in args])
    cand = _candidate(g)
    assert "reduce_sum" in [nd.name for nd in cand.spec.tile.group.nodes]  # rewritten, with the live count
    tol = cone_tolerances(g, [n.id for n in g.nodes], g.outputs)[0]
    want = jax.jit(fn)(*args)
    for cfg in (matmul_reduce.default_config(cand.spec), SMALL):
        got = autofuse.jit(fn, plan=plan_from_choices(g, [(cand.group, "matmul_reduce", cfg)]))(*args)
        ok, err, why = compare(got, want, tol)
        assert ok, (cfg, err, why)
        assert bool(jnp.all(got[1] == (0 if fn is splade_head else -jnp.inf)))


@pytest.mark.slow
def test_mask_converted_outside_the_group_holds_any_float():
    """A {0, 1} factor is known only from a bool converted inside the group. In the SPLADE model the mask is
    converted before the head's group, so inside it the mask is a float input, which the group's own check (and
    any program reusing the group) fills with any values: the head must not be rewritten as if it were a mask."""
    from autofuse.runner.evaluator import Evaluator
    from examples import splade

    g = autofuse.capture(splade.forward, *splade.small_inputs())
    float_mask = lambda c: [v for v in c.group.inputs if g.avals[v].dtype == jnp.float32 and g.avals[v].shape[-1] == 1]  # noqa: E731
    cand = max((c for c in enumerate_candidates(g) if c.template == "matmul_reduce" and float_mask(c)), key=lambda c: len(c.nodes))
    spec = matmul_reduce.match(cand.group)
    assert g.producer[float_mask(cand)[0]] not in cand.nodes  # the premise: converted outside
    res = Evaluator(g, measure="model").trial(cand.nodes, "matmul_reduce", matmul_reduce.default_config(spec))
    assert res.ok, res


@pytest.mark.slow
def test_head_group_takes_in_its_own_mask_conversion_and_is_rewritten():
    """The partitioner also offers a dot's group with the side inputs it alone reads made inside it: the SPLADE
    head with the bool mask's broadcast and conversion, where the template knows the factor is {0, 1} and moves
    relu/log1p after the max; that group passes its own check on random inputs."""
    from autofuse.runner.evaluator import Evaluator
    from examples import splade

    g = autofuse.capture(splade.forward, *splade.small_inputs())
    heads = [c for c in enumerate_candidates(g) if c.template == "matmul_reduce"]
    big = max(heads, key=lambda c: len(c.nodes))
    assert any(g.node_index[n].name == "convert_element_type" and g.avals[g.node_index[n].inputs[0]].dtype == jnp.bool_ for n in big.nodes)
    spec = matmul_reduce.match(big.group)
    per_tile = [nd.name for nd in spec.tile.group.nodes if spec.level[nd.id] < 0 and any(spec.loop(v) for v in nd.outputs)]
    assert "log1p" not in per_tile  # the chain runs once, after the loop
    res = Evaluator(g, measure="model").trial(big.nodes, "matmul_reduce", matmul_reduce.default_config(spec))
    assert res.ok, res
