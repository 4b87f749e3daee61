"""How much of the attention forward is the exp: the default kernel with jnp.exp2 as it is, as a polynomial on the FMA
pipe, and as a near-free stand-in (wrong values: timing only). One variant per process (argv[1]), D from argv[2]."""
import sys, types, jax, jax.numpy as jnp, numpy as np
from jax import lax
from autofuse.kernels import TEMPLATES
import autofuse.kernels.mosaic_gpu.attention as A
from autofuse.runner.measure import time_fn, random_inputs
from benchmarks.mosaic_probe import WORKLOADS, _group, arg_specs

def exp2_poly(x):  # 2^x for x <= 0: 2^round(x) by the exponent bits, 2^f (|f| <= 1/2) by a cubic
    x = jnp.maximum(x, -126.0)
    t = x + 12582912.0
    f = x - (t - 12582912.0)
    p = ((0.0555041 * f + 0.2402265) * f + 0.6931472) * f + 1.0
    return lax.bitcast_convert_type(lax.bitcast_convert_type(p, jnp.int32) + lax.shift_left(lax.bitcast_convert_type(t, jnp.int32), 23), jnp.float32)

variant, D, causal = sys.argv[1], int(sys.argv[2]), len(sys.argv) > 3
if variant != "base":
    fake = types.SimpleNamespace(**{k: getattr(jnp, k) for k in dir(jnp) if not k.startswith("__")})
    fake.exp2 = exp2_poly if variant == "poly" else (lambda x: 1.0 + x * 1e-9)
    A.jnp = fake
name = f"attention-{'causal-' if causal else ''}B8H32L2048D{D}"
fn, shapes = WORKLOADS[name]
graph, cand = _group(fn, arg_specs(name, shapes))
tmpl = TEMPLATES["attention"]
cfg = tmpl.default_config_of(cand.spec, "mosaic_gpu")
k = jax.jit(tmpl.build(cand.group, cfg, backend="mosaic_gpu", spec=cand.spec))
sets = [random_inputs(cand.group.input_avals(), s) for s in range(3)]
out = k(*sets[0])[0]; ref = jax.jit(fn)(*sets[0])
err = float(jnp.linalg.norm((out - ref).astype(jnp.float32)) / jnp.linalg.norm(ref.astype(jnp.float32)))
t = time_fn(k, sets)
print(f"RESULT {name} {variant}: {t.median_ms*1e3:.1f} us (p25 {t.q1_ms*1e3:.1f}, p75 {t.q3_ms*1e3:.1f}) rel err {err:.2e}", flush=True)
