"""A plan written into a store as a tuning job on this machine would have stored it (program, device, software rows),
for the tests of what a deployed `autofuse.jit` does with it."""
from __future__ import annotations

from autofuse.device import device_info, software
from autofuse.graph import Graph
from autofuse.store import PlanStore


def save_plan_here(store: PlanStore, graph: Graph, name: str, plan_json: dict, *, sw: dict | None = None,
                   baseline_ms: float = 1.5, **program: object) -> int:
    """Store `plan_json` for `graph` on this device under `sw` (this process's software unless given), as a modelled
    plan measured at 1 ms; `program`: more of the program's row (`function=`, `structure=`). The plan's id."""
    dev = device_info()
    pid = store.program(graph.fingerprint, name, graph.signature(), len(graph.nodes), **program)
    did = store.device(dev["name"], compute_capability=dev["compute_capability"], sm_count=dev["sm_count"], memory_bytes=dev["memory_bytes"])
    return store.save_plan(pid, did, store.software(**(sw or software())), plan_json, measured_ms=1.0, baseline_ms=baseline_ms,
                           speedup=baseline_ms, measure="model", tolerance={}, max_error=0.0)
