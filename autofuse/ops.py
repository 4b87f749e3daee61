"""The primitive table: what each primitive is, and how to run it on a tile.

An allow-list: a primitive not named here is opaque and stays in XLA. The
classes drive partitioning; `eval_on_tile` is how a generated kernel runs one
equation of the group's own jaxpr on register tiles.
"""
from __future__ import annotations

import enum
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np


class OpClass(enum.Enum):
    ELEMENTWISE = "elementwise"
    BROADCAST = "broadcast"
    LAYOUT = "layout"
    REDUCTION = "reduction"
    CONTRACTION = "contraction"
    SOURCE = "source"  # iota: a value computed from indices
    OPAQUE = "opaque"


_ELEMENTWISE = {
    # unary
    "neg", "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sin", "cos", "tan",
    "sqrt", "rsqrt", "cbrt", "abs", "sign", "floor", "ceil", "is_finite", "not", "square",
    "integer_pow", "convert_element_type", "stop_gradient", "reduce_precision", "copy", "copy_p",
    "one_minus_square",  # tanh's derivative in a gradient program: 1 - x²
    "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh",
    # binary / n-ary
    "add", "sub", "mul", "div", "rem", "pow", "max", "min", "atan2", "nextafter",
    "and", "or", "xor", "eq", "ne", "lt", "le", "gt", "ge", "select_n", "clamp",
    "shift_left", "shift_right_logical", "shift_right_arithmetic",
    "add_any",  # a gradient program's sum of two cotangents: an add
}
_BROADCAST = {"broadcast_in_dim"}
_LAYOUT = {"reshape", "squeeze", "expand_dims"}
_REDUCTION = {"reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min"}
_CONTRACTION = {"dot_general"}
_SOURCE = {"iota"}

#: Opaque primitives that compute nothing: their outputs are their inputs, held back by XLA (a `jax.checkpoint`
#: backward's barrier, `graph._Builder._remat_inputs`). They stay XLA's; dtype and depth pass through them.
IDENTITY_OPS = frozenset({"optimization_barrier"})

#: reduce_precision's (exponent bits, mantissa bits) -> the dtype whose rounding it is (round to nearest even, and
#: that dtype's range: a float32 tile rounded to bf16 by a conversion there and back is XLA's result bit for bit)
_ROUNDED_TO = {(8, 7): jnp.bfloat16, (5, 10): jnp.float16, (8, 23): jnp.float32}

# Math that needs floating point at least float32 inside a kernel.
_LOW_FLOATS = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def op_class(name: str) -> OpClass:
    if name in _ELEMENTWISE:
        return OpClass.ELEMENTWISE
    if name in _BROADCAST:
        return OpClass.BROADCAST
    if name in _LAYOUT:
        return OpClass.LAYOUT
    if name in _REDUCTION:
        return OpClass.REDUCTION
    if name in _CONTRACTION:
        return OpClass.CONTRACTION
    if name in _SOURCE:
        return OpClass.SOURCE
    return OpClass.OPAQUE


FUSIBLE = {OpClass.ELEMENTWISE, OpClass.BROADCAST, OpClass.LAYOUT, OpClass.REDUCTION, OpClass.SOURCE, OpClass.CONTRACTION}


def widening(src: Any, dst: Any) -> bool:
    """Whether every value of float dtype `src` is exact in float dtype `dst` (bf16 or f16 -> float32): a conversion
    that XLA may fuse into every reader and undo where a reader converts back."""
    s, d = np.dtype(src), np.dtype(dst)
    if not (jnp.issubdtype(s, jnp.floating) and jnp.issubdtype(d, jnp.floating)) or s == d:
        return False
    fs, fd = jnp.finfo(s), jnp.finfo(d)
    return fd.nmant >= fs.nmant and fd.maxexp >= fs.maxexp and fd.minexp <= fs.minexp


def reduction_kind(name: str) -> str:
    return _REDUCTION[name]


def compute_dtype(dtype: Any) -> np.dtype:
    """The dtype a value is held in inside a kernel: low floats widen to float32."""
    d = np.dtype(dtype)
    return np.dtype(np.float32) if d in _LOW_FLOATS else d


def reduction_identity(kind: str, dtype: Any) -> Any:
    d = np.dtype(dtype)
    if kind == "sum":
        return np.array(0, d)
    if jnp.issubdtype(d, jnp.floating):  # bfloat16 too, which numpy does not count as floating
        return np.array(-np.inf if kind == "max" else np.inf, d)
    info = np.iinfo(d)
    return np.array(info.min if kind == "max" else info.max, d)


def reduce_tile(kind: str, x: jax.Array, axis: int) -> jax.Array:
    fn = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min}[kind]
    return fn(x, axis=axis, keepdims=True)


def combine(kind: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """Merge two partial reductions."""
    return {"sum": jnp.add, "max": jnp.maximum, "min": jnp.minimum}[kind](a, b)


def rounded_dtype(params: dict) -> Any:
    """The dtype a `reduce_precision` with these parameters rounds to (None: none of bf16, f16, f32)."""
    return _ROUNDED_TO.get((params["exponent_bits"], params["mantissa_bits"]))


def eval_elementwise(prim: Any, params: dict, out_dtype: Any, ins: Sequence[Any], in_dtypes: Sequence[Any] = ()) -> jax.Array:
    """Run an elementwise primitive on tiles held in compute dtypes.

    Operands are broadcast to a common tile shape first (tiles of row or
    column vectors are kept unbroadcast until they meet a full tile).
    Low-precision values are held in float32 (excess precision, as XLA does)
    except where the program converts one explicitly: there it is rounded to
    its own type first, so `f32(bf16 value)` means what the program says.
    """
    name = prim.name
    if name == "convert_element_type":
        x = ins[0]
        if in_dtypes and np.dtype(in_dtypes[0]) in _LOW_FLOATS:
            x = x.astype(in_dtypes[0]).astype(jnp.float32)
        return x.astype(compute_dtype(out_dtype))
    if name in ("stop_gradient", "copy", "copy_p"):
        return ins[0]
    if name == "reduce_precision":  # `jax.checkpoint` rounds each residual to its own dtype: `_insert_reduce_precision`
        target, x = rounded_dtype(params), ins[0]
        if target is not None and np.dtype(target).itemsize <= np.dtype(x.dtype).itemsize:
            return x.astype(target).astype(x.dtype)  # what Triton's and Mosaic GPU's lowerings lack, as conversions
        return prim.bind(x, **params)
    shapes = [jnp.shape(x) for x in ins]
    common = jnp.broadcast_shapes(*shapes)
    ops = []
    for x in ins:
        x = jnp.asarray(x)
        ops.append(jnp.broadcast_to(x, common) if x.shape != common else x)
    if name == "select_n":
        pred, *cases = ops
        dt = jnp.result_type(*cases)
        cases = [c.astype(dt) for c in cases]
        if pred.dtype == jnp.bool_:
            return jnp.where(pred, cases[1], cases[0]) if len(cases) == 2 else jax.lax.select_n(pred, *cases)
        return jax.lax.select_n(pred, *cases)
    if name == "square":
        return ops[0] * ops[0]
    if name == "add_any":
        return ops[0] + ops[1]
    # `out_dtype=None` stays: mul's transpose rule needs it (the flash backward differentiates tiles), and both
    # Pallas lowerings accept it (jax 0.11.2)
    if name in ("exp", "log", "tanh", "logistic", "exp2", "log1p", "expm1", "sin", "cos") and "accuracy" in params:
        params = {**params, "accuracy": None}
    return prim.bind(*ops, **params)


# Algorithm presets that read operands of their own dtype as they are and accumulate in float32: what a dot of those
# operands does at default precision (`jax.nn.dot_product_attention`'s XLA path asks BF16_BF16_F32 of its scores).
_NATIVE_PRESETS = {"BF16_BF16_F32": "bfloat16", "F16_F16_F32": "float16"}


def dot_precision(dot: Any, operand_dtype: Any = None) -> str:
    """The precision the program asks of a dot: "default" (none given, DEFAULT, or an algorithm that takes
    `operand_dtype` operands as they are and accumulates in float32), "highest" (HIGHEST, or an exact float32
    algorithm), "high" (HIGH) or "other" (any other algorithm preset)."""
    prec = dot.params.get("precision")
    parts = [str(p) for p in (prec if isinstance(prec, tuple) else (prec,)) if p is not None]
    native = _NATIVE_PRESETS.get(parts[0].rsplit(".", 1)[-1]) if len(parts) == 1 and operand_dtype is not None else None
    if not parts or all("DEFAULT" in p for p in parts) or (native is not None and native == np.dtype(operand_dtype).name):
        return "default"
    if any("HIGHEST" in p or p.endswith("F32_F32_F32") for p in parts):
        return "highest"
    return "high" if any("HIGH" in p for p in parts) else "other"
