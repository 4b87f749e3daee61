"""A group timed alone as the program runs it (`runner.in_program`): the transposes, broadcasts and reshapes that
make its inputs in the program go in front of it, so XLA's reference reads what it reads in the program (GPT-2's
LM head: `wte`, not a row-major copy of `wte.T` with 100514-byte rows)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import autofuse
from autofuse.graph import Group
from autofuse.runner.evaluator import Evaluator
from autofuse.runner.in_program import in_program
from autofuse.runner.protocol import TrialRequest, XlaRequest
from autofuse.status import TrialStatus
from autofuse.tuning.partition import enumerate_candidates


def head(x, w, b):
    return x @ w.T + b


def _args(dtype=jnp.float32):
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    return (jax.random.normal(k[0], (64, 32), dtype), jax.random.normal(k[1], (40, 32), dtype), jax.random.normal(k[2], (40,), dtype))


def _group(graph, *names):
    return Group.of(graph, [n.id for n in graph.nodes if n.name in names])


def test_a_transposed_operand_is_read_as_the_program_holds_it():
    x, w, b = _args()
    graph = autofuse.capture(head, x, w, b)
    dot = _group(graph, "dot_general")
    view = in_program(dot)
    assert [n.name for n in view.prologue] == ["transpose"]
    assert [a.shape for a in view.input_avals()] == [(64, 32), (40, 32)]  # w itself, not its [32, 40] transpose
    assert [s.shape for s in view.structs()] == [(64, 32), (40, 32)]
    (out,) = jax.jit(view.around(lambda *a: dot.evaluate(a)))(x, w)
    np.testing.assert_allclose(out, x @ w.T, rtol=1e-6)


def test_a_broadcast_input_is_read_before_its_broadcast_and_chains_are_followed():
    def fn(x, b):
        return jnp.exp(x) + jnp.broadcast_to(b.reshape(1, 40), (64, 40))

    x, _, b = _args()
    x = x[:, :1] * jnp.ones((64, 40))
    graph = autofuse.capture(fn, x, b)
    add = _group(graph, "add")
    view = in_program(add)
    assert {n.name for n in view.prologue} <= {"broadcast_in_dim", "reshape"} and view.prologue
    assert [a.shape for a in view.input_avals()] == [(64, 40), (40,)]  # exp's result (not a layout op), and b
    (out,) = jax.jit(view.around(lambda *a: add.evaluate(a)))(jnp.exp(x), b)
    np.testing.assert_allclose(out, fn(x, b), rtol=1e-6)


def test_a_group_whose_inputs_are_computed_or_the_programs_own_is_timed_as_it_is():
    x, w, b = _args()
    graph = autofuse.capture(lambda x: jnp.tanh(jnp.exp(x)), x)
    tanh = _group(graph, "tanh")
    view = in_program(tanh)
    assert view.prologue == () and view.inputs == tanh.inputs
    fn = lambda *a: a  # noqa: E731
    assert view.around(fn) is fn


def test_the_evaluator_times_and_checks_xla_and_a_kernel_on_the_programs_operands():
    """Device mode on the CPU: XLA's reference and a Triton `matmul` trial (interpret mode) both take `w` as the
    program holds it, and the kernel is checked against the reference there."""
    x, w, b = _args()
    graph = autofuse.capture(head, x, w, b)
    dot = _group(graph, "dot_general")
    ev = Evaluator(graph, measure="device", interpret=True, n_input_sets=1, repeats=2, target_ms=1.0)
    (ref,) = ev._reference(dot)(x, w)
    np.testing.assert_allclose(ref, x @ w.T, rtol=1e-5)
    assert ev.handle(XlaRequest(dot.node_ids)).status is TrialStatus.OK
    cfg = {"backend": "triton", "block_m": 32, "block_n": 32, "block_k": 32, "group_m": 4, "num_warps": 4, "num_stages": 2}
    res = ev.handle(TrialRequest(dot.node_ids, "matmul", cfg))
    assert res.status is TrialStatus.OK, res.error
    assert res.max_error is not None and res.max_error < 1e-4
    # where the trial's seconds went, each part of it (the trial loop adds them up: `trial_parts`)
    assert set(res.seconds) == {"build", "build_lower", "build_compile", "check", "alone", "time"}, res.seconds
    assert all(v > 0 for k, v in res.seconds.items() if k != "alone"), res.seconds
    assert res.seconds["build"] >= res.seconds["build_lower"] + res.seconds["build_compile"] - 2e-3  # its parts (ms rounding)


def _unaligned_head(h, w):
    """A vocabulary head whose product the program reads (the loss) or returns (the logits)."""
    logits = h @ w.T
    return jnp.sum(logits.astype(jnp.float32) ** 2), logits


def test_a_padded_products_slice_is_timed_where_the_program_makes_it():
    """`aligned_dot` timed alone: the product the program's own kernels read stays padded (XLA fuses the slice into
    them), the one it returns is sliced (a copy there too); the checked kernel is sliced either way."""
    from autofuse.kernels import TEMPLATES

    h, w = jnp.ones((2, 48, 32), jnp.bfloat16), jnp.ones((203, 32), jnp.bfloat16)
    for returned in (False, True):
        fn = _unaligned_head if returned else (lambda h, w: _unaligned_head(h, w)[0])
        graph = autofuse.capture(fn, h, w)
        dot = _group(graph, "dot_general")
        alone = TEMPLATES["aligned_dot"].build_alone(dot, {"align": 64}, backend="xla_ops")
        checked = TEMPLATES["aligned_dot"].build(dot, {"align": 64}, backend="xla_ops")
        ins = [h, w.T]
        assert checked(*ins)[0].shape == (2, 48, 203)
        assert alone(*ins)[0].shape == ((2, 48, 203) if returned else (2, 48, 256))
        np.testing.assert_allclose(np.asarray(alone(*ins)[0][..., :203], np.float32), np.asarray(checked(*ins)[0], np.float32))
        ev = Evaluator(graph, measure="device", n_input_sets=1, repeats=2, target_ms=1.0)
        res = ev.handle(TrialRequest(dot.node_ids, "aligned_dot", {"align": 64, "backend": "xla_ops"}))
        assert res.status is TrialStatus.OK and res.median_ms > 0, res.error
    assert TEMPLATES["matmul"].build_alone(dot, {}, backend="triton") is None  # a kernel timed as it runs


def test_gpt2s_lm_head_dots_are_timed_on_the_embedding_itself():
    """GPT-2's training step (small config): the logits' dot and the gradient's dot both read `transpose(wte)`;
    timed alone they read `wte` as the program holds it (the jaxpr's transpose in front of them)."""
    from examples import gpt2

    params, batch = gpt2.small_inputs()
    graph = autofuse.capture(gpt2.grad_step_cudnn, params, batch)
    wte = tuple(params["wte"].shape)
    dots = [n for n in graph.nodes if n.name == "dot_general" and any(
        isinstance(a, int) and a in graph.producer and graph.node_index[graph.producer[a]].name == "transpose"
        and tuple(graph.avals[graph.node_index[graph.producer[a]].inputs[0]].shape) == wte for a in n.inputs)]
    assert len(dots) == 2  # the logits and the hidden states' gradient
    for nd in dots:
        view = in_program(Group.of(graph, [nd.id]))
        assert [n.name for n in view.prologue] == ["transpose"]
        assert wte in [tuple(a.shape) for a in view.input_avals()]


def test_the_programs_constants_are_read_at_their_values_never_random():
    """A group reading the program's constants (JAX's XLA path makes a sliding window's positions as constants of the
    trace) is checked and timed with them at their values: a kernel may rely on them (the grouped-query library
    attention's captured kernel knows its window's blocks), and random positions, which the program never has, once
    failed its every trial on the GPU (relative error 1.06)."""
    from benchmarks.workloads import SMALL, attention_library_gqa_window

    graph = autofuse.capture(attention_library_gqa_window,
                             *[jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in SMALL["attention_library_gqa_window"]])
    (cand,) = [c for c in enumerate_candidates(graph) if c.template == "attention"]
    view = in_program(cand.group)
    assert view.consts and set(view.consts) <= set(graph.consts) and not set(view.inputs) & set(graph.consts)
    ev = Evaluator(graph, measure="device", interpret=True, n_input_sets=1, repeats=2, target_ms=1.0)
    cfg = {"backend": "triton", "block_q": 32, "block_k": 32, "num_warps": 4, "num_stages": 2}
    res = ev.handle(TrialRequest(cand.group.node_ids, "attention", cfg))
    assert res.status is TrialStatus.OK, res.error


def test_whole_programs_are_timed_on_the_callers_integer_and_boolean_inputs(tmp_path):
    """A plan and jax.jit are timed on random floats but the caller's own integers and booleans (lengths, masks, token
    ids decide how much a data-dependent kernel does); without the caller's inputs, all random."""
    import pickle

    def prog(x, n, keep):
        return jnp.where(keep, x * n[:, None], 0.0)

    x, n, keep = jnp.ones((4, 8), jnp.float32), jnp.arange(4, dtype=jnp.int32) + 100, jnp.eye(4, 8, dtype=bool)
    graph = autofuse.capture(prog, x, n, keep)
    path = tmp_path / "examples.pkl"
    path.write_bytes(pickle.dumps([np.asarray(x), np.asarray(n), np.asarray(keep)]))
    ev = Evaluator(graph, measure="device", interpret=True, n_input_sets=2, example_inputs=str(path))
    sets = ev._program_sets([])
    assert len(sets) == 2 and all(np.array_equal(s[1], n) and np.array_equal(s[2], keep) for s in sets)
    assert not np.array_equal(sets[0][0], sets[1][0]) and not np.array_equal(sets[0][0], x)  # floats: random, rotated
    plain = Evaluator(graph, measure="device", interpret=True, n_input_sets=2)._program_sets([])
    assert not np.array_equal(plain[0][1], n)


def test_without_the_callers_inputs_key_lengths_are_timed_at_full_length():
    """A plan whose attention stops at each row's key length, timed on random inputs: the program's lengths input is
    held at the full length (as the group was timed alone), not random small integers."""
    from autofuse.plan import plan_from_choices
    from autofuse.tuning.partition import enumerate_candidates
    from tests.attention_programs import key_lengths_blhd

    S = jax.ShapeDtypeStruct
    graph = autofuse.capture(key_lengths_blhd, *[S((2, 64, 2, 32), jnp.bfloat16)] * 3, S((2,), jnp.int32))
    cand = max((c for c in enumerate_candidates(graph) if c.template == "attention"), key=lambda c: len(c.nodes))
    plan = plan_from_choices(graph, [(cand.group, "attention", {"block_q": 32, "block_k": 32, "num_warps": 4, "num_stages": 2})])
    ev = Evaluator(graph, measure="device", interpret=True, n_input_sets=2)
    assert [np.asarray(s[3]).tolist() for s in ev._program_sets([plan])] == [[64, 64]] * 2
    assert not all(np.asarray(s[3]).tolist() == [64, 64] for s in ev._program_sets([]))
