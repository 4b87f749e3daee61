"""Where a plan's savings go between its groups timed alone and the whole program (issue 32, item 2).

    python -m benchmarks profile composition --model gpt2 --step forward_cudnn --trials 40 --out results/composition_h100.md

Tunes one example model's entry point on the GPU (`autofuse.tune`, device measurement), then, in this process on
the model's own inputs:
- the saving each of the plan's distinct groups showed alone in the job ((XLA - best) x instances), and the
  saving the whole plan realises against `jax.jit` (`time_pair`: alternating, medians, the spread of the ratio);
- each distinct group's plan on its own (its instances only) against `jax.jit`: its saving in context;
- the GPU kernels of `jax.jit`'s program and of the plan's (`kernel_profile`), summed by kind, and the kernels
  whose time differs most: what the plan adds around its groups (copies, layouts) and what XLA's fusions around
  them lost or gained.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import gzip
import importlib
import os
import re
import sys
from dataclasses import replace

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # the tuning job's trial process shares the GPU

import jax  # noqa: E402

import autofuse  # noqa: E402
from autofuse.plan import Plan  # noqa: E402
from autofuse.runner.measure import time_pair  # noqa: E402
from autofuse.tuning import select  # noqa: E402
from benchmarks import kernel_profile  # noqa: E402
from benchmarks.provenance import command, commit  # noqa: E402

KINDS = (("attention (cuDNN)", r"fmha|cudnn|flash|sdpa"), ("GEMM (cuBLAS/CUTLASS)", r"gemm|cutlass|sm90_xmma|nvjet|cublas"),
         ("autofuse kernel", r"^af_|autofuse|mosaic|pallas"), ("copy/transpose", r"copy|transpose"),
         ("XLA fusion", r"fusion|loop_|input_|triton"))


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name, re.IGNORECASE):
            return kind
    return "other"


def by_kind(rows: list[kernel_profile.KernelTime]) -> dict[str, tuple[float, float]]:
    out: dict[str, list[float]] = {}
    for r in rows:
        t = out.setdefault(kind_of(r.name), [0.0, 0.0])
        t[0] += r.ms_per_call
        t[1] += r.launches_per_call
    return {k: (v[0], v[1]) for k, v in out.items()}


def alone_savings(report) -> dict[str, float]:
    """Per distinct group of the plan: (XLA - best) ms per instance, times the plan's instances of it (0 where the
    job's candidates are not known: a plan read from a file)."""
    one = select.alone_savings(report.candidates)
    out: dict[str, float] = {}
    for g in report.plan.groups:
        out[g.signature] = out.get(g.signature, 0.0) + one.get(g.signature, 0.0)
    return out


class Measured:
    """A plan given as JSON, with the savings its groups showed alone as its provenance records them."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.candidates = []

    def summary(self) -> str:
        return f"plan from a file: {len(self.plan.groups)} groups, {XLA_FLAGS}"


BATCH_MS = 100.0  # back-to-back calls per sync: a model's call lasts tens of ms, and one call per sync also times its launch
XLA_FLAGS = f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}"


def on_triton(plan: Plan, graph) -> Plan:
    """`plan` with each group on its template's Triton lowering at the default config."""
    from autofuse.graph import Group
    from autofuse.kernels import TEMPLATES

    groups = []
    for g in plan.groups:
        tmpl = TEMPLATES[g.template]
        spec = tmpl.match(Group.of(graph, g.nodes))
        groups.append(replace(g, backend="triton", config=tmpl.default_config_of(spec, "triton")))
    return replace(plan, groups=tuple(groups))


def batching(fn, plan: Plan, sets: list, out: str) -> None:
    """Whether the plan's saving depends on how its calls are issued: 1, 3 or 10 back-to-back calls per sync (a
    whole model's pair timed at one call per sync pays each call's launch and sync), the plan's groups on Mosaic GPU
    and on Triton (a custom call XLA cannot capture in a command buffer splits it), and the timeline under load."""
    import shutil
    import subprocess
    import time

    graph = autofuse.capture(fn, *sets[0])
    ref = jax.jit(fn)
    variants = {"plan": autofuse.jit(fn, plan=plan), "plan on triton": autofuse.jit(fn, plan=on_triton(plan, graph))}
    one = {}
    for k, f in [("jax.jit", ref), *variants.items()]:
        jax.block_until_ready(f(*sets[0]))
        t0 = time.perf_counter()
        jax.block_until_ready(f(*sets[0]))
        one[k] = (time.perf_counter() - t0) * 1e3
    smi = None if shutil.which("nvidia-smi") is None else subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader", "-lms", "500"],
                           stdout=subprocess.PIPE, text=True)
    t_end = time.perf_counter() + 3.0
    while time.perf_counter() < t_end:
        ref(*sets[0])
        variants["plan"](*sets[0])
    jax.block_until_ready(ref(*sets[0]))
    lines = [f"### calls per sync ({XLA_FLAGS}; {jax.devices()[0].device_kind}, commit {commit()})", "",
             "| variant | calls per sync | jax.jit ms | variant ms | saving ms | ratio q1-q3 |", "|---|---|---|---|---|---|"]
    for name, f in variants.items():
        for calls in (1, 3, 10):
            b, p, r = time_pair(ref, f, sets, repeats=10, target_ms=calls * one["jax.jit"] * 0.999)
            lines.append(f"| {name} | {b.calls_per_sync} | {b.median_ms:.3f} | {p.median_ms:.3f} | {b.median_ms - p.median_ms:.3f} | "
                         f"{r.q1_ms:.4f}-{r.q3_ms:.4f} |")
            print(lines[-1], flush=True)
    for name, f in [("jax.jit", ref), *variants.items()]:
        tl = kernel_profile.timeline(f, tuple(sets[0]), calls=10)
        if tl is not None:
            lines.append(f"\n{name} under load, 10 calls: GPU busy {tl.busy_ms:.3f} ms of a {tl.span_ms:.3f} ms span per call; "
                         "gaps: " + "; ".join(f"{kernel_profile._short(b, 40)} -> {kernel_profile._short(n, 40)} {ms:.3f} ms x{k:g}"
                                              for b, n, ms, k in tl.gaps[:4]))
    if smi is not None:
        smi.terminate()
        clocks = [ln.strip() for ln in smi.communicate()[0].splitlines() if ln.strip()]
        lines.append(f"\nnvidia-smi (sm clock, power, temperature) every 0.5 s over the run: {', '.join(clocks[::4])}")
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    if out:
        with open(out, "a") as fh:
            fh.write(text + "\n")


def write_hlo(folder: str, programs: dict, args: list) -> None:
    """Each program's optimised HLO module as `<name>.hlo.gz` in `folder` (made if missing; gzipped: a plan's module
    carries its Mosaic GPU kernels, tens of MB of text)."""
    os.makedirs(folder, exist_ok=True)
    for name, f in programs.items():
        with gzip.open(os.path.join(folder, f"{name}.hlo.gz"), "wt") as out:
            out.write(f.lower(*args).compile().as_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--step", default="forward_cudnn")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--trials", type=int, default=40)
    ap.add_argument("--top", type=int, default=12, help="kernels listed per program")
    ap.add_argument("--each", type=int, default=4, help="distinct groups timed alone in context (largest alone-saving first)")
    ap.add_argument("--store", default="sqlite:////tmp/composition.db")
    ap.add_argument("--out", default="")
    ap.add_argument("--small", action="store_true", help="the CPU-sized small_inputs() (a smoke run)")
    ap.add_argument("--plan", default="", help="a plan's JSON (from --save-plan) to measure instead of tuning")
    ap.add_argument("--save-plan", default="", help="write the tuned plan's JSON here")
    ap.add_argument("--batching", action="store_true",
                    help="with --plan: the plan (and its groups on Triton) against jax.jit at 1, 3 and 10 calls per sync, "
                         "after 3 s of load, and the GPU timeline under sustained load")
    ap.add_argument("--hlo", default="", help="a folder: write jax.jit's and the plan's optimised HLO there (jax_jit.hlo.gz, plan.hlo.gz) "
                                              "to read what XLA fused around the plan's kernels")
    a = ap.parse_args()

    mod = importlib.import_module(f"examples.{a.model}")
    factory = mod.small_inputs if a.small else functools.partial(mod.example_inputs, a.layers) if a.layers else mod.example_inputs
    fn = getattr(mod, a.step)
    if a.plan:
        with open(a.plan) as f:
            rep = Measured(Plan.from_json(f.read()))
    else:
        # the model's own arrays, as `autofuse tune --inputs` passes them: a training step's whole-plan check on random
        # inputs alone cannot tell a wrong plan (jax.jit's own result moves by up to 5 there) and refuses every one
        rep = autofuse.tune(fn, *factory(), trials=a.trials, seed=0, quiet=True, store=a.store,
                            name=f"examples.{a.model}:{a.step}", trial_timeout_s=120.0)
        print(rep.table(), flush=True)
        print(rep.summary(), flush=True)
        print("provenance:", {k: v for k, v in rep.plan.provenance.items()}, flush=True)
        if a.save_plan:
            with open(a.save_plan, "w") as f:
                f.write(rep.plan.to_json())
    sets = [list(factory())]  # a model's activations are GBs: no set stays in the L2 between calls
    if a.batching:
        return batching(fn, rep.plan, sets, a.out)
    ref = jax.jit(fn)
    lines = [f"## {a.model}:{a.step} ({a.layers or 'all'} layers), {a.trials} trials", "",
             f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {datetime.date.today()}, commit {commit()}, `{command()}`", "",
             f"Job: {rep.summary()}", ""]
    alone = alone_savings(rep)
    plan = rep.plan
    if plan.is_xla:
        lines.append(f"The job kept XLA's plan: {plan.provenance.get('reason', '')}")
    total_alone = sum(alone.values())
    fused = autofuse.jit(fn, plan=plan)
    if a.hlo:
        write_hlo(a.hlo, {"jax_jit": ref, "plan": fused}, sets[0])
    base, got, ratio = time_pair(ref, fused, sets, repeats=12, target_ms=BATCH_MS)
    realised = base.median_ms - got.median_ms
    lines += ["| plan | groups | saving alone (ms) | jax.jit ms | plan ms | realised (ms) | share | ratio spread |", "|---|---|---|---|---|---|---|---|",
              f"| whole plan | {len(plan.groups)} | {total_alone:.3f} | {base.median_ms:.3f} | {got.median_ms:.3f} | {realised:.3f} | "
              f"{realised / total_alone if total_alone else float('nan'):.0%} | {ratio.q1_ms:.3f}-{ratio.q3_ms:.3f} |"]
    by_sig = {c.signature: c for c in rep.candidates}
    for sig in sorted(alone, key=lambda s: -alone[s])[:a.each]:
        sub = replace(plan, groups=tuple(g for g in plan.groups if g.signature == sig))
        b, p, r = time_pair(ref, autofuse.jit(fn, plan=sub), sets, repeats=10, target_ms=BATCH_MS)
        c = by_sig.get(sig)
        what = f"{c.template} {'·'.join(c.ops[:3])}… ({len(c.nodes)} ops)" if c else f"{sub.groups[0].template} {sig[:8]}"
        lines.append(f"| {what} | {len(sub.groups)} | {alone[sig]:.3f} | {b.median_ms:.3f} | "
                     f"{p.median_ms:.3f} | {b.median_ms - p.median_ms:.3f} | "
                     f"{(b.median_ms - p.median_ms) / alone[sig] if alone[sig] else float('nan'):.0%} | {r.q1_ms:.3f}-{r.q3_ms:.3f} |")
        print(lines[-1], flush=True)
    lines.append("")
    k_ref = kernel_profile.kernel_times(ref, tuple(sets[0]))
    k_plan = kernel_profile.kernel_times(fused, tuple(sets[0]))
    kr, kp = by_kind(k_ref), by_kind(k_plan)
    lines += ["| kernel kind | jax.jit ms | launches | plan ms | launches | plan - jax.jit |", "|---|---|---|---|---|---|"]
    for kind in sorted(set(kr) | set(kp), key=lambda k: -max(kr.get(k, (0, 0))[0], kp.get(k, (0, 0))[0])):
        x, y = kr.get(kind, (0.0, 0.0)), kp.get(kind, (0.0, 0.0))
        lines.append(f"| {kind} | {x[0]:.3f} | {x[1]:g} | {y[0]:.3f} | {y[1]:g} | {y[0] - x[0]:+.3f} |")
    lines.append(f"| all | {sum(r.ms_per_call for r in k_ref):.3f} | | {sum(r.ms_per_call for r in k_plan):.3f} | | |")
    lines.append("")
    for what, f in (("jax.jit", ref), ("the plan", fused)):
        tl = kernel_profile.timeline(f, tuple(sets[0]))
        if tl is None:
            continue
        lines += [f"{what}: GPU busy {tl.busy_ms:.3f} ms of a {tl.span_ms:.3f} ms span per call; longest idle gaps:", "",
                  "| before | after | idle ms per call | gaps per call |", "|---|---|---|---|"]
        lines += [f"| `{kernel_profile._short(b, 60)}` | `{kernel_profile._short(n, 60)}` | {ms:.3f} | {k:g} |" for b, n, ms, k in tl.gaps]
        lines.append("")
    lines += kernel_profile.kernel_table(k_ref, top=a.top, title="jax.jit's kernels")
    lines.append("")
    lines += kernel_profile.kernel_table(k_plan, top=a.top, title="the plan's kernels")
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    if a.out:
        with open(a.out, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
