"""Kernel templates. Each module has `match(group)`, `space(group)` and `build(group, config)`.

A template knows a loop structure; the arithmetic comes from the group's own
jaxpr (see `tiling.py`). `TEMPLATES` is the registry the partitioner and the
search use, in order of preference.
"""
from __future__ import annotations

from types import ModuleType

from . import elementwise, row_reduce

TEMPLATES: dict[str, ModuleType] = {"row_reduce": row_reduce, "elementwise": elementwise}


def match_template(group) -> tuple[str, object] | None:
    """The first template that can implement `group`, with its match data."""
    for name, mod in TEMPLATES.items():
        m = mod.match(group)
        if m is not None:
            return name, m
    return None
