"""The `Template` base class: what the partitioner, the search and the plan executor ask of a kernel template.

A template knows one loop structure. Matching a group, the facts its search
spaces' constraints read and its cost model do not depend on how the kernel is
written, so they live with the template; everything that does lives in one
lowering module per backend, `autofuse.kernels.<backend>.<name>`, and every
backend's module has the same shape (`Lowering`), so this base names none:
adding a backend is writing those modules and naming it in `backends`.
"""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import Any, Callable, Generic, Protocol, TypeVar

from ..costmodel import H200, GPUModel, xla_group_time_ms
from ..differentiate import VJPRule
from ..graph import Graph, Group
from ..spaces import DEFAULT_BACKEND, space_key
from .tiling import NoMatch, template_space

Spec = TypeVar("Spec")


class Lowering(Protocol):
    """What a backend's lowering module of one template holds (`Template.lowering_module`).

    Required: `PARAMS` (the config keys, the parameters of `search_spaces/<template>[.<backend>].toml`),
    `default_config(spec) -> dict` (good without tuning: the search's first trial) and
    `lower(group, spec, config, *, interpret) -> Callable`. Optional: `lower_stages(group, spec, stages, config, *,
    interpret)` for a template with `stage_split`; `lower_alone(group, spec, config, *, interpret)`, the kernel as the
    tuner times it alone where the program's readers absorb part of what `lower`'s function does (`aligned_dot`'s
    slice of its padded product, which XLA fuses into the product's readers); `check_group(spec)` and `check_config(spec, config)`, which raise
    NotImplementedError for what the lowering cannot run (found without compiling; `config` is `Config.of(dict)`
    where the module defines a `Config`, else the dict). A lowering without them runs whatever its space allows.
    `XLA_KERNELS = True` where the lowering is XLA's own operations (no Pallas kernel: `Template.xla_kernels`).
    """

    PARAMS: tuple[str, ...]

    def default_config(self, spec: Any) -> dict: ...

    def lower(self, group: Group, spec: Any, config: dict, *, interpret: Any) -> Callable: ...


class Template(ABC, Generic[Spec]):
    """A kernel template. Subclasses set the class attributes and implement the abstract methods.

    `match` returns the template's own spec type (what it read off the group); the
    other methods take it back, so a group is analysed once per candidate.
    """

    name: str  # the registry key, the search-space file and the lowering modules' name
    defaults: dict[str, int] = {}  # values for params added after plans were stored (read-only)
    backends: tuple[str, ...] = (DEFAULT_BACKEND,)  # the backends with a lowering module of this template

    @abstractmethod
    def match(self, group: Group) -> Spec | None:
        """What the template reads off `group` (the structure it needs), or None if it cannot run it."""

    @abstractmethod
    def facts(self, group: Group, spec: Spec) -> dict:
        """What the search spaces' constraints read about the group besides the parameters (sizes, itemsize, ...):
        the same for every backend."""

    @abstractmethod
    def model_time_ms(self, spec: Spec, config: dict, model: GPUModel = H200) -> float:
        """Modelled time of the kernel with `config` on `model` (orders and prunes configs before any is timed)."""

    def xla_model_ms(self, group: Group, spec: Spec, model: GPUModel = H200) -> float:
        """Modelled time of XLA's option for `group` (phase 1's order until XLA's is measured): its own fusion of the
        group's ops. A template whose group is a library call overrides it (`attention`: cuDNN)."""
        return xla_group_time_ms(group, model)

    def build(self, group: Group, config: dict, *, backend: str = DEFAULT_BACKEND, interpret: bool = False,
              spec: Spec | None = None) -> Callable:
        """The kernel for `group` with `config`, lowered through `backend`: a function of the group's inputs
        returning its outputs. `spec` (from `match`) saves matching again."""
        lower = self.lowering(backend)
        spec = spec if spec is not None else self.match(group)
        if spec is None:
            raise NoMatch(f"{self.name} does not match this group")
        return lower(group, spec, {**self.defaults, **config}, interpret=interpret)

    def build_alone(self, group: Group, config: dict, *, backend: str = DEFAULT_BACKEND, interpret: bool = False,
                    spec: Spec | None = None) -> Callable | None:
        """The kernel as timed alone, where the backend's lowering has a `lower_alone` (else None: `build`'s is)."""
        lower = getattr(self.lowering_module(backend), "lower_alone", None)
        spec = spec if spec is not None else self.match(group)
        if lower is None or spec is None:
            return None
        return lower(group, spec, {**self.defaults, **config}, interpret=interpret)

    def timing_inputs(self, group: Group, spec: Spec) -> dict[int, int]:
        """Group inputs held at one value (input value id -> the value every element takes) when a kernel of the group
        is timed alone; checked, they stay random. Where a kernel's work depends on an input's values (attention
        stopping at each row's key length), random values could flatter it: the template names the values of the
        unreduced work. None by default."""
        return {}

    def leaner_config(self, spec: Spec, config: dict) -> dict | None:
        """A config of the same group that holds less device memory, for a plan over a job's memory cap
        (`tune(max_memory=)`), or None (the default): `aligned_region`'s run in chunks of its rows."""
        return None

    def vjp_rule(self, group: Group, config: dict, *, backend: str = DEFAULT_BACKEND, interpret: bool = False) -> VJPRule | None:
        """The template's own reverse-mode rule for `group` (cheaper residuals, a generated backward kernel), or
        None: the plan then saves the group's inputs and differentiates its sub-jaxpr in XLA
        (`autofuse.differentiate.recompute_rule`)."""
        return None

    def candidate_groups(self, graph: Graph, fusible: Callable[[int], bool]) -> list[tuple[Group, Spec, tuple[frozenset[int], ...]]]:
        """Groups the partitioner's growth by neighbours cannot find (of any size, or not convex but run in stages),
        each as (group, spec, stages: () for one kernel); `fusible(node_id)` says which nodes a group may hold. The
        partitioner asks every registered template, so a template that finds its own groups needs no edit there."""
        return []

    offers_row_sums = False  # the partitioner also offers this template's groups with the sums over their rows

    def stage_split(self, spec: Spec) -> tuple[frozenset[int], ...] | None:
        """For a template whose group may run in stages (`plan.FusedGroup.stages`): the matched group's nodes split
        into them, in order; None for a template that runs each group as one kernel."""
        return None

    def build_stages(self, group: Group, stages, config: dict, *, backend: str = DEFAULT_BACKEND, interpret: bool = False,
                     spec: Spec | None = None) -> list[Callable]:
        """The stage functions of `group` run in `stages` (its `stage_split`): `stage(ins, private) -> (outs,
        private)`, with `ins`/`outs` those of `graph.stage_groups(group, stages)` and `private` what the stage
        before handed on. From the backend's `lower_stages(group, spec, stages, config, *, interpret)`."""
        spec = spec if spec is not None else self.match(group)
        if spec is None or self.stage_split(spec) is None:
            raise NoMatch(f"{self.name} does not run this group in stages")
        return self.lowering_module(backend).lower_stages(group, spec, stages, {**self.defaults, **config}, interpret=interpret)

    def xla_kernels(self, backend: str) -> bool:
        """Whether the backend's lowering of this template runs XLA's own operations (its module's `XLA_KERNELS`):
        the model then errs on it as it errs on XLA's option of the group (`scheduler.default_ms`)."""
        return backend in self.backends and bool(getattr(self.lowering_module(backend), "XLA_KERNELS", False))

    def lowering(self, backend: str) -> Callable:
        """The backend's `lower(group, spec, config, *, interpret)` for this template, imported on first use (a
        plan loads only the backends it runs)."""
        return self.lowering_module(backend).lower

    def lowering_module(self, backend: str, name: str | None = None) -> Lowering:
        """The module `autofuse.kernels.<backend>.<name>` (`name`: this template's, or another's that this template
        borrows from). A template outside this package overrides this (or the methods that use it)."""
        if backend not in self.backends:
            raise ValueError(f"template {self.name!r} has no {backend!r} lowering; its backends: {', '.join(self.backends)}")
        return importlib.import_module(f"{__package__}.{backend}.{name or self.name}")

    def params_of(self, backend: str = DEFAULT_BACKEND) -> tuple[str, ...]:
        """The config keys of `backend`'s lowering."""
        return tuple(self.lowering_module(backend).PARAMS)

    def default_config_of(self, spec: Spec, backend: str = DEFAULT_BACKEND) -> dict:
        """`backend`'s config that is good without tuning (the search's first trial)."""
        return self.lowering_module(backend).default_config(spec)

    def space_of(self, group: Group, spec: Spec | None = None, backend: str = DEFAULT_BACKEND) -> dict:
        """`backend`'s search space (`search_spaces/<name>[.<backend>].toml`) with the group's facts: {"params": choices
        per param, "default": config, "facts": what constraints read, "space": Space}."""
        spec = spec if spec is not None else self.match(group)
        return template_space(space_key(self.name, backend), self.default_config_of(spec, backend), self.facts(group, spec))

    def default_model_ms(self, spec: Spec, model: GPUModel = H200) -> float:
        """The model's time of the fastest backend default that runs the group."""
        return min(self.model_time_ms(spec, {**self.default_config_of(spec, b), "backend": b}, model)
                   for b in self.backends if self.unsupported(spec, b) is None)

    def unsupported(self, spec: Spec, backend: str, config: dict | None = None) -> str | None:
        """Why `backend`'s lowering cannot run this group (or this config of it), found without compiling; None if it can."""
        mod = self.lowering_module(backend)
        try:
            if hasattr(mod, "check_group"):
                mod.check_group(spec)
            if config is not None and hasattr(mod, "check_config"):
                mod.check_config(spec, mod.Config.of(config) if hasattr(mod, "Config") else config)
        except NotImplementedError as e:
            return str(e)
        return None

    @property
    def preferred_backend(self) -> str:
        """The backend a caller naming none gets: the default one (what stored plans without a "backend" ran on), or
        this template's first where it has no lowering there (`aligned_dot`'s is XLA's own operations)."""
        return DEFAULT_BACKEND if DEFAULT_BACKEND in self.backends else self.backends[0]

    # The preferred backend's, for callers that name none (and stored plans without a "backend").
    @property
    def params(self) -> tuple[str, ...]:
        return self.params_of(self.preferred_backend)

    def default_config(self, spec: Spec) -> dict:
        return self.default_config_of(spec, self.preferred_backend)

    def space(self, group: Group, spec: Spec | None = None) -> dict:
        return self.space_of(group, spec, self.preferred_backend)
