"""The example models' programs and their candidates, made once per test process and shared by the modules that ask.

`enumerate_candidates` takes 5 to 25 s on these graphs on a 2-core machine (SPLADE's small training step, 1377
equations: about 18 s), and several tests of several modules enumerate the same one. Candidates are frozen (a
spec is matched when first asked, then kept), so sharing them changes nothing a test sees; a test that needs a
fresh enumeration (one that changes the templates) calls `enumerate_candidates` itself.
"""
from __future__ import annotations

import functools
import importlib

import jax

import autofuse
from autofuse.tuning.partition import Candidate, enumerate_candidates


@functools.cache
def program(model: str, entry: str = "grad_step", shapes: str = "small", layers: int | None = None):
    """(module, graph, args) of `examples.<model>:<entry>`: at `small_inputs()` (arrays), or with ``shapes="published"``
    at `example_inputs()`'s shapes (ShapeDtypeStructs only; `layers`: that many of its layers, else its default)."""
    mod = importlib.import_module(f"examples.{model}")
    if shapes == "small":
        assert layers is None, "small_inputs() has its own layers"
        args = mod.small_inputs()
    elif shapes == "published":
        make = mod.example_inputs if layers is None else functools.partial(mod.example_inputs, layers=layers)
        args = jax.eval_shape(make)
    else:
        raise ValueError(shapes)
    return mod, autofuse.capture(getattr(mod, entry), *args), args


@functools.cache
def candidates(model: str, entry: str = "grad_step", shapes: str = "small", layers: int | None = None) -> tuple[Candidate, ...]:
    """`enumerate_candidates` of `program(...)`'s graph, once per process."""
    return tuple(enumerate_candidates(program(model, entry, shapes, layers)[1]))
