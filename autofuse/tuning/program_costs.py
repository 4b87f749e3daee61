"""What XLA spends on a group's nodes in the program, from one profile of jax.jit's program (`runner.profile`): the
prices the budget rule and the selection weigh a fused group against, where the GPU gave a profile.

A group's XLA time alone is not its cost in the program: alone, XLA reads what the program fuses away, fuses
differently, and writes every output. In the program, fusing a group removes XLA's kernels whose nodes all lie in
it, and changes those it takes some nodes of: what is left of such a kernel still runs, reading what the group now
writes. Its credit (`credit_ms`) is the kernel's time scaled by how much the model's roofline of what is left
(its reads, writes and flops as one fusion) falls below that of the whole kernel: taking the heavy part of a kernel
(a dot, the scores' softmax beside a transpose) earns most of its time, taking some elementwise ops of a
memory-bound fusion earns nothing, and cutting a layer norm in half (its remainder reading float32 intermediates
it never wrote before) costs time. Each kernel's time is shared evenly among its nodes as the price of leaving a
node to XLA (`node_ms`); a fused group's price is its own time and its nodes' shares less its credit (`fused_ms`).
"""
from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

from .. import costmodel
from ..graph import Graph, Group
from ..ops import OpClass, op_class
from ..runner.protocol import ProfileRequest, XlaKernel
from .ledger import CandidateState
from .partition import Candidate

if TYPE_CHECKING:
    from .space import CandidateSpace

#: The most a kernel's remainder is charged, as a multiple of the kernel's time, when a group cuts it (its roofline
#: grows with what it must now read): a bound on the model's word, which never saw the remainder run.
MAX_REMAINDER = 3.0
XLA_EMITTED = ("kLoop", "kInput")  # fusion kinds of XLA's own elementwise and reduction emitters: no GEMM runs there
LIBRARY_CALL = "custom-call"  # the HLO instructions that call cuBLAS (and cuDNN): a copy or fusion computes no dot
LONGEST_KEPT = 12  # of the profile's kernels, the longest kept in the run's record (`ProgramCosts.summary`)


@dataclass(frozen=True)
class ProgramCosts:
    """XLA's kernels of the whole program (one profile), priced per node and per group of nodes."""

    kernels: tuple[XlaKernel, ...]
    graph: Graph = field(repr=False, compare=False)
    model: costmodel.GPUModel = field(default=costmodel.H200, repr=False, compare=False)
    taken: dict = field(default_factory=dict, compare=False)  # how it was taken: its seconds, the trace's level and scale

    @cached_property
    def computed(self) -> tuple[frozenset[int], ...]:
        """Each kernel's nodes as it computes them (by kernel index): those its metadata names, less the contractions
        where it is one of XLA's own loop or reduction fusions (kLoop, kInput), which read a product and never compute
        one. In GPT-2's step the fusion of the MLP's GELU backward (0.128 ms) names the forward's up-projection (an
        instruction in it carries the dot's scope); priced as computing that GEMM, the dgrad + GELU' group cutting it
        was credited 0.046 ms of it, 0.057 without (results/row_reduce_sums_h200.md)."""
        contraction = {n for k in self.kernels for n in k.nodes
                       if n in self.graph.node_index and op_class(self.graph.node_index[n].name) is OpClass.CONTRACTION}
        return tuple(k.nodes - contraction if k.fusion_kind in XLA_EMITTED else k.nodes | self._rearranged(k) for k in self.kernels)

    def _rearranged(self, k: XlaKernel) -> frozenset[int]:
        """The contractions whose products a library call named only by ops that move data rearranges: XLA writes a GEMM's
        product transposed by choosing its output layout, and the cuBLAS call then carries the transpose's name. In
        GPT-2's step the QKV weight's gradient (0.14 ms a layer) was named by its transpose alone, so a group taking
        its dot was credited none of it and priced at -3.5 ms in the program; it saved 1.36 ms there
        (results/concat_once_h200.md)."""
        index = self.graph.node_index
        if not k.instruction.startswith(LIBRARY_CALL) or not k.nodes or not all(n in index and _moves_data(index[n].name) for n in k.nodes):
            return frozenset()
        found, todo, seen = set(), list(k.nodes), set(k.nodes)
        while todo:
            for a in index[todo.pop()].inputs:
                p = self.graph.producer.get(a) if isinstance(a, int) else None
                if p is None or p in seen:
                    continue
                seen.add(p)
                if op_class(index[p].name) is OpClass.CONTRACTION:
                    found.add(p)
                elif _moves_data(index[p].name):
                    todo.append(p)
        return frozenset(found)

    @cached_property
    def node_ms(self) -> dict[int, float]:
        """Each node's share of XLA's kernels that compute it (a kernel's time split evenly among its nodes)."""
        out: dict[int, float] = {}
        for k, nodes in zip(self.kernels, self.computed):
            for n in nodes:
                out[n] = out.get(n, 0.0) + k.ms / len(nodes)
        return out

    @cached_property
    def _by_node(self) -> dict[int, list[int]]:
        """node -> the kernels (by index) that compute it."""
        out: dict[int, list[int]] = {}
        for i, nodes in enumerate(self.computed):
            for n in nodes:
                out.setdefault(n, []).append(i)
        return out

    def credit_ms(self, nodes: Collection[int], alone_ms: float | None = None) -> float:
        """XLA's time that fusing `nodes` into one kernel saves in the program (before that kernel's own time): every
        kernel they hold all of, and what is saved of each they hold part of (negative where its remainder must read
        more than the whole did). `alone_ms`, XLA's time of the group compiled alone, where measured, bounds the
        latter: inside a larger kernel XLA spends no more on some nodes than on the same nodes alone, and the model's
        word on a cut kernel is only a model (a row reduction of GPT-2's step that took part of the cross-entropy's
        fusion was credited 1.47 ms and saved nothing; alone XLA ran it in 0.076)."""
        parts = self.credit_parts(nodes)
        whole = sum(credit for _, held, credit in parts if held)
        cut = sum(credit for _, held, credit in parts if not held)
        if alone_ms is not None:
            cut = min(cut, max(alone_ms - whole, 0.0))
        return whole + cut

    def credit_parts(self, nodes: Collection[int]) -> list[tuple[XlaKernel, bool, float]]:
        """Each of XLA's kernels that computes some of `nodes`: (the kernel, whether they hold all it computes, what
        fusing them saves of it: its time where held, else `_kernel_credit`'s share)."""
        members = frozenset(nodes)
        touched = sorted({i for n in members for i in self._by_node.get(n, ())})
        return [(self.kernels[i], self.computed[i] <= members,
                 self.kernels[i].ms if self.computed[i] <= members else self._kernel_credit(i, members & self.computed[i]))
                for i in touched]

    @cached_property
    def _credits(self) -> dict[tuple[int, frozenset[int]], float]:
        """(kernel, the nodes a group takes of it) -> the group's credit for it (`_kernel_credit`)."""
        return {}

    @cached_property
    def _rooflines(self) -> dict[int, float]:
        """kernel -> the model's roofline of all its nodes as one fusion (made when a group first cuts it)."""
        return {}

    def _kernel_credit(self, i: int, taken: frozenset[int]) -> float:
        """What taking `taken` (some of kernel i's nodes) saves of its time, by the model's rooflines."""
        k, nodes = self.kernels[i], self.computed[i]
        key = (i, taken)
        if key not in self._credits:
            if i not in self._rooflines:
                self._rooflines[i] = costmodel.group_time_ms(Group.of(self.graph, sorted(nodes)), self.model)
            whole = self._rooflines[i]
            rest = costmodel.group_time_ms(Group.of(self.graph, sorted(nodes - taken)), self.model)
            self._credits[key] = k.ms * (1.0 - min(rest / whole, MAX_REMAINDER)) if whole > 0 else 0.0
        return self._credits[key]

    def xla_ms(self, nodes: Collection[int]) -> float:
        """What leaving `nodes` to XLA costs in a cover: their shares of XLA's kernels."""
        return sum(self.node_ms.get(n, 0.0) for n in nodes)

    def fused_ms(self, nodes: Collection[int], kernel_ms: float, alone_ms: float | None = None) -> float:
        """What fusing `nodes` costs in a cover: the kernel's own time, and its nodes' shares of XLA's kernels less
        what fusing them saves there (`credit_ms`)."""
        return kernel_ms + self.xla_ms(nodes) - self.credit_ms(nodes, alone_ms)

    def credit_per_instance(self, instances: Sequence[Collection[int]], alone_ms: float | None = None) -> float:
        """What fusing one instance of a candidate saves of XLA's kernels (the mean over its instances)."""
        return sum(self.credit_ms(c, alone_ms) for c in instances) / len(instances) if instances else 0.0

    def saving_ms(self, instances: Sequence[Collection[int]], kernel_ms: float, alone_ms: float | None = None) -> float:
        """What fusing a candidate saves in the program, per instance (their mean)."""
        return self.credit_per_instance(instances, alone_ms) - kernel_ms if instances else 0.0

    def price(self, cands: Sequence[CandidateState], by_sig: dict[str, list[Candidate]],
              spaces: Mapping[str, CandidateSpace] | None = None) -> None:
        """Set each candidate's XLA time in the program (`CandidateState.program_xla_ms`), which the budget rule then
        weighs its fused times against (`scheduler.xla_time_ms`). A candidate not timed alone yet is bounded by the
        model's XLA time of it alone (its space's `xla_model_ms`) until it is: in GPT-2's step, fourteen variants of
        the first layer norm (0.07-0.14 ms alone) each took a cut of a large XLA kernel, were priced 1.56-1.61 ms,
        and took phase 1's visits one after another, each falling back to a loss once timed."""
        for r in cands:
            alone = r.xla_ms if r.xla_ms is not None or spaces is None else spaces[r.signature].xla_model_ms
            r.program_xla_ms = self.credit_per_instance([c.nodes for c in by_sig[r.signature]], alone)

    @property
    def total_ms(self) -> float:
        """Every kernel's time in one call of jax.jit's program."""
        return sum(k.ms for k in self.kernels)

    @property
    def attributed_ms(self) -> float:
        """The time of the kernels known to compute some node (the rest, memsets, costs every cover alike)."""
        return sum(k.ms for k in self.kernels if k.nodes)

    def summary(self, top: int = LONGEST_KEPT) -> dict:
        """What the run's selection timings keep of the profile: its size, and its `top` longest kernels with what
        they compute (`show run` and the report list them: where jax.jit's time goes, by XLA's own kernels)."""
        longest = [{"instruction": k.instruction, "ms": round(k.ms, 4), "ops": self.ops_text(k.nodes)} for k in
                   sorted(self.kernels, key=lambda k: -k.ms)[:top]]
        return {"kernels": len(self.kernels), "total_ms": round(self.total_ms, 4), "attributed_ms": round(self.attributed_ms, 4),
                **{k: round(v, 3) for k, v in self.taken.items()}, "longest": longest}

    def ops_text(self, nodes: Collection[int], most: int = 4) -> str:
        """The primitives of `nodes`, the most frequent first: ``dot_general, add x2``."""
        counts = Counter(self.graph.node_index[n].name for n in nodes if n in self.graph.node_index)
        parts = [f"{name} x{c}" if c > 1 else name for name, c in counts.most_common(most)]
        return ", ".join(parts) + (", ..." if len(counts) > most else "")


def _moves_data(name: str) -> bool:
    """A primitive that only rearranges its operand (a transpose, a reshape): what XLA folds into a layout."""
    return name == "transpose" or op_class(name) is OpClass.LAYOUT


def take_profile(runner: Any, record: dict, graph: Graph, model: costmodel.GPUModel = costmodel.H200) -> ProgramCosts | None:
    """XLA's kernels in jax.jit's program, profiled on the GPU by the trial process, as prices (`ProgramCosts`): their
    device times, the level groups are timed at (`runner.measure.time_kernels`); None where the profile failed or
    saw no kernel of a node (the job then prices groups by their times alone). What it found, or why it failed, goes into `record["profile"]` (the
    run's selection timings)."""
    res = runner.call(ProfileRequest())
    costs = None
    if res.ok:
        costs = ProgramCosts(res.kernels, graph, model, dict(res.seconds))
    if costs is not None and costs.attributed_ms > 0:
        record["profile"] = costs.summary()
        return costs
    record["profile"] = {"error": res.error or "no kernel of the program's nodes in the trace", **{k: round(v, 3) for k, v in res.seconds.items()}}
    logging.getLogger("autofuse").warning("autofuse: jax.jit's program could not be profiled (%s); groups are priced by their times alone",
                                          record["profile"]["error"])
    return None
