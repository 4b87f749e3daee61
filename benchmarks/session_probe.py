"""Session probe (issue 8): (1) the shared memory Triton asks for, per config, of Llama's attention group, against the
template's estimate; (2) the SPLADE head's fused kernel with the log1p/relu applied per tile (as written) against the same
head with the monotone work moved after the max (the rewrite a monotonicity rule would make); (3) where the SPLADE
model's time goes, part by part."""
from __future__ import annotations

import functools
import itertools
import os
import re
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from autofuse.graph import capture  # noqa: E402
from autofuse.kernels import TEMPLATES  # noqa: E402
from autofuse.runner.measure import random_inputs, time_fn, compare  # noqa: E402
from autofuse.tuning.partition import enumerate_candidates  # noqa: E402
from autofuse.plan import executor, plan_from_choices  # noqa: E402
from examples import llama  # noqa: E402


def largest(g, template):
    return max((c for c in enumerate_candidates(g) if c.template == template), key=lambda c: len(c.nodes))


def run_plan(g, cand, template, cfg):
    run = executor(g, plan_from_choices(g, [(cand.group, template, cfg)]), interpret=None)
    return jax.jit(lambda *x: run(x))


def llama_smem():
    args = jax.eval_shape(functools.partial(llama.example_inputs, 1))
    g = capture(llama.forward, *args)
    cand = largest(g, "attention")
    spec = TEMPLATES["attention"].match(cand.group)
    print("llama attention", len(cand.nodes), "nodes; D", spec.D, "Dv", spec.Dv, "dtype", spec.dot_dtype1, flush=True)
    avals = [g.avals[v] for v in g.inputs]
    x = random_inputs(avals, 1)
    for bq, bk, w, s in itertools.product((64, 128), (64, 128), (4, 8), (1, 2, 3, 4)):
        cfg = {"block_q": bq, "block_k": bk, "num_warps": w, "num_stages": s}
        est = (bq * spec.D + bk * (spec.D + spec.Dv) * s) * spec.dot_dtype1.itemsize
        try:
            jax.block_until_ready(run_plan(g, cand, "attention", cfg)(*x))
            got = "ok"
        except Exception as e:
            m = re.search(r"[Rr]equired:? *(\d+)", str(e))
            got = f"needs {m.group(1)}" if m else f"{type(e).__name__}: {str(e)[:160]}"
        print(f"bq={bq} bk={bk} w={w} s={s} est={est} -> {got}", flush=True)


def splade(h, w, bias, mask):
    return jnp.max(jnp.log1p(jax.nn.relu(h @ w + bias)) * mask[..., None], axis=1)


def splade_premax(h, w, bias, mask):
    return jnp.log1p(jax.nn.relu(jnp.max(jnp.where(mask[..., None], h @ w + bias, -jnp.inf), axis=1)))


def splade_probe():
    bf = jnp.bfloat16
    sp = [jax.ShapeDtypeStruct(s, d) for s, d in (((32, 256, 768), bf), ((768, 30522), bf), ((30522,), bf), ((32, 256), jnp.bool_))]
    ref = jax.jit(splade)
    for fn in (splade, splade_premax):
        g = capture(fn, *sp)
        avals = [g.avals[v] for v in g.inputs]
        sets = [random_inputs(avals, 100 + k) for k in range(3)]
        cand = largest(g, "matmul_reduce")
        print(fn.__name__, "jax.jit", f"{time_fn(jax.jit(fn), sets).median_ms:.4f}", flush=True)
        for bm, bn, bk, w, s in ((128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (64, 128, 64, 4, 4), (128, 256, 64, 8, 3), (128, 128, 128, 8, 2), (256, 128, 64, 8, 3)):
            cfg = {"block_m": bm, "block_n": bn, "block_k": bk, "num_warps": w, "num_stages": s, "split": 1}
            try:
                f = run_plan(g, cand, "matmul_reduce", cfg)
                err = compare(f(*sets[0])[0], ref(*sets[0]), 1.0)[1]
                print(fn.__name__, cfg, f"{time_fn(f, sets).median_ms:.4f} ms err {err:.2e}", flush=True)
            except Exception as e:
                print(fn.__name__, cfg, "failed", type(e).__name__, str(e)[:200], flush=True)


def splade_parts():
    """Where the SPLADE model's time goes: jax.jit of the whole forward, of the forward up to the head's input, of the
    head alone; the fused head alone and inside the whole forward (the rest in XLA); the transpose of the embedding."""
    from examples import splade as sp

    cfg = {"block_m": 256, "block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 3, "split": 1}
    model = sp.Config(**{**sp.BERT_BASE.__dict__, "n_layers": 2})
    sets = [sp.make_inputs(model, 32, 256, seed=s) for s in range(3)]

    def body(params, batch):
        tokens, mask = batch["tokens"], batch["mask"]
        x = params["word_emb"][tokens] + params["pos_emb"][:256] + params["type_emb"][0]
        x = sp.layer_norm(x, params["ln_emb"])
        for lp in params["layers"]:
            x = sp.encoder_layer(x, lp, mask)
        m = params["mlm"]
        return sp.layer_norm(jax.nn.gelu(sp.dense(x, m["transform"]), approximate=False), m["ln"])

    def fused(fn, args):
        g = capture(fn, *args)
        cand = largest(g, "matmul_reduce")
        run = executor(g, plan_from_choices(g, [(cand.group, "matmul_reduce", cfg)]), interpret=None)
        return jax.jit(lambda *x: run(jax.tree_util.tree_leaves(x))[0])

    head_sets = [(jax.jit(body)(*a), a[0]["word_emb"].T, a[0]["mlm"]["bias"], a[1]["mask"]) for a in sets]
    rows = {"jax.jit forward": (jax.jit(sp.forward), sets), "jax.jit forward up to h": (jax.jit(body), sets),
            "jax.jit head": (jax.jit(sp.splade_head), head_sets), "fused head alone": (fused(sp.splade_head, head_sets[0]), head_sets),
            "forward with the fused head": (fused(sp.forward, sets[0]), sets),
            "transpose of word_emb": (jax.jit(lambda p: p["word_emb"].T), [(a[0],) for a in sets])}
    for name, (fn, args) in rows.items():
        print(f"{name}: {time_fn(fn, args).median_ms:.4f} ms", flush=True)


if __name__ == "__main__":
    {"llama": llama_smem, "splade": splade_probe, "splade_parts": splade_parts}[sys.argv[1]]()
