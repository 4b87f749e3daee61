"""The typed boundary between the tuner and the trial process: requests, results, and the `Runner` protocol.

Everything here crosses a process boundary (pickled), so it is plain data:
node ids, configs of scalars, a plan as JSON text. A runner answers every
request with a result, never an exception: a kernel that fails to build, is
wrong, crashes or hangs is a result with that status.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Union

from ..status import TrialStatus


@dataclass(frozen=True)
class XlaRequest:
    """Time a group as XLA runs it (or model that time)."""

    nodes: tuple[int, ...]


@dataclass(frozen=True)
class TrialRequest:
    """Build one config of a template for a group, check it against XLA, time it."""

    nodes: tuple[int, ...]
    template: str
    config: dict
    check: bool | None = None  # None: check on the device (model mode checks only the configs that may be chosen)


@dataclass(frozen=True)
class ProgramRequest:
    """jax.jit of the whole program, which every plan's validation is checked and timed against: an item of a
    `CompileRequest` only, sent with the XLA timings' first batch so that the selection finds it built (GPT-2
    medium's forward: 4.6 s of its first plan's 15, compiled there on the critical path)."""


@dataclass(frozen=True)
class CompileRequest:
    """Compile ahead, concurrently on `workers` threads, what later XLA, trial and validation requests will time one
    at a time (a validation's whole plan, and once the whole program's jax.jit reference).

    Compilation is CPU work (XLA releases the GIL while it compiles); timing needs
    the GPU alone. The later requests find their executables compiled (an item that
    failed to compile is compiled again, and fails, in its own request), so the
    results are those of the serial path. `timeout_s` bounds the whole batch
    (None: the runner's per-request limit).
    """

    items: tuple[CompileItem, ...]
    workers: int
    timeout_s: float | None = None


@dataclass(frozen=True)
class CompileResult:
    """What a `CompileRequest` did: items compiled, items that failed, the wall time, and per kind of item
    ("program": jax.jit's whole program, "plan", "xla", "trial") the longest compilation of one, in seconds; the
    kernels lowered by helper processes (`lowering_pool`)."""

    status: TrialStatus
    compiled: int = 0
    failed: int = 0
    seconds: float = 0.0
    error: str | None = None
    longest: dict = field(default_factory=dict)
    lowered_apart: int = 0

    @property
    def ok(self) -> bool:
        return self.status is TrialStatus.OK


@dataclass(frozen=True)
class ValidateRequest:
    """Check a whole plan against jax.jit of the whole program and time both."""

    plan_json: str


@dataclass(frozen=True)
class CompareRequest:
    """Time two validated whole plans against each other, alternating, over more pairs than a validation: which is
    faster where each against jax.jit could not tell (a 1 ms difference in a 100 ms training step is within the
    noise of eight pairs)."""

    first_json: str
    second_json: str


@dataclass(frozen=True)
class ProfileRequest:
    """Trace jax.jit's whole program and return XLA's kernels with the nodes each computes (`profile.py`): what
    fusing a group removes from the program, which its time alone does not say. As an item of a `CompileRequest`,
    the program the profile runs compiled ahead (with the XLA timings' first batch: GPT-2's step, 10-12 s)."""


Request = Union[XlaRequest, TrialRequest, CompileRequest, ValidateRequest, CompareRequest, ProfileRequest]
#: What a `CompileRequest` compiles ahead: what later requests time (a `ProgramRequest` and a `ProfileRequest` only here).
CompileItem = Union[XlaRequest, TrialRequest, ValidateRequest, ProgramRequest, ProfileRequest]


@dataclass(frozen=True)
class Timing:
    """Per-call time over repeats (each repeat: many back-to-back calls, one sync): median, range and quartiles."""

    median_ms: float
    min_ms: float
    max_ms: float
    q1_ms: float
    q3_ms: float
    calls_per_sync: int = 1
    repeats: int = 0

    @property
    def spread(self) -> float:
        """Interquartile range relative to the median."""
        return (self.q3_ms - self.q1_ms) / self.median_ms


@dataclass(frozen=True)
class TrialResult:
    """What one XLA timing or one kernel trial gave. Times are modelled where `modelled`."""

    status: TrialStatus
    median_ms: float | None = None
    min_ms: float | None = None
    max_ms: float | None = None
    error: str | None = None
    max_error: float | None = None
    modelled: bool = False
    device: str | None = None  # where it ran: "gpu:0 NVIDIA H100 80GB HBM3 (CUDA_VISIBLE_DEVICES=1)"
    # a kernel trial's parts in seconds: "build" (lowered and compiled, or taken ready; of it "build_lower", the
    # jitted group's tracing and lowering around a kernel `build_group` lowered already, into or out of
    # `kernel_cache`, and "build_compile", XLA's compile), "check" (against XLA on fresh inputs), "alone" (its timed
    # form compiled, where the template times it otherwise), "time"
    seconds: dict[str, float] | None = None

    @property
    def ok(self) -> bool:
        return self.status is TrialStatus.OK


@dataclass(frozen=True)
class InputsCheck:
    """The whole plan on the caller's own inputs, held to jax.jit's rounding spread there."""

    ok: bool
    max_error: float
    tolerance: list[float]
    rounding_sensitivity: list[float]
    error: str = ""


@dataclass(frozen=True)
class ValidationResult:
    """A whole plan against jax.jit: correctness (random inputs, and the caller's when given), then both timed."""

    status: TrialStatus
    max_error: float = 0.0
    tolerance: dict = field(default_factory=dict)
    error: str | None = None
    rounding_sensitivity: list[float] = field(default_factory=list)
    example_inputs: InputsCheck | None = None
    baseline: Timing | None = None  # jax.jit of the whole program (device mode)
    plan: Timing | None = None  # the plan (device mode), timed in alternation with the baseline
    ratio: Timing | None = None  # plan / baseline, per alternation (its spread is the comparison's noise)
    seconds: dict = field(default_factory=dict)  # where the validation's time went: compile, reference, check, examples, time
    peak_bytes: int | None = None  # the plan's program: XLA's peak device memory (arguments, outputs, temporaries)
    baseline_peak_bytes: int | None = None  # jax.jit's program, the same way

    @property
    def ok(self) -> bool:
        return self.status is TrialStatus.OK


@dataclass(frozen=True)
class ComparisonResult:
    """Two plans timed in alternation (`CompareRequest`): each one's time and the ratio second / first per pair."""

    status: TrialStatus
    first: Timing | None = None
    second: Timing | None = None
    ratio: Timing | None = None
    error: str | None = None
    seconds: dict = field(default_factory=dict)  # compile (of what was not held compiled), time

    @property
    def ok(self) -> bool:
        return self.status is TrialStatus.OK

    @property
    def second_faster(self) -> bool:
        """The second plan was faster in more pairs than not (the ratio's median below 1). Both plans passed their
        validation against jax.jit, so a near tie costs nothing either way, while asking for three pairs of four kept
        the slower plan of most near ties: GPT-2's step kept a plan that had realised 1.2 ms less (ratio 0.990,
        quartiles 0.977..1.001 over 19 pairs, results/concat_once_h200.md)."""
        return self.ok and self.ratio is not None and self.ratio.median_ms < 1.0


@dataclass(frozen=True)
class XlaKernel:
    """One of XLA's kernels in the whole program: the HLO instruction that launched it, its device time per call of
    the program (every launch), the program's nodes its metadata names (empty: none known, a memset), and XLA's kind
    of fusion where the instruction is one (kLoop, kInput: XLA's own elementwise and reduction emitters; kCustom: a
    Triton GEMM; "" otherwise)."""

    instruction: str
    ms: float
    nodes: frozenset[int]
    fusion_kind: str = ""


@dataclass(frozen=True)
class ProfileResult:
    """XLA's kernels in the whole program (`ProfileRequest`), longest first; none without a device trace."""

    status: TrialStatus
    kernels: tuple[XlaKernel, ...] = ()
    error: str | None = None
    seconds: dict = field(default_factory=dict)  # compile, trace

    @property
    def ok(self) -> bool:
        return self.status is TrialStatus.OK


Result = Union[TrialResult, CompileResult, ValidationResult, ComparisonResult, ProfileResult]


class Runner(Protocol):
    """Answers requests for one program: in this process, or in an isolated child process."""

    def call(self, request: Request) -> Any:
        ...

    def close(self) -> None:
        ...

    def restart(self) -> None:
        """The next request answered by a fresh evaluator (a fresh child process where there is one)."""
        ...


def failed(request: Request, status: TrialStatus, error: str) -> Result:
    """The result of a request that could not be answered (the trial process crashed, hung or raised)."""
    if isinstance(request, ValidateRequest):
        return ValidationResult(status, error=error)
    if isinstance(request, CompareRequest):
        return ComparisonResult(status, error=error)
    if isinstance(request, CompileRequest):
        return CompileResult(status, failed=len(request.items), error=error)
    if isinstance(request, ProfileRequest):
        return ProfileResult(status, error=error)
    return TrialResult(status, error=error)
