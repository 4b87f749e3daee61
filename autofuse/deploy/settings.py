"""What one `autofuse.jit` function deploys: the function, where its plans come from, and what to do when there is
none. One frozen object, so that the deploy modules take a single argument instead of the face's whole state."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ..graph import qualified_name
from ..plan import Plan
from .background import BackgroundTune

OnMiss = Literal["xla", "error", "tune"]
OnVersionMismatch = Literal["verify", "refuse"]
OnOtherShape = Literal["check", "refuse"]


@dataclass(frozen=True)
class Deployment:
    """The settings of `autofuse.jit` (see its docstring), checked: static arguments as tuples, and `tune_budget` a
    `BackgroundTune` with ``on_miss="tune"`` (None otherwise)."""

    fn: Callable
    plan: Plan | None = None
    store: Any = None  # a PlanStore, a URL, or None ($AUTOFUSE_DB / the per-user file)
    static_argnums: tuple[int, ...] = ()
    static_argnames: tuple[str, ...] = ()
    on_miss: OnMiss = "xla"
    on_version_mismatch: OnVersionMismatch = "verify"
    on_other_shape: OnOtherShape = "check"
    interpret: bool | None = None
    tune_budget: BackgroundTune | None = None

    @staticmethod
    def of(fn: Callable, *, plan: Plan | None = None, store: Any = None, static_argnums: int | Sequence[int] = (),
           static_argnames: str | Sequence[str] = (), on_miss: str = "xla", on_version_mismatch: str = "verify",
           on_other_shape: str = "check", interpret: bool | None = None, tune_budget: Any = None) -> Deployment:
        """The settings as `autofuse.jit` takes them; ValueError for an unknown policy or budget."""
        if on_miss not in ("xla", "error", "tune"):
            raise ValueError(f"on_miss must be 'xla', 'error' or 'tune', got {on_miss!r}")
        if on_version_mismatch not in ("verify", "refuse"):
            raise ValueError(f"on_version_mismatch must be 'verify' or 'refuse', got {on_version_mismatch!r}")
        if on_other_shape not in ("check", "refuse"):
            raise ValueError(f"on_other_shape must be 'check' or 'refuse', got {on_other_shape!r}")
        return Deployment(fn, plan, store, (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums),
                          (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames), on_miss,  # type: ignore[arg-type]
                          on_version_mismatch, on_other_shape, interpret,  # type: ignore[arg-type]
                          BackgroundTune.of(tune_budget) if on_miss == "tune" else None)

    @property
    def name(self) -> str:
        """``module:qualname`` of the wrapped function, as misses and `explain` name it."""
        return qualified_name(self.fn)
