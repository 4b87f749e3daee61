"""A stored plan of one program against jax.jit of another that computes the same thing, in one process.

The question it answers: is a program written one way and tuned by autofuse faster than the same model written
another way under plain jax.jit — say GPT-2's training step with `jax.nn.dot_product_attention` at its default (JAX's
XLA path, which autofuse replaces by its flash kernels) against the same step asking for cuDNN's attention:

    python -m benchmarks deploy versus --db /tmp/g.db --program examples.gpt2:grad_step_library \\
        --against examples.gpt2:grad_step_cudnn --inputs examples.gpt2:example_inputs

`--program` runs through `autofuse.jit` with the database's plan (a miss is an error, never a silent jax.jit); both
programs also run under jax.jit. Every output is compared on the model's own inputs (the two programs round
differently: the table gives each one's relative error against jax.jit of `--program`), then the three are timed
on three rotating sets of random inputs, each pair in alternation (`runner.measure.time_pair`: the ratio's median
and quartiles). A program whose jax.jit needs most of the card beside the others (GPT-2's library step: ~90 GiB)
runs with `XLA_PYTHON_CLIENT_MEM_FRACTION=0.95` (JAX preallocates 75% by default).
"""
from __future__ import annotations

import argparse

import jax
import numpy as np

import autofuse
from autofuse.graph import Aval
from autofuse.plan import PlanError
from autofuse.refs import resolve
from autofuse.runner.evaluator import peak_bytes
from autofuse.runner.measure import compare, random_inputs, time_pair
from benchmarks.provenance import header
from benchmarks.workloads import emit


def max_error(out, ref) -> float:
    """The largest relative error-norm over the outputs' leaves."""
    return max(compare(o, r)[1] for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref)))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", required=True, help="the store holding --program's plan (a URL or a file path)")
    ap.add_argument("--program", required=True, help="MODULE:FUNCTION run by autofuse.jit with its stored plan")
    ap.add_argument("--against", required=True, help="MODULE:FUNCTION run by jax.jit, computing the same")
    ap.add_argument("--inputs", required=True, help="MODULE:FACTORY returning the example arguments of both")
    ap.add_argument("--budget-s", type=float, default=20.0, help="seconds of timing per pair (at least 8 repeats)")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    program, against, factory = resolve(a.program), resolve(a.against), resolve(a.inputs)
    url = a.db if "://" in a.db else f"sqlite:///{a.db}"
    fused = autofuse.jit(program, store=url, on_miss="error")
    plain, other = jax.jit(program), jax.jit(against)

    example = factory()
    try:
        out = fused(*example)
    except PlanError as e:
        raise SystemExit(f"versus: {a.program} has no plan to serve here: {e}") from None
    ref = plain(*example)
    errors = {"autofuse.jit": max_error(out, ref), "jax.jit (--against)": max_error(other(*example), ref)}
    leaves, tree = jax.tree.flatten(jax.eval_shape(factory))
    avals = [Aval(tuple(x.shape), np.dtype(x.dtype)) for x in leaves]
    sets = [tree.unflatten(random_inputs(avals, 700 + k)) for k in range(3)]
    budget = a.budget_s * 1e3
    t_plain, t_fused, vs_plain = time_pair(plain, fused, sets, budget_ms=budget)
    t_other, t_fused2, vs_other = time_pair(other, fused, sets, budget_ms=budget)

    def ratio(r) -> str:
        return f"{1 / r.median_ms:.2f}x ({1 / r.q3_ms:.2f}..{1 / r.q1_ms:.2f})"

    def peak(f) -> str:
        b = peak_bytes(f.lower(*example).compile())
        return "?" if b is None else f"{b / 2**30:.3g}"

    lines = [
        header(), "",
        f"`{a.program}` through autofuse.jit ({fused.last_status}) against jax.jit of it and of `{a.against}`; "
        "each pair timed in alternation, the speedup's median (quartiles); errors on the model's own inputs against "
        f"jax.jit of `{a.program}`.", "",
        "| program | ms | autofuse.jit ms beside it | autofuse.jit's speedup | max relative error | peak memory GiB |",
        "|---|---|---|---|---|---|",
        f"| jax.jit `{a.program}` | {t_plain.median_ms:.3f} | {t_fused.median_ms:.3f} | {ratio(vs_plain)} | 0 (the reference) | {peak(plain)} |",
        f"| jax.jit `{a.against}` | {t_other.median_ms:.3f} | {t_fused2.median_ms:.3f} | {ratio(vs_other)} | {errors['jax.jit (--against)']:.3g} | {peak(other)} |",
        f"| autofuse.jit `{a.program}` | | | | {errors['autofuse.jit']:.3g} | {peak(fused)} |",
    ]
    emit(lines, a.out)


if __name__ == "__main__":
    main()
