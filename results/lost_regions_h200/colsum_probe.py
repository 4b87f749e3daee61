"""GPU probe: Mosaic GPU matmul candidates with column sums (LN backward's dgamma/dbeta partials) at block_n 128/192/256."""
import sys, jax, jax.numpy as jnp, autofuse
from autofuse.kernels import TEMPLATES
from autofuse.plan import build_group
from autofuse.tuning.partition import enumerate_candidates
from autofuse.tuning.output import group_label
from autofuse.runner.measure import check, cone_tolerances
from examples import gpt2
cpu = jax.default_backend() == "cpu"
for D in ((192,) if cpu else (1024, 1152)):
    cfg = gpt2.Config(vocab=512, d_model=D, n_layers=1, max_seq=2048)
    args = gpt2.make_inputs(cfg, batch=1 if cpu else 4, seq=128 if cpu else 2048)
    graph = autofuse.capture(gpt2.grad_step_cudnn, *args)
    seen = set()
    for c in enumerate_candidates(graph):
        if c.template != "matmul" or not c.spec.epi.col_sums:
            continue
        label = group_label("matmul", [n.name for n in c.group.nodes])
        if label in seen or len(seen) >= 2 or "mul" not in label:
            continue
        seen.add(label)
        base = TEMPLATES["matmul"].default_config_of(c.spec, "mosaic_gpu")
        avals = c.group.input_avals()
        tols = cone_tolerances(graph, c.group.node_ids, c.group.outputs)
        ref = jax.jit(lambda *a, g=c.group: g.evaluate(a))
        print(f"D={D} {label} M,N,K={c.spec.M},{c.spec.N},{c.spec.K} default {base}", flush=True)
        for bn in (128, 192):
            for et in (32, 64):
                for mcs in (base["max_concurrent_steps"], 3, 2):
                    cf = {**base, "block_n": bn, "epi_tile_n": et, "max_concurrent_steps": mcs, "pingpong": 0}
                    why = TEMPLATES["matmul"].unsupported(c.spec, "mosaic_gpu", cf)
                    if not why:
                        break
                if why:
                    print(f"  bn={bn} et={et}: unsupported {str(why)[:80]}"); continue
                try:
                    fn = build_group(c.group, "matmul", cf, backend="mosaic_gpu", interpret=cpu)
                    res = check(fn, ref, avals, (1, 2), tols)
                    print(f"  bn={bn} et={et} mcs={mcs} bm={cf['block_m']} bk={cf['block_k']}: ok={res.ok} err={res.max_error:.3g} {res.reason[:100]}", flush=True)
                except Exception as e:
                    print(f"  bn={bn} et={et}: {type(e).__name__} {str(e)[:100]}", flush=True)
