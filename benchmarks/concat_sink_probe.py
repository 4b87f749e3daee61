"""GPU probe: the `concat_sink` template on GPT-2 medium's QKV backward (one layer of `grad_step_cudnn` at B8 S2048):
the concatenation of dq, dk, dv read by the weight's gradient, the input's and the bias's, as XLA runs it against
each config of the template, same process, same inputs (each checked against jax.jit before it is timed; the ratio
of alternating repeats, `runner.measure.time_pair`, with its quartiles).

    python -m benchmarks kernels concat-sink [--out results/x.md] [--small]
"""
from __future__ import annotations

import argparse

import jax

import autofuse
from autofuse import costmodel
from autofuse.kernels import TEMPLATES
from autofuse.runner.measure import check, cone_tolerances, random_inputs, time_pair
from benchmarks.provenance import header
from benchmarks.workloads import emit

CONFIGS = ({"accumulate": 0, "contracted": 0, "kept": 1}, {"accumulate": 0, "contracted": 0, "kept": 0},
           {"accumulate": 0, "contracted": 1, "kept": 0}, {"accumulate": 1, "contracted": 1, "kept": 0})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="", help="the Markdown table")
    ap.add_argument("--small", action="store_true", help="the CPU-sized small_inputs() (a smoke run)")
    ap.add_argument("--repeats", type=int, default=15)
    a = ap.parse_args(argv)

    import examples.gpt2 as gpt2

    args = gpt2.small_inputs() if a.small else jax.eval_shape(lambda: gpt2.example_inputs(1))
    graph = autofuse.capture(gpt2.grad_step_cudnn, *args)
    tmpl = TEMPLATES["concat_sink"]
    group, spec, _ = tmpl.candidate_groups(graph, lambda i: True)[0]
    avals = group.input_avals()
    sets = [random_inputs(avals, 100 + k) for k in range(3)]
    ref = jax.jit(lambda *xs: group.evaluate(xs))
    tol = cone_tolerances(graph, group.node_ids, group.outputs)
    lines = [header(argv), "", f"inputs: {', '.join(str(x) for x in avals)}", "",
             "| config | checked (max error) | XLA ms | concat_sink ms | ratio (q1..q3) | modelled ms |", "|---|---|---|---|---|---|"]
    for cfg in CONFIGS:
        kernel = jax.jit(tmpl.build(group, cfg, backend="xla_ops", spec=spec))
        res = check(kernel, ref, avals, (1,), tol)
        xla, mine, ratio = time_pair(ref, kernel, sets, repeats=a.repeats)
        lines.append(f"| {' '.join(f'{k}={v}' for k, v in cfg.items())} | {'ok' if res.ok else 'WRONG'} ({res.max_error:.1e}) | "
                     f"{xla.median_ms:.4f} | {mine.median_ms:.4f} | {ratio.median_ms:.3f} ({ratio.q1_ms:.3f}..{ratio.q3_ms:.3f}) | "
                     f"{tmpl.model_time_ms(spec, cfg):.4f} |")
    lines.append(f"\nXLA's group modelled at {costmodel.xla_group_time_ms(group):.4f} ms.")
    emit(lines, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
