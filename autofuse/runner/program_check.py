"""Whether a whole fused program computes what jax.jit computes: the one rule that the tuning job's validation
(`evaluator.Evaluator.validate`) and the deploy-time re-check of a plan (`api.jit`, a plan made with other software
or serving other shapes) both apply.

Each output is held to its cone's dtype bound, or to jax.jit's own rounding spread at the inputs where larger (at
most MAX_PROGRAM_TOLERANCE): a fused plan rounds its intermediates differently, and a deep bf16 program amplifies
rounding. Where jax.jit's spread on random inputs is larger than the dtype's bound (a bf16 training step on N(0, 1)
weights is chaotic), one random sample cannot decide that output: given the caller's own inputs, such outputs are
judged there instead; at those inputs an output that is rounding noise (a gradient that is zero in exact arithmetic)
is held to jax.jit's own accuracy there (`example_tolerances`). A check that fails within MAX_PROGRAM_TOLERANCE is made
once more against the largest move over every seed's nudge (one nudge is one sample of the spread), and where it fails
again the plan passes if it is no further from the program computed in float32 than jax.jit is (`check_as_accurate`):
a plan that rounds less than jax.jit (a GEMM's epilogue on its float32 accumulator) is not a wrong one.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..graph import Graph
from .measure import (CheckResult, check, check_as_accurate, compare, compile_beside, compile_view, cone_tolerances, pool_view, random_inputs,
                      viewed, widened)
from .protocol import InputsCheck

MAX_PROGRAM_TOLERANCE = 0.25  # a whole program is never accepted beyond 25% relative error, however sensitive
#: jax.jit's own spread (`rounding_sensitivity`) from which a random-input check cannot decide an output: one nudge
#: is one sample of the spread, and a plan rounding differently at every operation has been 0.6-0.75x of it on
#: forward programs but 1.5-2x on GPT-2 medium's training step (0.369 at 0.249, 0.0585 at 0.03; H100).
CHAOTIC_SPREAD = MAX_PROGRAM_TOLERANCE / 2
#: jax.jit's own spread at the caller's inputs from which an output is rounding noise there: one rounding step of the
#: inputs moves it by as much as its own norm. SPLADE's key-bias gradients are so (mathematically zero: softmax ignores
#: a shift of every key; jax.jit's bf16 result 113x its norm away from a float32 one, spread >= 0.25); such an output
#: is held to NOISE_FACTOR times that spread instead of MAX_PROGRAM_TOLERANCE, i.e. to jax.jit's own accuracy there.
NOISE_SPREAD = 1.0
NOISE_FACTOR = 2.0


@dataclass(frozen=True)
class ProgramVerdict:
    """A fused program against jax.jit: on random inputs, then (when given, and the random check passed) on the
    caller's inputs. `sensitivity`: jax.jit's spread on random inputs that the check used; `seconds`: where the
    check's time went ("check" on random inputs, "examples" on the caller's)."""

    random: CheckResult
    sensitivity: list[float]
    examples: InputsCheck | None = None
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.random.ok and (self.examples is None or self.examples.ok)

    @property
    def max_error(self) -> float:
        """The worst relative error of either check (outputs left to the caller's inputs are 0 on random ones)."""
        return max(self.random.max_error, self.examples.max_error if self.examples is not None else 0.0)

    @property
    def reason(self) -> str:
        if not self.random.ok:
            return self.random.reason
        return f"on the example inputs: {self.examples.error}" if self.examples is not None and not self.examples.ok else ""

    def chaotic(self) -> list[int]:
        """The outputs jax.jit itself cannot hold still on random inputs (`chaotic_outputs`)."""
        return chaotic_outputs(self.sensitivity)


class ProgramCheck:
    """Judges fused versions of one program against `ref` (jax.jit of it, compiled), on random inputs from `seeds`
    and, where given, on the caller's input leaves `examples` (graph input order). jax.jit's spreads are measured
    once and kept for every plan judged (a job validates its chosen plan and perhaps smaller ones)."""

    def __init__(self, graph: Graph, ref: Callable, seeds: Sequence[int], examples: Sequence[Any] | None = None):
        self.graph, self.ref, self.seeds = graph, ref, tuple(seeds)
        self.avals = [graph.avals[v] for v in graph.inputs]
        # the caller's leaves as given (on the host for a job): on the device only while they are checked, so that the
        # random-input runs of a program near the card's size keep the room they had (GPT-2 medium's training step:
        # 64.7 GiB of temporaries in a 71 GiB pool, its second run failed out of memory with them held beside it)
        self.examples = None if examples is None else list(examples)
        if self.examples is not None and len(self.examples) != len(self.avals):
            raise ValueError(f"{len(self.examples)} example inputs for a program of {len(self.avals)}")
        self._sens: list[float] | None = None
        self._widened = False  # whether `_sens` is over every seed's nudge
        self._example_sens: list[float] | None = None
        self._example_widened = False
        self._bounds: list[float] | None = None
        self._wide: Callable | None = None

    @property
    def bounds(self) -> list[float]:
        """Per output, its cone's dtype bound (`output_bounds`), found once: a walk of the whole graph, 1.8 s for
        GPT-2 medium's training step on the CPU, which every judging of a plan asked for two to four times."""
        if self._bounds is None:
            self._bounds = output_bounds(self.graph)
        return self._bounds

    def sensitivity(self) -> list[float]:
        """jax.jit's rounding spread on random inputs under the first seed's nudge (measured once)."""
        if self._sens is None:
            self._sens = rounding_sensitivity(self.ref, self.avals, self.seeds[0])
        return self._sens

    def judge(self, fused: Callable) -> ProgramVerdict:
        t0 = time.perf_counter()
        res, self._sens, self._widened = _judged(self._random_check(fused), self.sensitivity(), self._widened, self._widen(None),
                                                 self._as_accurate(fused, self._random_tolerances, None))
        secs = {"check": time.perf_counter() - t0}
        examples = None
        if res.ok and self.examples is not None:
            t1 = time.perf_counter()
            examples = self._check_examples(fused)
            secs["examples"] = time.perf_counter() - t1
        return ProgramVerdict(res, self._sens, examples, secs)

    def _random_check(self, fused: Callable) -> Callable[[list[float]], CheckResult]:
        """Each output held to `program_tolerances`; with the caller's inputs, an output whose bound would come from
        jax.jit's spread rather than its dtype's is left to them (on random inputs that bound is one sample)."""
        def judge(sens: list[float]) -> CheckResult:
            return check(fused, self.ref, self.avals, self.seeds, self._random_tolerances(sens))
        return judge

    def _random_tolerances(self, sens: list[float]) -> list[float | None]:
        tols: list[float | None] = list(program_tolerances(self.bounds, sens))
        if self.examples is not None:
            tols = [None if e > b else t for t, e, b in zip(tols, sens, self.bounds, strict=True)]
        return tols

    def _as_accurate(self, fused: Callable, tolerances: Callable[[list[float]], list[float | None]],
                     args: Sequence[Any] | None) -> Callable[[list[float]], CheckResult]:
        """The plan held to jax.jit's own distance from the float32 program (`check_as_accurate`), on random inputs
        or `args`: the second chance of a plan that failed within MAX_PROGRAM_TOLERANCE. GPT-2 medium's cuDNN training
        step on an H200 refused its chosen plan of 148 groups at 0.0265 from jax.jit on one gradient (seed 2; jax.jit's
        own spread there below the 0.02 bound), and one of its groups alone, the MLP's GEMM with GELU in its epilogue
        (GELU of the float32 accumulator, not of a bf16 rounding of it), at 0.0404: a correct plan that rounds less."""
        def judge(sens: list[float]) -> CheckResult:
            if self._wide is None:
                self._wide = widened(self.graph)
            return check_as_accurate(fused, self.ref, self._wide, self.avals, self.seeds, tolerances(sens), inputs=args)
        return judge

    def _check_examples(self, fused: Callable) -> InputsCheck:
        """The plan on the caller's inputs, held to jax.jit's rounding spread there (tight at a model's real weights)."""
        args = [jnp.asarray(x, dtype=a.dtype) for x, a in zip(self.examples, self.avals, strict=True)]
        if self._example_sens is None:
            self._example_sens = rounding_sensitivity(self.ref, self.avals, self.seeds[0], args=args)

        def judge(sens: list[float]) -> CheckResult:
            return check(fused, self.ref, self.avals, tolerances=example_tolerances(self.bounds, sens), inputs=args)

        res, self._example_sens, self._example_widened = _judged(judge, self._example_sens, self._example_widened, self._widen(args),
                                                                 self._as_accurate(fused, lambda s: example_tolerances(self.bounds, s), args))
        sens = self._example_sens
        return InputsCheck(res.ok, res.max_error, example_tolerances(self.bounds, sens), sens, res.reason)

    def _widen(self, args: Sequence[Any] | None) -> Callable[[list[float]], list[float]]:
        """`sens` widened to the largest move under every seed's nudge (`rounding_spread`): GPT-2 medium's training
        step moved by at most 0.02 under seed 1's where its right plan was 0.043 from jax.jit at seed 2 (H100).
        Asked only after a check failed: the other nudges cost two runs of the whole program each."""
        def widen(sens: list[float]) -> list[float]:
            more = rounding_spread(self.ref, self.avals, self.seeds[1:], args=args) if len(self.seeds) > 1 else sens
            return [max(a, b) for a, b in zip(sens, more, strict=True)]
        return widen


def _judged(judge: Callable[[list[float]], CheckResult], sens: list[float], widened: bool,
            widen: Callable[[list[float]], list[float]],
            as_accurate: Callable[[list[float]], CheckResult]) -> tuple[CheckResult, list[float], bool]:
    """`judge(sens)`; where it fails within MAX_PROGRAM_TOLERANCE and `sens` is still one nudge's, judged again with
    `widen(sens)`; where that fails within it too, by `as_accurate(sens)` (the plan's result no further from float32
    than jax.jit's), which keeps the failure's error against jax.jit when it passes. Returns the result, the spread
    used and whether it is widened."""
    res = judge(sens)
    if not res.ok and res.max_error <= MAX_PROGRAM_TOLERANCE and not widened:
        sens, widened = widen(sens), True
        res = judge(sens)
    if not res.ok and res.max_error <= MAX_PROGRAM_TOLERANCE:
        again = as_accurate(sens)
        res = CheckResult(True, res.max_error, res.tolerance) if again.ok else CheckResult(False, res.max_error, res.tolerance, f"{res.reason}; {again.reason}")
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


def program_tolerances(bounds: Sequence[float], sens: Sequence[float]) -> list[float]:
    """Per output of the whole program: its cone's dtype bound (`bounds`, from `output_bounds`), or jax.jit's rounding
    spread `sens` where larger (at most MAX_PROGRAM_TOLERANCE): the bound of a whole plan against jax.jit."""
    return [max(t, min(e, MAX_PROGRAM_TOLERANCE)) for t, e in zip(bounds, sens, strict=True)]


def example_tolerances(bounds: Sequence[float], sens: Sequence[float]) -> list[float]:
    """`program_tolerances` at the caller's inputs, where an output that is rounding noise there (`sens` at least
    NOISE_SPREAD) is held to NOISE_FACTOR times jax.jit's own move instead. Only at the caller's inputs: on random
    ones such a spread says the program is chaotic there (`chaotic_outputs`), not that the output carries nothing."""
    return [NOISE_FACTOR * e if e >= NOISE_SPREAD else t for t, e in zip(program_tolerances(bounds, sens), sens, strict=True)]


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
    outs = jax.block_until_ready(ref(*args))
    del args  # random inputs are not held beside the second run (a model's weights: its size again)
    moved = ref(*nudged)
    del nudged
    errs = [compare(m, o, 0.0)[1] if np.issubdtype(np.dtype(o.dtype), np.inexact) or o.dtype == jnp.bfloat16 else 0.0
            for o, m in zip(outs, moved)]
    return [e if math.isfinite(e) else 0.0 for e in errs]


def rounding_spread(ref: Callable, avals: Sequence[Any], seeds: Sequence[int], args: Sequence[Any] | None = None) -> list[float]:
    """Per output, the largest `rounding_sensitivity` over `seeds` (each its own random inputs, or the given `args`,
    and its own nudge): one nudge is one sample of the spread."""
    per_seed = [rounding_sensitivity(ref, avals, s, args=args) for s in seeds]
    return [max(e) for e in zip(*per_seed, strict=True)]


def check_program_builders(inputs: Sequence[Any], outputs: Sequence[Any], done: set[tuple] | None = None) -> list[Callable[[], int]]:
    """What compiles, without running them, the small programs that checking a whole plan runs for a program with
    these input and output shapes, one function per distinct shape (each returns how many it compiled): the random
    inputs' view, the nudge's sign and the nudge of `rounding_sensitivity` per input shape and dtype, and the
    comparison of each output (`measure.compile_compare`). One by one they were ~3 s of GPT-2 medium's first
    validation on an H100 (about 15 shapes, three programs each); on the compile threads beside the plan (XLA
    compiles without the GIL), they cost it nothing. `done`: the views and comparisons this process compiled
    already (`measure.compile_beside`), left out, and those made here added."""
    done = set() if done is None else done
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    narrow = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))

    def made(shape: tuple[int, ...], dtype: np.dtype, view: bool) -> int:
        if view:
            compile_view(shape, dtype)
        if dtype not in narrow:
            return int(view)
        compile_view(shape, dtype, "sign")
        _nudged.lower(jax.ShapeDtypeStruct(shape, dtype, sharding=device), jax.ShapeDtypeStruct(shape, jnp.float32, sharding=device)).compile()
        return int(view) + 2

    ins = []
    for sh, d in dict.fromkeys((tuple(a.shape), np.dtype(a.dtype)) for a in inputs):
        view = ("view", sh, d) not in done
        if viewed(sh) and (view or d in narrow):
            ins.append(lambda sh=sh, d=d, view=view: made(sh, d, view))
            done.add(("view", sh, d))
    return ins + compile_beside([], outputs, done)


@jax.jit
def _nudged(x: jax.Array, sign: jax.Array) -> jax.Array:
    """x moved by one rounding step of its dtype, up or down by `sign` (one compiled program per shape)."""
    return (x.astype(jnp.float32) * (1 + 2.0 ** -jnp.finfo(x.dtype).nmant * sign)).astype(x.dtype)
