"""GPU probe of the Mosaic GPU matmul_reduce lowering over L (the SPLADE head): which outputs are wrong and under
which configs, against jax.jit on the same inputs.

    python -m benchmarks.over_l_probe
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

import autofuse
from autofuse.kernels.mosaic_gpu import matmul_reduce as mgpu
from autofuse.tuning.partition import enumerate_candidates

BF16 = jnp.bfloat16


def splade_head(h, w, bias, mask):
    return jnp.max(jnp.log1p(jax.nn.relu(h @ w + bias)) * mask[..., None], axis=1)


def splade_nomask(h, w, bias):
    return jnp.max(jnp.log1p(jax.nn.relu(h @ w + bias)), axis=1)


def plain_max(h, w):
    return jnp.max(h @ w, axis=1)


def _group(fn, specs):
    g = autofuse.capture(fn, *specs)
    cands = [c for c in enumerate_candidates(g) if c.template == "matmul_reduce"]
    cand = max(cands, key=lambda c: len(c.nodes))
    return g, cand.group, cand.spec


def run(name, fn, shapes, cfgs):
    specs = [jax.ShapeDtypeStruct(s, BF16) for s in shapes]
    g, group, spec = _group(fn, specs)
    keys = jax.random.split(jax.random.key(0), len(shapes))
    xs = [jax.random.normal(k, s, jnp.float32).astype(BF16) for k, s in zip(keys, shapes)]
    if fn is splade_head:
        xs[3] = (jax.random.uniform(keys[3], shapes[3]) < 0.8).astype(BF16)
    ref = np.asarray(jax.jit(fn)(*xs), np.float64)
    order = [list(g.inputs).index(v) for v in group.inputs]
    d = mgpu.default_config(spec)
    print(f"== {name} {shapes} default {d}", flush=True)
    for cfg in cfgs:
        full = {**d, **cfg}
        try:
            k = jax.jit(mgpu.lower(group, spec, full))
            out = np.asarray(k(*[xs[i] for i in order])[0], np.float64)
        except Exception as e:  # noqa: BLE001
            print(f"  {cfg}: ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        err = np.abs(out - ref)
        rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
        bad = err > 0.05 * (1 + np.abs(ref))
        msg = f"  {cfg}: rel {rel:.3e} bad {bad.mean():.4f}"
        if bad.any():
            P, N = ref.shape
            rows = bad.any(axis=1)
            cols = bad.any(axis=0)
            bn = full["block_n"]
            blk = np.unique((np.nonzero(cols)[0] // bn))
            within = np.unique(np.nonzero(cols)[0] % (2 * bn))
            msg += (f" | bad p {np.nonzero(rows)[0][:8]}.. ({rows.sum()}/{P}) cols {cols.sum()}/{N}; col blocks of block_n {blk[:10]}..;"
                    f" pos in 2*block_n [{within.min()}..{within.max()}] n={len(within)}; out>ref {(out > ref)[bad].mean():.2f}")
            i = np.argwhere(bad)[0]
            msg += f"; e.g. {tuple(i)} out {out[tuple(i)]:.4f} ref {ref[tuple(i)]:.4f}"
        print(msg, flush=True)


def sweep(name, fn, specs, cfgs, make_inputs) -> None:
    """Time jax.jit, the Triton default and Mosaic GPU configs of the group's matmul_reduce candidate, checked first."""
    from autofuse.kernels import matmul_reduce
    from autofuse.runner.measure import time_fn
    g, group, spec = _group(fn, specs)
    order = [list(g.inputs).index(v) for v in group.inputs]
    sets = [make_inputs(s) for s in range(3)]
    ref = jax.jit(fn)
    want = np.asarray(ref(*sets[0]), np.float64)
    d = mgpu.default_config(spec)
    kernels = [("jax.jit", ref)]
    tri = matmul_reduce.TEMPLATE.build(group, matmul_reduce.TEMPLATE.default_config_of(spec, "triton"), spec=spec)
    kernels.append(("triton default", jax.jit(lambda *xs: tri(*[xs[i] for i in order])[0])))
    for cfg in cfgs:
        full = {**d, **cfg}
        why = matmul_reduce.TEMPLATE.unsupported(spec, "mosaic_gpu", full)
        if why:
            print(f"  {name} mosaic {cfg}: declined {why}", flush=True)
            continue
        k = mgpu.lower(group, spec, full)
        kernels.append((f"mosaic {cfg}", jax.jit(lambda *xs, k=k: k(*[xs[i] for i in order])[0])))
    kernels.append(("jax.jit again", jax.jit(fn)))
    for label, f in kernels:
        try:
            got = np.asarray(f(*sets[0]), np.float64)
            rel = np.linalg.norm(got - want) / np.linalg.norm(want)
            if not rel < 2e-2:
                print(f"  {name} {label}: WRONG rel {rel:.3e}", flush=True)
                continue
            t = time_fn(f, sets, repeats=15)
            print(f"  {name} {label}: {t.median_ms:.3f} ms ({t.min_ms:.3f}..{t.max_ms:.3f}) rel {rel:.1e}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"  {name} {label}: ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)


def ce_memory() -> None:
    """Cross-entropy over 32000 classes from h[8192, 4096]: the fused kernel's temporary memory and time vs jax.jit."""
    from benchmarks.workloads import cross_entropy
    from autofuse.runner.measure import time_fn
    M, K, V = 8192, 4096, 32000
    specs = [jax.ShapeDtypeStruct((M, K), BF16), jax.ShapeDtypeStruct((K, V), BF16), jax.ShapeDtypeStruct((M,), jnp.int32)]
    g, group, spec = _group(cross_entropy, specs)
    order = [list(g.inputs).index(v) for v in group.inputs]
    cfg = mgpu.default_config(spec)
    kern = mgpu.lower(group, spec, cfg)
    fused = jax.jit(lambda h, w, t: kern(*[(h, w, t)[i] for i in order]))
    ref = jax.jit(cross_entropy)
    for label, f in (("jax.jit", ref), ("mosaic", fused)):
        m = f.lower(*specs).compile().memory_analysis()
        print(f"  CE {label}: temp {m.temp_size_in_bytes / 2**20:.1f} MiB, output {m.output_size_in_bytes / 2**20:.2f} MiB, "
              f"args {m.argument_size_in_bytes / 2**20:.1f} MiB", flush=True)
    sets = []
    for s in range(3):
        k1, k2, k3 = jax.random.split(jax.random.key(s), 3)
        sets.append([jax.random.normal(k1, (M, K), BF16), (jax.random.normal(k2, (K, V), BF16) * 0.02).astype(BF16),
                     jax.random.randint(k3, (M,), 0, V)])
    a, b = np.asarray(ref(*sets[0]), np.float64), np.asarray(fused(*sets[0])[0], np.float64)
    print(f"  CE rel err {np.linalg.norm(a - b) / np.linalg.norm(a):.2e} cfg {cfg}", flush=True)
    for label, f in (("jax.jit", ref), ("mosaic", fused), ("jax.jit again", ref)):
        t = time_fn(lambda *xs, f=f: f(*xs), sets, repeats=15)
        print(f"  CE {label}: {t.median_ms:.3f} ms ({t.min_ms:.3f}..{t.max_ms:.3f})", flush=True)


def main() -> int:
    print(jax.devices()[0].device_kind, jax.__version__, flush=True)
    base = [{}, {"max_concurrent_steps": 5}, {"max_concurrent_steps": 2}, {"block_m": 64}, {"block_n": 64},
            {"epi_tile": 64}, {"epi_tile": 128}, {"block_m": 256, "epi_tile": 64}]
    run("plain_max ragged", plain_max, [(3, 200, 256), (256, 1000)], base[:3])
    ce_memory()
    run("splade full", splade_head, [(32, 256, 768), (768, 30522), (30522,), (32, 256)], base[:5])
    sh = [(32, 256, 768), (768, 30522), (30522,), (32, 256)]

    def splade_inputs(s):
        k = jax.random.split(jax.random.key(s), 4)
        return [jax.random.normal(k[0], sh[0], BF16), (jax.random.normal(k[1], sh[1], BF16) * 0.05).astype(BF16),
                jax.random.normal(k[2], sh[2], BF16), (jax.random.uniform(k[3], sh[3]) < 0.8).astype(BF16)]

    sweep("splade", splade_head, [jax.ShapeDtypeStruct(x, BF16) for x in sh],
          [{}, {"block_n": 64}, {"block_m": 64}, {"block_m": 64, "block_n": 64}, {"epi_tile": 64}, {"block_k": 128, "max_concurrent_steps": 2},
           {"max_concurrent_steps": 3}], splade_inputs)
    from benchmarks.workloads import cross_entropy
    M, K, V = 8192, 4096, 32000

    def ce_inputs(s):
        k1, k2, k3 = jax.random.split(jax.random.key(s), 3)
        return [jax.random.normal(k1, (M, K), BF16), (jax.random.normal(k2, (K, V), BF16) * 0.02).astype(BF16),
                jax.random.randint(k3, (M,), 0, V)]

    sweep("ce", cross_entropy, [jax.ShapeDtypeStruct((M, K), BF16), jax.ShapeDtypeStruct((K, V), BF16), jax.ShapeDtypeStruct((M,), jnp.int32)],
          [{}, {"split": 1}, {"split": 2}, {"split": 8}, {"epi_tile": 64}, {"block_n": 256, "block_m": 64, "epi_tile": 64},
           {"block_n": 64}, {"max_concurrent_steps": 3}, {"max_concurrent_steps": 2, "block_k": 128}], ce_inputs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
