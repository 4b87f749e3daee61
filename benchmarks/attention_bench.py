"""Issue 6 benchmark: plain-jnp attention under jax.jit, autofuse's attention kernel, cuDNN and Pallas `mha`.

Same process, same inputs (three rotated sets, `measure.time_fn`). The plain-jnp
programs (`benchmarks.workloads.attention_bhld`, `..._causal`, `attention_blhd`)
are what a user writes; cuDNN (`jax.nn.dot_product_attention(implementation=
"cudnn")`) and `jax.experimental.pallas.ops.gpu.attention.mha` take [B, L, H, D],
so they get the same data transposed beforehand (untimed). The autofuse kernel is
either the whole program with the attention group fused at each `--configs` entry (tile sweep) or the tuned plan
(`--tune N`: `autofuse.tune` with N trials, device measurement, then `autofuse.jit`).

    python -m benchmarks kernels attention --configs 128x64w8s3,128x128w8s2 --out results/x.md
"""
from __future__ import annotations

import argparse
import functools
import math
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import autofuse  # noqa: E402
from autofuse.runner.measure import check, random_inputs, time_fn  # noqa: E402
from autofuse.tuning.partition import enumerate_candidates  # noqa: E402
from autofuse.plan import plan_from_choices  # noqa: E402
from benchmarks.provenance import header  # noqa: E402
from benchmarks.workloads import attention_bhld, attention_bhld_causal, attention_config, attention_table, attention_blhd, emit  # noqa: E402


def _mha(causal: bool, scale: float):
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    bs = pallas_attention.BlockSizes(block_q=128, block_k=64)
    return jax.jit(functools.partial(pallas_attention.mha, segment_ids=None, sm_scale=scale, causal=causal,
                                     block_sizes=bs, num_warps=8, num_stages=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="8,32,2048,128", help="B,H,L,D")
    ap.add_argument("--configs", default="", help="comma-separated BQxBKwWARPSsSTAGES, timed directly")
    ap.add_argument("--tune", type=int, default=0, help="trials for autofuse.tune (0: no tuning)")
    ap.add_argument("--time-budget", type=float, default=120.0)
    ap.add_argument("--variants", default="bhld,bhld_causal")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    B, H, L, D = (int(x) for x in a.shape.split(","))
    scale = 1.0 / math.sqrt(D)
    fns = {"bhld": attention_bhld, "bhld_causal": attention_bhld_causal, "blhd": attention_blhd}
    rows = []
    for name in a.variants.split(","):
        fn, causal = fns[name], name.endswith("causal")
        shape = (B, L, H, D) if name == "blhd" else (B, H, L, D)
        specs = [jax.ShapeDtypeStruct(shape, jnp.bfloat16)] * 3
        sets = [random_inputs([autofuse.graph.Aval(shape, jnp.dtype(jnp.bfloat16))] * 3, 100 + i) for i in range(3)]
        flops = 4.0 * B * H * L * L * D * (0.5 if causal else 1.0)
        ref = jax.jit(fn)
        t_ref = time_fn(ref, sets, repeats=10)

        def row(label, t, extra=""):
            rows.append((name, label, t.median_ms, (t.q3_ms - t.q1_ms) / t.median_ms, flops / t.median_ms / 1e9, t_ref.median_ms / t.median_ms, extra))
            print(rows[-1], flush=True)

        row("jax.jit (XLA)", t_ref)
        blhd = [[jnp.swapaxes(x, 1, 2) for x in s] for s in sets] if name != "blhd" else sets
        to_bhld = (lambda o: o) if name == "blhd" else (lambda o: jnp.swapaxes(o, 1, 2))
        want = ref(*sets[0])
        try:
            cud = jax.jit(functools.partial(jax.nn.dot_product_attention, scale=scale, is_causal=causal, implementation="cudnn"))
            err = float(jnp.linalg.norm((to_bhld(cud(*blhd[0])) - want).astype(jnp.float32)) / jnp.linalg.norm(want.astype(jnp.float32)))
            row("cuDNN dot_product_attention", time_fn(cud, blhd, repeats=10), f"rel err {err:.1e}")
        except Exception as e:  # noqa: BLE001 - report and go on
            print("cuDNN failed:", type(e).__name__, str(e)[:300])
        try:
            mha = _mha(causal, scale)
            err = float(jnp.linalg.norm((to_bhld(mha(*blhd[0])) - want).astype(jnp.float32)) / jnp.linalg.norm(want.astype(jnp.float32)))
            row("Pallas mha (128x64 w8 s2)", time_fn(mha, blhd, repeats=10), f"rel err {err:.1e}")
        except Exception as e:  # noqa: BLE001
            print("Pallas mha failed:", type(e).__name__, str(e)[:300])

        g = autofuse.capture(fn, *specs)
        cand = max((c for c in enumerate_candidates(g) if c.template == "attention"), key=lambda c: len(c.nodes))
        for cs in filter(None, a.configs.split(",")):
            cfg = attention_config(cs)
            try:
                kern = autofuse.jit(fn, plan=plan_from_choices(g, [(cand.group, "attention", cfg)]))
                res = check(lambda *x: [kern(*x)], lambda *x: [ref(*x)], [g.avals[v] for v in g.inputs], (1,))
                assert kern.last_status.startswith("plan:"), kern.last_status
                row(f"autofuse kernel {cs}", time_fn(kern, sets, repeats=10), f"ok={res.ok} err {res.max_error:.1e}")
            except Exception as e:  # noqa: BLE001
                print(cs, "failed:", type(e).__name__, str(e)[:300], flush=True)
        if a.tune:
            rep = autofuse.tune(fn, *specs, trials=a.tune, time_budget_s=a.time_budget, name=f"attention-{name}", quiet=True, store=False)
            print(rep.table(), flush=True)
            fused = autofuse.jit(fn, plan=rep.plan)
            plan = "XLA" if rep.plan.is_xla else "; ".join(f"{gr.template} {gr.config}" for gr in rep.plan.groups)
            row("autofuse (tuned plan)", time_fn(fused, sets, repeats=10), f"{plan}; validation speedup {rep.speedup:.2f}x")
    lines = [
        f"{header()}; B,H,L,D = {a.shape}, bfloat16",
    ]
    emit(lines + attention_table(rows), a.out)


if __name__ == "__main__":
    main()
