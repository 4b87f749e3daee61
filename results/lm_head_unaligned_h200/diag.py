import sys, json, jax, jax.numpy as jnp, numpy as np
import autofuse
from autofuse.graph import Group
from autofuse.kernels import matmul
from autofuse.kernels.mosaic_gpu import matmul as mm
S = jax.ShapeDtypeStruct
v = json.loads(sys.argv[1])
fn = lambda x, w: jnp.einsum("mk,nk->mn", x, w)
shapes = v["shapes"]
g = autofuse.capture(fn, *[S(s, jnp.bfloat16) for s in shapes])
group = Group.of(g, [n.id for n in g.nodes]); spec = matmul.match(group)
cfg = {**mm.default_config(spec), **v.get("cfg", {})}
k = jax.jit(mm.lower(group, spec, cfg))
keys = jax.random.split(jax.random.key(0), len(shapes))
xs = [jax.random.normal(kk, s, jnp.float32).astype(jnp.bfloat16) for kk, s in zip(keys, shapes)]
try:
    out = np.asarray(jax.block_until_ready(k(*xs))[0].astype(jnp.float32))
    ref = np.asarray(jax.jit(fn)(*xs).astype(jnp.float32))
    bad = np.abs(out - ref) > 0.05 * np.abs(ref).mean()
    r, c = np.nonzero(bad)
    print("RESULT", json.dumps(v), "direct" if mm.stored_directly(spec) else "padded", cfg, "bad", int(bad.sum()), "of", bad.size,
          "rows", np.unique(r)[:20].tolist(), "n_rows", len(np.unique(r)), "cols", np.unique(c)[:20].tolist(), "n_cols", len(np.unique(c)),
          "rows%64", np.unique(r % 64)[:20].tolist(), "cols%64", np.unique(c % 64)[:16].tolist(), flush=True)
except Exception as e:
    print("RESULT", json.dumps(v), "FAIL", str(e)[:160], flush=True)
