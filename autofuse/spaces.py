"""Declarative search spaces (the repository's top-level `search_spaces/*.toml`, shipped in the wheel as package data
`autofuse/search_spaces/`), plus the user's own (``$AUTOFUSE_SEARCH_SPACES``): parameters, choices, constraints.

Read with the standard library's `tomllib` (the deploy path checks stored plans against these
files, and must not import a third-party parser), loaded and validated once; a malformed file
raises `SpaceError` naming the file and the key. Constraints are small arithmetic expressions over the
parameters and facts about the group (R, C, itemsize, ...), parsed with `ast`
and evaluated with no access to Python builtins beyond a few math helpers.
They are checked before anything is compiled.
"""
from __future__ import annotations

import ast
import functools
import math
import operator
import os
import tomllib
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

USER_SPACES = "AUTOFUSE_SEARCH_SPACES"  # directories (os.pathsep between) of spaces that override or add to the bundled
_FUNCS = {"next_pow2": lambda x: 1 << max(0, int(x - 1).bit_length()), "min": min, "max": max, "log2": math.log2, "ceil_div": lambda a, b: -(-a // b)}
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
           ast.Div: operator.truediv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_CMPOPS = {ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge, ast.Eq: operator.eq, ast.NotEq: operator.ne}


class SpaceError(ValueError):
    """A search-space file that is malformed."""


@dataclass(frozen=True)
class Constraint:
    expr: str
    why: str
    tree: Any

    def holds(self, names: dict) -> bool:
        return bool(_eval(self.tree.body, names))


#: The backend a config or a stored plan that names none runs on, and the one whose search-space files carry no
#: backend suffix (`<template>.toml`; another backend's are `<template>.<backend>.toml`). Everything else about a
#: backend is found through its lowering modules (`autofuse.kernels.<backend>.<template>`).
DEFAULT_BACKEND = "triton"


def space_key(template: str, backend: str = DEFAULT_BACKEND) -> str:
    """The name of a template's search space for a backend (its file's stem)."""
    return template if backend == DEFAULT_BACKEND else f"{template}.{backend}"


@dataclass(frozen=True)
class Space:
    template: str
    params: dict[str, list]
    constraints: tuple[Constraint, ...]
    path: str
    backend: str = DEFAULT_BACKEND

    @property
    def key(self) -> str:
        return space_key(self.template, self.backend)

    def violated(self, config: dict, facts: dict) -> list[str]:
        """The constraints `config` breaks (empty: feasible)."""
        names = {**facts, **config}
        out = []
        for name, choices in self.params.items():
            if config.get(name) not in choices:
                out.append(f"{name}={config.get(name)!r} not in {choices}")
        for c in self.constraints:
            try:
                ok = c.holds(names)
            except (KeyError, ZeroDivisionError, TypeError, ValueError) as e:
                out.append(f"{c.expr}: {e}")
                continue
            if not ok:
                out.append(f"{c.expr} ({c.why})")
        return out

    def demand(self, config: dict, facts: dict, limit: str) -> float | None:
        """The largest left side of the constraints written `... <= limit` (e.g. the shared memory a config
        needs by the file's estimate, for `limit="smem_bytes"`); None when no constraint bounds `limit`."""
        names = {**facts, **config}
        sides = [_eval(c.tree.body.left, names) for c in self.constraints
                 if isinstance(c.tree.body, ast.Compare) and len(c.tree.body.ops) == 1 and isinstance(c.tree.body.ops[0], ast.LtE)
                 and isinstance(c.tree.body.comparators[0], ast.Name) and c.tree.body.comparators[0].id == limit]
        return max(sides) if sides else None


def _eval(node: ast.AST, names: dict) -> Any:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.Name):
        if node.id not in names:
            raise KeyError(f"unknown name {node.id!r}")
        return names[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _BINOPS[type(node.op)](_eval(node.left, names), _eval(node.right, names))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand, names)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return not _eval(node.operand, names)
    if isinstance(node, ast.BoolOp):  # short-circuit as Python does: `seg == 0 or block_n % seg == 0` is safe
        want = not isinstance(node.op, ast.And)
        return want if any(bool(_eval(v, names)) == want for v in node.values) else not want
    if isinstance(node, ast.Compare):
        left = _eval(node.left, names)
        for op, comp in zip(node.ops, node.comparators):
            right = _eval(comp, names)
            if not _CMPOPS[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS and not node.keywords:
        return _FUNCS[node.func.id](*[_eval(a, names) for a in node.args])
    raise ValueError(f"unsupported expression element {ast.dump(node)[:60]}")


def _check_tree(node: ast.AST, where: str) -> None:
    allowed = (ast.Expression, ast.Constant, ast.Name, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.Call, ast.Load,
               ast.And, ast.Or, ast.USub, ast.Not, *_BINOPS, *_CMPOPS)
    for sub in ast.walk(node):
        if not isinstance(sub, allowed):
            raise SpaceError(f"{where}: {type(sub).__name__} is not allowed in a constraint")
        if isinstance(sub, ast.Call) and not (isinstance(sub.func, ast.Name) and sub.func.id in _FUNCS):
            raise SpaceError(f"{where}: only {sorted(_FUNCS)} may be called")


def parse_space(data: Any, path: str) -> Space:
    if not isinstance(data, dict):
        raise SpaceError(f"{path}: top level must be a mapping")
    unknown = set(data) - {"template", "backend", "parameters", "constraints"}
    if unknown:
        raise SpaceError(f"{path}: unknown keys {sorted(unknown)}")
    template = data.get("template")
    if not isinstance(template, str):
        raise SpaceError(f"{path}: key 'template' must be a string")
    backend = data.get("backend", DEFAULT_BACKEND)
    if not isinstance(backend, str) or not backend.isidentifier():
        raise SpaceError(f"{path}: key 'backend' must be a backend's name (e.g. 'mosaic_gpu')")
    params = data.get("parameters")
    if not isinstance(params, dict) or not params:
        raise SpaceError(f"{path}: key 'parameters' must be a non-empty mapping")
    out: dict[str, list] = {}
    for name, p in params.items():
        where = f"{path}: parameters.{name}"
        if not isinstance(p, dict) or set(p) - {"choices", "power_of_two"} or "choices" not in p:
            raise SpaceError(f"{where} must be a mapping with 'choices' (and optionally 'power_of_two')")
        ch = p["choices"]
        if not isinstance(ch, list) or not ch or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in ch):
            raise SpaceError(f"{where}.choices must be a non-empty list of non-negative integers")
        if p.get("power_of_two") and any(c & (c - 1) for c in ch):
            raise SpaceError(f"{where}.choices must all be powers of two")
        out[name] = list(ch)
    constraints = data.get("constraints") or []
    if not isinstance(constraints, list):
        raise SpaceError(f"{path}: key 'constraints' must be a list of tables ([[constraints]] entries)")
    cons = []
    for i, c in enumerate(constraints):
        where = f"{path}: constraints[{i}]"
        if not isinstance(c, dict) or not isinstance(c.get("expr"), str):
            raise SpaceError(f"{where} must be a mapping with an 'expr' string")
        try:
            tree = ast.parse(c["expr"], mode="eval")
        except SyntaxError as e:
            raise SpaceError(f"{where}.expr does not parse: {e.msg}") from None
        _check_tree(tree, f"{where}.expr")
        cons.append(Constraint(c["expr"], str(c.get("why", "")), tree))
    return Space(template, out, tuple(cons), path, backend)


def load_space_file(path: str | Path | Traversable) -> Space:
    if isinstance(path, str):
        path = Path(path)
    stem = Path(path.name).stem
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise SpaceError(f"{path}: not valid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise SpaceError(f"{path}: not valid TOML: not UTF-8: {e}") from None
    except OSError as e:
        raise SpaceError(f"{path}: cannot read: {e}") from None
    space = parse_space(data, str(path))
    if space.key != stem:
        raise SpaceError(f"{path}: keys 'template' and 'backend' say {space.key!r} but the file is named for {stem!r}")
    return space


@functools.cache  # constant for the process; asked at each load_spaces(), once per candidate
def bundled_dir() -> Path | Traversable:
    """The spaces autofuse ships. An installed wheel has them inside the package (`autofuse/search_spaces/`, mapped
    there from the top-level `search_spaces/` at build time); a source checkout on the path, or an editable install,
    has no such directory and keeps them beside the package, at the repository's top level."""
    packaged = resources.files(__package__).joinpath("search_spaces")
    if packaged.is_dir() and any(p.name.endswith(".toml") for p in packaged.iterdir()):
        return packaged  # (a checkout updated past the move can keep an emptied autofuse/search_spaces/: skipped)
    return Path(__file__).resolve().parent.parent / "search_spaces"


def user_dirs() -> tuple[Path, ...]:
    """The directories of ``$AUTOFUSE_SEARCH_SPACES`` (empty entries skipped), read at each call so that a job's
    workers, which inherit the environment, see the spaces their launcher saw."""
    return tuple(Path(d).expanduser() for d in os.environ.get(USER_SPACES, "").split(os.pathsep) if d.strip())


def load_spaces(directory: str | None = None) -> dict[str, Space]:
    """All search spaces, by `space_key(template, backend)`: the bundled ones (`bundled_dir`) overridden or added to
    by the user's (`user_dirs`: the first directory naming a space wins, as on $PATH), or only the `*.toml` files of
    `directory`. A template's Triton space is `<template>.toml`, another backend's `<template>.<backend>.toml`."""
    if directory:
        return _load_dirs((Path(directory),))
    return _load_dirs((bundled_dir(), *reversed(user_dirs())), user=True)


@functools.lru_cache(maxsize=None)
def _load_dirs(dirs: tuple[Path | Traversable, ...], user: bool = False) -> dict[str, Space]:
    """The spaces of `dirs`, a later directory's file replacing an earlier one's of the same name; loaded once per
    process (a job asks for them per candidate). `user`: all but the first directory came from $AUTOFUSE_SEARCH_SPACES."""
    out: dict[str, Space] = {}
    for i, d in enumerate(dirs):
        if not d.is_dir():
            named = f" (named by ${USER_SPACES})" if user and i else ""
            raise SpaceError(f"search space directory {d}{named} does not exist")
        files = sorted((p for p in d.iterdir() if p.name.endswith(".toml") and p.is_file()), key=lambda p: p.name)
        if not files and i == 0:
            raise SpaceError(f"no search spaces (*.toml) in {d}")
        out.update({Path(p.name).stem: load_space_file(p) for p in files})
    return out
