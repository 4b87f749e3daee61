"""Input signatures as text (``bfloat16[8, 128]``, as `Graph.signature` and the store write them): parsed, shortened
(``bf16[8,128]``), compared and abstracted. Pure Python: the command line lists shapes without importing JAX."""
from __future__ import annotations

import math
import re
from collections.abc import Sequence

_AVAL = re.compile(r"^([a-z]+[0-9]*)\[([0-9, ]*)\]$")
_SHORT = {"bfloat16": "bf16", "float16": "f16", "float32": "f32", "float64": "f64", "int8": "i8", "int16": "i16",
          "int32": "i32", "int64": "i64", "uint8": "u8", "uint32": "u32", "bool": "bool"}


def parse_aval(text: str) -> tuple[str, tuple[int, ...]] | None:
    """``("bfloat16", (8, 128))`` from ``"bfloat16[8, 128]"``; None if it does not read so."""
    m = _AVAL.match(text.strip())
    if m is None:
        return None
    dims = [d for d in m.group(2).replace(" ", "").split(",") if d]
    return m.group(1), tuple(int(d) for d in dims)


def short_aval(text: str) -> str:
    """``bf16[8,128]`` for ``bfloat16[8, 128]`` (what status lines show)."""
    parsed = parse_aval(text)
    if parsed is None:
        return text
    dtype, shape = parsed
    return f"{_SHORT.get(dtype, dtype)}[{','.join(map(str, shape))}]"


def short_inputs(inputs: Sequence[str]) -> str:
    """``f32[8,128], f32[128]``."""
    return ", ".join(map(short_aval, inputs))


def pattern(inputs: Sequence[str]) -> str:
    """The inputs with their sizes abstracted, ``f32[?,?], f32[?]``: the shapes a structure may take."""
    out = []
    for text in inputs:
        parsed = parse_aval(text)
        out.append(text if parsed is None else f"{_SHORT.get(parsed[0], parsed[0])}[{','.join('?' for _ in parsed[1])}]")
    return ", ".join(out)


def shape_change(tuned: Sequence[str], serving: Sequence[str]) -> tuple[str, str]:
    """The inputs that differ between the shapes a plan was tuned at and those it serves, as two short texts
    (``("f32[8,128]", "f32[32,128]")``)."""
    if len(tuned) != len(serving):
        return short_inputs(tuned), short_inputs(serving)
    diff = [(a, b) for a, b in zip(tuned, serving, strict=True) if a != b] or list(zip(tuned, serving, strict=True))
    return ", ".join(short_aval(a) for a, _ in diff), ", ".join(short_aval(b) for _, b in diff)


def distance(tuned: Sequence[str], serving: Sequence[str]) -> float:
    """How far apart two input signatures are: the sum over dimensions of |log2(ratio)| (0: the same shapes; inf:
    not comparable)."""
    if len(tuned) != len(serving):
        return math.inf
    total = 0.0
    for a, b in zip(tuned, serving, strict=True):
        pa, pb = parse_aval(a), parse_aval(b)
        if pa is None or pb is None or len(pa[1]) != len(pb[1]):
            return math.inf
        total += sum(abs(math.log2(max(x, 1) / max(y, 1))) for x, y in zip(pa[1], pb[1], strict=True))
    return total
