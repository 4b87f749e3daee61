"""One XLA timing, one trial, one plan validation: build -> check -> time, for one program.

Runs inside the trial process (`process.py`) or inline. `measure="device"`
compiles and times on the accelerator; `measure="model"` builds the kernel,
runs the CUDA lowering guard where there is no GPU, and costs it with the
roofline model (results marked `modelled`).
"""
from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .. import costmodel, kernel_cache
from ..device import device_label
from ..graph import Graph, Group
from ..kernels import TEMPLATES, Template, preload_lowerings
from ..plan import Plan, build_group, default_interpret, executor, preload_pallas_lowerings
from ..spent import add_parts, add_since
from ..status import TrialStatus
from .in_program import InProgram, in_program
from .lowering_pool import LOWER_TIMEOUT_S, LoweringPool
from .measure import check, check_as_accurate, compile_beside, cone_tolerances, random_inputs, time_kernels, time_pair, widened
from .program_check import MAX_PROGRAM_TOLERANCE, ProgramCheck, check_program_builders
from .profile import compile_profiled, profile_program
from .protocol import (CompareRequest, CompileItem, CompileRequest, CompileResult, ComparisonResult, ProfileRequest, ProfileResult,
                       ProgramRequest, Request, Result, Timing, TrialRequest, TrialResult, ValidateRequest, ValidationResult,
                       XlaRequest)

#: How long one timed batch of a candidate's calls lasts (XLA's group or a kernel config; the median of `repeats`
#: batches is its time). 10 ms is tens of calls of a typical group, enough for a stable median, and keeps a
#: model's XLA timings (GPT-2 medium: 158 distinct groups, each 12 batches) from being a job's longest phase;
#: whole plans are timed in 25 ms batches (`time_pair`'s default), where the decision is final.
CANDIDATE_BATCH_MS = 10.0
#: About how long a whole plan's timing against jax.jit may take: 20 pairs of a small program, 8 of a whole model.
VALIDATION_TIMING_MS = 3000.0
#: Two validated plans timed against each other (`CompareRequest`): at least this many pairs, about this long.
COMPARE_PAIRS, COMPARE_TIMING_MS = 16, 12000.0
HELD_PLANS = 3  # validated plans kept compiled for a comparison (their code only: no buffers are held)
FIRST = {"program": 0, "profile": 0, "plan": 0, "trial": 1}  # the order `compile_ahead` starts its items in, by kind (then XLA's)
SMALL_THREADS = 2  # threads of a batch for the small programs beside its items (`measure.compile_beside`, a plan's check)


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
        self._example_leaves: list | None = None
        self._held_at: dict[tuple, dict[int, int]] = {}  # (template, nodes) -> its `timing_inputs`
        self._sets: dict[tuple, list] = {}
        self._refs: dict[tuple, Callable] = {}
        self._views: dict[tuple, InProgram] = {}
        self._ahead: dict[tuple, Callable] = {}  # kernels compiled ahead (`compile_ahead`), taken by their trial
        self.last_jit: dict[str, float] = {}  # the last kernel `_jit` compiled: its lowering's and compile's seconds
        self._plans: dict[str, Callable] = {}  # whole plans compiled ahead (`compile_ahead`), taken by their validation
        self._held: dict[str, Callable] = {}  # the last validated plans, compiled, for a comparison (`compare`)
        self._program: Callable | None = None  # the whole program under jax.jit: compiled once per job (perhaps ahead)
        self._profiled: Callable | None = None  # the same as the profile runs it (`profile.compile_profiled`), compiled ahead
        self._check: ProgramCheck | None = None  # judging plans against it, its spreads measured once per job, not per plan
        self.device = device_label()  # recorded on every result: which device of which worker ran it
        self._pool: LoweringPool | None = None  # helper processes lowering `compile_ahead`'s kernels (`lower_apart`)
        self._target: kernel_cache.Target | None = None
        self._beside: set[tuple] = set()  # the random inputs' views and comparisons compiled ahead (`measure.compile_beside`)
        if measure == "device":
            # The lowerings the kernels need, imported now, not by a batch's compile threads: importing holds the GIL
            # (Mosaic GPU's MLIR dialects' generated modules: on a GPU host busy compiling, every thread of GPT-2's
            # first batch, and the lowering helpers' traffic, stalled 2.3-2.8 s), and a Pallas module that defines a
            # JAX option makes every function jitted before it miss its cache (the views compiled ahead)
            preload_pallas_lowerings(self.interpret)
            preload_lowerings()

    def lower_apart(self, pool: LoweringPool) -> None:
        """Have `pool`'s helpers lower the kernels `compile_ahead` builds, where kernels are built for a GPU and
        kept in the kernel cache the helpers write to; else stop them."""
        if self.measure == "device" and not self.interpret and jax.default_backend() == "gpu" and kernel_cache.cache_dir() == pool.directory:
            self._pool, self._target = pool, kernel_cache.Target.here()
        else:
            pool.close()

    def handle(self, req: Request) -> Result:
        if isinstance(req, XlaRequest):
            return replace(self.xla(req.nodes), device=self.device)
        if isinstance(req, TrialRequest):
            res = self.trial(req.nodes, req.template, req.config, check_result=self.measure == "device" if req.check is None else req.check)
            return replace(res, device=self.device)
        if isinstance(req, CompileRequest):
            return self.compile_ahead(req.items, req.workers)
        if isinstance(req, ValidateRequest):
            try:
                return self.validate(Plan.from_json(req.plan_json), key=req.plan_json)
            except Exception as e:  # noqa: BLE001 - out of GPU memory is a status of its own: the job may try a fresh process
                if classify_compile_error(e) is not TrialStatus.RESOURCE_EXHAUSTED:
                    raise
                return ValidationResult(TrialStatus.RESOURCE_EXHAUSTED, error=_short(e))
        if isinstance(req, CompareRequest):
            return self.compare(req.first_json, req.second_json)
        if isinstance(req, ProfileRequest):
            return self.profile()
        raise TypeError(f"unknown request {req!r}")

    # helpers ---------------------------------------------------------------
    def _input_sets(self, avals: Sequence[Any]) -> list[list]:
        key = tuple((a.shape, str(a.dtype)) for a in avals)
        if key not in self._sets:
            self._sets = {key: [random_inputs(avals, 1000 + k) for k in range(self.n_input_sets)]}  # keep one program's sets only
        return self._sets[key]

    def _program_sets(self, plans: Sequence[Plan]) -> list[list]:
        """The whole program's timing inputs: random, with its integer and boolean inputs at the caller's example values
        where the job has them. Those are what a program's work can depend on (key lengths, padding masks, token
        ids: attention stops at each row's last live key), and random small integers would flatter such kernels
        against XLA, whose work does not; floats stay random, as everywhere. Without the caller's inputs, a program
        input that a group of `plans` holds at one value when timed alone (`Template.timing_inputs`) takes it."""
        avals = [self.graph.avals[v] for v in self.graph.inputs]
        sets = self._input_sets(avals)
        examples = self._examples()
        if examples is not None:
            fixed = {i: jnp.asarray(examples[i], a.dtype) for i, a in enumerate(avals)
                     if a.dtype == np.dtype(bool) or np.issubdtype(a.dtype, np.integer)}
        else:
            fixed = {self.graph.inputs.index(v): jnp.full(self.graph.avals[v].shape, x, self.graph.avals[v].dtype)
                     for v, x in self._timing_inputs(plans).items() if v in self.graph.inputs}
        return [[fixed.get(i, x) for i, x in enumerate(s)] for s in sets] if fixed else sets

    def _timing_inputs(self, plans: Sequence[Plan]) -> dict[int, int]:
        """The values the plans' groups are timed alone at (`Template.timing_inputs`), by program value: matched once
        per group and only for the templates that hold any (attention's), not for every group of every validation."""
        out: dict[int, int] = {}
        for fg in (fg for plan in plans for fg in plan.groups):
            tmpl = TEMPLATES[fg.template]
            if type(tmpl).timing_inputs is Template.timing_inputs:
                continue
            key = (fg.template, tuple(fg.nodes))
            if key not in self._held_at:
                group = Group.of(self.graph, fg.nodes)
                spec = tmpl.match(group)
                self._held_at[key] = {} if spec is None else tmpl.timing_inputs(group, spec)
            out.update(self._held_at[key])
        return out

    def _view(self, group: Group) -> InProgram:
        """The group as it is timed and checked alone: with the layout ops that make its inputs in the program."""
        key = tuple(group.node_ids)
        if key not in self._views:
            self._views[key] = in_program(group)
        return self._views[key]

    def _reference(self, group: Group) -> Callable:
        """The group under plain jax.jit, compiled once per group (perhaps ahead, by `compile_ahead`)."""
        key = tuple(group.node_ids)
        if key not in self._refs:
            self._refs[key] = self._xla_fn(group)
        return self._refs[key]

    def _xla_fn(self, group: Group) -> Callable:
        """The group under plain jax.jit as it is timed alone (`in_program`), not compiled yet."""
        return jax.jit(self._view(group).around(lambda *a: group.evaluate(a)))

    def _compiles(self) -> bool:
        """Whether a kernel trial compiles for the device (else it runs in interpret mode and is modelled)."""
        return self.measure == "device" or not self.interpret

    def _kernel(self, group: Group, template: str, config: dict, lowered: Future | None = None) -> Callable:
        """One config of a template for a group, built and (on the device) compiled; once `lowered` (a lowering
        helper's, `compile_ahead`) is done, where it reads the helper's export from the kernel cache."""
        if lowered is not None:
            with contextlib.suppress(Exception):
                lowered.result(LOWER_TIMEOUT_S)
        backend, params = _split(config)
        kernel = build_group(group, template, params, backend=backend, interpret=self.interpret)
        if not self._compiles() and jax.default_backend() == "cpu":  # the real GPU lowering of the same kernel, with no GPU
            lowering_guard(build_group(group, template, params, backend=backend, interpret=False), _structs(group))
        return self._jit(group, kernel)

    def _alone(self, group: Group, template: str, config: dict) -> Callable | None:
        """The kernel as timed alone where its template's lowering times it otherwise than it runs
        (`Template.build_alone`), compiled on the device; None where it is the checked kernel itself."""
        backend, params = _split(config)
        kernel = TEMPLATES[template].build_alone(group, params, backend=backend, interpret=self.interpret)
        return None if kernel is None else self._jit(group, kernel)

    def _jit(self, group: Group, kernel: Callable) -> Callable:
        """`kernel` as the group is timed alone (`in_program`), jitted and (on the device) compiled; the seconds of
        the jitted function's lowering (the kernel's own lowering happened in `build_group`, where `kernel_cache`
        keeps it) and of XLA's compile in `last_jit`."""
        view = self._view(group)
        fn = jax.jit(view.around(lambda *a: kernel(*a)))
        if not self._compiles():
            return fn
        t0 = time.perf_counter()
        lowered = fn.lower(*view.structs())
        t1 = time.perf_counter()
        compiled = lowered.compile()
        self.last_jit = {"lower": t1 - t0, "compile": time.perf_counter() - t1}
        return compiled

    def compile_ahead(self, items: Sequence[CompileItem], workers: int) -> CompileResult:
        """Compile what `items` will need on `workers` threads at once (XLA compiles without the GIL), then keep
        the executables for the requests that time them one at a time. Only what those would compile is
        compiled: XLA's reference in device mode, a kernel where trials compile; nothing in model mode's XLA
        timings. A failure is not kept: its own request compiles it again, and fails as on the serial path."""
        t0 = time.perf_counter()
        todo: list[tuple[str, Any, Callable[[], Callable]]] = []
        helpers = self._pool
        lowered_before = helpers.lowered if helpers is not None else 0
        timed: list[Group] = []  # the groups the requests after this batch will time (XLA's and kernels) and check (kernels)
        checked: list[Group] = []
        for it in items:
            if isinstance(it, ProfileRequest):  # the program its profile will run
                if self.measure == "device" and self._profiled is None and not any(kind == "profile" for kind, _, _ in todo):
                    todo.append(("profile", None, lambda: compile_profiled(self.graph)))
                continue
            if isinstance(it, (ValidateRequest, ProgramRequest)):  # a whole plan, and once the whole program's reference
                if self._program is None and not any(kind == "program" for kind, _, _ in todo):
                    todo.append(("program", None, self._compile_program))
                if isinstance(it, ProgramRequest):
                    continue
                if it.plan_json not in self._plans:
                    todo.append(("plan", it.plan_json, lambda pj=it.plan_json: self._compile_plan(Plan.from_json(pj))))
                continue
            group = Group.of(self.graph, it.nodes)
            if isinstance(it, XlaRequest) and self.measure == "device" and tuple(group.node_ids) not in self._refs \
                    and not any(kind == "xla" and key == tuple(group.node_ids) for kind, key, _ in todo):
                todo.append(("xla", tuple(group.node_ids),
                             lambda f=self._xla_fn(group), v=self._view(group): f.lower(*v.structs()).compile()))
                timed.append(group)
            elif isinstance(it, TrialRequest) and self._compiles() and TEMPLATES[it.template].match(group) is not None:
                key = _trial_key(it.nodes, it.template, it.config)
                if key not in self._ahead and not any(kind == "trial" and k == key for kind, k, _ in todo):
                    self._view(group)  # made here, not in the compiling threads
                    lowered = helpers.submit(it.nodes, it.template, it.config, self._target) if helpers is not None else None
                    todo.append(("trial", key, lambda g=group, t=it.template, c=dict(it.config), f=lowered: self._kernel(g, t, c, f)))
                    timed.append(group)
                    checked.append(group)

        def attempt(build: Callable[[], Any]) -> tuple[Any, float]:
            t = time.perf_counter()
            try:
                return build(), time.perf_counter() - t
            except Exception:
                return None, time.perf_counter() - t

        # with a whole plan: the small programs its check will run (inputs, nudges, comparisons), not a result. Not with
        # the program alone, in a job's first batch: 11 programs of GPT-2's, 3-8 s each beside 24 references, 12
        # kernels and the program on a saturated CPU, where the first validation compiles them beside its plan
        side = check_program_builders([self.graph.avals[v] for v in self.graph.inputs], [self.graph.aval(a) for a in self.graph.outputs],
                                      self._beside) if self.measure == "device" and self._check is None and any(kind == "plan" for kind, _, _ in todo) else []
        if self.measure == "device":  # and the random inputs and comparisons of what the batch's requests will time and check
            side += compile_beside([a for g in timed for a in self._view(g).input_avals()],
                                   [self.graph.avals[v] for g in checked for v in g.outputs], self._beside)
        # the longest first: the whole program (GPT-2 medium's forward: 7.6 s among 45 items on 16 threads, where it
        # waited 9.5 s for a thread behind the references); then the kernels, whose threads mostly wait for their
        # helpers (and so come as threads beside `workers`). The small programs compile on threads of their own: after
        # the rest they made GPT-2's cold first batch 3.7-4.6 s longer than its longest item, and before them 3.8-5.9
        # s (mostly Python, each held its thread 8-10 s on a host busy compiling)
        todo.sort(key=lambda item: FIRST.get(item[0], len(FIRST)))
        waiting = sum(1 for kind, key, _ in todo if kind == "trial" and helpers is not None)
        with ThreadPoolExecutor(SMALL_THREADS, thread_name_prefix="autofuse-compile-small") as small, \
                ThreadPoolExecutor(max(1, min(workers + waiting, len(todo) or 1)), thread_name_prefix="autofuse-compile") as pool:
            beside = small.map(attempt, side)
            done = list(pool.map(attempt, [b for _, _, b in todo]))
            small_secs = [secs for _, secs in beside]
        longest: dict[str, float] = {"inputs": round(max(small_secs), 3)} if small_secs else {}
        for (kind, _, _), (_, secs) in zip(todo, done):
            longest[kind] = round(max(longest.get(kind, 0.0), secs), 3)
        built = [(kind, key, fn) for (kind, key, _), (fn, _) in zip(todo, done)]
        for kind, key, fn in built:
            if fn is None:
                continue
            if kind == "program":
                self._program = fn
            elif kind == "profile":
                self._profiled = fn
            else:
                {"xla": self._refs, "trial": self._ahead, "plan": self._plans}[kind][key] = fn
        failed = sum(fn is None for _, _, fn in built)
        return CompileResult(TrialStatus.OK, len(built) - failed, failed, time.perf_counter() - t0, longest=longest,
                             lowered_apart=helpers.lowered - lowered_before if helpers is not None else 0)

    def _time(self, fn: Callable, avals: Sequence[Any], fixed: dict[int, int] | None = None) -> Timing:
        """`fn`'s kernels timed on the device (`time_kernels`: as they run in the program, where no host dispatches
        them one call at a time) on the input sets; `fixed`: inputs (by position) held at one value
        (`Template.timing_inputs`)."""
        sets = self._input_sets(avals)
        if fixed:
            sets = [[jnp.full(a.shape, fixed[i], a.dtype) if i in fixed else x for i, (x, a) in enumerate(zip(s, avals))]
                    for s in sets]
        return time_kernels(fn, sets, repeats=self.repeats, target_ms=self.target_ms)

    def _timed(self, fn: Callable, avals: Sequence[Any], fixed: dict[int, int] | None = None, **extra: Any) -> TrialResult:
        t = self._time(fn, avals, fixed)
        return TrialResult(TrialStatus.OK, t.median_ms, t.min_ms, t.max_ms, **extra)

    # requests ----------------------------------------------------------------
    def xla(self, nodes: Sequence[int]) -> TrialResult:
        group = Group.of(self.graph, nodes)
        if self.measure == "model":
            ms = costmodel.xla_group_time_ms(group, self.model)
            return TrialResult(TrialStatus.OK, ms, ms, ms, modelled=True)
        return self._timed(self._reference(group), self._view(group).input_avals())

    def trial(self, nodes: Sequence[int], template: str, config: dict, *, check_result: bool = True) -> TrialResult:
        group = Group.of(self.graph, nodes)
        tmpl = TEMPLATES[template]
        spec = tmpl.match(group)
        if spec is None:
            return TrialResult(TrialStatus.ERROR, error=f"template {template} does not match group")
        view = self._view(group)
        avals = view.input_avals()
        secs: dict[str, float] = {}
        t = time.perf_counter()
        fn = self._ahead.pop(_trial_key(nodes, template, config), None)
        if fn is None:
            self.last_jit = {}
            try:
                fn = self._kernel(group, template, config)
            except Exception as e:
                add_since(secs, "build", t)
                return TrialResult(classify_compile_error(e), error=_short(e), seconds=secs)
            add_parts(secs, self.last_jit, "build_")  # of which lowering and XLA's compile
        t = add_since(secs, "build", t)
        max_error = None
        if check_result:
            tols = cone_tolerances(self.graph, group.node_ids, group.outputs)
            res = check(fn, self._reference(group), avals, self.seeds, tols)
            if not res.ok and res.max_error <= MAX_PROGRAM_TOLERANCE:  # rounding amplified, or wrong: judged by the program run wider
                again = check_as_accurate(fn, self._reference(group), view.around(widened(group)), avals, self.seeds, tols)
                res = again if again.ok else replace(res, reason=f"{res.reason}; {again.reason}")
            max_error = res.max_error
            t = add_since(secs, "check", t)
            if not res.ok:
                status = TrialStatus.NAN if "NaN" in res.reason else TrialStatus.WRONG_RESULT
                return TrialResult(status, error=res.reason, max_error=res.max_error, seconds=secs)
        if self.measure == "model":
            ms = tmpl.model_time_ms(spec, config, self.model)
            return TrialResult(TrialStatus.OK, ms, ms, ms, max_error=max_error, modelled=True, seconds=secs)
        try:
            timed = self._alone(group, template, config) or fn
            t = add_since(secs, "alone", t)
            fixed = {view.inputs.index(v): x for v, x in tmpl.timing_inputs(group, spec).items() if v in view.inputs}
            res = self._timed(timed, avals, fixed, max_error=max_error)
            add_since(secs, "time", t)
            return replace(res, seconds=secs)
        except Exception as e:
            return TrialResult(TrialStatus.ERROR, error=_short(e), seconds=secs)

    def profile(self) -> ProfileResult:
        """XLA's kernels in jax.jit's whole program with the nodes each computes (`profile.profile_program`), on the
        program's timing inputs: device times, as groups are timed (`measure.time_kernels`); none in model mode or
        without a GPU's trace."""
        if self.measure == "model":
            return ProfileResult(TrialStatus.OK)
        t0 = time.perf_counter()
        self._sets.clear()  # the trials' input sets make room for the program's, as a validation does
        compiled, self._profiled = self._profiled, None  # compiled ahead (`compile_ahead`), run once
        try:
            compiled = compiled if compiled is not None else compile_profiled(self.graph)
            sets = self._program_sets([])
            kernels = profile_program(self.graph, sets[0], compiled=compiled)
        except Exception as e:  # noqa: BLE001 - a profile that cannot be taken leaves the selection to the times alone
            return ProfileResult(TrialStatus.ERROR, error=_short(e), seconds={"profile": time.perf_counter() - t0})
        return ProfileResult(TrialStatus.OK, tuple(kernels), seconds={"profile": time.perf_counter() - t0})

    def _compile_program(self) -> Callable:
        """The whole program under jax.jit, compiled for its input shapes."""
        g = self.graph
        return jax.jit(lambda *a: g.evaluate(a)).lower(*_program_structs(g)).compile()

    def _compile_plan(self, plan: Plan) -> Callable:
        """A whole plan as one jitted function, compiled for the program's input shapes."""
        run = executor(self.graph, plan, interpret=self.interpret)
        return jax.jit(lambda *a: run(a)).lower(*_program_structs(self.graph)).compile()

    def _program_check(self) -> ProgramCheck:
        """jax.jit of the whole program, compiled once per job with its rounding spreads (every plan validated, the
        chosen one and its fallbacks, is held to the same reference), and the caller's inputs where the job has them."""
        if self._check is None:
            if self._program is None:
                self._program = self._compile_program()
            self._check = ProgramCheck(self.graph, self._program, self.seeds, self._examples())
        return self._check

    def _examples(self) -> list | None:
        """The caller's input leaves (graph input order) where the job has them."""
        if self.example_inputs and self._example_leaves is None:
            import pickle

            with open(self.example_inputs, "rb") as f:
                self._example_leaves = pickle.load(f)
        return self._example_leaves

    def validate(self, plan: Plan, key: str | None = None) -> ValidationResult:
        """The whole plan against jax.jit of the whole program: correctness (`ProgramCheck`), then both timed. `key`:
        the plan's JSON as requested, under which `compile_ahead` may have compiled it."""
        secs: dict[str, float] = {}
        t0 = time.perf_counter()
        fused = self._plans.pop(key, None) if key is not None else None
        if fused is None:
            try:
                fused = self._compile_plan(plan)
            except Exception as e:  # noqa: BLE001 - a plan that does not bind or compile: no check to run, its reason kept
                secs["compile"] = time.perf_counter() - t0
                return ValidationResult(TrialStatus.COMPILE_ERROR, error=f"{type(e).__name__}: {e}", seconds=secs)
        t1 = time.perf_counter()
        # The trials' random input sets go first (made again from their seeds if a trial follows): the whole
        # program's check needs its largest block in one piece (GPT-2 medium's training step: jax.jit's 63.6 GiB of
        # temporaries, in a pool where a softmax candidate's three [B, H, L, L] sets had taken the low 7 GiB).
        self._sets.clear()
        judge = self._program_check()
        judge.sensitivity()
        secs.update(compile=t1 - t0, reference=time.perf_counter() - t1)
        verdict = judge.judge(fused)
        secs.update(verdict.seconds)
        res = verdict.random
        status = TrialStatus.OK if verdict.ok else TrialStatus.WRONG_RESULT
        error = verdict.reason or None
        chaotic = verdict.chaotic()
        if not res.ok and chaotic and not self.example_inputs:
            shown = ", ".join(map(str, chaotic[:4])) + (", ..." if len(chaotic) > 4 else "")
            error += (f"; on random inputs jax.jit's own result moves by up to {max(verdict.sensitivity):.2g} when the inputs move "
                      f"by one rounding step ({len(chaotic)} output(s): {shown}), so it cannot be checked there: tune with the "
                      "program's real inputs (arrays, not shapes)")
        memory = {"peak_bytes": peak_bytes(fused), "baseline_peak_bytes": peak_bytes(judge.ref)}
        out = ValidationResult(status, verdict.max_error, res.tolerance, error, verdict.sensitivity, verdict.examples, seconds=secs, **memory)
        if status is not TrialStatus.OK or self.measure == "model":
            return out
        t4 = time.perf_counter()
        base, plan_t, ratio = time_pair(judge.ref, fused, self._program_sets([plan]), repeats=2 * self.repeats,
                                        budget_ms=VALIDATION_TIMING_MS)
        secs["time"] = time.perf_counter() - t4
        self._hold(key or plan.to_json(), fused)
        return ValidationResult(status, verdict.max_error, res.tolerance, error, verdict.sensitivity, verdict.examples, base, plan_t, ratio,
                                seconds=secs, **memory)

    def _hold(self, key: str, fused: Callable) -> None:
        """Keep a validated plan compiled for a comparison (the last HELD_PLANS of them)."""
        self._held.pop(key, None)
        self._held[key] = fused
        while len(self._held) > HELD_PLANS:
            self._held.pop(next(iter(self._held)))

    def compare(self, first_json: str, second_json: str) -> ComparisonResult:
        """Two whole plans, validated before (here or on another GPU), timed against each other in alternation: at
        least COMPARE_PAIRS pairs, about COMPARE_TIMING_MS. Compiled again where not held (the persistent
        compilation cache has them). Their correctness is their validations'."""
        if self.measure == "model":
            return ComparisonResult(TrialStatus.OK)
        secs: dict[str, float] = {}
        t0 = time.perf_counter()
        fns = []
        try:
            for key in (first_json, second_json):
                fns.append(self._held.get(key) or self._compile_plan(Plan.from_json(key)))
                self._hold(key, fns[-1])
        except Exception as e:  # noqa: BLE001 - a plan that no longer compiles here: no comparison
            return ComparisonResult(classify_compile_error(e), error=_short(e))
        secs["compile"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        self._sets.clear()
        plans = [Plan.from_json(first_json), Plan.from_json(second_json)]
        first, second, ratio = time_pair(fns[0], fns[1], self._program_sets(plans), repeats=3 * COMPARE_PAIRS, min_repeats=COMPARE_PAIRS,
                                         budget_ms=COMPARE_TIMING_MS)
        secs["time"] = time.perf_counter() - t1
        return ComparisonResult(TrialStatus.OK, first, second, ratio, seconds=secs)


def peak_bytes(compiled: Any) -> int | None:
    """XLA's peak device memory of a compiled program (its arguments, outputs and temporaries at the busiest point;
    a Pallas kernel's scratch lives in shared memory and adds nothing), or None where it has none to say (a plan that
    failed to build, a backend without the analysis)."""
    try:
        stats = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - not a compiled program, or no analysis on this backend: nothing to report
        return None
    if stats is None:
        return None
    peak = getattr(stats, "peak_memory_in_bytes", 0)
    return int(peak) if peak else int(stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
                                      - stats.alias_size_in_bytes)


def _structs(group: Group) -> list[jax.ShapeDtypeStruct]:
    """The group's inputs as the shapes its executables are compiled for (the random inputs have exactly these)."""
    return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in group.input_avals()]


def _program_structs(graph: Graph) -> list[jax.ShapeDtypeStruct]:
    """The whole program's inputs as the shapes its executables are compiled for."""
    return [jax.ShapeDtypeStruct(graph.avals[v].shape, graph.avals[v].dtype) for v in graph.inputs]


def _split(config: dict) -> tuple[str, dict]:
    """A trial's config as (its backend, the lowering's own parameters)."""
    return config.get("backend", "triton"), {k: v for k, v in config.items() if k != "backend"}


def _trial_key(nodes: Sequence[int], template: str, config: dict) -> tuple:
    return tuple(nodes), template, tuple(sorted(config.items()))


def lowering_guard(kernel: Callable, structs: Sequence[Any]) -> None:
    """Run the real Triton lowering for CUDA without a GPU (GPU_NOTES.md) and verify each Triton module as XLA will
    parse it; raises on unsupported kernels."""
    verify_triton_modules(export_for_cuda(lambda *a: kernel(*a), structs).mlir_module())


def verify_triton_modules(text: str) -> None:
    """Parse and verify every Triton kernel in an exported module (StableHLO text), as XLA does before compiling it:
    Pallas' Triton lowering itself does not verify, so a module it emits can still be refused on the GPU ("'scf.for'
    op failed to verify": loop bounds of different types). Raises `MLIRError` on the first that fails."""
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir
    from jax._src.lib.triton import dialect as tt_dialect

    ctx = mlir.make_ir_context()
    tt_dialect.register_dialect(ctx)
    ctx.load_all_available_dialects()
    with ctx:
        module = ir.Module.parse(text)
        calls = []
        module.operation.walk(lambda op: calls.append(op) or ir.WalkResult.ADVANCE
                              if op.name == "stablehlo.custom_call" else ir.WalkResult.ADVANCE)
        for op in calls:
            if ir.StringAttr(op.attributes["call_target_name"]).value != "__gpu$xla.gpu.triton":
                continue
            config = ir.DictAttr(op.attributes["mhlo.backend_config"])
            ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes).operation.verify()


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
