"""What XLA spends on a group's nodes in the program, from one profile of jax.jit's program (`runner.profile`): the
prices the selection compares a fused group with, where the GPU gave a profile.

A group's XLA time alone is not its cost in the program: alone, XLA reads what the program fuses away, fuses
differently, and writes every output. In the program a fused group removes exactly XLA's kernels whose nodes all lie
in it; a kernel it takes only some nodes of still runs (XLA's layer norm around a group holding its second half), so
its time is not saved. Each kernel's time is shared evenly among its nodes as the cost of leaving a node to XLA
(`node_ms`), and a fused group pays, beyond its own time, the shares of its nodes in kernels it does not remove
(`fused_ms`): a cover then costs what the program would run, and XLA's own cover costs the profile's total.
"""
from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from ..runner.protocol import ProfileRequest, XlaKernel
from .ledger import CandidateState
from .partition import Candidate


@dataclass(frozen=True)
class ProgramCosts:
    """XLA's kernels of the whole program (one profile), priced per node and per group of nodes."""

    kernels: tuple[XlaKernel, ...]
    seconds: dict = field(default_factory=dict, compare=False)  # what taking the profile cost (compile, trace)

    @cached_property
    def node_ms(self) -> dict[int, float]:
        """Each node's share of XLA's kernels that compute it (a kernel's time split evenly among its nodes)."""
        out: dict[int, float] = {}
        for k in self.kernels:
            for n in k.nodes:
                out[n] = out.get(n, 0.0) + k.ms / len(k.nodes)
        return out

    def removed_ms(self, nodes: Collection[int]) -> float:
        """XLA's time that fusing `nodes` into one kernel removes from the program: its kernels whose nodes all lie
        among them."""
        members = set(nodes)
        return sum(k.ms for k in self.kernels if k.nodes and k.nodes <= members)

    def xla_ms(self, nodes: Collection[int]) -> float:
        """What leaving `nodes` to XLA costs in a cover: their shares of XLA's kernels."""
        return sum(self.node_ms.get(n, 0.0) for n in nodes)

    def fused_ms(self, nodes: Collection[int], kernel_ms: float) -> float:
        """What fusing `nodes` costs in a cover: the kernel's own time, and the shares of its nodes in XLA's kernels
        that still run beside it."""
        return kernel_ms + self.xla_ms(nodes) - self.removed_ms(nodes)

    def removed_per_instance(self, instances: Sequence[Collection[int]]) -> float:
        """What fusing one instance of a candidate removes of XLA's kernels (the mean over its instances)."""
        return sum(self.removed_ms(c) for c in instances) / len(instances) if instances else 0.0

    def saving_ms(self, instances: Sequence[Collection[int]], kernel_ms: float) -> float:
        """What fusing a candidate saves in the program, per instance (their mean)."""
        return self.removed_per_instance(instances) - kernel_ms if instances else 0.0

    def price(self, cands: Sequence[CandidateState], by_sig: dict[str, list[Candidate]]) -> None:
        """Set each candidate's XLA time in the program (`CandidateState.program_xla_ms`), which the budget rule then
        weighs its fused times against (`scheduler.xla_time_ms`)."""
        for r in cands:
            r.program_xla_ms = self.removed_per_instance([c.nodes for c in by_sig[r.signature]])

    @property
    def total_ms(self) -> float:
        """Every kernel's time in one call of jax.jit's program."""
        return sum(k.ms for k in self.kernels)

    @property
    def attributed_ms(self) -> float:
        """The time of the kernels known to compute some node (the rest, memsets, costs every cover alike)."""
        return sum(k.ms for k in self.kernels if k.nodes)

    def summary(self) -> dict:
        """What the run's selection timings keep of the profile."""
        return {"kernels": len(self.kernels), "total_ms": round(self.total_ms, 4), "attributed_ms": round(self.attributed_ms, 4),
                **{k: round(v, 3) for k, v in self.seconds.items()}}


def take_profile(runner: Any, record: dict) -> ProgramCosts | None:
    """XLA's kernels in jax.jit's program, profiled on the GPU by the trial process, as prices (`ProgramCosts`); None
    where the profile failed or saw no kernel of a node (the job then prices groups by their times alone). What it
    found, or why it failed, goes into `record["profile"]` (the run's selection timings)."""
    res = runner.call(ProfileRequest())
    costs = ProgramCosts(res.kernels, res.seconds) if res.ok else None
    if costs is not None and costs.attributed_ms > 0:
        record["profile"] = costs.summary()
        return costs
    record["profile"] = {"error": res.error or "no kernel of the program's nodes in the trace", **{k: round(v, 3) for k, v in res.seconds.items()}}
    logging.getLogger("autofuse").warning("autofuse: jax.jit's program could not be profiled (%s); groups are priced by their times alone",
                                          record["profile"]["error"])
    return None
