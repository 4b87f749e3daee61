"""Correctness checks against the XLA reference (and, later, device timing).

A candidate is checked on fresh random inputs (several seeds, never zeros)
against plain `jax.jit` of the same computation. Errors are relative error
norms in float64 with dtype-aware tolerances; NaN and infinity positions
must match exactly; integer and boolean results must be equal.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..graph import Aval, Graph, Group, Lit, Node, bind_node, read_atom
from ..ops import IDENTITY_OPS, OpClass, dot_precision, op_class, rounded_dtype
from .profile import traced_events
from .protocol import Timing

# Relative error-norm tolerances: ‖out − ref‖ / ‖ref‖.
TOLERANCE = {
    np.dtype("float64"): 1e-9,
    np.dtype("float32"): 2e-5,
    np.dtype(jnp.float16): 4e-3,
    np.dtype(jnp.bfloat16): 2e-2,
}


def tolerance(dtype: Any) -> float:
    return TOLERANCE.get(np.dtype(dtype), 0.0)


def dot_tolerance(dot: Node, graph: Any) -> float:
    """The bound a float32 dot carries at the program's own precision: one at default precision (no `precision=` in
    the program, nor a `jax.default_matmul_precision` around it, which the trace records as one) XLA runs as TF32 on
    a GPU (measured on an H100, jax 0.11.2: 2.9e-4 from float64, against 5.7e-7 at `precision=HIGHEST`;
    `benchmarks/precision_probe.py`), a 10-bit mantissa like float16's, and exactly elsewhere. A dot of another
    precision (HIGHEST: the `matmul` template's Triton kernel runs it as three-pass TF32) or of other operands adds
    nothing beyond its dtypes."""
    if dot.name != "dot_general" or dot_precision(dot) != "default" or jax.default_backend() != "gpu":
        return 0.0
    if any(np.dtype(graph.aval(a).dtype) != np.dtype(jnp.float32) for a in dot.inputs):
        return 0.0
    return tolerance(jnp.float16)


def cone_tolerances(graph: Any, node_ids: Sequence[int], outputs: Sequence[Any]) -> list[float]:
    """Per output, the tolerance of the least precise float type it depends on inside `node_ids`, and of the least
    precise float32 dot there at the program's own precision (`dot_tolerance`).

    A float32 result computed from bfloat16 values carries bfloat16 error, and one computed by a TF32 dot carries
    TF32's; XLA and a fused kernel may round such intermediates differently.
    """
    members = set(node_ids)
    prod = graph.producer
    out = []
    for v in outputs:
        if not isinstance(v, int):
            out.append(tolerance(v.aval.dtype))
            continue
        tol, seen, todo = tolerance(graph.avals[v].dtype), set(), [v]
        while todo:
            x = todo.pop()
            if x in seen:
                continue
            seen.add(x)
            tol = max(tol, tolerance(graph.avals[x].dtype)) if np.issubdtype(graph.avals[x].dtype, np.inexact) or graph.avals[x].dtype == np.dtype(jnp.bfloat16) else tol
            nid = prod.get(x)
            if nid is not None and nid in members:
                tol = max(tol, dot_tolerance(graph.node_index[nid], graph))
                todo.extend(a for a in graph.node_index[nid].inputs if isinstance(a, int))
        out.append(tol)
    return out


POOL_SIZE = 1_000_003  # a prime: a view's period never divides a power-of-two stride of the shapes it fills


def random_inputs(avals: Sequence[Aval], seed: int) -> list[jax.Array]:
    """Fresh random inputs made on the device: normal floats, small integers, random booleans (never zeros).

    Each input is a view of one pool of random numbers per process, x[i] = pool[(a * i + b) mod POOL_SIZE] with
    (a, b) drawn from (seed, position): a model's hundreds of weights and a job's hundreds of candidates then
    compile one small gather per distinct shape (tens of ms on a GPU) instead of a random-number generator per
    shape (threefry: several times that, seconds of every job's start and of every whole-program check).
    Arrays longer than the prime pool repeat it with that period, which no indexing bug's stride matches."""
    out = []
    for i, a in enumerate(avals):
        d = np.dtype(a.dtype)
        if not (np.issubdtype(d, np.floating) or d == np.dtype(jnp.bfloat16) or d == np.bool_ or np.issubdtype(d, np.integer)):
            raise TypeError(f"cannot make random inputs of dtype {d}")
        out.append(pool_view(tuple(a.shape), d, seed, i))
    return out


def pool_view(shape: tuple[int, ...], dtype: Any, seed: int, position: int, kind: str = "value") -> jax.Array:
    """One array of `random_inputs` (`kind` "value"), or a random +-1 of the same shape in float32 ("sign")."""
    normal, uniform = _pools(jax.devices()[0])
    rng = np.random.default_rng([seed & 0xFFFFFFFF, position, kind == "sign"])
    step, start = int(rng.integers(1, 2048)), int(rng.integers(0, POOL_SIZE))
    if not viewed(shape):  # past int32 indices: the generator itself
        key = jax.random.fold_in(jax.random.PRNGKey(seed), position)
        if kind == "sign":
            return jax.random.rademacher(key, shape, jnp.float32)
        return _generated(key, shape, np.dtype(dtype))
    return _viewer(shape, _dtype_name(dtype), kind)(normal, uniform, jnp.int32(step), jnp.int32(start))


def viewed(shape: tuple[int, ...]) -> bool:
    """Whether `pool_view` makes an array of this shape as a view of the pool (not with the generator)."""
    return int(np.prod(shape, dtype=np.int64)) < 2**31 - 2**24


def compile_view(shape: tuple[int, ...], dtype: Any, kind: str = "value") -> None:
    """Compile, without running it, the view `pool_view` runs for this shape, dtype and kind (a shape `viewed`)."""
    normal, uniform = _pools(jax.devices()[0])
    _viewer(tuple(shape), _dtype_name(dtype), kind).lower(normal, uniform, jnp.int32(1), jnp.int32(0)).compile()


def compile_beside(inputs: Sequence[Aval], outputs: Sequence[Aval], done: set[tuple]) -> list[Callable[[], int]]:
    """What compiles, without running them, the small programs that timing and checking groups run besides the
    groups themselves: the random view (`pool_view`) of each input shape and the comparison (`compare`) of each
    output shape, those not in `done` (added to it: each once per process). Each returns how many it compiled. One
    by one between the GPU's timings they were 4-5 s of GPT-2 medium's cold job on an H200 (views in its XLA timings,
    comparisons of 0.1-0.35 s in its first trials' checks); beside a batch they made its cold first batch ~2 s longer
    (results/tuning_h200_run28.md). The pool they view is made here, once, not by each thread."""
    out: list[Callable[[], int]] = []
    views = [k for k in dict.fromkeys(("view", tuple(a.shape), np.dtype(a.dtype)) for a in inputs) if viewed(k[1]) and k not in done]
    compares = [k for k in dict.fromkeys(("compare", tuple(a.shape), np.dtype(a.dtype)) for a in outputs) if k not in done]
    if views:
        _pools(jax.devices()[0])
    for _, sh, d in views:
        out.append(lambda sh=sh, d=d: compile_view(sh, d) or 1)
    for _, sh, d in compares:
        out.append(lambda sh=sh, d=d: compile_compare(sh, d))
    done.update(views + compares)
    return out


def _dtype_name(dtype: Any) -> str:
    return np.dtype(dtype).str if np.dtype(dtype) != np.dtype(jnp.bfloat16) else "bfloat16"


@functools.lru_cache(maxsize=4)
def _pools(device: Any) -> tuple[jax.Array, jax.Array]:
    key = jax.device_put(jax.random.PRNGKey(0), device)
    return (jax.random.normal(key, (POOL_SIZE,), jnp.float32),
            jax.random.uniform(jax.random.fold_in(key, 1), (POOL_SIZE,), jnp.float32, minval=1e-7, maxval=1.0))


@functools.lru_cache(maxsize=1024)
def _viewer(shape: tuple[int, ...], dtype_name: str, kind: str) -> Callable:
    d = np.dtype(jnp.bfloat16) if dtype_name == "bfloat16" else np.dtype(dtype_name)
    n = int(np.prod(shape, dtype=np.int64))

    def view(normal: jax.Array, uniform: jax.Array, step: jax.Array, start: jax.Array) -> jax.Array:
        i = jnp.arange(n, dtype=jnp.int32) % POOL_SIZE
        idx = ((step * i) + start) % POOL_SIZE  # step < 2048, i < POOL_SIZE: no int32 overflow
        if kind == "sign":
            return jnp.where(uniform[idx] < 0.5, -1.0, 1.0).astype(jnp.float32).reshape(shape)
        return _shaped(normal[idx], uniform[idx], d).reshape(shape)

    return jax.jit(view)


def _shaped(normal: jax.Array, uniform: jax.Array, d: np.dtype) -> jax.Array:
    """Normal floats, booleans, or integers uniform in [-hi, hi) (unsigned: [0, hi)), hi at most 64."""
    if np.issubdtype(d, np.floating) or d == np.dtype(jnp.bfloat16):
        return normal.astype(d)
    if d == np.bool_:
        return uniform < 0.5
    hi = int(min(np.iinfo(d).max, 64))
    lo = 0 if np.issubdtype(d, np.unsignedinteger) else -hi
    return jnp.clip(jnp.floor(uniform * (hi - lo)).astype(jnp.int32) + lo, lo, hi - 1).astype(d)


def _generated(key: jax.Array, shape: tuple[int, ...], d: np.dtype) -> jax.Array:
    return _shaped(jax.random.normal(key, shape, jnp.float32), jax.random.uniform(jax.random.fold_in(key, 1), shape, jnp.float32), d)


@dataclass
class CheckResult:
    ok: bool
    max_error: float = 0.0  # worst relative error norm over outputs and seeds
    tolerance: dict = field(default_factory=dict)  # dtype -> tolerance used
    reason: str = ""

    def to_dict(self) -> dict:
        return {"ok": self.ok, "max_error": self.max_error, "tolerance": self.tolerance, "reason": self.reason}


@jax.jit
def _float_stats(o: jax.Array, r: jax.Array) -> tuple:
    """On the device: NaN/inf position mismatches and the error and reference norms over finite entries."""
    o, r = o.astype(jnp.float32), r.astype(jnp.float32)
    nan_bad = jnp.sum(jnp.isnan(o) != jnp.isnan(r))
    inf_bad = jnp.sum(jnp.isinf(o) != jnp.isinf(r)) + jnp.sum(jnp.isinf(r) & (o != r))
    fin = jnp.isfinite(r) & jnp.isfinite(o)
    d = jnp.where(fin, o - r, 0.0)
    rr = jnp.where(fin, r, 0.0)
    scale = jnp.maximum(jnp.max(jnp.abs(rr)), 1e-30)  # scaled sums of squares cannot overflow
    return nan_bad, inf_bad, jnp.sqrt(jnp.sum(jnp.square(d / scale))) * scale, jnp.sqrt(jnp.sum(jnp.square(rr / scale))) * scale


#: `_float_stats` compiled per (shape, dtype of the output, dtype of the reference), run as an executable: a jitted call
#: compiles once per placement of its arguments (a kernel's output is committed to its device, jax.jit's compiled
#: program's is not), so the comparisons compiled ahead (`compile_compare`) were compiled again by the checks.
_STATS: dict[tuple, Any] = {}


def _stats_of(shape: tuple[int, ...], out_dtype: Any, ref_dtype: Any) -> Any:
    key = (tuple(shape), np.dtype(out_dtype), np.dtype(ref_dtype))
    if key not in _STATS:
        dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        _STATS[key] = _float_stats.lower(jax.ShapeDtypeStruct(key[0], key[1], sharding=dev),
                                         jax.ShapeDtypeStruct(key[0], key[2], sharding=dev)).compile()
    return _STATS[key]


def compile_compare(shape: tuple[int, ...], dtype: Any) -> int:
    """Compile, without running it, what `compare` runs on the device for two floating outputs of this shape and
    dtype (none for others); returns how many were compiled."""
    d = np.dtype(dtype)
    if not (np.issubdtype(d, np.floating) or d == np.dtype(jnp.bfloat16)):
        return 0
    _stats_of(tuple(shape), d, d)
    return 1


def compare(out: Any, ref: Any, tol: float | None = None) -> tuple[bool, float, str]:
    """One output against its reference (`tol`: relative error-norm bound; default by dtype)."""
    o, r = jnp.asarray(out), jnp.asarray(ref)
    dt = np.dtype(r.dtype)
    if o.shape != r.shape:
        return False, float("inf"), f"shape {o.shape} != {r.shape}"
    if not (np.issubdtype(dt, np.floating) or dt == np.dtype(jnp.bfloat16)):
        bad = int(jnp.sum(o != r))
        return bad == 0, float(bad > 0), f"{bad} integer/boolean elements differ" if bad else ""
    try:
        stats = _stats_of(o.shape, o.dtype, r.dtype)(o, r)
    except ValueError:  # arrays on another device than the executable's
        stats = _float_stats(o, r)
    nan_bad, inf_bad, diff, scale = (float(x) for x in stats)
    if nan_bad:
        return False, float("inf"), "NaN positions differ"
    if inf_bad:
        return False, float("inf"), "infinity positions differ"
    err = diff / scale if scale > 0 else diff
    tol = tolerance(dt) if tol is None else tol
    return err <= tol, err, "" if err <= tol else f"relative error {err:.3g} > {tol:.3g} ({dt.name})"


def check(candidate: Callable[..., Sequence[Any]], reference: Callable[..., Sequence[Any]], avals: Sequence[Aval], seeds: Sequence[int] = (1, 2, 3),
          tolerances: Sequence[float | None] | None = None, inputs: Sequence[Any] | None = None) -> CheckResult:
    """Run candidate and reference on fresh random inputs per seed (or on the given `inputs` instead) and
    compare every output.

    `tolerances` gives a bound per output (see `cone_tolerances`), None for an output not compared here (another
    check decides it); default: by each output's dtype.
    """
    worst, tols = 0.0, {}
    for seed in seeds if inputs is None else ("given",):
        args = random_inputs(avals, seed) if inputs is None else inputs
        try:
            outs = jax.block_until_ready(candidate(*args))
        except Exception as e:  # a kernel that fails to build or run fails the check
            return CheckResult(False, float("inf"), tols, f"{type(e).__name__}: {e}")
        refs = jax.block_until_ready(reference(*args))
        if len(outs) != len(refs):
            return CheckResult(False, float("inf"), tols, f"{len(outs)} outputs, expected {len(refs)}")
        for k, (o, r) in enumerate(zip(outs, refs)):
            tol = tolerances[k] if tolerances is not None else tolerance(jnp.asarray(r).dtype)
            if tol is None:
                continue
            tols[f"output{k}"] = tol
            ok, err, why = compare(o, r, tol)
            worst = max(worst, err)
            if not ok:
                return CheckResult(False, worst, tols, f"output {k}, {'seed ' + str(seed) if inputs is None else 'given inputs'}: {why}")
    return CheckResult(True, worst, tols)


ACCURACY_SLACK = 1.25  # a kernel failing the dtype bound passes if it is no further from the wider result (`widened`) than this times XLA's own


_LOW_FLOATS = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


#: Opaque primitives that move values without arithmetic: `widened` runs them on float32 values as they are.
_MOVES_DATA = IDENTITY_OPS | {"transpose", "slice", "concatenate", "pad", "rev", "dynamic_slice", "dynamic_update_slice"}


def widened(source: Group | Graph) -> Callable[..., list]:
    """A group (or a whole program) run by plain JAX with every value one float wider: bfloat16/float16 values
    (inputs, constants, conversions, dot results) in float32, and in a program with no such value, float32 ones in
    float64 (its results rounded back to float32). The reference both XLA's result and a kernel's are
    measured against by `check_as_accurate`: a float32 program held to float32 itself is held to XLA's own order of
    sums, where a kernel that sums in another order is as right (a flash attention's backward in a checkpointed
    step: 4.5e-5 from XLA against 2e-5). An opaque node (a cuDNN attention call, a loop) runs at its own dtypes, its
    results widened: it has no wider form, and XLA and a plan compute it alike; one that only moves values (a
    transpose, a `jax.checkpoint` barrier: `_MOVES_DATA`) runs on the wide values, as does a residual's rounding to
    its own dtype."""
    avals = source.graph.avals if isinstance(source, Group) else source.avals
    nodes_of = source.nodes
    floats = {np.dtype(a.dtype) for a in avals.values()} | {np.dtype(a.aval.dtype) for nd in nodes_of for a in nd.inputs if isinstance(a, Lit)}
    to64 = not (floats & set(_LOW_FLOATS)) and np.dtype(np.float32) in floats
    wider = {np.dtype(np.float32): np.dtype(np.float64)} if to64 else {d: np.dtype(jnp.float32) for d in _LOW_FLOATS}
    widest = (11, 52) if to64 else (8, 23)  # reduce_precision's (exponent, mantissa) bits of the wide dtype

    def wide(a: Any) -> Any:
        return Lit(np.asarray(a.value, wider[np.dtype(a.aval.dtype)]), Aval(a.aval.shape, wider[np.dtype(a.aval.dtype)])) \
            if isinstance(a, Lit) and np.dtype(a.aval.dtype) in wider else a

    def up(x: Any) -> Any:
        return x.astype(wider[np.dtype(x.dtype)]) if np.dtype(x.dtype) in wider else x

    nodes, kept = [], {}
    for nd in nodes_of:
        if op_class(nd.name) is OpClass.OPAQUE and nd.name not in _MOVES_DATA:
            kept[nd.id] = [a.aval.dtype if isinstance(a, Lit) else avals[a].dtype for a in nd.inputs]
            nodes.append(nd)
            continue
        params = dict(nd.params)
        for key in ("new_dtype", "preferred_element_type", "dtype"):
            if params.get(key) is not None and np.dtype(params[key]) in wider:
                params[key] = wider[np.dtype(params[key])]
        if nd.name == "reduce_precision" and (to := rounded_dtype(params)) is not None and np.dtype(to) in wider:
            params.update(exponent_bits=widest[0], mantissa_bits=widest[1])  # a residual rounded to its own dtype: the wide one's now
        nodes.append(Node(nd.id, nd.primitive, params, tuple(wide(a) for a in nd.inputs), nd.outputs))
    consts = getattr(source, "consts", {})

    def run(*xs):
        env = {v: up(jnp.asarray(x)) for v, x in consts.items()}
        env.update((v, up(x)) for v, x in zip(source.inputs, xs))
        for nd in nodes:
            ins = [read_atom(env, a) for a in nd.inputs]
            if nd.id in kept:
                ins = [x.astype(d) if np.dtype(x.dtype) != np.dtype(d) else x for x, d in zip(ins, kept[nd.id])]
                env.update(zip(nd.outputs, map(up, bind_node(nd, ins))))
            else:
                env.update(zip(nd.outputs, bind_node(nd, ins)))
        return [read_atom(env, a) for a in source.outputs]

    compiled = jax.jit(run)
    if not to64:
        return compiled

    def run64(*xs):
        """Traced and run under 64-bit types (so called outside any trace); the results rounded back to float32."""
        with jax.enable_x64(True):
            return [o.astype(jnp.float32) if np.dtype(o.dtype) == np.float64 else o for o in compiled(*xs)]

    return run64


def check_as_accurate(candidate: Callable, reference: Callable, wide: Callable, avals: Sequence[Aval], seeds: Sequence[int],
                      tolerances: Sequence[float | None], inputs: Sequence[Any] | None = None) -> CheckResult:
    """The second check of a kernel (or a whole plan) that failed its bound against XLA (`check`): per output and
    seed (or on the given `inputs`), its distance from the wider result (`widened`) may be at most ACCURACY_SLACK
    times XLA's own plus the bound. Where a computation amplifies rounding (a bf16 product of random N(0, 1) operands
    over K = 1024 has logits of ~30, one rounding step apart by 0.125 to 0.5, and a softmax of them moves by ~10%
    with any one of them), two correct computations differ by more than the dtype's bound; a wrong one is still far
    from the wider one. A wider result that cannot be had (out of memory) decides nothing: the check fails."""
    worst = 0.0
    for seed in seeds if inputs is None else ("given",):
        args = random_inputs(avals, seed) if inputs is None else inputs
        try:
            outs = jax.block_until_ready(candidate(*args))
        except Exception as e:
            return CheckResult(False, float("inf"), {}, f"{type(e).__name__}: {e}")
        try:
            exact = jax.block_until_ready(wide(*args))
        except Exception as e:  # noqa: BLE001 - e.g. the float32 program does not fit beside the others
            return CheckResult(False, float("inf"), {}, f"no wider result to compare with ({type(e).__name__}: {str(e)[:200]})")
        where = f"seed {seed}" if inputs is None else "given inputs"
        for k, (o, r, w) in enumerate(zip(outs, reference(*args), exact)):
            if tolerances[k] is None or not (np.issubdtype(np.dtype(w.dtype), np.floating)):
                continue
            _, mine, why = compare(o, w, 0.0)
            _, xla, _ = compare(r, w, 0.0)
            worst = max(worst, mine)
            if not (mine <= ACCURACY_SLACK * xla + tolerances[k]):
                return CheckResult(False, worst, {}, f"output {k}, {where}: {mine:.3g} from the program run wider, XLA's result "
                                   f"{xla:.3g} ({why or 'a mismatch'})")
        del exact
    return CheckResult(True, worst, {}, "")


# ---------------------------------------------------------------------------
# Device timing.
def time_fn(fn: Callable, arg_sets: Sequence[Sequence[Any]], *, repeats: int = 15, target_ms: float = 25.0, warmup: int = 2) -> Timing:
    """Median time of one call: many back-to-back calls per sync, rotating input sets.

    `fn` must already be compiled or compile on its first call (which is not
    timed). Each repeat issues enough calls to last about `target_ms`, so host
    dispatch overlaps device work; inputs rotate through `arg_sets` so caches
    do not flatter the result (use ≥ 3 sets larger than L2 together).
    """
    calls = max(len(arg_sets), min(2000, int(target_ms / max(_one_call_ms(fn, arg_sets), 1e-3))))
    samples = [_batch(fn, arg_sets, calls) for _ in range(warmup + repeats)][warmup:]
    return _stats(np.array(samples), calls)


#: The most calls of one batch a device trace holds (`time_kernels`): its host no longer has to keep ahead of the
#: device, and a trace of 15 batches of 2000 calls of a tiny kernel takes longer to read than to take.
MAX_TRACED_CALLS = 200
_TRACE_OPTIONS: list = []  # the trace options found to keep the GPU's kernels (`time_kernels`), once found


def time_kernels(fn: Callable, arg_sets: Sequence[Sequence[Any]], *, repeats: int = 15, target_ms: float = 25.0, warmup: int = 2) -> Timing:
    """Median device time of one call: the durations of the kernels it runs, from a profiler trace of `repeats`
    batches of back-to-back calls rotating `arg_sets`; the host's clock (`time_fn`) without a GPU, or where the
    trace holds no kernel or not as many every call.

    Why not the host's clock: a kernel shorter than its call's dispatch is timed as the dispatch. On an H200 a
    layer norm's forward (0.037 ms on the device) timed 0.049 ms by the host's clock on an idle host and 0.123 on
    one as busy as a tuning job's (XLA's version of it: 0.062, 0.067, 0.144), so a job priced every small group by
    how busy its host was (results/device_timing_h200.md). Inside the program no host dispatches a group: its
    kernels run back to back with the rest."""
    if jax.default_backend() != "gpu":
        return time_fn(fn, arg_sets, repeats=repeats, target_ms=target_ms, warmup=warmup)
    calls = max(len(arg_sets), min(MAX_TRACED_CALLS, int(target_ms / max(_one_call_ms(fn, arg_sets), 1e-3))))
    for _ in range(warmup):
        _batch(fn, arg_sets, calls)
    events = []
    try:
        for options in _TRACE_OPTIONS[:1] or _trace_options():
            events = traced_events(lambda: [_batch(fn, arg_sets, calls) for _ in range(repeats)], options)
            if events:
                _TRACE_OPTIONS[:] = [options]
                break
    except Exception:  # noqa: BLE001 - a trace already running (a user's profile of the job): the host's clock
        events = []
    total = repeats * calls
    if not events or len(events) % total:
        return time_fn(fn, arg_sets, repeats=repeats, target_ms=target_ms, warmup=warmup)
    ns = np.array([e.duration_ns for e in sorted(events, key=lambda e: e.start_ns)], dtype=np.float64)
    return _stats(ns.reshape(repeats, -1).sum(axis=1) / calls / 1e6, calls)


def _trace_options() -> list[Any]:
    """The trace's options to try: without the host's and Python's tracers (less of a trace's overhead), then the
    defaults."""
    lean = jax.profiler.ProfileOptions()
    lean.host_tracer_level = 0
    lean.python_tracer_level = 0
    return [lean, None]


def _one_call_ms(fn: Callable, arg_sets: Sequence[Sequence[Any]]) -> float:
    """One call of `fn` on each of `arg_sets`, each waited for, after one untimed (its compile): ms per call, the
    measure of how many calls a batch holds."""
    jax.block_until_ready(fn(*arg_sets[0]))
    t0 = time.perf_counter()
    for args in arg_sets:
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - t0) / len(arg_sets) * 1e3


def _batch(fn: Callable, arg_sets: Sequence[Sequence[Any]], calls: int) -> float:
    """`calls` back-to-back calls rotating `arg_sets`, one sync: ms per call by the host's clock."""
    t0 = time.perf_counter()
    out = None
    for i in range(calls):
        out = fn(*arg_sets[i % len(arg_sets)])
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / calls * 1e3


def time_pair(fn_a: Callable, fn_b: Callable, arg_sets: Sequence[Sequence[Any]], *, repeats: int = 15, target_ms: float = 25.0,
              warmup: int = 2, budget_ms: float | None = None, min_repeats: int = 8) -> tuple[Timing, Timing, Timing]:
    """Two functions timed in alternation (a, b, a, b, ...), each repeat as in `time_fn`: their timings and that of
    the ratio b / a per repeat.

    A GPU's clock drifts with its power and temperature over a run (an H100 moved 10% between 25 ms batches of one
    GEMM); timed back to back, each pair sees the same clock, so the ratio's spread is the comparison's noise.
    `budget_ms`: fewer repeats (no fewer than `min_repeats`) where `repeats` pairs would take longer: a whole
    model's pair (GPT-2 medium: 3 calls of 86 ms and 3 of 30 ms) is long enough that 8 already span seconds.
    """
    calls, pair_ms = [], 0.0
    for fn in (fn_a, fn_b):
        one = _one_call_ms(fn, arg_sets)
        calls.append(max(len(arg_sets), min(2000, int(target_ms / max(one, 1e-3)))))
        pair_ms += calls[-1] * one
    if budget_ms is not None:
        repeats = max(min(repeats, min_repeats), min(repeats, int(budget_ms / max(pair_ms, 1e-3)) - warmup))

    a, b = [], []
    for r in range(warmup + repeats):
        ta, tb = _batch(fn_a, arg_sets, calls[0]), _batch(fn_b, arg_sets, calls[1])
        if r >= warmup:
            a.append(ta)
            b.append(tb)
    a, b = np.array(a), np.array(b)
    return _stats(a, calls[0]), _stats(b, calls[1]), _stats(b / a, 1)


def _stats(samples: np.ndarray, calls: int) -> Timing:
    return Timing(float(np.median(samples)), float(samples.min()), float(samples.max()), float(np.percentile(samples, 25)),
                  float(np.percentile(samples, 75)), calls, len(samples))
