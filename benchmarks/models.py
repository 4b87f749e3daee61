"""Whole models through the tuning job on the GPU: each example model's forward, bf16, realistic sizes.

    python -m benchmarks models forward --out results/models_h200.md [--models gpt2,splade,llama] [--budget gpt2=90,...]

Per model: one `autofuse.tune` job (device measurement, time budget per
model) on the forward at `example_inputs()` shapes (taken as shapes only: the
trial worker makes its own random inputs), then the table row: jax.jit and
autofuse ms as measured by the job's end-to-end validation (same worker
process, same inputs, median of back-to-back calls), speedup, tuning wall
time, distinct candidates (tuned / enumerated, and their instances), and the
number of fused kernels in the kept plan. A plan not faster than jax.jit
beyond noise is not kept (1.00x); its measured time is reported beside it.
Rows are written as each model finishes, so a cut-off run keeps what it did.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import time

import jax

from autofuse.tuning.local import tune
from benchmarks.provenance import header
from benchmarks.workloads import emit

MODELS = {
    "gpt2": "GPT-2 medium (24 layers, d=1024, 16 heads, vocab 50257), batch 8, seq 2048",
    "splade": "SPLADE: BERT-base dims, 2 of 12 layers + MLM transform + SPLADE head (vocab 30522), batch 32, seq 256",
    "llama": "Llama-3.2-1B-class blocks (d=2048, 32 q / 8 kv heads, ffn 8192), 2 of 16 blocks, batch 4, seq 2048",
}
DEFAULT_BUDGET_S = {"gpt2": 90.0, "splade": 60.0, "llama": 45.0}


def run_model(name: str, budget_s: float, small: bool = False, layers: int | None = None, trials: int | None = None,
              step: str = "forward", real: bool = False) -> dict:
    mod = importlib.import_module(f"examples.{name}")
    factory = mod.small_inputs if small else functools.partial(mod.example_inputs, layers) if layers else mod.example_inputs
    args = factory() if real else jax.eval_shape(factory)  # real: the plan is also checked on these (the model's weights)
    t0 = time.time()
    rep = tune(getattr(mod, step), *args, trials=trials, time_budget_s=budget_s, seed=0, quiet=True, store=False, name=f"examples.{name}:{step}",
               trial_timeout_s=120.0)
    wall = time.time() - t0
    measured_plan = rep.validation.plan.median_ms if rep.validation.plan is not None else None
    tuned = [c for c in rep.candidates if c.trials]
    return {
        "model": name,
        "xla_ms": rep.baseline_ms,
        "af_ms": rep.tuned_ms,
        "speedup": rep.speedup,
        "plan_measured_ms": measured_plan,
        "wall_s": wall,
        "tuned": len(tuned),
        "distinct": len(rep.candidates),
        "instances": sum(c.instances for c in rep.candidates),
        "trials": rep.trials_run,
        "kernels": len(rep.plan.groups),
        "templates": sorted({g.template for g in rep.plan.groups}),
        "reason": rep.plan.provenance.get("reason", ""),
        "example": rep.validation.example_inputs,
        "table": "\n".join(ln for ln in rep.table().splitlines() if " 0/0 " not in ln),  # candidates given trials
    }


def _row(r: dict) -> str:
    f = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    x = lambda v: "-" if v is None else f"{v:.2f}x"  # noqa: E731
    return (f"| {r['model']} | {f(r['xla_ms'])} | {f(r['af_ms'])} | {x(r['speedup'])} | {f(r['plan_measured_ms'])} | "
            f"{r['wall_s']:.0f} | {r['tuned']} / {r['distinct']} ({r['instances']}) | {r['trials']} | {r['kernels']} "
            f"{','.join(r['templates'])} |")


def _pairs(text: str, kind: type) -> dict:
    return {k: kind(v) for k, v in (kv.split("=") for kv in filter(None, text.split(",")))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--budget", default="", help="per-model time budgets in seconds, e.g. gpt2=90,splade=60")
    ap.add_argument("--trials", default="", help="per-model trial budgets (with the time budget, which counts from the job's start), e.g. gpt2=24")
    ap.add_argument("--layers", default="", help="per-model layer counts (default: each example's), e.g. gpt2=6")
    ap.add_argument("--step", default="forward", choices=("forward", "grad_step", "forward_cudnn", "grad_step_cudnn", "forward_library", "grad_step_library",
                                                             "grad_step_cudnn_remat"),
                    help="the program tuned: the forward pass, or grad_step (gradients of the loss for every parameter); "
                         "*_cudnn: the same with jax.nn.dot_product_attention, as careful JAX users write it (cuDNN's "
                         "attention on a GPU, XLA's elsewhere); *_library: that function at its default implementation "
                         "(JAX's XLA path; gpt2 and llama); grad_step_cudnn_remat: grad_step_cudnn with each block under "
                         "jax.checkpoint (gpt2 and llama)")
    ap.add_argument("--real-inputs", action="store_true",
                    help="materialise example_inputs() and hand the arrays to the job (the plan is also checked on the model's own weights)")
    ap.add_argument("--out", default="")
    ap.add_argument("--small", action="store_true", help="the CPU-sized small_inputs() (a smoke test)")
    a = ap.parse_args()
    budgets = dict(DEFAULT_BUDGET_S, **_pairs(a.budget, float))
    layers, trials = _pairs(a.layers, int), _pairs(a.trials, int)
    lines = [
        header(),
        "",
        "| model | jax.jit ms | autofuse ms | speedup | fused plan measured ms | tuning wall s | candidates tuned / distinct (instances) | trials | fused kernels |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    details = []
    for name in a.models.split(","):
        try:
            r = run_model(name, budgets[name], a.small, layers.get(name), trials.get(name), a.step, a.real_inputs)
        except Exception as e:  # one model failing still leaves the others' rows
            lines.append(f"| {name} | failed: {type(e).__name__}: {str(e)[:200]} |")
            emit(lines + details, a.out)
            continue
        lines.append(_row(r))
        what = "small_inputs() (CPU smoke test)" if a.small else MODELS[name] + (f" -- here {layers[name]} layers" if name in layers else "")
        what += f"; program: {a.step}"
        if r["example"]:
            what += (f"; on the model's own inputs: relative error {r['example'].max_error:.3g} (bound {max(r['example'].tolerance):.3g},"
                     f" jax.jit's rounding spread there {max(r['example'].rounding_sensitivity):.3g})")
        details += ["", f"{name}: {what}; budget {budgets[name]:.0f} s" + (f", {trials[name]} trials" if name in trials else "") + (f"; {r['reason']}" if r["reason"] else ""),
                    "", "```", r["table"], "```"]
        emit(lines + details, a.out)


if __name__ == "__main__":
    main()
