"""Random inputs and paired timing (autofuse.runner.measure): what every check and every timing stands on."""
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from autofuse.graph import Aval
from autofuse.runner import measure
from autofuse.runner.measure import POOL_SIZE, check, random_inputs, time_kernels, time_pair


def _avals(*specs):
    return [Aval(shape, jnp.dtype(dt)) for shape, dt in specs]


def test_random_inputs_are_fixed_by_seed_and_differ_by_seed_and_position():
    av = _avals(((64, 48), jnp.bfloat16), ((64, 48), jnp.bfloat16), ((5,), jnp.float32))
    a, b, c = random_inputs(av, 1), random_inputs(av, 1), random_inputs(av, 2)
    for x, y in zip(a, b):
        assert np.array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    assert not np.array_equal(np.asarray(a[0], np.float32), np.asarray(c[0], np.float32))
    assert not np.array_equal(np.asarray(a[0], np.float32), np.asarray(a[1], np.float32))  # q and k are not one array
    assert [x.shape for x in a] == [(64, 48), (64, 48), (5,)] and [x.dtype for x in a] == [jnp.bfloat16, jnp.bfloat16, jnp.float32]


def test_random_floats_look_normal_and_never_zero():
    (x,) = random_inputs(_avals(((256, 512), jnp.float32)), 7)
    x = np.asarray(x)
    assert abs(x.mean()) < 0.02 and abs(x.std() - 1) < 0.02 and np.count_nonzero(x) == x.size
    assert len(np.unique(x)) > 0.99 * x.size  # no repeats within the pool's length


def test_arrays_longer_than_the_pool_do_not_repeat_at_power_of_two_strides():
    """A kernel that mixes up batch elements must see different numbers in them: 2^k strides never match the period."""
    (x,) = random_inputs(_avals(((4, 2**19), jnp.float32), ), 3)
    x = np.asarray(x)
    assert x.size > POOL_SIZE
    for i in range(1, 4):
        assert not np.array_equal(x[0], x[i])


def test_integer_and_boolean_inputs_stay_small_and_mixed():
    i32, u8, b = random_inputs(_avals(((4000,), jnp.int32), ((4000,), jnp.uint8), ((4000,), jnp.bool_)), 5)
    i32, u8, b = np.asarray(i32), np.asarray(u8), np.asarray(b)
    assert i32.min() >= -64 and i32.max() < 64 and i32.min() < -50 and i32.max() > 50
    assert u8.min() >= 0 and u8.max() < 64 and u8.dtype == np.uint8
    assert 0.4 < b.mean() < 0.6


def test_unsupported_dtypes_are_refused():
    with pytest.raises(TypeError, match="complex64"):
        random_inputs(_avals(((3,), jnp.complex64)), 0)


def _slow(ms):
    def fn(x):
        time.sleep(ms / 1e3)
        return x
    return fn


def test_time_pair_shortens_to_its_budget_but_keeps_its_minimum():
    sets = [[np.ones(3)] for _ in range(3)]
    _, _, ratio = time_pair(_slow(10), _slow(5), sets, repeats=20, target_ms=1.0, warmup=1, budget_ms=200.0, min_repeats=4)
    assert ratio.repeats == 4  # a pair of 3 + 3 calls is 45 ms: 200 ms allows 3, the minimum is 4
    a, b, ratio = time_pair(_slow(1), _slow(1), sets, repeats=6, target_ms=1.0, warmup=1, budget_ms=10_000.0, min_repeats=4)
    assert ratio.repeats == 6 and a.repeats == 6  # a budget never adds repeats
    _, _, ratio = time_pair(_slow(40), _slow(20), sets, repeats=5, target_ms=1.0, warmup=1)
    assert ratio.repeats == 5  # without a budget: as asked
    assert 0.3 < ratio.median_ms < 0.7  # (sleeps long enough that a loaded machine's wake-up delay cannot reach 0.7)


def test_time_kernels_reads_the_devices_kernels_not_the_hosts_clock(monkeypatch):
    """On a GPU a group is timed by its kernels' durations in a trace (a call that takes the host 2 ms to dispatch
    and the device 0.004 ms times 0.004), batch by batch over the calls rotating the input sets; where the lean trace
    (no host tracer) holds nothing, the default one is tried; where the trace's kernels do not come as many per call
    (or there is none), or without a GPU, the host's clock is what is left."""
    from autofuse.runner.profile import KernelEvent

    sets = [[np.ones(3)] for _ in range(3)]
    calls = {"n": 0}

    def fn(x):  # 2 ms of the host's time a call
        calls["n"] += 1
        time.sleep(0.002)
        return x

    tried, per_call = [], {"kernels": 2, "lean_empty": False}

    def traced(run, options):
        tried.append(options)
        before = calls["n"]
        run()
        n = calls["n"] - before
        if options is not None and per_call["lean_empty"]:
            return []
        out, t = [], 0.0
        for i in range(n * 2):  # a 1 us kernel and a 3 us one per call
            dur = 1000.0 if i % 2 == 0 else 3000.0
            out.append(KernelEvent("k", t, dur, {}))
            t += 10_000.0
        if per_call["kernels"] != 2:
            out = out[:-1]  # not as many every call
        return out

    monkeypatch.setattr(measure, "traced_events", traced)
    monkeypatch.setattr(measure.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(measure, "_TRACE_OPTIONS", [])
    t = time_kernels(fn, sets, repeats=4, target_ms=20.0, warmup=1)
    assert t.median_ms == pytest.approx(0.004) and t.min_ms == pytest.approx(0.004) and t.repeats == 4
    assert t.calls_per_sync >= 3 and tried[0] is not None  # the lean options first, and kept
    tried.clear()
    assert time_kernels(fn, sets, repeats=3, target_ms=20.0, warmup=0).median_ms == pytest.approx(0.004)
    assert len(tried) == 1 and tried[0] is not None

    monkeypatch.setattr(measure, "_TRACE_OPTIONS", [])
    per_call["lean_empty"] = True
    tried.clear()
    assert time_kernels(fn, sets, repeats=3, target_ms=20.0, warmup=0).median_ms == pytest.approx(0.004)
    assert tried[0] is not None and tried[1] is None and measure._TRACE_OPTIONS == [None]

    per_call["kernels"] = 3
    host = time_kernels(fn, sets, repeats=3, target_ms=20.0, warmup=0)
    assert host.median_ms >= 2.0  # the host's clock: at least the sleep
    monkeypatch.setattr(measure.jax, "default_backend", lambda: "cpu")
    tried.clear()
    assert time_kernels(fn, sets, repeats=3, target_ms=20.0, warmup=0).median_ms >= 2.0 and tried == []


def test_rounding_spread_is_the_largest_move_over_the_seeds():
    """jax.jit's rounding spread, which bounds a whole plan's error, is the largest move of each output under the
    seeds' nudges (one nudge is one sample: GPT-2 medium's training step moved by 0.02 under seed 1's while its
    right plan was 0.043 from jax.jit at seed 2); with given inputs, each seed nudges them differently."""
    import jax

    from autofuse.runner.program_check import rounding_sensitivity, rounding_spread

    av = _avals(((64, 256), jnp.bfloat16), ((256, 256), jnp.bfloat16))

    def chain(x, w):  # a few bf16 layers: ill-conditioned enough that the samples differ
        for _ in range(4):
            x = jnp.tanh((x @ w) * 0.3).astype(jnp.bfloat16)
        return x, jnp.sum(x.astype(jnp.float32), axis=0)

    ref = jax.jit(chain)
    per_seed = [rounding_sensitivity(ref, av, s) for s in (1, 2, 3)]
    assert len({round(p[0], 6) for p in per_seed}) > 1  # the samples differ, so the max is not any one of them by chance
    assert rounding_spread(ref, av, (1, 2, 3)) == [max(e) for e in zip(*per_seed)]
    given = random_inputs(av, 9)
    on_given = [rounding_sensitivity(ref, av, s, args=given) for s in (1, 2)]
    assert rounding_spread(ref, av, (1, 2), args=given) == [max(e) for e in zip(*on_given)]


def test_a_kernel_as_accurate_as_xla_passes_where_rounding_is_amplified():
    """softmax(h @ w) in bfloat16 with K = 1024 on N(0, 1) inputs: logits of ~30 one rounding step apart by up to
    0.25, so a right result rounded otherwise (here: float32 throughout) misses the dtype's bound against XLA's;
    judged by its distance from float32 against XLA's own, it passes, and a wrong one (doubled) still fails."""
    import autofuse
    from autofuse.graph import Group
    from autofuse.runner.measure import check_as_accurate, widened

    def f(h, w):
        return jax.nn.softmax(h @ w, axis=-1)

    graph = autofuse.capture(f, jnp.zeros((64, 1024), jnp.bfloat16), jnp.zeros((1024, 256), jnp.bfloat16))
    group = Group.of(graph, [n.id for n in graph.nodes])
    avals, tols = group.input_avals(), [0.02]
    xla = jax.jit(lambda *a: group.evaluate(a))
    wide = widened(group)
    exact = lambda *a: [o.astype(jnp.bfloat16) for o in wide(*a)]  # noqa: E731
    assert not check(exact, xla, avals, (1,), tols).ok
    assert check_as_accurate(exact, xla, wide, avals, (1, 2), tols).ok
    doubled = lambda *a: [2 * o for o in xla(*a)]  # noqa: E731
    assert not check_as_accurate(doubled, xla, wide, avals, (1,), tols).ok


def test_a_float32_program_is_judged_against_float64():
    """A float32 program has no wider float32 form: its reference is float64. A sum that cancels (2^16 terms of
    x + 6, less 6 · 2^16) is ~4.6e-5 from the exact sum in XLA's own order, over float32's bound of 2e-5: the exact
    sum rounded to float32 (a kernel that sums more carefully) misses that bound against XLA, yet passes, being no
    further from float64 than XLA; XLA's sum 1e-3 too large still fails."""
    import autofuse
    from autofuse.graph import Group
    from autofuse.runner.measure import check_as_accurate, widened

    def f(x):
        return jnp.sum(x + 6.0, axis=-1) - 6.0 * 65536

    graph = autofuse.capture(f, jnp.zeros((8, 65536), jnp.float32))
    group = Group.of(graph, [n.id for n in graph.nodes])
    avals, tols = group.input_avals(), [2e-5]
    xla = jax.jit(lambda *a: group.evaluate(a))
    wide = widened(group)
    exact = lambda x: [jnp.asarray((np.sum(np.asarray(x, np.float64) + 6.0, -1) - 6.0 * 65536).astype(np.float32))]  # noqa: E731
    assert not check(exact, xla, avals, (1, 2), tols).ok
    assert check_as_accurate(exact, xla, wide, avals, (1, 2), tols).ok
    biased = jax.jit(lambda x: [o * (1 + 1e-3) for o in xla(x)])
    assert not check_as_accurate(biased, xla, wide, avals, (1,), tols).ok


def test_a_float32_dot_is_checked_at_the_programs_own_precision(monkeypatch):
    """On a GPU XLA runs a float32 dot at default precision as TF32 (H100: 2.9e-4 from float64, 5.7e-7 at HIGHEST):
    a float32 output computed through one is held to TF32's bound (float16's: the same 10-bit mantissa), not to
    float32's 2e-5, which XLA itself misses. A dot of explicit precision, another backend (exact float32 dots), or a
    bfloat16 dot keep their dtypes' bounds."""
    import jax
    import jax.numpy as jnp

    from autofuse.graph import capture
    from autofuse.runner.measure import cone_tolerances, tolerance

    def scores(q, k, w):
        return jnp.einsum("qd,kd->qk", q, k), jnp.dot(q, w, precision=jax.lax.Precision.HIGHEST), jnp.tanh(q)

    f32 = jax.ShapeDtypeStruct((64, 32), jnp.float32)
    g = capture(scores, f32, f32, jax.ShapeDtypeStruct((32, 32), jnp.float32))
    ids = [n.id for n in g.nodes]
    assert cone_tolerances(g, ids, g.outputs) == [tolerance(jnp.float32)] * 3  # the CPU: XLA's float32 dots are exact
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert cone_tolerances(g, ids, g.outputs) == [tolerance(jnp.float16), tolerance(jnp.float32), tolerance(jnp.float32)]
    bf = jax.ShapeDtypeStruct((64, 32), jnp.bfloat16)
    gb = capture(lambda q, k: jnp.einsum("qd,kd->qk", q, k, preferred_element_type=jnp.float32), bf, bf)
    assert cone_tolerances(gb, [n.id for n in gb.nodes], gb.outputs) == [tolerance(jnp.bfloat16)]
