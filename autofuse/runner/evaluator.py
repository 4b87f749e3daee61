"""One XLA timing, one trial, one plan validation: build -> check -> time, for one program.

Runs inside the trial process (`process.py`) or inline. `measure="device"`
compiles and times on the accelerator; `measure="model"` builds the kernel,
runs the CUDA lowering guard where there is no GPU, and costs it with the
roofline model (results marked `modelled`).
"""
from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .. import costmodel
from ..device import device_label
from ..graph import Graph, Group
from ..kernels import TEMPLATES
from ..plan import Plan, build_group, default_interpret, executor
from ..status import TrialStatus
from .measure import CheckResult, check, compare, cone_tolerances, pool_view, random_inputs, time_fn, time_pair
from .protocol import (CompileRequest, CompileResult, InputsCheck, Request, Result, Timing, TrialRequest, TrialResult, ValidateRequest, ValidationResult,
                       XlaRequest)

#: How long one timed batch of a candidate's calls lasts (XLA's group or a kernel config; the median of `repeats`
#: batches is its time). 10 ms is tens of calls of a typical group, enough for a stable median, and keeps a
#: model's XLA timings (GPT-2 medium: 158 distinct groups, each 12 batches) from being a job's longest phase;
#: whole plans are timed in 25 ms batches (`time_pair`'s default), where the decision is final.
CANDIDATE_BATCH_MS = 10.0
#: About how long a whole plan's timing against jax.jit may take: 20 pairs of a small program, 8 of a whole model.
VALIDATION_TIMING_MS = 3000.0
MAX_PROGRAM_TOLERANCE = 0.25  # a whole program is never accepted beyond 25% relative error, however sensitive
#: jax.jit's own spread (`rounding_sensitivity`) from which a random-input check cannot decide an output: one nudge
#: is one sample of the spread, and a plan rounding differently at every operation has been 0.6-0.75x of it on
#: forward programs but 1.5-2x on GPT-2 medium's training step (0.369 at 0.249, 0.0585 at 0.03; H100).
CHAOTIC_SPREAD = MAX_PROGRAM_TOLERANCE / 2


def classify_compile_error(e: BaseException) -> TrialStatus:
    low = str(e).lower()
    if "resource_exhausted" in low or "out of resource" in low or "shared memory" in low or "smem_bytes" in low:
        return TrialStatus.RESOURCE_EXHAUSTED
    return TrialStatus.COMPILE_ERROR


def _short(e: BaseException, n: int = 400) -> str:
    s = f"{type(e).__name__}: {e}"
    return s if len(s) <= n else s[:n] + "..."


class Evaluator:
    """Answers the requests of `protocol.py` for one program."""

    def __init__(self, graph: Graph, *, measure: str = "device", model: str = "h200", seeds: Sequence[int] = (1, 2, 3),
                 interpret: bool | None = None, n_input_sets: int = 3, repeats: int = 10, example_inputs: str | None = None,
                 target_ms: float = CANDIDATE_BATCH_MS):
        if measure not in ("device", "model"):
            raise ValueError(f"measure must be 'device' or 'model', got {measure!r}")
        self.graph, self.measure = graph, measure
        self.model = costmodel.get_model(model)
        self.seeds = tuple(seeds)
        self.interpret = default_interpret() if interpret is None else interpret
        self.n_input_sets, self.repeats, self.target_ms = n_input_sets, repeats, target_ms
        self.example_inputs = example_inputs  # a pickle of the user's own input leaves (graph input order), if given
        self._sets: dict[tuple, list] = {}
        self._refs: dict[tuple, Callable] = {}
        self._ahead: dict[tuple, Callable] = {}  # kernels compiled ahead (`compile_ahead`), taken by their trial
        self._plans: dict[str, Callable] = {}  # whole plans compiled ahead (`compile_ahead`), taken by their validation
        self._program: Callable | None = None  # the whole program under jax.jit: compiled once per job, not per plan validated
        self._program_sens: list[float] | None = None  # its rounding sensitivity on random inputs (`rounding_sensitivity`)
        self._program_widened = False  # whether that is over every seed's nudge (`_widened`)
        self._examples: tuple[list, list[float], bool] | None = None  # the caller's inputs, the sensitivity there, widened
        self.device = device_label()  # recorded on every result: which device of which worker ran it

    def handle(self, req: Request) -> Result:
        if isinstance(req, XlaRequest):
            return replace(self.xla(req.nodes), device=self.device)
        if isinstance(req, TrialRequest):
            res = self.trial(req.nodes, req.template, req.config, check_result=self.measure == "device" if req.check is None else req.check)
            return replace(res, device=self.device)
        if isinstance(req, CompileRequest):
            return self.compile_ahead(req.items, req.workers)
        if isinstance(req, ValidateRequest):
            return self.validate(Plan.from_json(req.plan_json), key=req.plan_json)
        raise TypeError(f"unknown request {req!r}")

    # helpers ---------------------------------------------------------------
    def _input_sets(self, avals: Sequence[Any]) -> list[list]:
        key = tuple((a.shape, str(a.dtype)) for a in avals)
        if key not in self._sets:
            self._sets = {key: [random_inputs(avals, 1000 + k) for k in range(self.n_input_sets)]}  # keep one program's sets only
        return self._sets[key]

    def _reference(self, group: Group) -> Callable:
        """The group under plain jax.jit, compiled once per group (perhaps ahead, by `compile_ahead`)."""
        key = tuple(group.node_ids)
        if key not in self._refs:
            self._refs[key] = jax.jit(lambda *a: group.evaluate(a))
        return self._refs[key]

    def _compiles(self) -> bool:
        """Whether a kernel trial compiles for the device (else it runs in interpret mode and is modelled)."""
        return self.measure == "device" or not self.interpret

    def _kernel(self, group: Group, template: str, config: dict) -> Callable:
        """One config of a template for a group, built and (on the device) compiled."""
        backend = config.get("backend", "triton")
        params = {k: v for k, v in config.items() if k != "backend"}
        kernel = build_group(group, template, params, backend=backend, interpret=self.interpret)
        fn = jax.jit(lambda *a: kernel(*a))
        if self._compiles():
            fn = fn.lower(*_structs(group)).compile()
        elif jax.default_backend() == "cpu":  # the real GPU lowering of the same kernel, with no GPU
            lowering_guard(build_group(group, template, params, backend=backend, interpret=False), _structs(group))
        return fn

    def compile_ahead(self, items: Sequence[XlaRequest | TrialRequest], workers: int) -> CompileResult:
        """Compile what `items` will need on `workers` threads at once (XLA compiles without the GIL), then keep
        the executables for the requests that time them one at a time. Only what those would compile is
        compiled: XLA's reference in device mode, a kernel where trials compile; nothing in model mode's XLA
        timings. A failure is not kept: its own request compiles it again, and fails as on the serial path."""
        t0 = time.perf_counter()
        todo: list[tuple[str, Any, Callable[[], Callable]]] = []
        for it in items:
            if isinstance(it, ValidateRequest):  # a whole plan, and once the whole program's reference
                if self._program is None and not any(kind == "program" for kind, _, _ in todo):
                    todo.append(("program", None, self._compile_program))
                if it.plan_json not in self._plans:
                    todo.append(("plan", it.plan_json, lambda pj=it.plan_json: self._compile_plan(Plan.from_json(pj))))
                continue
            group = Group.of(self.graph, it.nodes)
            if isinstance(it, XlaRequest) and self.measure == "device" and tuple(group.node_ids) not in self._refs:
                todo.append(("xla", tuple(group.node_ids), lambda g=group: jax.jit(lambda *a: g.evaluate(a)).lower(*_structs(g)).compile()))
            elif isinstance(it, TrialRequest) and self._compiles() and TEMPLATES[it.template].match(group) is not None:
                key = _trial_key(it.nodes, it.template, it.config)
                if key not in self._ahead:
                    todo.append(("trial", key, lambda g=group, t=it.template, c=dict(it.config): self._kernel(g, t, c)))

        def attempt(build: Callable[[], Callable]) -> tuple[Callable | None, float]:
            t = time.perf_counter()
            try:
                return build(), time.perf_counter() - t
            except Exception:
                return None, time.perf_counter() - t

        with ThreadPoolExecutor(max(1, min(workers, len(todo) or 1)), thread_name_prefix="autofuse-compile") as pool:
            done = list(pool.map(attempt, [b for _, _, b in todo]))
        built = [fn for fn, _ in done]
        longest: dict[str, float] = {}
        for (kind, _, _), (_, secs) in zip(todo, done):
            longest[kind] = round(max(longest.get(kind, 0.0), secs), 3)
        for (kind, key, _), fn in zip(todo, built):
            if fn is None:
                continue
            if kind == "program":
                self._program = fn
            else:
                {"xla": self._refs, "trial": self._ahead, "plan": self._plans}[kind][key] = fn
        failed = sum(fn is None for fn in built)
        return CompileResult(TrialStatus.OK, len(built) - failed, failed, time.perf_counter() - t0, longest=longest)

    def _time(self, fn: Callable, avals: Sequence[Any]) -> Timing:
        return time_fn(fn, self._input_sets(avals), repeats=self.repeats, target_ms=self.target_ms)

    def _timed(self, fn: Callable, avals: Sequence[Any], **extra: Any) -> TrialResult:
        t = self._time(fn, avals)
        return TrialResult(TrialStatus.OK, t.median_ms, t.min_ms, t.max_ms, **extra)

    # requests ----------------------------------------------------------------
    def xla(self, nodes: Sequence[int]) -> TrialResult:
        group = Group.of(self.graph, nodes)
        if self.measure == "model":
            ms = costmodel.xla_group_time_ms(group, self.model)
            return TrialResult(TrialStatus.OK, ms, ms, ms, modelled=True)
        return self._timed(self._reference(group), group.input_avals())

    def trial(self, nodes: Sequence[int], template: str, config: dict, *, check_result: bool = True) -> TrialResult:
        group = Group.of(self.graph, nodes)
        tmpl = TEMPLATES[template]
        spec = tmpl.match(group)
        if spec is None:
            return TrialResult(TrialStatus.ERROR, error=f"template {template} does not match group")
        avals = group.input_avals()
        fn = self._ahead.pop(_trial_key(nodes, template, config), None)
        if fn is None:
            try:
                fn = self._kernel(group, template, config)
            except Exception as e:
                return TrialResult(classify_compile_error(e), error=_short(e))
        max_error = None
        if check_result:
            res = check(fn, self._reference(group), avals, self.seeds, cone_tolerances(self.graph, group.node_ids, group.outputs))
            max_error = res.max_error
            if not res.ok:
                status = TrialStatus.NAN if "NaN" in res.reason else TrialStatus.WRONG_RESULT
                return TrialResult(status, error=res.reason, max_error=res.max_error)
        if self.measure == "model":
            ms = tmpl.model_time_ms(spec, config, self.model)
            return TrialResult(TrialStatus.OK, ms, ms, ms, max_error=max_error, modelled=True)
        try:
            return self._timed(fn, avals, max_error=max_error)
        except Exception as e:
            return TrialResult(TrialStatus.ERROR, error=_short(e))

    def _compile_program(self) -> Callable:
        """The whole program under jax.jit, compiled for its input shapes."""
        g = self.graph
        return jax.jit(lambda *a: g.evaluate(a)).lower(*_program_structs(g)).compile()

    def _compile_plan(self, plan: Plan) -> Callable:
        """A whole plan as one jitted function, compiled for the program's input shapes."""
        run = executor(self.graph, plan, interpret=self.interpret)
        return jax.jit(lambda *a: run(a)).lower(*_program_structs(self.graph)).compile()

    def _reference_program(self, avals: Sequence[Any]) -> tuple[Callable, list[float]]:
        """jax.jit of the whole program and its rounding sensitivity under the first seed's nudge, computed once per
        job (every plan validated, the chosen one and its fallbacks, is held to the same reference)."""
        if self._program is None:
            self._program = self._compile_program()
        if self._program_sens is None:
            self._program_sens = rounding_sensitivity(self._program, avals, self.seeds[0])
        return self._program, self._program_sens

    def _widened(self, sens: list[float], avals: Sequence[Any], ref: Callable, args: Sequence[Any] | None = None) -> list[float]:
        """`sens` widened to the largest move under every seed's nudge (`rounding_spread`): one nudge is one sample
        of the spread, and GPT-2 medium's training step moved by at most 0.02 under seed 1's where its right plan
        was 0.043 from jax.jit at seed 2 (H100). Asked only after a check failed: the other nudges cost two runs of
        the whole program each, seconds of a whole model's first plan."""
        more = rounding_spread(ref, avals, self.seeds[1:], args=args) if len(self.seeds) > 1 else sens
        return [max(a, b) for a, b in zip(sens, more, strict=True)]

    def _random_check(self, fused: Callable, ref: Callable, avals: Sequence[Any], sens: Sequence[float]) -> CheckResult:
        """The plan on random inputs, each output held to its `_program_tolerances`; where the job has the caller's
        inputs, an output whose bound would come from jax.jit's own spread rather than its dtype's is left to them
        (`_check_examples`, always run): on random inputs that bound is one sample of a spread."""
        tols = self._program_tolerances(sens)
        if self.example_inputs:
            tols = [None if e > b else t for t, e, b in zip(tols, sens, output_bounds(self.graph), strict=True)]
        return check(fused, ref, avals, self.seeds, tols)

    def validate(self, plan: Plan, key: str | None = None) -> ValidationResult:
        """The whole plan against jax.jit of the whole program: correctness, then both timed. `key`: the plan's JSON
        as requested, under which `compile_ahead` may have compiled it. A check that fails within the bound's reach
        is made again with jax.jit's spread over every seed's nudge (`_widened`, kept for the job's later plans)."""
        g = self.graph
        avals = [g.avals[v] for v in g.inputs]
        secs: dict[str, float] = {}
        t0 = time.perf_counter()
        fused = self._plans.pop(key, None) if key is not None else None
        if fused is None:
            try:
                fused = self._compile_plan(plan)
            except Exception as e:  # noqa: BLE001 - fails the check below, as a plan that failed to build always did
                fused = _raiser(e)
        t1 = time.perf_counter()
        ref, sens = self._reference_program(avals)
        t2 = time.perf_counter()
        secs.update(compile=t1 - t0, reference=t2 - t1)
        res, sens, self._program_widened = _judged(lambda sp: self._random_check(fused, ref, avals, sp), sens, self._program_widened,
                                                   lambda sp: self._widened(sp, avals, ref))
        self._program_sens = sens
        secs["check"] = time.perf_counter() - t2
        status = TrialStatus.OK if res.ok else TrialStatus.WRONG_RESULT
        error = res.reason or None
        chaotic = chaotic_outputs(sens)
        if not res.ok and chaotic and not self.example_inputs:
            shown = ", ".join(map(str, chaotic[:4])) + (", ..." if len(chaotic) > 4 else "")
            error += (f"; on random inputs jax.jit's own result moves by up to {max(sens):.2g} when the inputs move by one "
                      f"rounding step ({len(chaotic)} output(s): {shown}), so it cannot be checked there: tune with the "
                      "program's real inputs (arrays, not shapes)")
        examples = None
        if res.ok and self.example_inputs:
            t3 = time.perf_counter()
            examples = self._check_examples(fused, ref, avals)
            secs["examples"] = time.perf_counter() - t3
            if not examples.ok:
                status, error = TrialStatus.WRONG_RESULT, f"on the example inputs: {examples.error}"
        out = ValidationResult(status, res.max_error, res.tolerance, error, sens, examples, seconds=secs)
        if status is not TrialStatus.OK or self.measure == "model":
            return out
        t4 = time.perf_counter()
        base, plan_t, ratio = time_pair(ref, fused, self._input_sets(avals), repeats=2 * self.repeats, budget_ms=VALIDATION_TIMING_MS)
        secs["time"] = time.perf_counter() - t4
        return ValidationResult(status, res.max_error, res.tolerance, error, sens, examples, base, plan_t, ratio, seconds=secs)

    def _check_examples(self, fused: Callable, ref: Callable, avals: Sequence[Any]) -> InputsCheck:
        """The plan on the user's own inputs (a model's real weights, not N(0, 1) ones, under which a deep
        bf16 network is chaotic), held to jax.jit's rounding spread at those inputs (tight there; computed once)."""
        import pickle

        if self._examples is None:
            with open(self.example_inputs, "rb") as f:
                args = [jnp.asarray(x, dtype=a.dtype) for x, a in zip(pickle.load(f), avals)]
            self._examples = args, rounding_sensitivity(ref, avals, self.seeds[0], args=args), False
        args, sens, widened = self._examples
        res, sens, widened = _judged(lambda sp: check(fused, ref, avals, tolerances=self._program_tolerances(sp), inputs=args), sens, widened,
                                     lambda sp: self._widened(sp, avals, ref, args))
        self._examples = args, sens, widened
        return InputsCheck(res.ok, res.max_error, self._program_tolerances(sens), sens, res.reason)

    def _program_tolerances(self, sens: Sequence[float]) -> list[float]:
        return program_tolerances(self.graph, sens)


def _judged(judge: Callable[[list[float]], CheckResult], sens: list[float], widened: bool,
            widen: Callable[[list[float]], list[float]]) -> tuple[CheckResult, list[float], bool]:
    """`judge(sens)`; where it fails within MAX_PROGRAM_TOLERANCE and `sens` is still one nudge's, judged again with
    `widen(sens)` (every seed's nudge, `Evaluator._widened`). Returns the result, the spread used and whether it is
    widened."""
    res = judge(sens)
    if not res.ok and res.max_error <= MAX_PROGRAM_TOLERANCE and not widened:
        sens, widened = widen(sens), True
        res = judge(sens)
    return res, sens, widened


def chaotic_outputs(sens: Sequence[float]) -> list[int]:
    """The outputs that jax.jit's own result moves by more than CHAOTIC_SPREAD under `rounding_sensitivity`'s
    nudge: a check on such inputs cannot tell a right plan from a wrong one within MAX_PROGRAM_TOLERANCE. A bf16
    training step on N(0, 1) weights is so (Llama's blocks: 0.97 at the first gradient at CPU size, its 2-block
    plan on an H100 0.994 from jax.jit, every fused group of it right on its own); at the model's own weights it
    is not."""
    return [k for k, e in enumerate(sens) if e > CHAOTIC_SPREAD]


def output_bounds(graph: Graph) -> list[float]:
    """Per output of the whole program: its cone's dtype bound."""
    return cone_tolerances(graph, [n.id for n in graph.nodes], graph.outputs)


def program_tolerances(graph: Graph, sens: Sequence[float]) -> list[float]:
    """Per output of the whole program: its cone's dtype bound, or jax.jit's rounding spread `sens` where larger
    (at most MAX_PROGRAM_TOLERANCE): the bound of a whole plan against jax.jit, at tuning and at deploy."""
    return [max(t, min(e, MAX_PROGRAM_TOLERANCE)) for t, e in zip(output_bounds(graph), sens, strict=True)]


def _structs(group: Group) -> list[jax.ShapeDtypeStruct]:
    """The group's inputs as the shapes its executables are compiled for (the random inputs have exactly these)."""
    return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in group.input_avals()]


def _program_structs(graph: Graph) -> list[jax.ShapeDtypeStruct]:
    """The whole program's inputs as the shapes its executables are compiled for."""
    return [jax.ShapeDtypeStruct(graph.avals[v].shape, graph.avals[v].dtype) for v in graph.inputs]


def _raiser(e: BaseException) -> Callable:
    """A function that raises `e` when called: a plan that failed to compile, failing its check as it always did."""
    def fn(*_: Any) -> Any:
        raise e
    return fn


def _trial_key(nodes: Sequence[int], template: str, config: dict) -> tuple:
    return tuple(nodes), template, tuple(sorted(config.items()))


def rounding_sensitivity(ref: Callable, avals: Sequence[Any], seed: int, args: Sequence[Any] | None = None) -> list[float]:
    """Per output, how far the XLA program's own result moves (relative error norm) when each low-precision
    float input moves by about one rounding step, x * (1 +- 2^-mantissa_bits).

    A deep bf16 program amplifies rounding: XLA's GPT-2 forward in bf16 is 2.5% (4 layers) to 5.7% (24 layers)
    away from the same program in float32 on random inputs, and at GPT-2-medium width (6 layers, H200) its
    result moves 15.6% under such a nudge, while the fused plan was 9-12% from it. A fused program that rounds
    its intermediates differently is held to this spread (at most MAX_PROGRAM_TOLERANCE), not to one
    operation's bf16 tolerance; each fused group was already checked on its own at that tighter tolerance.
    `args`: the inputs to nudge (default: random ones from `seed`).
    """
    args = random_inputs(avals, seed) if args is None else list(args)
    nudged = [_nudged(x, pool_view(tuple(a.shape), a.dtype, seed + 7919, i, kind="sign"))
              if np.dtype(a.dtype) in (np.dtype(jnp.bfloat16), np.dtype(jnp.float16)) else x
              for i, (a, x) in enumerate(zip(avals, args))]
    outs, moved = ref(*args), ref(*nudged)
    errs = [compare(m, o, 0.0)[1] if np.issubdtype(np.dtype(o.dtype), np.inexact) or o.dtype == jnp.bfloat16 else 0.0
            for o, m in zip(outs, moved)]
    return [e if math.isfinite(e) else 0.0 for e in errs]


def rounding_spread(ref: Callable, avals: Sequence[Any], seeds: Sequence[int], args: Sequence[Any] | None = None) -> list[float]:
    """Per output, the largest `rounding_sensitivity` over `seeds` (each its own random inputs, or the given `args`,
    and its own nudge): one nudge is one sample of the spread."""
    per_seed = [rounding_sensitivity(ref, avals, s, args=args) for s in seeds]
    return [max(e) for e in zip(*per_seed, strict=True)]


@jax.jit
def _nudged(x: jax.Array, sign: jax.Array) -> jax.Array:
    """x moved by one rounding step of its dtype, up or down by `sign` (one compiled program per shape)."""
    return (x.astype(jnp.float32) * (1 + 2.0 ** -jnp.finfo(x.dtype).nmant * sign)).astype(x.dtype)


def lowering_guard(kernel: Callable, structs: Sequence[Any]) -> None:
    """Run the real Triton lowering for CUDA without a GPU (GPU_NOTES.md); raises on unsupported kernels."""
    export_for_cuda(lambda *a: kernel(*a), structs)


def export_for_cuda(fn: Callable, structs: Sequence[Any]) -> Any:
    """`jax.export` of `fn` for CUDA on a machine without a GPU: the Pallas lowerings run for real.

    jax >= 0.11 asks the device for its compute capability while lowering a Pallas
    kernel; without a GPU an abstract H100 stands in (an abstract mesh's device).
    """
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=132, platform="cuda")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=dev)):
        return jax.export.export(
            jax.jit(fn),
            platforms=["cuda"],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
        )(*structs)
