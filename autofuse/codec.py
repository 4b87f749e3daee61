"""Example arguments as JSON, for a process that rebuilds them: a tuning worker (the run's job row) and a background
tuning job (its job file). One wire format, written and read here only, so that the two never drift apart.

Arrays (and tracers, and shape structs) travel as shape and dtype and come back as `jax.ShapeDtypeStruct`; tuples,
lists and dicts with string keys keep their structure (a static tuple comes back a tuple, hashable as jax.jit needs
it); plain scalars travel as they are. Imports nothing from autofuse, and JAX and NumPy only when an array is met: a
background job reads its file before it lowers its priority and loads JAX.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class EncodeError(ValueError):
    """An argument that cannot be written as data (one line)."""


def encode(x: Any) -> Any:
    """The JSON form of one argument (static ones too); `EncodeError` for what cannot be written as data."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        import numpy as np

        return {"array": [[int(d) for d in x.shape], np.dtype(x.dtype).name]}
    if isinstance(x, (list, tuple)):
        return {"tuple" if isinstance(x, tuple) else "list": [encode(v) for v in x]}
    if isinstance(x, dict):
        if not all(isinstance(k, str) for k in x):
            raise EncodeError("cannot describe a dict with keys other than strings as data")
        return {"dict": {k: encode(v) for k, v in x.items()}}
    if x is None or isinstance(x, (bool, int, float, str)):
        return {"value": x}
    raise EncodeError(f"cannot describe a {type(x).__name__} as data: tuples, lists, dicts, arrays and scalars only")


def decode(x: Any) -> Any:
    """An argument from its `encode` form: arrays as `jax.ShapeDtypeStruct`."""
    (kind, v), = x.items()
    if kind == "array":
        import jax  # here, not at the top: a background job loads JAX only once its priority is lowered

        return jax.ShapeDtypeStruct(tuple(v[0]), jax.numpy.dtype(v[1]))
    if kind in ("list", "tuple"):
        seq = [decode(e) for e in v]
        return seq if kind == "list" else tuple(seq)
    if kind == "dict":
        return {k: decode(e) for k, e in v.items()}
    return v


def encode_call(args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[list, dict]:
    """A call's positional and keyword arguments, each encoded."""
    return [encode(a) for a in args], {k: encode(v) for k, v in kwargs.items()}


def decode_call(args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[tuple, dict]:
    """The arguments of a call from their `encode_call` form."""
    return tuple(decode(a) for a in args), {k: decode(v) for k, v in kwargs.items()}
