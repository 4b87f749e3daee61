"""GPU probe behind results/models_h200.md: the plan the GPT-2 tuning job found (6 layers, its tuned attention config),
timed against jax.jit, with its error next to jax.jit's own rounding spread; and the Llama attention trial's error.

    python benchmarks/models_probe.py
"""
import functools
import json

import jax
from examples import gpt2, llama
from autofuse.graph import capture
from autofuse.tuning.partition import enumerate_candidates
from autofuse.tuning.select import Option, select_cover
from autofuse.plan import executor, plan_from_choices
from autofuse.runner.evaluator import Evaluator
from autofuse.runner.program_check import rounding_sensitivity
from autofuse.kernels import TEMPLATES
from autofuse.runner.measure import random_inputs, compare, time_fn

args = jax.eval_shape(functools.partial(gpt2.example_inputs, 6))
g = capture(gpt2.forward, *args)
cands = enumerate_candidates(g)
# the job's measured winners: attention (8.5x) and every default-config row_reduce that beat XLA
attn = [c for c in cands if c.template == "attention"]
rr = [c for c in cands if c.template == "row_reduce" and len(c.nodes) >= 14]
cfg = {"attention": {"block_q": 128, "block_k": 128, "num_warps": 8, "num_stages": 3}}
for which, pool in (("attention", attn), ("attention+row_reduce", attn + rr)):
    opts = [Option(c.nodes, -float(len(c.nodes)), c) for c in pool]
    chosen = select_cover(g, opts, {})
    plan = plan_from_choices(g, [(o.label.group, o.label.template, cfg.get(o.label.template) or TEMPLATES[o.label.template].default_config(o.label.spec)) for o in chosen])
    avals = [g.avals[v] for v in g.inputs]
    run = executor(g, plan)
    fused = jax.jit(lambda *a: run(a)); ref = jax.jit(lambda *a: g.evaluate(a))
    spread = rounding_sensitivity(ref, avals, 1)
    errs = []
    for seed in (1, 2):
        x = random_inputs(avals, seed)
        errs.append(compare(fused(*x)[0], ref(*x)[0], 1.0)[1])
    sets = [random_inputs(avals, 1000 + k) for k in range(3)]
    tb, tf = time_fn(ref, sets), time_fn(fused, sets)
    print(json.dumps({"plan": which, "groups": len(plan.groups), "xla_spread": spread, "fused_vs_xla_err": errs,
                      "jit_ms": tb.median_ms, "fused_ms": tf.median_ms, "speedup": tb.median_ms / tf.median_ms,
                      "iqr": [(tb.q3_ms - tb.q1_ms) / tb.median_ms, (tf.q3_ms - tf.q1_ms) / tf.median_ms]}), flush=True)
    del sets
la = jax.eval_shape(llama.example_inputs)
lg = capture(llama.forward, *la)
ac = [c for c in enumerate_candidates(lg) if c.template == "attention"][0]
ev = Evaluator(lg, measure="device")
r = ev.trial(list(ac.nodes), "attention", TEMPLATES["attention"].default_config(ac.spec))
print(json.dumps({"llama_attention_trial": {k: r.get(k) for k in ("status", "error", "max_error", "median_ms")}}), flush=True)
