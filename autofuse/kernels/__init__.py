"""Kernel templates. Each module has `match(group)`, `space(group)` and `build(group, config)`.

A template knows a loop structure; the arithmetic comes from the group's own
jaxpr (see `tiling.py`). `TEMPLATES` is the registry the partitioner and the
search use, in order of preference. More templates can be added with
`register_template`, or by naming modules in `$AUTOFUSE_TEMPLATE_PLUGINS`
(comma-separated; each is imported and registers itself), which also
reaches the trial worker processes.
"""
from __future__ import annotations

import importlib
import os
from types import ModuleType

from . import attention, elementwise, matmul, matmul_reduce, row_reduce

TEMPLATES: dict[str, ModuleType] = {"attention": attention, "row_reduce": row_reduce, "elementwise": elementwise, "matmul_reduce": matmul_reduce, "matmul": matmul}


def register_template(module: ModuleType, *, first: bool = False) -> None:
    """Add a template module (with NAME, PARAMS, match, space, default_config, build)."""
    for attr in ("NAME", "PARAMS", "match", "space", "default_config", "build"):
        if not hasattr(module, attr):
            raise TypeError(f"template module {module.__name__} lacks {attr}")
    if first:
        items = [(module.NAME, module)] + [(k, v) for k, v in TEMPLATES.items() if k != module.NAME]
        TEMPLATES.clear()
        TEMPLATES.update(items)
    else:
        TEMPLATES[module.NAME] = module


def match_template(group) -> tuple[str, object] | None:
    """The first template that can implement `group`, with its match data."""
    for name, mod in TEMPLATES.items():
        m = mod.match(group)
        if m is not None:
            return name, m
    return None


for _name in filter(None, (s.strip() for s in os.environ.get("AUTOFUSE_TEMPLATE_PLUGINS", "").split(","))):
    importlib.import_module(_name)
