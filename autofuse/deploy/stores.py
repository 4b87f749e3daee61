"""The plan store as the deploy path sees it: opened read-only for lookups (a lookup never creates, migrates or writes
a database), a writer only for what a trace learned (shape checks, programs' structures), and XLA's autotune entries
written out before a stored plan compiles. Nothing here ever breaks the program: a store that cannot be opened, read
or written is a reason in words. `autofuse.store` (SQLAlchemy) is imported only when a store is used, so that
``autofuse.jit(fn, plan=...)`` never loads it."""
from __future__ import annotations

import functools
import logging
import os
from typing import TYPE_CHECKING, Any

from .. import xla_autotune
from ..device import device_info, software
from ..graph import Graph
from .resolution import Checked, Resolution
from .settings import Deployment

if TYPE_CHECKING:  # the store's types without SQLAlchemy at deploy time
    from ..store import PlanStore
    from ..store.results import ShapeVerdict

log = logging.getLogger("autofuse")

# Shape checks made by this process: (store, plan id, program fingerprint) -> (verdict, detail). A store that cannot
# be written cannot remember them for the next process; this process still checks each shape once.
_CHECKED: dict[tuple[str, int | None, str], tuple[str, str]] = {}
_SAID: set[str] = set()
# (store, autotune directory, jaxlib, device) whose entries this process wrote: once is enough.
_RESTORED: set[tuple[str, str, str, str]] = set()


def open_store(store: Any) -> tuple[PlanStore | None, str]:
    """A `PlanStore` (opened read-only: a lookup never creates, migrates or writes a database) from a store,
    a URL, or (None) $AUTOFUSE_DB / the default file; or None and why not."""
    from ..store import PlanStore
    from ..store.db import data_dir, default_url, display_url

    if isinstance(store, PlanStore):
        return store, ""
    if store is None:
        if not os.environ.get("AUTOFUSE_DB") and not (data_dir() / "autofuse.db").exists():
            return None, "no plan store (pass store= or set AUTOFUSE_DB)"
        store = default_url()
    try:
        return _store_cache(store), ""
    except Exception as e:
        return None, f"the plan store {display_url(str(store))} cannot be opened ({e})"


@functools.lru_cache(maxsize=8)
def _store_cache(url: str) -> PlanStore:
    from ..store import PlanStore

    return PlanStore(url, readonly=True)


def store_key(store: Any) -> str:
    """The store as this process's memory of checks names it: its URL, else what was given, else $AUTOFUSE_DB."""
    return getattr(store, "url", None) or str(store or os.environ.get("AUTOFUSE_DB") or "")


def remembered(store: PlanStore, plan_id: int, fingerprint: str, sw: dict, given: Any) -> ShapeVerdict | Checked | None:
    """The verdict of an earlier check of plan `plan_id` at program `fingerprint` with this software: the store's,
    else this process's; None if never checked."""
    try:
        hit = store.shape_verdict(plan_id, fingerprint, sw)
    except Exception:  # noqa: BLE001 -- not readable: check again
        hit = None
    if hit is not None:
        return hit
    here = _CHECKED.get((store_key(given), plan_id, fingerprint))
    return Checked(*here) if here is not None else None


def remember(dep: Deployment, res: Resolution, graph: Graph, verdict: tuple[str, str] | None) -> None:
    """Record what this trace learned: the `verdict` ((``ok``|``failed``, detail)) of checking a plan at a shape
    it was not tuned for (in this process always; in the store where it can be written, so the next process
    skips the check), and the structures of stored programs computed on the way. A store that cannot be written
    is said so once per process; a failed write is one warning, never an error."""
    if verdict is not None:
        _CHECKED[(store_key(dep.store), res.plan_id, graph.fingerprint)] = verdict
    writer, why = _writer(dep.store)
    if writer is None:
        if verdict is not None:
            _say_once(store_key(dep.store), why)
        return
    try:
        for fp, structure in res.learned:
            writer.set_structure(fp, structure)
        if verdict is not None:
            writer.record_shape(res.plan_id, graph.fingerprint, graph.signature()["inputs"], software(), verdict[0], verdict[1])
    except Exception as e:  # noqa: BLE001 -- remembering is an optimisation: never break the program
        log.warning("autofuse: %s: could not record a shape check in the plan store (%s: %s)", dep.name, type(e).__name__,
                    str(e)[:200])


def restore_autotune(store: Any) -> None:
    """Write the store's XLA autotune entries for this jaxlib and device that this process's autotune directory lacks,
    before a plan from it compiles: XLA reads a cache file for each fusion it has no result for in memory, so the
    plan's GEMMs get the kernels its tuning job measured, even on a machine that never tuned. Silent where there is
    no directory, it cannot be written, or the store cannot be read: XLA then autotunes as it would."""
    if xla_autotune.DIR is None:
        return
    opened, _ = open_store(store)
    if opened is None:
        return
    jaxlib, device = software()["jaxlib"], device_info()["name"]
    key = (store_key(opened), xla_autotune.DIR, jaxlib, device)
    if key in _RESTORED:
        return
    _RESTORED.add(key)
    try:
        written = xla_autotune.write_entries(xla_autotune.DIR, opened.autotune_entries(jaxlib, device))
    except Exception as e:  # noqa: BLE001 -- the kernels' choice is XLA's again: never a reason to break the program
        log.debug("autofuse: XLA autotune entries not restored into %s: %s: %s", xla_autotune.DIR, type(e).__name__, e)
        return
    if written:
        log.debug("autofuse: wrote %d XLA autotune entries of %s into %s", len(written), store_key(opened), xla_autotune.DIR)


def readonly_why(store: Any) -> tuple[str, str | None]:
    """The store's URL, and why it cannot be written (None where it can): a background job needs to store its plan."""
    from ..store import PlanStore
    from ..store.db import readonly_reason, resolve_url

    url = store.url if isinstance(store, PlanStore) else resolve_url(store)
    return str(url), "it was opened read-only" if isinstance(store, PlanStore) and store.readonly else readonly_reason(url)


def _writer(store: Any) -> tuple[PlanStore | None, str]:
    """A store that can record shape checks (the given read-write `PlanStore`, or the URL's database opened for
    writing without migrating it), or None and why not."""
    from ..store import PlanStore

    if isinstance(store, PlanStore):
        return (None, "it was opened read-only") if store.readonly else (store, "")
    opened, why = open_store(store)
    if opened is None:
        return None, why
    return _writable_store(opened.url, opened.revision)


@functools.lru_cache(maxsize=8)
def _writable_store(url: str, revision: str | None) -> tuple[PlanStore | None, str]:
    from ..store import PlanStore
    from ..store.db import HEAD_REVISION, readonly_reason

    readonly = readonly_reason(url)
    if readonly is not None:
        return None, f"it is read-only: {readonly}"
    if (revision or "") < "0005":
        return None, f"its schema revision {revision} predates shape checks (autofuse db upgrade --db URL)"
    if revision != HEAD_REVISION:
        return None, f"its schema revision {revision} is not this autofuse's {HEAD_REVISION}"
    try:
        return PlanStore(url), ""
    except Exception as e:  # noqa: BLE001 -- an unreachable server: remembered per process only
        return None, str(e).split("\n")[0][:200]


def _say_once(key: str, why: str) -> None:
    if key in _SAID:
        return
    _SAID.add(key)
    log.warning("autofuse: the plan store %s cannot remember which shapes its plans serve (%s): plans serving shapes they "
                "were not tuned for are checked against jax.jit again in every process", key or "(default)", why)
