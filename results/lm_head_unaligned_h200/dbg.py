"""One variant per process: a Mosaic GPU matmul checked against jax.jit on the GPU."""
import sys, json, jax, jax.numpy as jnp, numpy as np
import autofuse
from autofuse.graph import Group
from autofuse.kernels import matmul
from autofuse.kernels.mosaic_gpu import matmul as mm
S = jax.ShapeDtypeStruct
v = json.loads(sys.argv[1])
fns = {"bias_gelu": lambda x, w, b: jax.nn.gelu(x @ w + b), "lm": lambda x, w: jnp.einsum("mk,nk->mn", x, w),
       "plain": lambda x, w: x @ w}
fn = fns[v["fn"]]
shapes = v["shapes"]
if v.get("no_rows"):
    mm.row_stored = lambda spec, cfg: False
g = autofuse.capture(fn, *[S(s, jnp.bfloat16) for s in shapes])
group = Group.of(g, [n.id for n in g.nodes]); spec = matmul.match(group)
cfg = {**mm.default_config(spec), **v.get("cfg", {})}
k = jax.jit(mm.lower(group, spec, cfg))
keys = jax.random.split(jax.random.key(0), len(shapes))
xs = [jax.random.normal(kk, s, jnp.float32).astype(jnp.bfloat16) for kk, s in zip(keys, shapes)]
try:
    out = jax.block_until_ready(k(*xs))[0]
    ref = jax.jit(fn)(*xs)
    err = float(jnp.linalg.norm((out - ref).astype(jnp.float32)) / jnp.linalg.norm(ref.astype(jnp.float32)))
    print("RESULT", json.dumps(v), "rows" if mm.row_stored(spec, mm.Config.of(cfg)) else "padded", f"err={err:.2e}", flush=True)
except Exception as e:
    print("RESULT", json.dumps(v), "FAIL", str(e)[:160], flush=True)
