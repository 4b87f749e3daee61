"""Kernel templates: the `Template` base class (`template.py`), one module per template, one lowering per backend.

A template knows a loop structure; the arithmetic comes from the group's own
jaxpr (`tiling.py`, `tile_eval.py`). `TEMPLATES` is the registry the
partitioner and the search use, in order of preference. More templates can be
added with `register_template`, or by naming modules in
`$AUTOFUSE_TEMPLATE_PLUGINS` (comma-separated; each is imported and registers
itself), which also reaches the trial worker processes.
"""
from __future__ import annotations

import importlib
import os

from ..graph import Group
from . import aligned_dot, aligned_region, attention, attention_vjp, concat_sink, elementwise, matmul, matmul_reduce, matmul_reduce_vjp, reduce_vjp, row_reduce
from .template import Template

__all__ = ["TEMPLATES", "Template", "match_template", "preload_lowerings", "register_template"]

TEMPLATES: dict[str, Template] = {t.name: t for t in (attention.TEMPLATE, attention_vjp.TEMPLATE, row_reduce.TEMPLATE, elementwise.TEMPLATE,
                                                      matmul_reduce.TEMPLATE, matmul.TEMPLATE, matmul_reduce_vjp.TEMPLATE,
                                                      reduce_vjp.TEMPLATE, aligned_dot.TEMPLATE, aligned_region.TEMPLATE,
                                                      concat_sink.TEMPLATE)}


def register_template(template: Template, *, first: bool = False) -> None:
    """Add (or replace) a template; `first` puts it before the others (it is tried first)."""
    if not isinstance(template, Template):
        raise TypeError(f"{template!r} is not a template: subclass autofuse.kernels.Template")
    if first:
        items = [(template.name, template)] + [(k, v) for k, v in TEMPLATES.items() if k != template.name]
        TEMPLATES.clear()
        TEMPLATES.update(items)
    else:
        TEMPLATES[template.name] = template


def preload_lowerings() -> None:
    """Import every registered template's lowering modules now, where each would be imported by its first kernel:
    importing holds the GIL, and in a trial process's first batch of compiles on a busy host every thread waits
    for it."""
    for template in list(TEMPLATES.values()):
        for backend in template.backends:
            try:
                template.lowering_module(backend)
            except ImportError:  # a backend this host cannot import: its kernels fail where they are built
                pass


def match_template(group: Group) -> tuple[str, object] | None:
    """The first template that can implement `group`, with its match data."""
    for name, template in TEMPLATES.items():
        m = template.match(group)
        if m is not None:
            return name, m
    return None


for _name in filter(None, (s.strip() for s in os.environ.get("AUTOFUSE_TEMPLATE_PLUGINS", "").split(","))):
    importlib.import_module(_name)
