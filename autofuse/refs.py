"""``module:qualname`` references: how autofuse names a function that another process imports (the CLI's
MODULE:FUNCTION and MODULE:FACTORY, a worker's program, a background job's function), the one way it resolves one,
and how it starts the Python processes that do.

The working directory is searched after the installed packages, never before: a file there (a ``numpy.py``) must not
shadow an installed module, while the user's own module there stays importable by name. Imports nothing from
autofuse or JAX."""
from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any


def resolve(ref: str) -> Any:
    """The object `ref` (``MODULE:NAME``, NAME dotted for a class attribute) names, the working directory searched
    last; ValueError (one line) otherwise."""
    mod, _, attr = ref.partition(":")
    if not mod or not attr:
        raise ValueError(f"expected MODULE:NAME, got {ref!r}")
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.append(cwd)
    try:
        obj = importlib.import_module(mod)
    except ImportError as e:
        raise ValueError(f"cannot import module {mod!r}: {e}") from None
    except Exception as e:  # a syntax error, or an error while the module runs: the user's to fix, in one line
        where = f" ({e.filename}, line {e.lineno})" if isinstance(e, SyntaxError) else ""
        raise ValueError(f"importing module {mod!r} failed: {type(e).__name__}: {e.msg if isinstance(e, SyntaxError) else e}{where}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"module {mod!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def reference(fn: Callable) -> str:
    """``module:qualname`` of `fn` that another process can `resolve` back to it (or to a wrapper of it: a `jax.jit`
    or `autofuse.jit` of it); ValueError (one line) when there is none."""
    ref = f"{getattr(fn, '__module__', None)}:{getattr(fn, '__qualname__', '?')}"
    if ref.startswith(("__main__:", "None:")) or "<" in ref:
        raise ValueError(f"{ref} cannot be imported by name in another process: define it at the top level of a module")
    got = resolve(ref)
    if got is not fn and getattr(got, "__wrapped__", None) is not fn:
        raise ValueError(f"{ref} names another object than the function given")
    return ref


def python_command(module: str, *args: str, env: Mapping[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of a Python process running `module` that imports as this one does: this
    process's search path as its PYTHONPATH, less the working directory that Python put first for ``-m``, ``-c`` or a
    prompt (an entry the PYTHONPATH names stays), and ``-P``, so that Python does not put it first again. `resolve`
    appends it last where a reference needs it."""
    named = set(filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    cwd = os.getcwd()
    path = [p for p in dict.fromkeys(sys.path) if p and (p in named or os.path.abspath(p) != cwd)]
    return [sys.executable, "-P", "-m", module, *args], {**(os.environ if env is None else env), "PYTHONPATH": os.pathsep.join(path)}
