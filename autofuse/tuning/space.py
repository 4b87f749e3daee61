"""A candidate's search space as the tuner sees it: its template's parameters and constraints, the group's
facts, the default config, and the roofline model's time of any config.

What a config is worth before anything is compiled lives here: whether it
breaks a constraint (infeasible, never compiled), whether the model puts it
far behind the default (pruned on the GPU), which config the model ranks best,
and how a shared-memory failure corrects the group's budget.
"""
from __future__ import annotations

import itertools
import math
import re
import threading
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Sequence

from .. import costmodel
from ..kernels import TEMPLATES
from ..spaces import DEFAULT_BACKEND
from ..status import TrialStatus
from .ledger import CandidateState

PRUNE_FACTOR = 3.0  # on the GPU, configs modelled this much slower than the default are not timed
MODEL_BEST_LIMIT = 20000  # spaces with more configs than this are not enumerated for the model's best


@dataclass
class SearchSpace:
    """One backend's space of a candidate (configs without the "backend" key)."""

    template: str
    params: dict[str, list]
    default: dict
    facts: dict
    constraints: Any  # spaces.Space: the template's parameters and constraints
    model_ms: Callable[[dict], float]
    backend: str = DEFAULT_BACKEND
    check: Callable[[dict], str | None] | None = None  # the lowering's own rules, checked without compiling
    # `model_best`'s answer for the facts it was found with (a space corrected by `learn_shared_memory` has new facts)
    _best: tuple[dict, dict | None] | None = field(default=None, repr=False, compare=False)
    _default_ms: tuple[dict, float] | None = field(default=None, repr=False, compare=False)  # `default_ms`'s, likewise
    _lock: Any = field(default_factory=threading.Lock, repr=False, compare=False)

    @staticmethod
    def of(template: str, group: Any, spec: Any, model: costmodel.GPUModel = costmodel.H200, backend: str = DEFAULT_BACKEND) -> "SearchSpace":
        tmpl = TEMPLATES[template]
        sp = tmpl.space_of(group, spec, backend)
        return SearchSpace(template, sp["params"], sp["default"], sp["facts"], sp["space"],
                           lambda cfg: tmpl.model_time_ms(spec, {**cfg, "backend": backend}, model), backend,
                           lambda cfg: tmpl.unsupported(spec, backend, cfg))

    @property
    def size(self) -> int:
        return math.prod(len(v) for v in self.params.values())

    def complete(self, params: dict) -> dict:
        """A config of the searched `params`, with the default's value for each parameter the space does not search
        (a narrowed space, as matmul_reduce_vjp's backward `bwd_` ones): the config a trial runs is the one a plan
        stores and binds (`plan.bind_plan` wants every parameter of the lowering)."""
        return {**self.default, **params}

    def violated(self, config: dict) -> list[str]:
        broken = self.constraints.violated(config, self.facts)
        why = self.check(config) if self.check is not None and not broken else None
        return broken + ([why] if why else [])

    def unmeasured_reason(self, config: dict, measure: str) -> tuple[TrialStatus, str, int] | None:
        """(infeasible, why, number of broken constraints) for a config that breaks the constraints; (pruned,
        why, 0) on the GPU for one the model puts far behind the default; None for one worth timing."""
        violated = self.violated(config)
        if violated:
            return TrialStatus.INFEASIBLE, "; ".join(violated), len(violated)
        if measure == "device" and self.model_ms(config) > PRUNE_FACTOR * self.default_ms():
            return (TrialStatus.PRUNED, f"modelled {self.model_ms(config):.4f} ms > {PRUNE_FACTOR}x the default's "
                    f"{self.default_ms():.4f} ms", 0)
        return None

    def default_ms(self) -> float:
        """The model's time of the default config, found once per facts (the scheduler asks at every pick, for
        every candidate)."""
        with self._lock:
            if self._default_ms is None or self._default_ms[0] is not self.facts:
                self._default_ms = (self.facts, self.model_ms(self.default))
            return self._default_ms[1]

    def model_best(self) -> dict | None:
        """The feasible config with the lowest modelled time (None for spaces too large to enumerate). Found once
        per facts (enumerating a space takes up to a second: `ahead.prefetch_model_bests` finds them ahead)."""
        with self._lock:
            if self._best is None or self._best[0] is not self.facts:
                feasible = self.feasible()
                self._best = (self.facts, None if feasible is None else min(feasible, key=self.model_ms, default=None))
            best = self._best[1]
        return None if best is None else dict(best)

    def feasible(self) -> Iterator[dict] | None:
        """Every config that breaks no rule (None for spaces too large to enumerate)."""
        if self.size > MODEL_BEST_LIMIT:
            return None
        names = list(self.params)
        configs = (self.complete(dict(zip(names, vals))) for vals in itertools.product(*(self.params[n] for n in names)))
        return (c for c in configs if not self.violated(c))

    def holds(self, config: dict) -> bool:
        """Whether `config` is one of this space's (each searched parameter at one of its choices)."""
        return all(config.get(k) in v for k, v in self.params.items())

    def learn_shared_memory(self, status: TrialStatus, config: dict, error: str | None) -> bool:
        """A config that exhausted shared memory tells how far the space's estimate is off for this group.

        The compiler reports what it asked for ("requested 278528, available 232448":
        Llama's attention with float32 scores needs 2.4x the file's estimate); the
        group's `smem_bytes` fact shrinks by that ratio, so configs needing as much by
        the estimate are skipped unmeasured instead of failing one by one. Returns
        whether the space changed.
        """
        if status is not TrialStatus.RESOURCE_EXHAUSTED:
            return False
        m = _SMEM_REPORT.search(error or "")
        est = self.constraints.demand(config, self.facts, "smem_bytes") if m else None
        if not est or "smem_bytes" not in self.facts:
            return False
        budget = int(int(m.group(2)) * est / int(m.group(1)))
        if budget >= self.facts["smem_bytes"]:
            return False
        self.facts = {**self.facts, "smem_bytes": budget}
        return True

    def copy(self) -> "SearchSpace":
        return replace(self, facts=dict(self.facts), _best=None, _default_ms=None, _lock=threading.Lock())


_SMEM_REPORT = re.compile(r"(?:requested|required|smem_bytes)[:=]?\s*(\d+)\D+?(?:available|hardware limit|max_smem_bytes)[:=]?\s*(\d+)",
                          re.IGNORECASE)


@dataclass
class CandidateSpace:
    """A candidate's search space over its backends: a config names its backend ("backend") and that backend's
    parameters, so Optuna samples a conditional space (the backend first, then its parameters)."""

    spaces: dict[str, SearchSpace]  # by backend, the preferred first
    xla_model_ms: float = 0.0  # the model's time of XLA's option (`Template.xla_model_ms`): phase 1's order until XLA's is measured
    cut_ms: float = 0.0  # what fusing the group costs its neighbours in the program (`costmodel.cut_outputs_ms`)
    #: Backends whose configs are no longer worth a trial here, with why (`scheduler.set_aside_backends`: they lost to
    #: another backend on the job's other candidates of the template); their configs are pruned unmeasured.
    set_aside: dict[str, str] = field(default_factory=dict)
    _worth: dict = field(default_factory=dict, repr=False, compare=False)  # `worth_timing`'s counts, by measure

    @staticmethod
    def of(template: str, group: Any, spec: Any, model: costmodel.GPUModel = costmodel.H200,
           backends: Sequence[str] = (DEFAULT_BACKEND,)) -> "CandidateSpace":
        """The backends of `backends` (in that order) that the template has and that can run this group; a group none
        of them runs has no space (`job.tunable` leaves it to XLA: never another backend in their stead)."""
        usable = usable_backends(template, spec, backends)
        if not usable:
            raise ValueError(f"no backend of {', '.join(backends)} can run this {template} group")
        return CandidateSpace({b: SearchSpace.of(template, group, spec, model, b) for b in usable},
                              TEMPLATES[template].xla_model_ms(group, spec, model), costmodel.cut_outputs_ms(group, model))

    def __getitem__(self, config: dict) -> SearchSpace:
        return self.spaces[config.get("backend", DEFAULT_BACKEND)]

    @staticmethod
    def _params(config: dict) -> dict:
        return {k: v for k, v in config.items() if k != "backend"}

    @property
    def size(self) -> int:
        return sum(sp.size for sp in self.spaces.values())

    @property
    def default(self) -> dict:
        b, sp = next(iter(self.spaces.items()))
        return {"backend": b, **sp.default}

    def model_ms(self, config: dict) -> float:
        return self[config].model_ms(self._params(config))

    def default_ms(self) -> float:
        """The model's time of the default config (the preferred backend's)."""
        return next(iter(self.spaces.values())).default_ms()

    def violated(self, config: dict) -> list[str]:
        return self[config].violated(self._params(config))

    def unmeasured_reason(self, config: dict, measure: str) -> tuple[TrialStatus, str, int] | None:
        why = self.set_aside.get(config.get("backend", DEFAULT_BACKEND))
        if why and not self.violated(config):
            return TrialStatus.PRUNED, why, 0
        reason = self[config].unmeasured_reason(self._params(config), measure)
        if reason and reason[0] is TrialStatus.PRUNED:  # pruned against the candidate's default, whatever its backend
            return reason if self.model_ms(config) > PRUNE_FACTOR * self.default_ms() else None
        return reason

    def model_best(self) -> dict | None:
        best = [{"backend": b, **c} for b, sp in self.spaces.items() for c in [sp.model_best()] if c is not None]
        return min(best, key=self.model_ms) if best else None

    def explored(self, tried: Sequence[dict], measure: str) -> bool:
        """Whether every config worth timing is among `tried` (False where a backend's space is too large to
        enumerate): TPE proposes configs done already once a small space is explored, and no more trials of it can
        measure anything new."""
        n = self.worth_timing(measure)
        done = {config_key(c) for c in tried if c.get("backend", DEFAULT_BACKEND) in self.spaces and self[c].holds(c)
                and self.unmeasured_reason(c, measure) is None}
        return n is not None and len(done) >= n

    def worth_timing(self, measure: str) -> int | None:
        """How many configs break no rule and are not pruned (None where a backend's space is too large to
        enumerate): counted once per measure and facts."""
        facts = (*(sp.facts for sp in self.spaces.values()), frozenset(self.set_aside))
        known = self._worth.get(measure)
        if known is None or any(a is not b and a != b for a, b in zip(known[0], facts)):
            feasible = {b: sp.feasible() for b, sp in self.spaces.items()}
            n = None if any(f is None for f in feasible.values()) else sum(
                1 for b, f in feasible.items() for c in f if self.unmeasured_reason({"backend": b, **c}, measure) is None)
            known = self._worth[measure] = (facts, n)
        return known[1]

    def defaults(self) -> list[dict]:
        """Each backend's default, the preferred backend first: what a new study is created with."""
        return [{"backend": b, **sp.default} for b, sp in self.spaces.items()]

    def first_configs(self) -> list[dict]:
        """A new study's first trials: each backend's default (the preferred backend first), then the model's best."""
        out = self.defaults()
        best = self.model_best()
        return out + ([best] if best is not None and best not in out else [])

    def learn_shared_memory(self, status: TrialStatus, config: dict, error: str | None) -> bool:
        return self[config].learn_shared_memory(status, self._params(config), error) if config.get("backend", DEFAULT_BACKEND) in self.spaces else False

    def suggest(self, trial: Any) -> dict:
        """A config from an Optuna trial: the backend, then that backend's parameters (named `<backend>.<name>` in
        Optuna beside Triton's plain names: a name has one set of choices per study)."""
        backend = trial.suggest_categorical("backend", list(self.spaces))
        sp = self.spaces[backend]
        return {"backend": backend, **sp.complete({k: trial.suggest_categorical(_optuna_name(backend, k), v) for k, v in sp.params.items()})}

    def neighbours(self, config: dict, measure: str) -> list[dict]:
        """The configs of `config`'s backend one searched parameter away from it that are worth timing, the model's
        fastest first (ties in the space's order of parameters and choices): phase 2's next configs of a candidate,
        around its best (`queue_neighbours`). TPE's first proposals are random, and in a Mosaic GPU GEMM's space
        of ~230,000 configs most break a rule or run far slower: GPT-2's cuDNN step at 40 trials measured four of
        them, 0.12-0.93x its default (results/lost_regions_h200.md)."""
        b = config.get("backend", DEFAULT_BACKEND)
        if b not in self.spaces:
            return []
        sp, params = self.spaces[b], self._params(config)
        out = [{"backend": b, **sp.complete({**params, name: v})}
               for name, choices in sp.params.items() for v in choices if params.get(name) != v]
        return sorted((c for c in out if self.unmeasured_reason(c, measure) is None), key=self.model_ms)

    def optuna_params(self, config: dict) -> dict:
        """A config as Optuna's parameters (what `suggest` would have named them: the searched ones), for enqueueing it."""
        b = config.get("backend", DEFAULT_BACKEND)
        searched = self.spaces[b].params
        return {"backend": b, **{_optuna_name(b, k): v for k, v in config.items() if k in searched}}


def usable_backends(template: str, spec: Any, backends: Sequence[str]) -> list[str]:
    """The backends of `backends` (in that order) that `template` has a lowering for and that can run the group `spec`
    describes (checked without compiling)."""
    tmpl = TEMPLATES[template]
    return [b for b in backends if b in tmpl.backends and tmpl.unsupported(spec, b) is None]


def queue_neighbours(study: Any, space: CandidateSpace, cand: CandidateState, k: int, measure: str, seen: set[tuple] = frozenset(),
                     attrs: dict | None = None) -> list[dict]:
    """Queues in `study` up to `k` of the neighbours of the candidate's best config (`CandidateSpace.neighbours`)
    that it has not tried and that are not in `seen` (configs queued already); returns them. Phase 2's configs, before
    its sampler's: a local search around the best. `attrs`: the queued trials' user attributes."""
    if cand.best_config is None or k < 1:
        return []
    tried = {config_key(t.config) for t in cand.trials} | set(seen)
    out = [c for c in space.neighbours(cand.best_config, measure) if config_key(c) not in tried][:k]
    for c in out:
        study.enqueue_trial(space.optuna_params(c), user_attrs=attrs)
    return out


def sampler(seed: int) -> Any:
    """The sampler of a candidate's study (and of the copy phase 2 asks ahead, `ahead.CompileAhead`): TPE, seeded;
    the constant liar takes running trials (other workers', those asked before in the same batch) for bad ones, so
    that several asked at once differ."""
    import optuna

    return optuna.samplers.TPESampler(seed=seed % 2**31, n_startup_trials=4, constant_liar=True)


def config_key(config: dict) -> tuple:
    """A config as a hashable key (one config, whatever its keys' order)."""
    return tuple(sorted(config.items()))


def _optuna_name(backend: str, param: str) -> str:
    return param if backend == DEFAULT_BACKEND else f"{backend}.{param}"
