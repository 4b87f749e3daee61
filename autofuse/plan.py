"""The `Plan` (which groups run as which template with which config) and its executor.

A plan is data: versioned JSON, validated on load, never pickle, so loading
one never executes stored code. The executor turns a graph and a plan into
one function: fused groups as `pallas_call`s, every other node re-bound as
its original primitive. Wrap it in `jax.jit`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax

from .differentiate import differentiable
from .graph import Graph, Group, bind_node, execution_order, read_atom
from .kernels import TEMPLATES

SCHEMA_VERSION = 2  # 2: each group names its backend (1: every group ran on Triton)
READABLE_VERSIONS = (1, 2)


class PlanError(ValueError):
    """A plan that is malformed or does not fit the program it is applied to."""


@dataclass(frozen=True)
class FusedGroup:
    nodes: tuple[int, ...]
    template: str
    config: dict
    signature: str
    backend: str = "triton"  # which lowering of the template runs it ("triton", "mosaic_gpu")

    def to_dict(self) -> dict:
        return {"nodes": list(self.nodes), "template": self.template, "backend": self.backend, "config": dict(self.config),
                "signature": self.signature}


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
            _expect(isinstance(g, dict) and set(g) == keys, f"{where} must have exactly {', '.join(sorted(keys))}")
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
            out.append(FusedGroup(tuple(sorted(nodes)), g["template"], dict(cfg), g["signature"], backend))
        return Plan(data["fingerprint"], tuple(out), dict(data.get("provenance", {})))


def _expect(cond: bool, msg: str) -> None:
    if not cond:
        raise PlanError(msg)


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
        if mod.match(group) is None:
            raise PlanError(f"plan group {list(fg.nodes)}: template {fg.template} does not match group")
        choices = mod.space_of(group, None, fg.backend)["params"]
        for k in mod.params_of(fg.backend):
            v = fg.config.get(k, defaults.get(k))
            if isinstance(v, bool) or v not in choices.get(k, [v]):
                raise PlanError(f"plan group {list(fg.nodes)}: config {k}={v!r} is not one of the search space's choices {choices.get(k)}")
        out.append((group, fg))
    try:
        execution_order(graph, [frozenset(g.node_ids) for g, _ in out])
    except ValueError as e:
        raise PlanError(f"plan groups cannot be ordered ({e}): a group is not convex, or two groups need each other's outputs") from None
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
    mod = TEMPLATES[template]
    spec = mod.match(group)
    if spec is None:
        raise PlanError(f"template {template} does not match group {list(group.node_ids)}")
    return mod.build(group, config, backend=backend, interpret=default_interpret() if interpret is None else interpret, spec=spec)


def build_differentiable_group(group: Group, template: str, config: dict, *, backend: str = "triton",
                               interpret: bool | None = None) -> Callable:
    """`build_group` with a `jax.custom_vjp` (autofuse.differentiate): the template's own backward where it has
    one, else the group's sub-jaxpr differentiated and run by XLA."""
    interpret = default_interpret() if interpret is None else interpret
    kernel = build_group(group, template, config, backend=backend, interpret=interpret)
    rule = TEMPLATES[template].vjp_rule(group, config, backend=backend, interpret=interpret)
    return differentiable(group, kernel, rule)


def executor(graph: Graph, plan: Plan, *, interpret: bool | None = None) -> Callable[[Sequence[Any]], list]:
    """A function of the flat inputs that runs the graph under `plan` (trace it under `jax.jit`).

    Every fused group is differentiable (`jax.grad`, `jax.vjp`): see `autofuse.differentiate`."""
    bound = bind_plan(graph, plan)
    kernels = [build_differentiable_group(g, fg.template, fg.config, backend=fg.backend, interpret=interpret) for g, fg in bound]
    order = execution_order(graph, [frozenset(g.node_ids) for g, _ in bound])

    def run(flat_args: Sequence[Any]) -> list:
        env: dict[int, Any] = dict(zip(graph.inputs, flat_args))
        env.update(graph.consts)
        for kind, ref in order:
            if kind == "node":
                nd = graph.node_index[ref]
                env.update(zip(nd.outputs, bind_node(nd, [read_atom(env, a) for a in nd.inputs])))
            else:
                group = bound[ref][0]
                env.update(zip(group.outputs, kernels[ref](*[env[v] for v in group.inputs])))
        return [read_atom(env, a) for a in graph.outputs]

    return run


def plan_from_choices(graph: Graph, choices: Sequence[tuple[Group, str, dict]], provenance: dict | None = None) -> Plan:
    """A plan of `(group, template, config)` choices; a config's "backend" (a tuned parameter) goes to its group."""
    groups = tuple(
        FusedGroup(tuple(g.node_ids), template, {k: v for k, v in cfg.items() if k != "backend"}, g.signature, cfg.get("backend", "triton"))
        for g, template, cfg in sorted(choices, key=lambda c: c[0].node_ids)
    )
    return Plan(graph.fingerprint, groups, dict(provenance or {}))
