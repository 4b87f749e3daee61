"""GPU probe: a layer norm feeding a GEMM (GPT-2 medium's two, at B8 S2048), as jax.jit runs it, against plans of one
Mosaic GPU `matmul` group: the GEMM with its epilogue reading XLA's normalised activations (what plans held before
the fold), and the same group with the normalisation's elementwise half folded around the GEMM
(`kernels.prologue_fold`: XLA computes only the row statistics). Same process, same inputs; each plan checked
against jax.jit first; the ratio of alternating repeats (`runner.measure.time_pair`) with its quartiles.

    python -m benchmarks kernels norm-gemm [--out results/x.md] [--small] [--configs JSON]
"""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

import autofuse
from autofuse.graph import Group
from autofuse.kernels import matmul
from autofuse.kernels.mosaic_gpu import matmul as mosaic_matmul
from autofuse.plan import executor, plan_from_choices
from autofuse.runner.measure import check, random_inputs, time_fn, time_pair
from autofuse.tuning.partition import enumerate_candidates, is_fusible
from benchmarks.provenance import header
from benchmarks.workloads import emit
from examples.gpt2 import layer_norm

BF16 = jnp.bfloat16


def ln_fc_gelu(x, p):
    """GPT-2's second layer norm and the MLP's up-projection with bias and GELU."""
    return jax.nn.gelu(layer_norm(x, p) @ p["w"] + p["b"], approximate=True)


def ln_qkv_split(x, p):
    """GPT-2's first layer norm and the fused QKV projection, split into queries, keys and values."""
    return tuple(jnp.split(layer_norm(x, p) @ p["w"] + p["b"], 3, axis=-1))


WORKLOADS = {"ln-fc-gelu": (ln_fc_gelu, 4), "ln-qkv-split": (ln_qkv_split, 3)}  # N = D times this


def _args(B: int, S: int, D: int, widen: int) -> tuple:
    N = widen * D
    return (jax.ShapeDtypeStruct((B, S, D), BF16),
            {"scale": jax.ShapeDtypeStruct((D,), BF16), "bias": jax.ShapeDtypeStruct((D,), BF16),
             "w": jax.ShapeDtypeStruct((D, N), BF16), "b": jax.ShapeDtypeStruct((N,), BF16)})


def groups(graph) -> dict[str, Group]:
    """The workload's largest matmul group with the normalisation's half ("folded": the whole epilogue, GELU or the
    split with every part), and the same group without it ("unfolded")."""
    cands = [c.group for c in enumerate_candidates(graph) if c.template == "matmul"]
    cands += [g for g, _, _ in matmul.TEMPLATE.candidate_groups(graph, lambda i: is_fusible(graph, i))]
    folded = max((g for g in cands if matmul.match(g).pro), key=lambda g: len(g.node_ids))
    pro = {nd.id for nodes, _ in matmul.match(folded).pro.values() for nd in nodes}
    return {"folded": folded, "unfolded": Group.of(graph, [i for i in folded.node_ids if i not in pro])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="", help="the Markdown table")
    ap.add_argument("--small", action="store_true", help="CPU-sized shapes, interpret mode (a smoke run)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--parts", action="store_true", help="also time each plan's kernel, and the fold's preparation, alone")
    ap.add_argument("--configs", default="", help="a JSON list of Mosaic GPU configs (each over the group's default)")
    a = ap.parse_args(argv)

    B, S, D = (2, 40, 128) if a.small else (8, 2048, 1024)
    interpret = True if a.small else None
    parts: list[str] = []
    lines = [header(argv), "", f"x [{B}, {S}, {D}] bf16, float32 statistics (examples.gpt2.layer_norm)", "",
             "| workload | plan | config | checked (max error) | jax.jit ms | plan ms | ratio (q1..q3) |", "|---|---|---|---|---|---|---|"]
    for name, (fn, widen) in WORKLOADS.items():
        args = _args(B, S, D, widen)
        graph = autofuse.capture(fn, *args)
        flat = [graph.avals[v] for v in graph.inputs]
        sets = [random_inputs(flat, 100 + k) for k in range(3)]
        ref = jax.jit(lambda *xs, run=executor(graph, plan_from_choices(graph, [])): run(xs))  # jax.jit of the program
        for label, group in groups(graph).items():
            spec = matmul.match(group)
            for extra in ([{}] + json.loads(a.configs) if a.configs else [{}, {"pingpong": 0}]):
                cfg = {**mosaic_matmul.default_config(spec), **extra}
                why = matmul.TEMPLATE.unsupported(spec, "mosaic_gpu", cfg)
                if why:
                    lines.append(f"| {name} | {label} | {json.dumps(extra)} | declined: {why} | | | |")
                    continue
                plan = plan_from_choices(graph, [(group, "matmul", {**cfg, "backend": "mosaic_gpu"})])
                run = jax.jit(lambda *xs, run=executor(graph, plan, interpret=interpret): run(xs))
                res = check(run, ref, flat, (1,))
                xla, mine, ratio = time_pair(ref, run, sets, repeats=a.repeats)
                lines.append(f"| {name} | {label} ({len(group.node_ids)} ops) | {json.dumps(extra)} | "
                             f"{'ok' if res.ok else 'WRONG'} ({res.max_error:.1e}) | {xla.median_ms:.4f} | {mine.median_ms:.4f} | "
                             f"{ratio.median_ms:.3f} ({ratio.q1_ms:.3f}..{ratio.q3_ms:.3f}) |")
                print(lines[-1], flush=True)
                if a.parts and not extra:
                    parts.append(_parts(name, label, group, spec, cfg, interpret))
    if parts:
        lines += ["", "Each part alone (random inputs of its own, medians of back-to-back calls): the plan's kernel on its inputs, and "
                  "for the folded group what XLA prepares for it (W', the vectors) from the group's inputs.", "",
                  "| workload | plan | kernel ms | prepare ms |", "|---|---|---|---|"] + parts
    emit(lines, a.out)
    return 0


def _parts(name: str, label: str, group: Group, spec, cfg: dict, interpret) -> str:
    """The plan's kernel alone and, folded, its preparation alone (random inputs; timings only)."""
    sets = [random_inputs(group.input_avals(), 200 + k) for k in range(3)]
    prep = ""
    if spec.pro:
        fold = mosaic_matmul.folded(spec)
        prepare = jax.jit(fold.prepare)
        kernel = jax.jit(mosaic_matmul.lower(fold.spec.group, fold.spec, cfg, interpret=interpret))
        prep = f"{time_fn(prepare, sets).median_ms:.4f}"
        k_sets = [prepare(*xs) for xs in sets]
    else:
        kernel = jax.jit(mosaic_matmul.lower(group, spec, cfg, interpret=interpret))
        k_sets = sets
    return f"| {name} | {label} | {time_fn(kernel, k_sets).median_ms:.4f} | {prep} |"


if __name__ == "__main__":
    raise SystemExit(main())
