"""What the `attention` template reads off a group (`AttentionSpec`, its `Operand`s) and how the group's score work
runs on [block_q, block_k] tiles (`AttentionEval`): shared by the matcher (`attention.py`), the masks' analysis
(`attention_masks.py`) and every backend's lowering, apart from the matching itself so that they need not import it."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from .. import ops
from ..graph import Group, Lit, Node
from .tile_eval import TileEval
from .tiling import TileSpec

_NEG = -1e4  # a fill at or below this contributes exp(fill - max) == 0 in float32 next to real scores
_MAX_GRID = 1 << 28  # host-side mask analysis only for [q, k] grids up to this many positions (16k x 16k: 3-5 s on a
# 2-core host, once per spec and process; 32k x 32k would take 14 s)
#: A finite literal of the score work below this is raised to it. A mask's fill (JAX's XLA path writes float32's
#: lowest x 0.7, plain code its lowest) times log2(e) for the kernels' exp2 overflows float32, so a row whose every key
#: is masked computed -inf - -inf = NaN, where XLA's exp(fill - max) = 1 weighs its keys alike; and the row logsumexp
#: the backward reads (fill + log(keys)) must keep log(keys) beside the fill. At _NEG the first is exact and the second
#: within 5e-4 (float32's spacing there), while exp(fill - max) stays 0 next to any real score, as XLA's does.
FILL_LIMIT = _NEG
GRAIN = 16  # masks known at build time are kept per GRAIN x GRAIN block: every tile's sides are multiples of it


@dataclass(frozen=True)
class KeyBound:
    """Keys from a per-CTA scalar of the score work on are masked for every query (padding given as key lengths, as
    `jax.nn.dot_product_attention(key_value_seq_lengths=...)` writes it): a kernel visits the key blocks up to it only.
    Read from the group by `attention_masks`, evaluated in the kernel: the live keys are positions < min over `limits`
    of value (+ 1 where inclusive)."""
    limits: tuple[tuple[int, bool], ...]  # (a score-work value constant along the query and key axes, inclusive)
    # the masking selects it reads from (select node id -> its score operand): where every key of a block is live and
    # the masks known at build time leave the block whole, the select passes the score through
    selects: dict[int, int] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class LiveBlocks:
    """A mask known at build time, per `GRAIN` x `GRAIN` block of the [Lq, Lk] score grid ([cdiv(Lq, GRAIN),
    cdiv(Lk, GRAIN)] each): `some`, some real position is live (unmasked); `every`, every real position is (those
    past Lq or Lk do not count). Enough for the key block ranges of any tiling, and small at any length where the
    whole grid is not (16k x 16k positions: 2 MB against 256 MB)."""
    some: np.ndarray
    every: np.ndarray


@dataclass
class Operand:
    """A dot operand read from a group input: for each input axis, its role and index arithmetic."""

    value: int  # the group input
    seq_axis: int  # input axis of the sequence (q or k)
    d_axis: int  # input axis of the head dimension
    batch: dict[int, list[tuple[int, int, int, int]]]  # input axis -> [(score axis, div, mod, mul)]: index += ((b // div) % mod) * mul


@dataclass
class AttentionSpec:
    group: Group
    score_shape: tuple[int, ...]
    q_axis: int
    k_axis: int
    batch_axes: tuple[int, ...]
    q: Operand
    k: Operand
    v: Operand
    D: int
    Dv: int
    dot1: Node
    dot2: Node
    max_node: Node
    sum_node: Node
    combine: Node  # div/mul of the exp branch by a function of the sum
    x: int  # the value the max reduces (scores after their elementwise work)
    sub_row: int  # the row value subtracted before exp
    e_sum: int  # the value the sum reduces
    e_dot: int  # the exp-branch operand of `combine`
    e_first: bool  # whether that operand comes first in `combine`
    l_row: int  # the other operand of `combine`
    pre: list[Node]  # score work, per tile (no dependence on the max)
    row_m: list[Node]  # row work on the max
    exp_branch: list[Node]  # sub, exp, converts
    row_l: list[Node]  # row work on the sum
    post: list[Node]  # converts between dot2 and the group output
    out: int  # the group's single output
    out_roles: list  # per output axis: "q", "d", a score axis (batch index), or None (unit)
    tile: TileSpec  # score-space tile spec for the evaluator
    dot_dtype1: np.dtype
    dot_dtype2: np.dtype
    mask_selects: dict[int, int] = field(default_factory=dict)  # select node id -> value it takes where unmasked
    mask_adds: dict[int, int] = field(default_factory=dict)  # add node id -> its score operand (the mask is 0 where unmasked)
    live: LiveBlocks | None = field(default=None, repr=False, compare=False)  # where a mask known at build time leaves scores
    masks_known: bool = False  # the mask analysis ran (lazily: matching stays cheap for the partitioner)
    key_bound: KeyBound | None = field(default=None, repr=False, compare=False)  # runtime masks bounding the live keys
    # read as a library attention (`attention_library`): each input of `group`'s own graph -> the program's value it stands for
    feeds: dict[int, int] = field(default_factory=dict, compare=False)
    ranges: dict[tuple[int, int], np.ndarray | None] = field(default_factory=dict, repr=False, compare=False)  # `block_ranges` by tiles

    @property
    def Lq(self) -> int:
        return self.score_shape[self.q_axis]

    @property
    def Lk(self) -> int:
        return self.score_shape[self.k_axis]

    @property
    def batch(self) -> int:
        return math.prod(self.score_shape[a] for a in self.batch_axes)


# ---------------------------------------------------------------------------
# Tile evaluation.
def score_literal(a: Lit) -> jax.Array:
    """A literal of the score work as the kernels compute with it: a finite fill below `FILL_LIMIT` raised to it."""
    x = np.array(a.value, ops.compute_dtype(a.aval.dtype))
    if np.issubdtype(x.dtype, np.floating) and np.all(np.isfinite(x)):
        x = np.maximum(x, FILL_LIMIT).astype(x.dtype)
    return jnp.asarray(x)


class AttentionEval(TileEval):
    """The tile evaluator with attention coordinates: iota gives global q/k positions and batch indices."""

    def __init__(self, spec: AttentionSpec, bq: int, bk: int):
        super().__init__(spec.tile, bq, bk)
        self.aspec = spec
        self.bidx: list = []
        self.q0 = self.k0 = 0

    def atom(self, env: dict, a) -> jax.Array:
        return score_literal(a) if isinstance(a, Lit) else env[a]

    def eval_node(self, nd: Node, env: dict, r0, c0, colmask=None) -> None:
        # Float-to-float converts keep float32 (excess precision, as XLA allows): rounding every
        # score to bfloat16 and back costs two instructions per score in the inner loop.
        if nd.name == "convert_element_type" and isinstance(nd.inputs[0], int):
            src, dst = self.g.avals[nd.inputs[0]].dtype, self.g.avals[nd.outputs[0]].dtype
            if jnp.issubdtype(src, jnp.floating) and jnp.issubdtype(dst, jnp.floating):
                env[nd.outputs[0]] = env[nd.inputs[0]].astype(ops.compute_dtype(dst))
                return
        super().eval_node(nd, env, r0, c0, colmask)

    def set_program(self, bidx: list, q0, k0) -> None:
        self.bidx, self.q0, self.k0 = bidx, q0, k0

    def iota(self, nd: Node, r0, c0):
        a = self.spec.axes[nd.outputs[0]][nd.params["dimension"]]
        dt = ops.compute_dtype(nd.params["dtype"])
        if a == self.aspec.q_axis:
            return (self.q0 + jax.lax.broadcasted_iota(jnp.int32, (self.bm, 1), 0)).astype(dt)
        if a == self.aspec.k_axis:
            return (self.k0 + jax.lax.broadcasted_iota(jnp.int32, (1, self.bn), 1)).astype(dt)
        if a is None:
            return jnp.zeros((1, 1), dt)
        return jnp.full((1, 1), self.bidx[a], jnp.int32).astype(dt)
