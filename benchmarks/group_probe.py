"""One candidate group of an example model's program, XLA's version against chosen configs of autofuse's: each config
built, checked against XLA on fresh random inputs and timed on the device (`Evaluator.trial`, as a tuning job times
it), XLA's the same way (`Evaluator.xla`). Groups are named by the prefix of their signature, as `autofuse show run`
and a job's log print it.

Why: a tuning job gives a candidate whose default config loses no further trials, so a lowering whose default is
wrong for a group (a norm's backward with five column sums, a dgrad GEMM with a heavy epilogue) never shows what it
could do; this times the configs a question needs without a job.

    python -m benchmarks profile group --model gpt2 --step grad_step_cudnn --group 7121d91ec877 \\
        --grid block_rows=1,2,4 --grid row_steps=8,16,32 --out results/group.md
"""
from __future__ import annotations

import argparse
import importlib
import itertools
import json
from collections import Counter

import jax

from autofuse.device import default_backends
from autofuse.graph import capture
from autofuse.kernels import TEMPLATES
from autofuse.runner.evaluator import Evaluator
from autofuse.tuning.partition import Candidate, enumerate_candidates
from autofuse.tuning.program_costs import ProgramCosts
from autofuse.tuning.space import usable_backends
from benchmarks.provenance import header
from benchmarks.workloads import emit


def find(candidates: list[Candidate], prefix: str) -> Candidate:
    """The candidate whose group's signature starts with `prefix` (the first, where a layer repeats it)."""
    for c in candidates:
        if c.group.signature.startswith(prefix):
            return c
    raise SystemExit(f"no candidate's signature starts with {prefix!r}")


def grid(base: dict, axes: list[str]) -> list[dict]:
    """`base` with every combination of the axes' values (`NAME=V1,V2,...`, values read as JSON where they parse)."""
    names, values = [], []
    for axis in axes:
        name, _, vals = axis.partition("=")
        names.append(name)
        values.append([_value(v) for v in vals.split(",")])
    return [{**base, **dict(zip(names, combo))} for combo in itertools.product(*values)]


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _config(text: str) -> dict:
    """A `--config` argument: a JSON object (argparse says what is wrong in one line otherwise)."""
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {text!r} ({e.msg})") from None
    if not isinstance(cfg, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
    return cfg


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks profile group", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2", help="an example model (examples/MODEL.py)")
    ap.add_argument("--step", default="grad_step_cudnn", help="its entry point")
    ap.add_argument("--layers", type=int, default=2, help="layers of the program captured (a layer's groups do not "
                    "depend on how many there are; default 2)")
    ap.add_argument("--small", action="store_true", help="the model's small inputs (CPU-sized: interpret mode)")
    ap.add_argument("--list", action="store_true", help="list the program's candidates (signature, template, ops) and stop")
    ap.add_argument("--group", action="append", default=[], help="signature prefix of a candidate (repeatable)")
    ap.add_argument("--backend", default=None, help="the lowering (default: a tuning job's first on this machine)")
    ap.add_argument("--prices", action="store_true", help="also profile jax.jit's program and say how each group's price "
                    "in it is made: the XLA kernels that compute its nodes, held whole or cut, and what each is credited")
    ap.add_argument("--config", action="append", default=[], type=_config, help="a config as a JSON object, over the "
                    "default (repeatable)")
    ap.add_argument("--grid", action="append", default=[], help="NAME=V1,V2,...: every combination over the default "
                    "(repeatable; with --config, over each of them)")
    ap.add_argument("--out", default="", help="also write the table to this Markdown file")
    ap.add_argument("--commit", help="the commit measured (else $AUTOFUSE_COMMIT or git's HEAD)")
    a = ap.parse_args(argv)

    mod = importlib.import_module(f"examples.{a.model}")
    args = jax.eval_shape(mod.small_inputs if a.small else lambda: mod.example_inputs(a.layers))
    graph = capture(getattr(mod, a.step), *args)
    candidates = enumerate_candidates(graph)
    if a.list or not a.group:
        instances = Counter(c.group.signature for c in candidates)
        listed: set[str] = set()
        for c in candidates:
            if c.group.signature not in listed:
                listed.add(c.group.signature)
                print(f"{c.group.signature[:12]}  {c.template:18} x{instances[c.group.signature]:<3} {len(c.group.node_ids):3} ops  "
                      + " ".join(graph.node_index[i].name for i in c.group.node_ids)[:110])
        return
    chosen = [(p, find(candidates, p)) for p in a.group]  # every prefix resolved before the evaluator starts
    ev = Evaluator(graph)
    what = "small inputs" if a.small else f"{a.layers} layers captured"
    lines = [header(argv, a.commit), "", f"{a.model}:{a.step} ({what}); ms per call on the device "
             "(median, min-max of the repeats)", "",
             "| group | template | config | status | ms | min-max | vs XLA |", "|---|---|---|---|---|---|---|"]
    defaults: dict[str, dict] = {}
    for prefix, cand in chosen:
        tmpl = TEMPLATES[cand.template]
        backend = a.backend or usable_backends(cand.template, cand.spec, default_backends())[0]  # a job's first
        default = defaults[prefix] = {**tmpl.default_config_of(cand.spec, backend), "backend": backend}
        bases = [{**default, **c} for c in a.config] or [default]
        configs = [c for b in bases for c in (grid(b, a.grid) if a.grid else [b])]
        xla = ev.xla(cand.group.node_ids)
        name = f"{prefix} ({len(cand.group.node_ids)} ops)"
        lines.append(f"| {name} | XLA | | {xla.status.value} | {xla.median_ms:.4f} | {xla.min_ms:.4f}-{xla.max_ms:.4f} | |")
        print(lines[-1], flush=True)
        for cfg in [default] + [c for c in configs if c != default]:
            res = ev.trial(cand.group.node_ids, cand.template, cfg)
            shown = "default" if cfg == default else json.dumps({k: v for k, v in cfg.items() if default.get(k) != v})
            timed = res.median_ms is not None and res.status.value == "ok"
            lines.append(f"| {name} | {cand.template} | {shown} | {res.status.value}"
                         + (f" | {res.median_ms:.4f} | {res.min_ms:.4f}-{res.max_ms:.4f} | {xla.median_ms / res.median_ms:.2f}x |" if timed
                            else f" | | | {(res.error or '')[:80]} |"))
            print(lines[-1], flush=True)
    lines += [""] + [f"{p}'s default: `{json.dumps(d)}`" for p, d in defaults.items()]
    if a.prices:
        lines += [""] + price_lines(ev, graph, [c for _, c in chosen])
    emit(lines, a.out)


def price_lines(ev: Evaluator, graph, cands: list[Candidate]) -> list[str]:
    """How each candidate's price in jax.jit's program is made (`ProgramCosts.credit_parts`, its last instance)."""
    costs = ProgramCosts(ev.profile().kernels, graph)
    if not costs.kernels:
        return ["jax.jit's program gave no profile here (no GPU trace): no prices"]
    lines = [f"Prices in jax.jit's program ({len(costs.kernels)} kernels, {costs.total_ms:.3f} ms a call):", "",
             "| group | XLA kernel | ms | fusion kind | held | credited | what is left of it |", "|---|---|---|---|---|---|---|"]
    for c in cands:
        for k, held, credit in costs.credit_parts(c.group.node_ids):
            rest = "" if held else costs.ops_text(costs.computed[costs.kernels.index(k)] - set(c.group.node_ids), 6)
            lines.append(f"| {c.group.signature[:12]} | `{k.instruction}` | {k.ms:.4f} | {k.fusion_kind} | {'whole' if held else 'cut'} "
                         f"| {credit:.4f} | {rest} |")
        lines.append(f"| {c.group.signature[:12]} | all | {costs.xla_ms(c.group.node_ids):.4f} (the nodes' shares) | | "
                     f"| **{costs.credit_ms(c.group.node_ids):.4f}** | |")
    return lines


if __name__ == "__main__":
    main()
