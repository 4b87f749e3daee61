"""Capture: pytrees, static arguments, inlining, opaque control flow, evaluation and fingerprints."""
from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from autofuse import ops
from autofuse.graph import capture, flatten_args

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
S = jax.ShapeDtypeStruct
F32 = jnp.float32


def _names(graph) -> list[str]:
    return [n.name for n in graph.nodes]


def _rand(shape, dtype=np.float32, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(dtype))


def _assert_trees_close(a, b, rtol=1e-6, atol=1e-6):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        assert np.shape(x) == np.shape(y)
        assert jnp.asarray(x).dtype == jnp.asarray(y).dtype
        np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=rtol, atol=atol)


def _eval_tree(graph, fn, args, kwargs=None, **static):
    """Run the graph on real arguments and rebuild the output pytree."""
    leaves = flatten_args(graph, fn, args, kwargs or {}, **static)
    return jax.tree_util.tree_unflatten(graph.out_tree, graph.evaluate(leaves))


# ---------------------------------------------------------------------------
# Pytrees.
@functools.partial(jax.tree_util.register_dataclass, data_fields=["w", "b"], meta_fields=["act"])
@dataclasses.dataclass
class Layer:
    w: jax.Array
    b: jax.Array
    act: str = "relu"


class Pair:
    """A custom pytree node registered by hand, with auxiliary data."""

    def __init__(self, lo, hi, scale=1.0):
        self.lo, self.hi, self.scale = lo, hi, scale


jax.tree_util.register_pytree_node(Pair, lambda p: ((p.lo, p.hi), p.scale), lambda scale, ch: Pair(*ch, scale=scale))


def model(params, xs, layer, pair):
    x, y = xs
    h = x * params["a"] + y @ params["m"]
    h = h + layer.w
    h = jax.nn.relu(h) if layer.act == "relu" else jnp.tanh(h)
    h = h + layer.b
    clipped = jnp.clip(h, pair.lo, pair.hi) * pair.scale
    return {"out": clipped, "aux": (h.sum(), x), "pair": Pair(h.max(-1), h.min(-1), pair.scale)}


def _model_args(seed=0, act="relu", scale=2.0):
    params = {"a": _rand((4, 8), seed=seed), "m": _rand((8, 8), seed=seed + 1)}
    xs = (_rand((4, 8), seed=seed + 2), _rand((4, 8), seed=seed + 3))
    layer = Layer(_rand((8,), seed=seed + 4), _rand((8,), seed=seed + 5), act)
    pair = Pair(jnp.float32(-0.5), jnp.float32(0.7), scale)
    return params, xs, layer, pair


def test_pytree_inputs_and_outputs_match_jit():
    args = _model_args()
    g = capture(model, *args)
    ref = jax.jit(model)(*args)
    assert g.out_tree == jax.tree_util.tree_structure(ref)
    assert g.in_tree == jax.tree_util.tree_structure((args, {}))
    assert len(g.inputs) == len(jax.tree_util.tree_leaves(args))
    # Leaves in flattening order: their avals are the graph's input avals.
    assert [g.avals[v].shape for v in g.inputs] == [np.shape(x) for x in jax.tree_util.tree_leaves(args)]
    _assert_trees_close(_eval_tree(g, model, args), ref)
    # A different leaf value through the same graph still matches jax.jit.
    args2 = _model_args(seed=10)
    _assert_trees_close(_eval_tree(g, model, args2), jax.jit(model)(*args2))


def test_pytree_metadata_is_part_of_the_program():
    args = _model_args()
    g_relu = capture(model, *args)
    g_tanh = capture(model, *_model_args(act="tanh"))
    g_scale = capture(model, *_model_args(scale=3.0))
    assert "tanh" in _names(g_tanh) and "tanh" not in _names(g_relu)
    assert len({g_relu.fingerprint, g_tanh.fingerprint, g_scale.fingerprint}) == 3
    # A call with another structure is refused, not silently mis-flattened.
    params, xs, layer, pair = args
    with pytest.raises(ValueError, match="does not match"):
        flatten_args(g_relu, model, (params, xs, (layer.w, layer.b), pair), {})


def test_shape_dtype_struct_inputs():
    args = _model_args()
    specs = jax.tree_util.tree_map(lambda x: S(np.shape(x), jnp.asarray(x).dtype), args)
    g_spec = capture(model, *specs)
    g_real = capture(model, *args)
    assert g_spec.fingerprint == g_real.fingerprint
    assert [str(g_spec.avals[v]) for v in g_spec.inputs] == [str(g_real.avals[v]) for v in g_real.inputs]
    _assert_trees_close(_eval_tree(g_spec, model, args), jax.jit(model)(*args))

    gb = capture(lambda x, b: x.astype(jnp.float32) + b, S((3, 5), jnp.bfloat16), S((5,), F32))
    assert [str(gb.avals[v]) for v in gb.inputs] == ["bfloat16[3, 5]", "float32[5]"]
    assert gb.signature() == {"inputs": ["bfloat16[3, 5]", "float32[5]"], "outputs": ["float32[3, 5]"]}


# ---------------------------------------------------------------------------
# Static arguments.
def repeat(x, n, mode="add"):
    for _ in range(n):
        x = x + 1.0 if mode == "add" else x * 2.0
    return x


def test_static_int_changes_the_program():
    x = _rand((4, 8))
    g2 = capture(repeat, x, 2, static_argnums=(1,))
    g3 = capture(repeat, x, 3, static_argnums=1)
    assert _names(g2) == ["add"] * 2 and _names(g3) == ["add"] * 3
    assert g2.fingerprint != g3.fingerprint
    assert len(g2.inputs) == 1  # the static argument is not an input
    np.testing.assert_allclose(g3.evaluate([x])[0], jax.jit(repeat, static_argnums=1)(x, 3))
    # A negative position names the same argument.
    assert capture(repeat, x, 3, static_argnums=(-1,)).fingerprint == g3.fingerprint


def test_static_string_changes_the_program():
    x = _rand((4, 8))
    ga = capture(repeat, x, 2, "add", static_argnums=(1, 2))
    gm = capture(repeat, x, 2, "mul", static_argnums=(1, 2))
    assert _names(ga) == ["add", "add"] and _names(gm) == ["mul", "mul"]
    assert ga.fingerprint != gm.fingerprint
    np.testing.assert_allclose(gm.evaluate([x])[0], x * 4.0)


def test_static_argnames_by_keyword_and_by_position():
    x = _rand((4, 8))
    ref = jax.jit(repeat, static_argnames=("n", "mode"))(x, n=3, mode="mul")
    g_kw = capture(repeat, x, n=3, mode="mul", static_argnames=("n", "mode"))
    g_pos = capture(repeat, x, 3, "mul", static_argnames=("n", "mode"))
    for g in (g_kw, g_pos):
        assert _names(g) == ["mul"] * 3 and len(g.inputs) == 1
        np.testing.assert_allclose(g.evaluate([x])[0], ref)
    assert capture(repeat, x, n=2, mode="mul", static_argnames=("n", "mode")).fingerprint != g_kw.fingerprint


def test_static_argnums_given_by_keyword():
    # As with jax.jit, a static position passed by keyword is still static.
    x = _rand((4, 8))
    g = capture(repeat, x, n=3, static_argnums=(1,))
    assert _names(g) == ["add"] * 3 and len(g.inputs) == 1
    np.testing.assert_allclose(g.evaluate([x])[0], jax.jit(repeat, static_argnums=1)(x, n=3))


# ---------------------------------------------------------------------------
# Inlining and opaque control flow.
@jax.custom_jvp
def my_softplus(x):
    return jnp.log1p(jnp.exp(x))


my_softplus.defjvp(lambda primals, tangents: (my_softplus(primals[0]), tangents[0] * jax.nn.sigmoid(primals[0])))


@jax.jit
def inner_block(x):
    return jax.nn.gelu(x) + jax.nn.relu(x) + my_softplus(x)


def nested(x, w):
    h = inner_block(x * w)
    return jax.jit(lambda y: jnp.tanh(y) * 2.0)(h)


def _all_prims(jaxpr) -> set[str]:
    out = set()
    for e in jaxpr.eqns:
        out.add(e.primitive.name)
        for v in e.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                j = getattr(sub, "jaxpr", sub)
                if hasattr(j, "eqns"):
                    out |= _all_prims(j)
    return out


def test_nested_jit_and_custom_jvp_are_inlined():
    specs = (S((4, 8), F32), S((8,), F32))
    traced = _all_prims(jax.make_jaxpr(nested)(*specs).jaxpr)
    assert {"pjit", "jit"} & traced and "custom_jvp_call" in traced  # there is something to inline
    g = capture(nested, *specs)
    names = set(_names(g))
    assert not names & {"jit", "pjit", "custom_jvp_call", "closed_call", "core_call"}
    assert {"tanh", "max", "log1p", "exp"} <= names
    assert all(ops.op_class(n) is not ops.OpClass.OPAQUE for n in names), names
    x, w = _rand((4, 8)), _rand((8,), seed=1)
    np.testing.assert_allclose(g.evaluate([x, w])[0], jax.jit(nested)(x, w), rtol=1e-6, atol=1e-6)


def test_exact_gelu_is_inlined_but_erf_stays_opaque():
    g = capture(lambda x: jax.nn.gelu(x, approximate=False), S((4, 8), F32))
    names = _names(g)
    assert not set(names) & {"jit", "pjit", "custom_jvp_call"}
    assert any(ops.op_class(n) is ops.OpClass.OPAQUE for n in names if n.startswith("erf")), names


def _mlp_step(remat: bool):
    """jax.grad of three residual GELU layers, each under `jax.checkpoint` if `remat`."""
    def layer(x, w1, w2):
        return x + jax.nn.gelu(x @ w1) @ w2

    def loss(params, x):
        f = jax.checkpoint(layer) if remat else layer
        for w1, w2 in params:
            x = f(x, w1, w2)
        return jnp.mean(x ** 2)
    return jax.grad(loss)


def test_a_checkpointed_backward_is_inlined_and_keeps_what_checkpoint_saves():
    # A careful user checkpoints a training step's layers to fit it in memory. The backward's layers were one opaque
    # `remat2` node each (nothing in them to fuse); inlined bare, XLA merged their recomputation with the forward and
    # kept every residual (~2.4x the memory here). Inlined behind the barrier `jax.checkpoint`'s lowering uses,
    # they are the graph's and the memory is what jax.jit's is.
    d, f, rows = 128, 512, 1024
    params = [(_rand((d, f), seed=2 * i) * 0.05, _rand((f, d), seed=2 * i + 1) * 0.05) for i in range(3)]
    x = _rand((rows, d), seed=9)
    flat = jax.tree_util.tree_leaves((params, x))
    temp, dots = {}, {}
    for remat in (False, True):
        step = _mlp_step(remat)
        g = capture(step, params, x)
        names = _names(g)
        assert "remat2" not in names
        dots[remat] = names.count("dot_general")
        assert names.count("optimization_barrier") == (3 if remat else 0)
        _assert_trees_close(jax.tree_util.tree_unflatten(g.out_tree, g.evaluate(flat)), jax.jit(step)(params, x), rtol=1e-5, atol=1e-5)
        memory = lambda fn: fn.lower(*flat).compile().memory_analysis().temp_size_in_bytes  # noqa: E731
        temp[remat] = (memory(jax.jit(lambda *a: g.evaluate(a))), memory(jax.jit(lambda *a: jax.tree_util.tree_leaves(step(*jax.tree_util.tree_unflatten(jax.tree_util.tree_structure((params, x)), a))))))
    assert dots[True] == dots[False] + 3  # each layer's x @ w1 computed again in the backward
    assert temp[True][0] == temp[True][1] and temp[True][0] < 0.6 * temp[False][0], temp


@pytest.mark.slow
def test_gpt2s_checkpointed_step_has_its_backward_to_fuse():
    """GPT-2's training step with its blocks under `jax.checkpoint` (`grad_step_cudnn_remat`): the blocks' backward
    (their attention gradient, the dgrad GEMMs with GELU' in their epilogue) is candidates, as it is without it."""
    from autofuse.tuning.partition import enumerate_candidates
    from examples import gpt2

    params, batch = gpt2.small_inputs()
    g = capture(gpt2.grad_step_cudnn_remat, params, batch)
    assert _names(g).count("optimization_barrier") == len(params["blocks"])
    templates = {c.template for c in enumerate_candidates(g)}
    assert {"attention_vjp", "matmul", "row_reduce"} <= templates, templates
    flat = jax.tree_util.tree_leaves((params, batch))
    _assert_trees_close(jax.tree_util.tree_unflatten(g.out_tree, g.evaluate(flat)), jax.jit(gpt2.grad_step_cudnn)(params, batch),
                        rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_llamas_checkpointed_step_has_its_backward_to_fuse():
    """Llama's blocks under `jax.checkpoint` (`grad_step_cudnn_remat`): grouped-query library attention, rotary
    embeddings and SwiGLU recomputed in the backward, all of it candidates; the gradients are the unchecked step's."""
    from autofuse.tuning.partition import enumerate_candidates
    from examples import llama

    params, batch = llama.small_inputs()
    g = capture(llama.grad_step_cudnn_remat, params, batch)
    assert "remat2" not in _names(g)
    assert _names(g).count("optimization_barrier") == len(params["blocks"])
    templates = {c.template for c in enumerate_candidates(g)}
    assert {"matmul", "row_reduce"} <= templates, templates
    flat = jax.tree_util.tree_leaves((params, batch))
    _assert_trees_close(jax.tree_util.tree_unflatten(g.out_tree, g.evaluate(flat)), jax.jit(llama.grad_step_cudnn)(params, batch),
                        rtol=1e-5, atol=1e-6)


def control(x):
    y = jax.lax.cond(x.sum() > 0, lambda v: v * 2.0, lambda v: v - 1.0, x)
    c, ys = jax.lax.scan(lambda c, r: (c + r, jnp.sin(c * r)), jnp.zeros(x.shape[1], x.dtype), y)
    _, w = jax.lax.while_loop(lambda s: s[0] < 3, lambda s: (s[0] + 1, jnp.cos(s[1]) * 1.5), (0, c))
    return w + 1.0, ys


def test_control_flow_stays_one_opaque_node():
    g = capture(control, S((5, 8), F32))
    names = _names(g)
    for prim in ("cond", "scan", "while"):
        assert names.count(prim) == 1, names
        assert ops.op_class(prim) is ops.OpClass.OPAQUE
    # The bodies were not inlined.
    assert "sin" not in names and "cos" not in names
    for seed in (1, 2):
        x = _rand((5, 8), seed=seed)
        _assert_trees_close(jax.tree_util.tree_unflatten(g.out_tree, g.evaluate([x])), jax.jit(control)(x), rtol=1e-5, atol=1e-5)
    # Both branches of the cond are exercised.
    x = -jnp.abs(_rand((5, 8), seed=3))
    _assert_trees_close(jax.tree_util.tree_unflatten(g.out_tree, g.evaluate([x])), jax.jit(control)(x), rtol=1e-5, atol=1e-5)


def test_closed_over_constants_are_graph_constants():
    k = np.linspace(-1, 1, 8, dtype=np.float32)
    kj = jnp.arange(8.0)
    g = capture(lambda x: (x + k) * kj, S((4, 8), F32))
    assert len(g.consts) == 2
    x = _rand((4, 8))
    np.testing.assert_allclose(g.evaluate([x])[0], (x + k) * kj, rtol=1e-6)


# ---------------------------------------------------------------------------
# Fingerprints.
_FP_PROGRAM = textwrap.dedent(
    """
    import dataclasses, functools
    import jax, jax.numpy as jnp, numpy as np
    from autofuse.graph import capture

    @functools.partial(jax.tree_util.register_dataclass, data_fields=["w"], meta_fields=["act"])
    @dataclasses.dataclass
    class L:
        w: jax.Array
        act: str = "relu"

    K = np.linspace(0, 1, 16, dtype=np.float32)

    @jax.jit
    def inner(x):
        return jax.nn.gelu(x) + jax.nn.relu(x)

    def f(p, layer, n):
        x = p["x"] + K + layer.w
        x = jax.lax.cond(x.sum() > 0, lambda v: v * 2, lambda v: v - 1, x)
        c, ys = jax.lax.scan(lambda c, r: (c + r, jnp.sin(c * r)), jnp.zeros(x.shape[1]), x)
        _, w = jax.lax.while_loop(lambda s: s[0] < n, lambda s: (s[0] + 1, s[1] * 1.5), (0, c))
        return {"a": inner(ys).sum(-1), "b": (w, jax.nn.softmax(x, axis=-1))}

    S = jax.ShapeDtypeStruct
    g = capture(f, {"x": S((8, 16), jnp.float32)}, L(S((16,), jnp.float32)), 3, static_argnums=(2,))
    """
)


def _fingerprint_in_subprocess(hashseed: str) -> str:
    env = dict(os.environ, PYTHONHASHSEED=hashseed, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", _FP_PROGRAM + "\nprint(g.fingerprint)\n"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()[-1]


def test_fingerprint_is_stable_across_processes():
    a = _fingerprint_in_subprocess("1")
    b = _fingerprint_in_subprocess("2")
    assert a == b
    assert len(a) == 32 and int(a, 16) >= 0
    ns: dict = {}
    exec(compile(_FP_PROGRAM, "<fp>", "exec"), ns)
    assert ns["g"].fingerprint == a  # and equal to this process's


def _base(x, b):
    return jnp.exp(x + b) * 2.0


def test_fingerprint_changes_with_the_program():
    x, b = S((4, 8), F32), S((8,), F32)
    base = capture(_base, x, b).fingerprint
    assert capture(_base, x, b).fingerprint == base  # deterministic in one process
    assert capture(lambda x, b: jnp.exp(x + b) * 2.0, x, b).fingerprint == base  # the function's name is not part of it

    variants = {
        "op": capture(lambda x, b: jnp.log(x + b) * 2.0, x, b),
        "literal": capture(lambda x, b: jnp.exp(x + b) * 3.0, x, b),
        "shape": capture(_base, S((5, 8), F32), b),
        "dtype": capture(_base, S((4, 8), jnp.bfloat16), S((8,), jnp.bfloat16)),
        "structure": capture(lambda xb: _base(*xb), (x, b)),
    }
    k1 = np.arange(8, dtype=np.float32)
    k2 = k1.copy()
    k2[3] += 1e-3
    c1 = capture(lambda x: x * k1, x)
    c2 = capture(lambda x: x * k2, x)
    variants["constant"] = c2
    assert c1.fingerprint != c2.fingerprint
    assert capture(lambda x: x * k1.copy(), x).fingerprint == c1.fingerprint  # same value, same program

    s2 = capture(repeat, x, 2, static_argnums=(1,))
    s3 = capture(repeat, x, 3, static_argnums=(1,))
    sm = capture(repeat, x, 2, "mul", static_argnums=(1, 2))
    assert len({s2.fingerprint, s3.fingerprint, sm.fingerprint}) == 3

    fps = [base] + [g.fingerprint for g in variants.values()]
    assert len(set(fps)) == len(fps), dict(zip(["base", *variants], fps))


def test_fingerprint_changes_with_a_static_value_that_does_not_change_the_ops():
    # Same equations, different static value: still a different program key.
    def f(x, tag):
        return x + 1.0

    x = S((4, 8), F32)
    assert capture(f, x, "a", static_argnums=1).fingerprint != capture(f, x, "b", static_argnums=1).fingerprint
