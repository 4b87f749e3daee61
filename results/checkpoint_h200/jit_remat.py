"""jax.jit of GPT-2 medium's cuDNN training step with and without jax.checkpoint: time and peak memory, one process."""
import time, jax, numpy as np
from examples import gpt2
from autofuse.runner.measure import time_fn
params, batch = gpt2.example_inputs()
sets = [(params, batch)] + [(params, gpt2.make_inputs(gpt2.MEDIUM, 8, 2048, seed=s)[1]) for s in (1, 2)]
rows = []
for name in ("grad_step_cudnn", "grad_step_cudnn_remat"):
    t0 = time.time()
    fn = jax.jit(getattr(gpt2, name)).lower(params, batch).compile()
    m = fn.memory_analysis()
    jax.block_until_ready(fn(params, batch))
    stats = jax.devices()[0].memory_stats() or {}
    t = time_fn(fn, sets)
    rows.append((name, t.median_ms, t.spread if hasattr(t, "spread") else None, (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes) / 2**30, m.temp_size_in_bytes / 2**30, time.time() - t0))
for r in rows:
    print("| %s | %.2f ms | %s | peak %.2f GiB (temp %.2f) | %.0f s |" % r)
