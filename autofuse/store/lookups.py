"""Deploy-time reads of one program's plan: the current plan graded by how closely its versions match, and, on a
miss, why there is none in words a person can act on."""

from __future__ import annotations

from typing import Any

from autofuse.store import queries
from autofuse.store.base import PROMOTION, Db
from autofuse.store.results import SOFTWARE_KEYS, LookupResult, MissReason, check_software


def lookup(store: Db, fingerprint: str, device_name: str, software: dict[str, str]) -> LookupResult | None:
    """The current plan for this program on this device, graded.

    * ``match="exact"``: same fingerprint, device name, jax, jaxlib,
      autofuse and backend;
    * ``match="version"``: same fingerprint, device and backend, other
      versions (newest such plan; the caller re-verifies it);
    * None otherwise.

    One indexed query.
    """
    check_software(software, f" (needs {', '.join(SOFTWARE_KEYS)})")
    rows = store.read(queries.lookup(fingerprint, device_name, software))
    return LookupResult.from_row(rows[0]) if rows else None


def explain_miss(store: Db, fingerprint: str, device_name: str, software: dict[str, str], *, function: str | None = None,
                 signature: dict[str, Any] | None = None) -> MissReason:
    """Why :meth:`lookup` found no plan, in words: this program was never tuned, or only on other
    devices or for another code generator, or it has plans but none current; or, by *function*
    (``module:qualname``), the function was tuned for other input shapes, dtypes or static values
    (which ones differ from *signature*, this call's ``{"inputs": [...], "static": ...}``), or for the
    same inputs but as another program (its code changed). Reads only."""
    legacy = tuple(dict.fromkeys(x for x in (function, (function or "").rpartition(":")[2]) if x))
    progs = store.read(queries.programs_of(fingerprint, function, legacy, store.has(PROMOTION)))
    plans = store.read(queries.plans_of_programs([r["id"] for r in progs])) if progs else []
    where = f"in {store.shown}"
    this = next((r for r in progs if r["fingerprint"] == fingerprint), None)
    if this is not None:
        mine = [p for p in plans if p["program_id"] == this["id"]]
        here = [p for p in mine if p["device"] == device_name]
        same = [p for p in here if p["backend"] == software.get("backend")]
        if not mine:
            return MissReason("no_plan", f"this program was tuned but no plan was stored {where} (its run did not finish: autofuse runs)")
        if not here:
            devs = ", ".join(sorted({p["device"] for p in mine}))
            return MissReason("other_device", f"this program has plans only for another device ({devs}), not {device_name}")
        if not same:
            other = ", ".join(sorted({p["backend"] for p in here}))
            return MissReason("other_backend", f"this program's plans on {device_name} are for code generator {other}, "
                                               f"not {software.get('backend')} (made by an older autofuse: tune it again)")
        ids = ", ".join(str(p["id"]) for p in same[:5])
        return MissReason("no_current", f"plan(s) {ids} of this program on {device_name} are stored but none is current "
                                        "(autofuse plans promote ID)")
    others = [r for r in progs if r["fingerprint"] != fingerprint]
    if function and others:
        current = {p["program_id"] for p in plans if p["is_current"] and p["device"] == device_name}
        near = [r for r in others if r["id"] in current] or [r for r in others if any(p["program_id"] == r["id"] for p in plans)]
        if near:
            diff = _signature_diff(near[0]["signature"] or {}, signature or {})
            more = f" (and {len(near) - 1} other input signature(s))" if len(near) > 1 else ""
            if diff:
                return MissReason("other_inputs", f"{function} was tuned for other inputs: {diff}{more}")
            return MissReason("changed", f"{function} has plans for the same inputs but as another program "
                                         f"{near[0]['fingerprint'][:12]} (its code or constants changed since it was tuned)")
    return MissReason("no_plan", f"no plan for this program at all {where} (never tuned: autofuse tune)")


def _signature_diff(stored: dict[str, Any], this: dict[str, Any]) -> str:
    """Which inputs (shape and dtype) and static values differ between a stored program's signature and this call's."""
    parts = []
    a, b = list(stored.get("inputs") or []), list(this.get("inputs") or [])
    if len(a) != len(b):
        parts.append(f"{len(a)} input arrays ({', '.join(map(str, a[:4]))}{', ...' if len(a) > 4 else ''}), this call {len(b)}")
    else:
        d = [f"input {i} {x} (this call {y})" for i, (x, y) in enumerate(zip(a, b)) if x != y]
        if d:
            parts.append("; ".join(d[:3]) + (f"; and {len(d) - 3} more" if len(d) > 3 else ""))
    if "static" in stored or "static" in this:
        sa_, sb = stored.get("static"), this.get("static")
        if "static" in stored and sa_ != sb:
            parts.append(f"static values {sa_ or 'none'} (this call {sb or 'none'})")
    return "; ".join(parts)
