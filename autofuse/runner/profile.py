"""XLA's kernels in the whole program, each with the program's nodes it computes: one profiled run of jax.jit's
program, from which the tuner prices what fusing a group removes there (`tuning.program_costs`).

Why: XLA's time of a group compiled alone is not what XLA spends on its nodes in the program. GPT-2 medium's QKV
projection with its layer norm's second half took XLA 0.47 ms alone (it reads the norm's float32 input from memory
and fuses differently), while in the program XLA's kernels for those nodes take about 0.2 ms; a group that saved
0.24 ms alone saved nothing there (results/program_costs_h200.md).

How: the program is compiled with each node under a name scope (`NODE_SCOPE` + its id), which XLA keeps in the
metadata of every instruction made from it, and without command buffers (under them every kernel's profiler event
names the command buffer, not its instruction); a few calls are traced (CUPTI) and each kernel's device time is
summed by the instruction that launched it (the event's `hlo_op`), whose nodes are those named in its own metadata
and in the computations it calls (a fusion's body).
"""
from __future__ import annotations

import glob
import os
import re
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax

from ..graph import Graph, bind_node, read_atom
from .protocol import XlaKernel

NODE_SCOPE = "autofuse_n"
PROFILED_CALLS = 3
NO_COMMAND_BUFFERS = {"xla_gpu_enable_command_buffer": ""}
_NODE = re.compile(NODE_SCOPE + r"(\d+)\b")
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%([\w.\-]+)\s*\(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=")
_NAME = re.compile(r"%([\w.\-]+)")
_FUSION_KIND = re.compile(r"\bkind=(k\w+)")


def scoped(graph: Graph) -> Callable:
    """The graph as one function of its flat inputs, each node evaluated under its own name scope (the XLA path)."""

    def run(*flat: Any) -> list:
        env: dict[int, Any] = dict(zip(graph.inputs, flat))
        env.update(graph.consts)
        for node in graph.nodes:
            with jax.named_scope(f"{NODE_SCOPE}{node.id}"):
                env.update(zip(node.outputs, bind_node(node, [read_atom(env, a) for a in node.inputs])))
        return [read_atom(env, a) for a in graph.outputs]

    return run


def instruction_nodes(hlo_text: str) -> dict[str, frozenset[int]]:
    """Every instruction of a compiled module's text (`as_text()`) by name, with the ids of the nodes it computes:
    those its metadata names and those of every computation it calls, transitively."""
    lines = hlo_text.splitlines()
    computations = {m.group(1) for m in map(_COMPUTATION.match, lines) if m}
    own: dict[str, tuple[set[int], set[str]]] = {}  # instruction -> (its nodes, computations it calls)
    members: dict[str, list[str]] = {}  # computation -> its instructions
    current = None
    for line in lines:
        m = _COMPUTATION.match(line)
        if m:
            current = m.group(1)
            members[current] = []
            continue
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        name = m.group(1)
        calls = {c for c in _NAME.findall(line[m.end():]) if c in computations}
        own[name] = ({int(i) for i in _NODE.findall(line)}, calls)
        if current is not None:
            members[current].append(name)
    memo: dict[str, frozenset[int]] = {}

    def of_computation(c: str) -> frozenset[int]:
        if c not in memo:
            memo[c] = frozenset()  # HLO calls no computation recursively; this only guards a malformed text
            memo[c] = frozenset().union(*(of_instruction(i) for i in members.get(c, ())))
        return memo[c]

    def of_instruction(i: str) -> frozenset[int]:
        nodes, calls = own[i]
        return frozenset(nodes).union(*(of_computation(c) for c in calls))

    return {name: of_instruction(name) for name in own}


def fusion_kinds(hlo_text: str) -> dict[str, str]:
    """Every fusion instruction of a compiled module's text by name, with its kind (`kind=kLoop`, kInput, kCustom)."""
    out: dict[str, str] = {}
    for line in hlo_text.splitlines():
        m = _INSTRUCTION.match(line)
        kind = _FUSION_KIND.search(line) if m and " fusion(" in line else None
        if kind:
            out[m.group(1)] = kind.group(1)
    return out


@dataclass(frozen=True)
class KernelEvent:
    """One kernel launch of a traced call: its name, start and duration, and the profiler's stats on it (XLA's
    `hlo_op`, the HLO instruction that launched it, where the trace has it)."""

    name: str
    start_ns: float
    duration_ns: float
    stats: dict


def kernel_events(fn: Callable, args: Sequence[Any], calls: int) -> list[KernelEvent]:
    """Every kernel `calls` back-to-back calls of `fn(*args)` launch (empty without a device plane: the CPU)."""
    jax.block_until_ready(fn(*args))  # compiled and warm before the trace

    def run() -> None:
        for _ in range(calls - 1):
            fn(*args)
        jax.block_until_ready(fn(*args))

    return traced_events(run)


def traced_events(run: Callable[[], Any], options: Any = None) -> list[KernelEvent]:
    """Every kernel the device ran while `run()` did (which must wait for its own work), from a profiler trace of
    it: the GPU's streams only (its "XLA Modules" / "XLA Ops" lines repeat their time); empty without a device
    plane (the CPU). `options`: the trace's `jax.profiler.ProfileOptions`."""
    out = []
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, profiler_options=options):
            run()
        paths = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        if not paths:
            return []
        data = jax.profiler.ProfileData.from_file(paths[0])
        for plane in data.planes:
            if not plane.name.startswith("/device:GPU"):
                continue
            for line in plane.lines:
                if line.name.startswith("Stream"):
                    out.extend(KernelEvent(ev.name, ev.start_ns, ev.duration_ns, dict(ev.stats)) for ev in line.events)
    return out


def program_kernels(events: Sequence[KernelEvent], nodes: dict[str, frozenset[int]], calls: int,
                    kinds: dict[str, str] | None = None) -> list[XlaKernel]:
    """The events' device time per call, summed by the instruction that launched them, with that instruction's nodes
    (and those its event's own scope names: a library call's `name` stat) and its fusion kind (`fusion_kinds`); a
    kernel of no known instruction (a memset between calls) keeps its own name and no node. Longest first."""
    total: dict[str, list] = {}
    for ev in events:
        op = str(ev.stats.get("hlo_op") or ev.name)
        entry = total.setdefault(op, [0.0, set(nodes.get(op, ()))])
        entry[0] += ev.duration_ns
        entry[1].update(int(i) for i in _NODE.findall(str(ev.stats.get("name", ""))))
    kernels = [XlaKernel(op, ns / calls / 1e6, frozenset(ids), (kinds or {}).get(op, "")) for op, (ns, ids) in total.items()]
    return sorted(kernels, key=lambda k: -k.ms)


def compile_profiled(graph: Graph) -> Any:
    """jax.jit's program as the profile runs it: its nodes under their scopes, without command buffers on a GPU."""
    structs = [jax.ShapeDtypeStruct(graph.avals[v].shape, graph.avals[v].dtype) for v in graph.inputs]
    options = NO_COMMAND_BUFFERS if jax.default_backend() == "gpu" else {}
    return jax.jit(scoped(graph)).lower(*structs).compile(compiler_options=options)


def profile_program(graph: Graph, inputs: Sequence[Any], calls: int = PROFILED_CALLS, compiled: Any = None) -> list[XlaKernel]:
    """XLA's kernels of jax.jit's program on `inputs` (one flat set, the graph's input order): empty without a GPU.
    `compiled`: the program `compile_profiled` made ahead (else compiled here)."""
    compiled = compiled if compiled is not None else compile_profiled(graph)
    text = compiled.as_text()
    return program_kernels(kernel_events(compiled, inputs, calls), instruction_nodes(text), calls, fusion_kinds(text))
