"""The `Plan` (which groups run as which template with which config) and its executor.

A plan is data: versioned JSON, validated on load, never pickle, so loading
one never executes stored code. The executor turns a graph and a plan into
one function: fused groups as `pallas_call`s, every other node re-bound as
its original primitive. Wrap it in `jax.jit`.

Two-stage groups (schema 3). A group may run in *stages*: its nodes split into
ordered sets (`FusedGroup.stages`), each convex on its own while the union need
not be. The case it exists for is attention in a training step (template
`attention_vjp`): stage 1 is the forward chain (the flash forward, emitting O
and the row logsumexp), stage 2 its backward (dQ, dK, dV from the inputs, O, the
logsumexp and dO); dO depends on O through the rest of the network, so the two
cannot be one unit. The executor orders each stage as a unit of its own
(`graph.execution_order` with the stages as a chain) and passes what one stage
hands the next (the logsumexp, the saved inputs and output) privately: those
values live only in the executor, never in the program's environment. The
template says how its group splits (`Template.stage_split`) and runs each stage
(`Template.build_stages`); `bind_plan` checks that the recorded stages are that
split, cover the group's nodes exactly and are each convex. A staged group has
no VJP of its own (it already is a backward): differentiating a plan through
one raises a clear error.
"""
from __future__ import annotations

from collections import Counter

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax

from . import compile_cache, kernel_cache
from .differentiate import differentiable
from .graph import Graph, Group, bind_node, execution_order, read_atom, stage_groups
from .kernels import TEMPLATES

SCHEMA_VERSION = 3  # 3: a group may run in stages ("stages"); 2: each group names its backend (1: every group ran on Triton)
READABLE_VERSIONS = (1, 2, 3)


class PlanError(ValueError):
    """A plan that is malformed or does not fit the program it is applied to."""


@dataclass(frozen=True)
class FusedGroup:
    nodes: tuple[int, ...]
    template: str
    config: dict
    signature: str
    backend: str = "triton"  # which lowering of the template runs it ("triton", "mosaic_gpu")
    stages: tuple[tuple[int, ...], ...] = ()  # a group run in stages: its nodes split into them, in order (empty: one unit)

    def to_dict(self) -> dict:
        d = {"nodes": list(self.nodes), "template": self.template, "backend": self.backend, "config": dict(self.config),
             "signature": self.signature}
        if self.stages:
            d["stages"] = [list(st) for st in self.stages]
        return d


@dataclass(frozen=True)
class Plan:
    """A fused program: the groups to run as generated kernels; everything else runs in XLA."""

    fingerprint: str
    groups: tuple[FusedGroup, ...] = ()
    provenance: dict = field(default_factory=dict)  # how it was made: {"measure": "device"|"model"|"default", ...}

    @property
    def is_xla(self) -> bool:
        return not self.groups

    @property
    def backends(self) -> tuple[str, ...]:
        """The backends its groups run on."""
        return tuple(sorted({g.backend for g in self.groups}))

    def to_dict(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION,
            "fingerprint": self.fingerprint,
            "groups": [g.to_dict() for g in self.groups],
            "provenance": self.provenance,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @staticmethod
    def from_json(text: str | bytes) -> "Plan":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"plan is not valid JSON: {e}") from None
        return Plan.from_dict(data)

    @staticmethod
    def from_dict(data: Any) -> "Plan":
        _expect(isinstance(data, dict), "plan must be a JSON object")
        version = data.get("schema_version")
        _expect(type(version) is int and version in READABLE_VERSIONS,
                f"unknown plan schema_version {version!r} (this autofuse reads {', '.join(map(str, READABLE_VERSIONS))})")
        extra = set(data) - {"schema_version", "fingerprint", "groups", "provenance"} - ({"backend"} if version == 1 else set())
        _expect(not extra, f"unknown plan keys {sorted(extra)}")
        _expect(isinstance(data.get("fingerprint"), str) and data["fingerprint"], "plan.fingerprint must be a non-empty string")
        _expect(version != 1 or data.get("backend") == "triton", f"plan.backend must be 'triton' in a version 1 plan, got {data.get('backend')!r}")
        _expect(isinstance(data.get("provenance", {}), dict), "plan.provenance must be an object")
        groups = data.get("groups")
        _expect(isinstance(groups, list), "plan.groups must be a list")
        out, seen = [], set()
        for k, g in enumerate(groups):
            where = f"plan.groups[{k}]"
            keys = {"nodes", "template", "config", "signature"} | ({"backend"} if version >= 2 else set())
            optional = {"stages"} if version >= 3 else set()
            _expect(isinstance(g, dict) and keys <= set(g) <= keys | optional,
                    f"{where} must have exactly {', '.join(sorted(keys))}" + (f" (and optionally {', '.join(sorted(optional))})" if optional else ""))
            nodes = g["nodes"]
            _expect(isinstance(nodes, list) and nodes and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in nodes), f"{where}.nodes must be a non-empty list of node ids")
            _expect(not (set(nodes) & seen), f"{where} overlaps another group")
            seen |= set(nodes)
            _expect(g["template"] in TEMPLATES, f"{where}.template {g['template']!r} is not a known template {sorted(TEMPLATES)}")
            backend = g.get("backend", "triton")
            _expect(backend in TEMPLATES[g["template"]].backends,
                    f"{where}.backend {backend!r} is not a backend of template {g['template']} {list(TEMPLATES[g['template']].backends)}")
            cfg = g["config"]
            _expect(isinstance(cfg, dict) and all(isinstance(v, (int, float, str, bool)) for v in cfg.values()), f"{where}.config must map names to scalars")
            _expect(isinstance(g["signature"], str), f"{where}.signature must be a string")
            stages = g.get("stages", [])
            _expect(isinstance(stages, list) and len(stages) != 1 and all(
                isinstance(st, list) and st and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in st) for st in stages),
                f"{where}.stages must be a list of at least two non-empty lists of node ids")
            if stages:
                _expect(not _stage_split_error(nodes, stages), f"{where}.stages {_stage_split_error(nodes, stages)}")
            out.append(FusedGroup(tuple(sorted(nodes)), g["template"], dict(cfg), g["signature"], backend,
                                  tuple(tuple(sorted(st)) for st in stages)))
        return Plan(data["fingerprint"], tuple(out), dict(data.get("provenance", {})))


def _expect(cond: bool, msg: str) -> None:
    if not cond:
        raise PlanError(msg)


def _stage_split_error(nodes: Sequence[int], stages: Sequence[Sequence[int]]) -> str | None:
    """Why `stages` do not split `nodes` exactly (every node in one stage), or None."""
    seen: set[int] = set()
    twice = sorted({i for st in stages for i in st if i in seen or seen.add(i)})
    missing, extra = sorted(set(nodes) - seen), sorted(seen - set(nodes))
    if twice or missing or extra:
        return ("do not split the group's nodes:" + (f" nodes {missing} are in no stage" if missing else "")
                + (f" nodes {extra} are not the group's" if extra else "") + (f" nodes {twice} are in two stages" if twice else ""))
    return None


def _check_stages(graph: Graph, fg: FusedGroup, spec: Any) -> None:
    """A staged group's stages: they split its nodes, they are the template's own split, each is convex."""
    where = f"plan group {list(fg.nodes)}"
    if len(fg.stages) < 2:
        raise PlanError(f"{where}: a group in stages needs at least two, got {len(fg.stages)}")
    why = _stage_split_error(fg.nodes, fg.stages)
    if why:
        raise PlanError(f"{where}: its stages {why}")
    split = TEMPLATES[fg.template].stage_split(spec)
    if split is None:
        raise PlanError(f"{where}: template {fg.template} does not run in stages")
    if [tuple(sorted(st)) for st in split] != [tuple(sorted(st)) for st in fg.stages]:
        raise PlanError(f"{where}: its stages are not template {fg.template}'s split of the group "
                        f"(stage sizes {[len(st) for st in fg.stages]}, the template's {[len(st) for st in split]})")
    for k, st in enumerate(fg.stages):
        try:
            execution_order(graph, [frozenset(st)])
        except ValueError:
            raise PlanError(f"{where}: stage {k + 1} (nodes {list(st)}) is not convex: a path leaves it and comes back") from None


def plan_units(bound: Sequence[tuple[Group, FusedGroup]]) -> tuple[list[frozenset[int]], list[list[int]], list[tuple[int, int]]]:
    """The executor's units of bound groups: node sets (one per group, or one per stage of a staged group), the
    chains of unit indices that run in order (each staged group's stages), and each unit's (group, stage)."""
    units, chains, owner = [], [], []
    for k, (_, fg) in enumerate(bound):
        if fg.stages:
            chains.append(list(range(len(units), len(units) + len(fg.stages))))
            for s, st in enumerate(fg.stages):
                units.append(frozenset(st))
                owner.append((k, s))
        else:
            units.append(frozenset(fg.nodes))
            owner.append((k, -1))
    return units, chains, owner


def bind_plan(graph: Graph, plan: Plan) -> list[tuple[Group, FusedGroup]]:
    """Check that `plan` was made for `graph` and return its groups on it."""
    if plan.fingerprint != graph.fingerprint:
        raise PlanError(f"plan is for program {plan.fingerprint}, not {graph.fingerprint}")
    out = []
    for fg in plan.groups:
        if max(fg.nodes) >= len(graph.nodes):
            raise PlanError(f"plan group names node {max(fg.nodes)} but the program has {len(graph.nodes)}")
        group = Group.of(graph, fg.nodes)
        if group.signature != fg.signature:
            raise PlanError(f"plan group {list(fg.nodes)} does not match the program (signature {group.signature} != {fg.signature})")
        mod = TEMPLATES[fg.template]
        defaults = mod.defaults  # parameters added after plans were stored
        missing = set(mod.params_of(fg.backend)) - set(fg.config) - set(defaults)
        if missing:
            raise PlanError(f"plan group {list(fg.nodes)}: config lacks {sorted(missing)}")
        spec = mod.match(group)
        if spec is None:
            raise PlanError(f"plan group {list(fg.nodes)}: template {fg.template} does not match group")
        if fg.stages:
            _check_stages(graph, fg, spec)
        choices = mod.space_of(group, None, fg.backend)["params"]
        for k in mod.params_of(fg.backend):
            v = fg.config.get(k, defaults.get(k))
            if isinstance(v, bool) or v not in choices.get(k, [v]):
                raise PlanError(f"plan group {list(fg.nodes)}: config {k}={v!r} is not one of the search space's choices {choices.get(k)}")
        out.append((group, fg))
    units, chains, _ = plan_units(out)
    try:
        execution_order(graph, units, chains)
    except ValueError as e:
        raise PlanError(f"plan groups cannot be ordered ({e}): a group is not convex (one whose forward and backward "
                        "are not convex together runs in stages), or two groups need each other's outputs") from None
    return out


def default_interpret() -> bool:
    """Pallas runs compiled (Triton) on a GPU, interpreted elsewhere."""
    return jax.default_backend() != "gpu"


# Modules that JAX imports the first time it lowers a pallas_call (per backend, and for interpret mode). Some
# register configuration that is part of jax.jit's cache key, so one imported during a jit's first trace makes
# its second call trace (and compile) again; `preload_pallas_lowerings` imports them before any call.
_PALLAS_LOWERINGS = ("jax._src.pallas.triton.pallas_call_registration", "jax._src.pallas.mosaic_gpu.pallas_call_registration",
                     "jax._src.pallas.mosaic.interpret.interpret_pallas_call", "jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call")


def preload_pallas_lowerings(interpret: bool | None = None) -> None:
    """Import the Pallas lowering modules a fused plan's kernels need here (interpret mode's too off the GPU)."""
    import importlib

    names = _PALLAS_LOWERINGS if (default_interpret() if interpret is None else interpret) else _PALLAS_LOWERINGS[:2]
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:  # a backend this jaxlib does not ship: its kernels cannot run here anyway
            pass


def build_group(group: Group, template: str, config: dict, *, backend: str = "triton", interpret: bool | None = None) -> Callable:
    """The group's kernel for `config`: a function of its inputs (in `group.inputs` order) giving its outputs. On a
    GPU it is lowered once for all processes and jobs (`kernel_cache`), and compiled once (`compile_cache`)."""
    mod = TEMPLATES[template]
    spec = mod.match(group)
    if spec is None:
        raise PlanError(f"template {template} does not match group {list(group.node_ids)}")
    interpret = default_interpret() if interpret is None else interpret
    kernel = mod.build(group, config, backend=backend, interpret=interpret, spec=spec)
    if interpret or jax.default_backend() != "gpu":  # (the CPU lowers GPU kernels only to check them: nothing to keep)
        return kernel
    compile_cache.keep_short_compiles()
    return kernel_cache.cached(kernel, group, template, backend, config)


def build_differentiable_group(group: Group, template: str, config: dict, *, backend: str = "triton",
                               interpret: bool | None = None) -> Callable:
    """`build_group` with a `jax.custom_vjp` (autofuse.differentiate): the template's own backward where it has
    one, else the group's sub-jaxpr differentiated and run by XLA."""
    interpret = default_interpret() if interpret is None else interpret
    kernel = build_group(group, template, config, backend=backend, interpret=interpret)
    rule = TEMPLATES[template].vjp_rule(group, config, backend=backend, interpret=interpret)
    return differentiable(group, kernel, rule)


def build_staged_group(group: Group, stages: Sequence[Sequence[int]], template: str, config: dict, *, backend: str = "triton",
                       interpret: bool | None = None) -> list[Callable]:
    """The stage functions of a group run in stages: `stage(ins, private) -> (outs, private)`, `ins` and `outs`
    those of `graph.stage_groups(group, stages)`, `private` what the stage before handed on (None for the first)."""
    mod = TEMPLATES[template]
    spec = mod.match(group)
    if spec is None:
        raise PlanError(f"template {template} does not match group {list(group.node_ids)}")
    return mod.build_stages(group, stages, config, backend=backend, interpret=default_interpret() if interpret is None else interpret,
                            spec=spec)


def executor(graph: Graph, plan: Plan, *, interpret: bool | None = None) -> Callable[[Sequence[Any]], list]:
    """A function of the flat inputs that runs the graph under `plan` (trace it under `jax.jit`).

    Every fused group is differentiable (`jax.grad`, `jax.vjp`): see `autofuse.differentiate`; a group in
    stages runs each stage as a unit of its own, handing values on privately (see the module docstring)."""
    bound = bind_plan(graph, plan)
    units, chains, owner = plan_units(bound)
    preload_pallas_lowerings(interpret)  # else a shared kernel's first call traces under other config than the rest
    steps: list[tuple[Group, Callable]] = []  # per unit: its inputs and outputs, and fn(ins, private) -> (outs, private)
    shared: dict[tuple, list[Callable]] = {}  # per distinct computation and config: its unit functions, built once
    for g, fg in bound:
        key = kernel_key(g, fg)
        if key not in shared:
            if fg.stages:
                fns = build_staged_group(g, fg.stages, fg.template, fg.config, backend=fg.backend, interpret=interpret)
            else:
                kernel = build_differentiable_group(g, fg.template, fg.config, backend=fg.backend, interpret=interpret)
                fns = [lambda ins, _, kernel=kernel: (kernel(*ins), None)]
            shared[key] = [jax.jit(fn) for fn in fns]
        steps.extend(zip(stage_groups(g, fg.stages) if fg.stages else [g], shared[key]))
    order = execution_order(graph, units, chains)

    def run(flat_args: Sequence[Any]) -> list:
        env: dict[int, Any] = dict(zip(graph.inputs, flat_args))
        env.update(graph.consts)
        private: dict[int, Any] = {}  # per staged group: what its last stage run hands the next (never in env)
        for kind, ref in order:
            if kind == "node":
                nd = graph.node_index[ref]
                env.update(zip(nd.outputs, bind_node(nd, [read_atom(env, a) for a in nd.inputs])))
            else:
                unit, fn = steps[ref]
                k = owner[ref][0]
                outs, private[k] = fn([env[v] for v in unit.inputs], private.get(k))
                env.update(zip(unit.outputs, outs))
        return [read_atom(env, a) for a in graph.outputs]

    return run


def kernel_key(group: Group, fg: FusedGroup) -> tuple:
    """What makes two fused groups of a plan one kernel: the same computation (`Group.signature`: inputs, outputs and
    ops, ids renamed), template, backend, config and stage split (positions within the group).

    The executor builds one jitted function per key and calls it at every instance, so that a model's repeated
    layers lower their kernel once and the GPU compiles it once: lowered per call site, GPT-2 medium's 24 identical
    Mosaic GPU attention kernels were 24 modules differing only in a dump counter (so 24 kernel hashes), lowered one
    by one (10 s on the CPU; 0.3 s shared)."""
    pos = {n: k for k, n in enumerate(group.node_ids)}
    stages = tuple(tuple(pos[n] for n in st) for st in fg.stages)
    return group.signature, fg.template, fg.backend, json.dumps(fg.config, sort_keys=True), stages


def describe_groups(plan: Plan | None) -> str:
    """``3 fused groups (row_reduce×2, attention)``: how many groups of which templates a plan runs, the most
    frequent template first."""
    groups = plan.groups if plan is not None else ()
    counts = Counter(g.template for g in groups)
    kinds = ", ".join(t if n == 1 else f"{t}×{n}" for t, n in sorted(counts.items(), key=lambda tn: (-tn[1], tn[0])))
    return f"{len(groups)} fused group{'' if len(groups) == 1 else 's'} ({kinds})"


def plan_from_choices(graph: Graph, choices: Sequence[tuple], provenance: dict | None = None) -> Plan:
    """A plan of `(group, template, config)` or `(group, template, config, stages)` choices (stages: the node
    sets of a group run in stages, empty for one unit); a config's "backend" (a tuned parameter) goes to its group, and
    a config without one runs on its template's preferred backend."""
    groups = tuple(
        FusedGroup(tuple(c[0].node_ids), c[1], {k: v for k, v in c[2].items() if k != "backend"}, c[0].signature, c[2].get("backend", TEMPLATES[c[1]].preferred_backend),
                   tuple(tuple(sorted(st)) for st in (c[3] if len(c) > 3 else ()) or ()))
        for c in sorted(choices, key=lambda c: c[0].node_ids)
    )
    return Plan(graph.fingerprint, groups, dict(provenance or {}))
