"""Where a plan's peak device memory goes, against jax.jit's (issue 32, item 4: peak memory is part of a plan).

    XLA_FLAGS=--xla_dump_to=/tmp/dump python -m benchmarks profile memory --model gpt2 --step grad_step_cudnn \
        --plan plan.json --dump /tmp/dump --out results/memory_h200.md

Compiles the example model's entry point under jax.jit and under the plan (`plan.executor`, as a validation does),
prints each one's `memory_analysis()` (arguments, outputs, temporaries, peak), and, from XLA's buffer-assignment
dumps of the two programs (`--dump`: the directory XLA_FLAGS' `--xla_dump_to` names, set before JAX starts), the
largest values each holds outside its arguments: what the plan keeps that jax.jit does not.

`--template NAME` instead of `--plan`: the plan of every group that template finds by itself
(`Template.candidate_groups`, e.g. `aligned_dot`'s unaligned dots), each at its default config, and then each of
those groups alone: which of a plan's kinds of group costs the memory, without a tuning job first.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import importlib
import json
import os
import re

import jax

from autofuse.graph import capture, flatten_args
from autofuse.kernels import TEMPLATES
from autofuse.plan import Plan, executor, plan_from_choices
from autofuse.tuning.partition import is_fusible
from benchmarks.provenance import command, commit

ALLOC = re.compile(r"^allocation (\d+): size (\d+)(.*)$")
VALUE = re.compile(r"^\s+value: <\d+ ([^ @]+) @\d+> \(size=(\d+),offset=(\d+)\): (\S+)")


def largest_values(path: str, top: int) -> list[tuple[int, str, str, str]]:
    """The `top` largest values of a buffer-assignment dump outside parameters and constants (XLA packs a program's
    temporaries into one allocation at offsets: the values held there, largest first): (bytes, instruction, shape,
    the allocation's flags)."""
    out, flags = [], ""
    with open(path) as fh:
        for line in fh:
            m = ALLOC.match(line)
            if m:
                flags = m.group(3).strip(" ,:")
                continue
            v = VALUE.match(line)
            if v and "parameter" not in flags and "constant" not in flags:
                out.append((int(v.group(2)), v.group(1), v.group(4), flags))
    return sorted(out, key=lambda x: -x[0])[:top]


LIVE = re.compile(r"^\s+(\S+?)(\{[^}]*\})?: (\d+) bytes")
BRANCH = re.compile(r"^\s+[├└]── (.+?) \([\d.]+%, total: ([\d ]+) bytes")


def live_at_peak(path: str, top: int) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """From a live-range dump: the `top` largest values live at the program's peak (bytes, instruction), and the
    peak's bytes by the JAX operation that made them (XLA's stack-trace breakdown, its first level)."""
    live, ops, section = [], [], None
    with open(path) as fh:
        for line in fh:
            if "Live ranges at" in line and "(peak)" in line:
                section = "live"
                continue
            if "Stack trace breakdown for peak usage" in line:
                section = "ops"
                continue
            if section == "live":
                m = LIVE.match(line)
                if m:
                    live.append((int(m.group(3)), m.group(1)))
                elif line.strip() and not line.startswith("    "):
                    section = None
            elif section == "ops":
                m = BRANCH.match(line)
                if m and line.index("──") <= 8:  # the first level only
                    ops.append((int(m.group(2).replace(" ", "")), m.group(1)))
    return sorted(live, reverse=True)[:top], sorted(ops, reverse=True)[:top]


def _dump_of(dump: str, module: str, kind: str = "buffer-assignment") -> str | None:
    hits = sorted(glob.glob(os.path.join(dump, f"*{module}*{kind}.txt")), key=os.path.getmtime)
    return hits[-1] if hits else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--step", default="grad_step_cudnn")
    ap.add_argument("--plan", default="", help="a plan's JSON file (none: XLA's own plan, a smoke run)")
    ap.add_argument("--template", default="", help="instead of --plan: the groups this template finds by itself, at their "
                    "default configs, together and each alone")
    ap.add_argument("--config", action="append", default=[], type=json.loads, help="with --template: a JSON object over "
                    "each group's default config, e.g. '{\"chunks\": 8}'; repeated, one set of plans each")
    ap.add_argument("--small", action="store_true", help="the CPU-sized small_inputs()")
    ap.add_argument("--dump", default="", help="XLA's dump directory (XLA_FLAGS=--xla_dump_to=DIR, set before JAX starts)")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    mod = importlib.import_module(f"examples.{a.model}")
    fn, args = getattr(mod, a.step), (mod.small_inputs() if a.small else mod.example_inputs())
    graph = capture(fn, *args)
    flat = flatten_args(graph, fn, args, {})
    plans = ([p for over in a.config or [{}] for p in template_plans(graph, a.template, over)] if a.template
             else [("the plan", _plan_file(graph, a.plan))])
    lines = [f"## {a.model}:{a.step}: peak memory of jax.jit and of " + ", ".join(f"{n} ({len(p.groups)} groups)" for n, p in plans), "",
             f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {datetime.date.today()}, commit {commit()}, `{command()}`", "",
             "| program | arguments GiB | outputs GiB | temporaries GiB | peak GiB |", "|---|---|---|---|---|"]
    dumps = {}
    programs = [("jax.jit", "reference", lambda *xs: graph.evaluate(xs))]
    for k, (name, plan) in enumerate(plans):
        programs.append((name, f"planned{k}", _planned(executor(graph, plan))))
    for name, module, f in programs:
        f.__name__ = module  # the module XLA dumps it as: jit_<name>
        compiled = jax.jit(f).lower(*flat).compile()
        m = compiled.memory_analysis()
        gib = [getattr(m, k, 0) / 2**30 for k in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
                                                   "peak_memory_in_bytes")]
        lines.append(f"| {name} | " + " | ".join(f"{x:.3f}" for x in gib) + " |")
        print(lines[-1], flush=True)
        if a.dump:
            dumps[name] = f"jit_{module}."
    for name, module in dumps.items():
        path = _dump_of(a.dump, module)
        if path is None:
            lines += ["", f"({name}: no buffer-assignment dump found in {a.dump})"]
            continue
        lines += ["", f"### {name}: the {a.top} largest values outside its arguments ({os.path.basename(path)})", "",
                  "| MiB | instruction | shape | allocation |", "|---|---|---|---|"]
        for size, inst, shape, flags in largest_values(path, a.top):
            lines.append(f"| {size / 2**20:.1f} | {inst} | `{shape}` | {flags or '-'} |")
        ranges = _dump_of(a.dump, module, "live-range")
        if ranges is not None:
            live, ops = live_at_peak(ranges, a.top)
            lines += ["", f"{name}, live at its peak (MiB, value): " + "; ".join(f"{b / 2**20:.1f} {v}" for b, v in live),
                      "", f"{name}, the peak by the operation that made each value (MiB): " + "; ".join(f"{b / 2**20:.1f} {o}" for b, o in ops)]
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    if a.out:
        with open(a.out, "a") as fh:
            fh.write(text)


def _plan_file(graph, path: str) -> Plan:
    if not path:
        return Plan(graph.fingerprint)  # XLA's own plan: a smoke run
    with open(path) as fh:
        return Plan.from_json(fh.read())


def _planned(run):
    def planned(*xs):
        return run(xs)
    return planned


def template_plans(graph, name: str, over: dict | None = None) -> list[tuple[str, Plan]]:
    """The plan of every group `name` finds by itself at its default config (the first backend it runs on) with
    `over` laid over it, then each group alone."""
    t, over = TEMPLATES[name], over or {}
    choices = []
    for group, spec, stages in t.candidate_groups(graph, lambda i: is_fusible(graph, i)):
        backend = next(b for b in t.backends if t.unsupported(spec, b) is None)
        choices.append((group, name, {**t.default_config_of(spec, backend), **over, "backend": backend}, stages))
    label = f" {json.dumps(over)}" if over else ""
    out = [(f"all {len(choices)} {name} groups{label}", plan_from_choices(graph, choices))]
    for c in choices if len(choices) > 1 else ():
        nd = c[0].nodes[0]
        shapes = " x ".join(str(tuple(graph.aval(x).shape)) for x in nd.inputs if isinstance(x, int))
        out.append((f"{name} {nd.name} {shapes}{label} alone", plan_from_choices(graph, [c])))
    return out


if __name__ == "__main__":
    main()
