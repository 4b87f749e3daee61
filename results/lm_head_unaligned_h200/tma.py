"""A [16, 64] bf16 SMEM box TMA-stored into a [32, W] GMEM array at column `col` (one process per variant)."""
import sys, json, jax, jax.numpy as jnp, numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
W, col, rows, dyn = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])

def body(c_ref, o_ref, sm):
    sm[...] = jnp.full((rows, 64), 1.0, jnp.bfloat16)
    plgpu.commit_smem()
    c = c_ref[0] if dyn else col
    plgpu.copy_smem_to_gmem(sm, o_ref.at[pl.ds(0, rows), pl.ds(c, 64)])
    plgpu.wait_smem_to_gmem(0)

interp = plgpu.InterpretGPUParams() if len(sys.argv) > 5 else None
f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((32, W), jnp.bfloat16), scratch_types=[plgpu.SMEM((rows, 64), jnp.bfloat16)],
                 interpret=interp)
try:
    out = np.asarray(jax.block_until_ready(f(jnp.array([col], jnp.int32))).astype(np.float32))
    ok = (out[:rows, col:col + 64] == 1).all()
    print("RESULT", sys.argv[1:], "ok" if ok else "WRONG", flush=True)
except Exception as e:
    print("RESULT", sys.argv[1:], "FAIL", str(e)[:120], flush=True)
if len(sys.argv) > 5:
    print(out[:rows, col:col+64].min(), out.sum(), rows*64, np.nonzero(out)[0][:5], np.nonzero(out)[1][:5])
