"""A gradient program's elementwise residuals computed again beside their late readers (`graph.recompute_for_late_readers`):
the forward's GEMM + GELU group writes g and GELU(g) only, the backward reads g, and every plan still computes
`jax.grad`'s numbers."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autofuse
from autofuse import graph as graph_mod
from autofuse.graph import Group
from autofuse.kernels import matmul
from autofuse.plan import plan_from_choices
from autofuse.runner.measure import compare
from autofuse.tuning.partition import enumerate_candidates

S = jax.ShapeDtypeStruct
BF16 = jnp.bfloat16


def mlp_loss(x, w1, b1, w2):
    """An MLP under a softmax loss: the cotangent reaching the MLP depends on its forward (two GEMMs lie between
    GELU's residuals and the backward's reader of them)."""
    h = jax.nn.gelu(x @ w1 + b1, approximate=True)
    return jnp.sum(jax.nn.log_softmax((h @ w2).astype(jnp.float32)))


mlp_grad = jax.grad(mlp_loss, argnums=(0, 1, 2, 3))


def _specs(m=64, k=32, n=128, c=48):
    return [S((m, k), BF16), S((k, n), BF16), S((n,), BF16), S((n, c), BF16)]


def _inputs(specs, seed=0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(s.shape) * 0.5, s.dtype) for s in specs]


def _forward_gelu_group(graph) -> Group:
    """The forward's first GEMM with everything after it up to the second GEMM (the bias, GELU)."""
    first, second = [n.id for n in graph.nodes if n.name == "dot_general"][:2]
    return Group.of(graph, range(first, second))


def test_forward_group_writes_the_pre_activation_and_the_activation_only(monkeypatch):
    g = autofuse.capture(mlp_grad, *_specs())
    group = _forward_gelu_group(g)
    assert len(group.outputs) == 2, [str(g.avals[v]) for v in group.outputs]
    assert sum(n.name == "tanh" for n in g.nodes) == 2, "tanh once in the forward, once again in the backward"
    monkeypatch.setattr(graph_mod, "MAX_RECOMPUTED", 0)  # nothing recomputed: the forward writes GELU's residuals
    g0 = autofuse.capture(mlp_grad, *_specs())
    assert len(_forward_gelu_group(g0).outputs) >= 4
    assert sum(n.name == "tanh" for n in g0.nodes) == 1
    assert g0.fingerprint != g.fingerprint


def test_the_program_computes_jax_grads_numbers():
    specs = _specs()
    g = autofuse.capture(mlp_grad, *specs)
    args = _inputs(specs)
    got = jax.jit(g.evaluate)(args)
    want = jax.tree_util.tree_leaves(jax.jit(mlp_grad)(*args))
    for a, b in zip(got, want):
        assert compare(a, b, 1e-2)[0]


def test_the_backward_reads_the_pre_activation_not_the_residuals():
    """The dgrad GEMM's epilogue (GELU's derivative) reads g from the forward and computes tanh again."""
    g = autofuse.capture(mlp_grad, *_specs())
    forward = _forward_gelu_group(g)
    made_forward = {v for n in forward.nodes for v in n.outputs}
    backward = [n for n in g.nodes if n.id > max(forward.node_ids)]
    read = {a for n in backward for a in n.inputs if isinstance(a, int) and a in made_forward}
    assert len(read) == 2, "g (by GELU's derivative) and GELU(g) (by the down projection's wgrad GEMM)"
    gelu_out = max(forward.outputs)
    assert any(n.name == "dot_general" and gelu_out in n.inputs for n in backward), "a GEMM's operand is read as stored"


@pytest.mark.parametrize("which", ["forward", "both"])
def test_plans_fusing_the_forward_and_the_backward_epilogue_match_jax_grad(which):
    specs = _specs(m=40, k=24, n=72, c=40)  # not multiples of the tiles
    g = autofuse.capture(mlp_grad, *specs)
    forward = _forward_gelu_group(g)
    cands = [c for c in enumerate_candidates(g) if c.template == "matmul"]
    fwd = max((c for c in cands if set(c.nodes) <= set(forward.node_ids)), key=lambda c: len(c.nodes))
    assert len(fwd.group.outputs) == 2
    dgrad = max((c for c in cands if any(n.name == "tanh" for n in c.group.nodes) and min(c.nodes) > max(forward.node_ids)),
                key=lambda c: len(c.nodes))
    chosen = [fwd] + ([dgrad] if which == "both" else [])
    small = {"block_m": 16, "block_n": 32, "block_k": 16, "num_warps": 4, "num_stages": 2, "group_m": 4}
    plan = plan_from_choices(g, [(c.group, "matmul", {**matmul.default_config(c.spec), **small}) for c in chosen])
    fused = autofuse.jit(mlp_grad, plan=plan, on_miss="error")
    args = _inputs(specs, seed=3)
    got = jax.tree_util.tree_leaves(fused(*args))
    assert fused.last_status.startswith("plan:")
    want = jax.tree_util.tree_leaves(jax.jit(mlp_grad)(*args))
    for a, b in zip(got, want):
        ok, _, why = compare(a, b, 2e-2)
        assert ok, why


def test_only_where_the_chain_starts_from_kept_values():
    """A forward program reading tanh(h) only after two more GEMMs: tanh moves beside its reader where h is read
    there too (no new read), and stays where it is computed first otherwise (h would be read again)."""
    def not_kept(x, w1, w2, w3):
        h = x @ w1
        t = jnp.tanh(h)  # traced before the GEMMs
        return (h @ w2) @ w3 * t

    def kept(x, w1, w2, w3):
        h = x @ w1
        t = jnp.tanh(h)
        return (h @ w2) @ w3 * t + h

    def tanh_after_the_gemms(fn) -> bool:
        g = autofuse.capture(fn, *[S((16, 16), jnp.float32)] * 4)
        (tanh,) = [n.id for n in g.nodes if n.name == "tanh"]
        return tanh > max(n.id for n in g.nodes if n.name == "dot_general")

    assert tanh_after_the_gemms(kept) and not tanh_after_the_gemms(not_kept)
    forward = jax.jit(lambda x, w: jax.nn.gelu(x @ w, approximate=True))
    g = autofuse.capture(forward, S((8, 16), BF16), S((16, 32), BF16))
    assert len(g.nodes) == len(jax.make_jaxpr(forward)(S((8, 16), BF16), S((16, 32), BF16)).jaxpr.eqns[0].params["jaxpr"].eqns)


def test_decisions_do_not_depend_on_sizes():
    a = autofuse.capture(mlp_grad, *_specs())
    b = autofuse.capture(mlp_grad, *_specs(m=96, k=48, n=256, c=80))
    assert a.structure == b.structure and len(a.nodes) == len(b.nodes)


def _ln(x, scale, bias, eps=1e-5):
    xf = x.astype(jnp.float32)
    mean = xf.mean(-1, keepdims=True)
    var = ((xf - mean) ** 2).mean(-1, keepdims=True)
    return ((xf - mean) * jax.lax.rsqrt(var + eps) * scale + bias).astype(x.dtype)


def block_loss(x, scale, bias, w1, w2, w3):
    """A pre-norm residual block (bf16, the norm's statistics in float32) under a softmax loss."""
    z = x + (_ln(x, scale, bias) @ w1) @ w2
    return jnp.sum(jax.nn.log_softmax((z @ w3).astype(jnp.float32)))


block_grad = jax.grad(block_loss, argnums=(0, 1, 2, 3, 4, 5))
BLOCK = [S((48, 64), BF16), S((64,), jnp.float32), S((64,), jnp.float32), S((64, 96), BF16), S((96, 64), BF16), S((64, 40), BF16)]


def _norm_outputs(g) -> list[str]:
    first_dot = min(n.id for n in g.nodes if n.name == "dot_general")
    return sorted(str(g.avals[v]) for v in Group.of(g, [n.id for n in g.nodes if n.id < first_dot]).outputs)


def test_the_norms_float32_residuals_are_computed_again_from_its_bf16_input(monkeypatch):
    """x - mean and (x - mean) * rstd (float32) are read by the norm's backward: computed again there from x
    (bf16, read across the block's GEMMs anyway) and the row sums, the forward norm writes neither."""
    outs = _norm_outputs(autofuse.capture(block_grad, *BLOCK))
    assert "float32[48, 64]" not in outs, outs
    monkeypatch.setattr(graph_mod, "MAX_RECOMPUTED", 0)
    assert _norm_outputs(autofuse.capture(block_grad, *BLOCK)).count("float32[48, 64]") >= 2


def test_the_block_computes_jax_grads_numbers_with_its_norm_fused():
    g = autofuse.capture(block_grad, *BLOCK)
    cand = max((c for c in enumerate_candidates(g) if c.template == "row_reduce"), key=lambda c: len(c.nodes))
    from autofuse.kernels import TEMPLATES
    plan = plan_from_choices(g, [(cand.group, "row_reduce", TEMPLATES["row_reduce"].default_config(cand.spec))])
    fused = autofuse.jit(block_grad, plan=plan, on_miss="error")
    args = _inputs(BLOCK, seed=5)
    got = jax.tree_util.tree_leaves(fused(*args))
    assert fused.last_status.startswith("plan:")
    for a, b in zip(got, jax.tree_util.tree_leaves(jax.jit(block_grad)(*args))):
        ok, _, why = compare(a, b, 2e-2)
        assert ok, why
