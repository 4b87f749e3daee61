"""What each signature an `autofuse.jit` function traced runs, by jax.jit's own cache key: a call that did not trace
still says, in `last_status`, what its signature runs (not what the last traced one does)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax


class Signatures:
    """What each signature an `autofuse.jit` function traced runs, by what jax.jit's cache tells calls apart (the arguments'
    tree structure, static values, each array's shape, dtype and weak type), so that a call that did not trace (its
    signature traced before) says what it ran. Only the parts in which the traced signatures differ are looked at (a
    batch size among a model's hundreds of weights), so a call pays for a few leaves, and nothing with one signature."""

    def __init__(self, static_argnums: Sequence[int], static_argnames: Sequence[str]) -> None:
        self.static_argnums, self.static_argnames = static_argnums, frozenset(static_argnames)
        self.status_by_key: dict[tuple, str] = {}
        self.parts: tuple[int, ...] | None = None  # the key's parts that tell the traced signatures apart (None: all)
        self.by_parts: dict[tuple, str] = {}

    def several(self) -> bool:
        """Whether a call must look its signature up (with one traced signature, the last status is its own)."""
        return len(self.status_by_key) > 1

    def clear(self) -> None:
        """Forget every signature (the function's traces were dropped: each traces again)."""
        self.status_by_key, self.parts, self.by_parts = {}, None, {}

    def add(self, args: tuple, kwargs: dict, status: str) -> None:
        """Record what a signature runs (from the arguments `_traced` received: tracers where the call has arrays)."""
        tree, leaves = self._split(args, kwargs)
        self.status_by_key[(tree, *map(_leaf_key, leaves))] = status
        keys = list(self.status_by_key)
        if len({len(k) for k in keys}) == 1:
            self.parts = tuple(i for i in range(len(keys[0])) if len({k[i] for k in keys}) > 1)
            self.by_parts = {tuple(k[i] for i in self.parts): s for k, s in self.status_by_key.items()}
        else:
            self.parts, self.by_parts = None, dict(self.status_by_key)

    def status(self, args: tuple, kwargs: dict) -> str | None:
        """What a call with these arguments ran; None for a signature never traced."""
        tree, leaves = self._split(args, kwargs)
        if self.parts is None:
            return self.by_parts.get((tree, *map(_leaf_key, leaves)))
        if len(leaves) + 1 != len(next(iter(self.status_by_key))):
            return None
        return self.by_parts.get(tuple(tree if i == 0 else _leaf_key(leaves[i - 1]) for i in self.parts))

    def _split(self, args: tuple, kwargs: dict) -> tuple[Any, list]:
        """The tree structure of the dynamic arguments with the static values, and the dynamic leaves."""
        n = len(args)
        static = {i % n for i in self.static_argnums if -n <= i < n}
        fixed = (tuple(args[i] for i in sorted(static)), tuple(sorted((k, v) for k, v in kwargs.items() if k in self.static_argnames)))
        leaves, tree = jax.tree_util.tree_flatten(([a for i, a in enumerate(args) if i not in static],
                                                   {k: v for k, v in kwargs.items() if k not in self.static_argnames}))
        return (tree, fixed), leaves


def _leaf_key(x: Any) -> tuple:
    """A dynamic argument as jax.jit tells calls apart: shape, dtype and weak type (a Python scalar by its type alone)."""
    if isinstance(x, (bool, int, float, complex)):
        x = jax.typeof(x)
    return tuple(x.shape), x.dtype, bool(getattr(x, "weak_type", False))
