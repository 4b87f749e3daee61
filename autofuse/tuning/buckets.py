"""Tuning over shape buckets (issue 19): one job tunes a program at several sizes, each bucket its own plan.

``autofuse tune MODULE:FN --shapes SPEC`` (or `tune_buckets`) tunes every bucket of SPEC in turn, smallest first
(by the number of input elements), each with the whole trial and time budget, as its own run whose plan is stored
under that bucket's program fingerprint (all buckets share one structure, `Graph.structure`: a bucket of another
structure is an error). At deploy, `autofuse.jit` serves an untuned shape with the plan of the nearest bucket that
adapts to it (`autofuse.shapes.nearest_first`).

SPEC is one of

* ``MODULE:BUCKETS``: a function returning the buckets' positional arguments, a list of tuples (named by their
  input shapes) or a dict of them by name;
* ``NAME=LO-HI[,NAME=LO-HI...]``: axes, each taking every power of two from LO to HI (both powers of two, LO <= HI);
  ``NAME=N`` fixes an axis at N (any positive integer). The buckets are every combination, each built by the
  ``--inputs`` factory called with those keyword arguments (``FACTORY(batch=8, seq=256)``).

How the studies are shared. The same computation at two sizes is one candidate at each (candidates correspond by
template and node ids: programs of one structure number their nodes alike), but one Optuna study across buckets
would be unsound: a trial's value is a time at one bucket's sizes (not comparable across buckets), and a bucket's
choices and constraints depend on its sizes (a block no taller than the rows). So each bucket keeps its own study
per candidate, *seeded*: its first trials are the best configs (up to `SEEDS` of them, fastest first) measured
for the same candidate at the nearest bucket tuned before it (log-distance of the input shapes), those that fit
this bucket's choices and constraints; then each backend's default and the model's best, as for any study. The
sampler (TPE) then learns from this bucket's own times only. A seed that no longer fits is dropped, never tried.
"""
from __future__ import annotations

import itertools
import math
import re
import sys
from collections.abc import Callable, Sequence
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..graph import capture
from ..refs import resolve as resolve_ref
from ..signatures import distance, short_inputs
from ..spaces import DEFAULT_BACKEND
from ..status import TrialStatus
from .ledger import CandidateState
from .options import JobOptions
from .space import CandidateSpace

SEEDS = 2  # configs carried from the nearest bucket, per candidate
MAX_BUCKETS = 64
_AXIS = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$")


@dataclass
class Bucket:
    """One shape bucket: its name (``batch=8,seq=256``, a BUCKETS dict's key, or its input shapes) and arguments."""

    name: str
    args: tuple
    inputs: tuple[str, ...] = ()  # the program's input signature (``float32[8, 128]``), once captured
    fingerprint: str = ""


@dataclass
class BucketRun:
    """What tuning one bucket did: its report, and the configs its studies tried first, by candidate signature,
    with the bucket they came from."""

    bucket: Bucket
    report: Any  # TuneReport
    seeds: dict[str, list[dict]] = field(default_factory=dict)
    seeded_from: dict[str, str] = field(default_factory=dict)
    by_sig: dict = field(default_factory=dict, repr=False)  # the bucket's candidates by signature (what `Seeder.record` keys)

    def to_dict(self) -> dict:
        r = self.report
        return {"bucket": self.bucket.name, "inputs": list(self.bucket.inputs), "fingerprint": r.fingerprint, "run_id": r.run_id,
                "plan_id": r.plan_id, "current": r.plan_current, "measure": r.measure, "baseline_ms": r.baseline_ms,
                "tuned_ms": r.tuned_ms, "speedup": r.speedup, "trials": r.trials_run, "plan": r.plan.to_dict(),
                "seeded": {sig: {"from": self.seeded_from[sig], "configs": cfgs} for sig, cfgs in self.seeds.items()}}


def parse_axes(spec: str) -> dict[str, list[int]]:
    """``batch=1-64,seq=128-4096`` as {"batch": [1, 2, ..., 64], "seq": [128, ..., 4096]}; ValueError (one line)
    for anything else."""
    axes: dict[str, list[int]] = {}
    for part in spec.split(","):
        part = part.strip()
        m = _AXIS.match(part)
        if not m:
            raise ValueError(f"--shapes: expected NAME=LO-HI (powers of two) or NAME=N, got {part!r} "
                             "(e.g. --shapes batch=1-64,seq=128-4096, or --shapes MODULE:BUCKETS)")
        name, rng = m.groups()
        if name in axes:
            raise ValueError(f"--shapes: axis {name!r} is given twice")
        lo_s, sep, hi_s = rng.partition("-")
        try:
            lo, hi = int(lo_s), int(hi_s) if sep else int(lo_s)
        except ValueError:
            raise ValueError(f"--shapes: {part!r}: expected integers (NAME=LO-HI or NAME=N)") from None
        if lo < 1:
            raise ValueError(f"--shapes: {part!r}: sizes start at 1")
        if sep:
            bad = [x for x in (lo, hi) if x & (x - 1)]
            if bad:
                raise ValueError(f"--shapes: {part!r}: a range's ends must be powers of two ({bad[0]} is not); "
                                 "fix an axis at any size with NAME=N")
            if lo > hi:
                raise ValueError(f"--shapes: {part!r}: {lo} > {hi}")
            axes[name] = [2**k for k in range(lo.bit_length() - 1, hi.bit_length())]
        else:
            axes[name] = [lo]
    n = math.prod(len(v) for v in axes.values())
    if n > MAX_BUCKETS:
        raise ValueError(f"--shapes: {spec!r} makes {n} buckets, more than {MAX_BUCKETS}: narrow a range")
    return axes


def resolve(spec: str, inputs: str | None) -> list[Bucket]:
    """The buckets of a ``--shapes`` SPEC (see the module docstring); `inputs` is ``--inputs MODULE:FACTORY``, needed
    with axes. ValueError (one line) for a bad spec or a factory that fails."""
    spec = spec.strip()
    if not spec:
        raise ValueError("--shapes: empty (NAME=LO-HI,... or MODULE:BUCKETS)")
    if "=" in spec:
        axes = parse_axes(spec)
        if inputs is None:
            raise ValueError("--shapes with axes builds each bucket with the --inputs factory: give --inputs MODULE:FACTORY")
        factory = resolve_ref(inputs)
        out = []
        for values in itertools.product(*axes.values()):
            kw = dict(zip(axes, values, strict=True))
            name = ",".join(f"{k}={v}" for k, v in kw.items())
            try:
                args = factory(**kw)
            except Exception as e:  # noqa: BLE001 -- the user's factory: its error in one line
                raise ValueError(f"--shapes: the --inputs factory {inputs} failed at {name}: {type(e).__name__}: {e}") from None
            out.append(Bucket(name, _args_tuple(args, f"the --inputs factory {inputs} at {name}")))
        return out
    if ":" not in spec:
        raise ValueError(f"--shapes: expected NAME=LO-HI,... (axes) or MODULE:BUCKETS (a factory of buckets), got {spec!r}")
    factory = resolve_ref(spec)
    try:
        got = factory()
    except Exception as e:  # noqa: BLE001 -- the user's factory: its error in one line
        raise ValueError(f"--shapes: the buckets factory {spec} failed: {type(e).__name__}: {e}") from None
    if isinstance(got, dict):
        items = [(str(k), v) for k, v in got.items()]
    elif isinstance(got, list):
        items = [("", v) for v in got]
    else:
        raise ValueError(f"--shapes: the buckets factory {spec} must return a list of argument tuples (one per bucket) or a dict "  # noqa: TRY004
                         f"of them by name, got a {type(got).__name__}")
    if not items:
        raise ValueError(f"--shapes: the buckets factory {spec} returned no buckets")
    if len(items) > MAX_BUCKETS:
        raise ValueError(f"--shapes: the buckets factory {spec} returned {len(items)} buckets, more than {MAX_BUCKETS}")
    return [Bucket(name, _args_tuple(v, f"bucket {name or i} of {spec}")) for i, (name, v) in enumerate(items)]


def _args_tuple(args: Any, what: str) -> tuple:
    if not isinstance(args, tuple):
        raise ValueError(f"--shapes: {what} must be a tuple of the function's positional arguments, got a {type(args).__name__}")  # noqa: TRY004
    return args


def prepare(fn: Callable, buckets: list[Bucket], static_argnums: Sequence[int] = ()) -> list[Bucket]:
    """The buckets captured (inputs, fingerprint, a name for unnamed ones) and ordered smallest first; ValueError
    (one line) for a bucket that does not trace, two of the same shapes, or buckets of different structures."""
    structure, first = None, None
    seen: dict[str, str] = {}
    for b in buckets:
        try:
            g = capture(fn, *b.args, static_argnums=tuple(static_argnums))
        except Exception as e:  # noqa: BLE001 -- the user's function: its error in one line
            raise ValueError(f"--shapes: tracing bucket {b.name or '?'} failed: {type(e).__name__}: {e}") from None
        b.inputs, b.fingerprint = tuple(g.signature()["inputs"]), g.fingerprint
        b.name = b.name or short_inputs(b.inputs)
        if g.fingerprint in seen:
            raise ValueError(f"--shapes: buckets {seen[g.fingerprint]} and {b.name} are the same program (same shapes)")
        seen[g.fingerprint] = b.name
        if structure is None:
            structure, first = g.structure, b.name
        elif g.structure != structure:
            raise ValueError(f"--shapes: bucket {b.name} is not the program of bucket {first} at other sizes (another structure: "
                             "its operations differ, not only its sizes); tune it on its own")
    return sorted(buckets, key=lambda b: _elements(b.inputs))


def _elements(inputs: Sequence[str]) -> int:
    from ..signatures import parse_aval

    return sum(math.prod(p[1]) for p in map(parse_aval, inputs) if p is not None)


def best_configs(cand: CandidateState, n: int = SEEDS) -> list[dict]:
    """A candidate's `n` fastest distinct configs that ran correctly, fastest first."""
    out: list[dict] = []
    for t in sorted((t for t in cand.trials if t.status is TrialStatus.OK and t.median_ms is not None), key=lambda t: t.median_ms):
        if t.config not in out:
            out.append(dict(t.config))
        if len(out) == n:
            break
    return out


def fits(space: CandidateSpace, config: dict) -> bool:
    """Whether `config` is one of this space's choices (its backend, every parameter) and keeps its constraints."""
    sp = space.spaces.get(config.get("backend", DEFAULT_BACKEND))
    if sp is None:
        return False
    params = {k: v for k, v in config.items() if k != "backend"}
    return set(params) == set(sp.params) and all(v in sp.params[k] for k, v in params.items()) and not space.violated(config)


class Seeder:
    """What the buckets tuned so far found, by candidate (template and node ids of each instance), and the seeds of
    the next bucket's studies (the nearest tuned bucket's best configs that fit)."""

    def __init__(self) -> None:
        self.found: list[tuple[Bucket, dict[tuple, list[dict]]]] = []

    def record(self, bucket: Bucket, by_sig: dict, cands: Sequence[CandidateState]) -> None:
        best = {}
        for r in cands:
            cfgs = best_configs(r)
            if cfgs:
                for key in _keys(by_sig.get(r.signature, ()), r):
                    best[key] = cfgs
        self.found.append((bucket, best))

    def seeds(self, bucket: Bucket, by_sig: dict, cands: Sequence[CandidateState],
              spaces: dict[str, CandidateSpace]) -> tuple[dict[str, list[dict]], dict[str, str]]:
        seeds, source = {}, {}
        near = sorted(self.found, key=lambda f: distance(f[0].inputs, bucket.inputs))
        for r in cands:
            keys = _keys(by_sig.get(r.signature, ()), r)
            for other, best in near:
                cfgs = next((best[k] for k in keys if k in best), None)
                if cfgs is None:
                    continue
                ok = [c for c in cfgs if fits(spaces[r.signature], c)]
                if ok:
                    seeds[r.signature], source[r.signature] = ok, other.name
                break  # the nearest bucket that had this candidate decides (its bests that fit, or none)
        return seeds, source


def _keys(instances: Sequence[Any], cand: CandidateState) -> list[tuple]:
    keys = [(c.template, tuple(sorted(c.group.node_ids))) for c in instances]
    return keys or [(cand.template, tuple(sorted(cand.nodes)))]


def tune_buckets(fn: Callable, buckets: list[Bucket], *, static_argnums: Sequence[int] = (), quiet: bool = False,
                 on_bucket: Callable[[int, BucketRun], None] | None = None, **tune_kwargs: Any) -> list[BucketRun]:
    """Tune `fn` at every bucket (`prepare`d here: smallest first), each a run of `tune` with the whole budget, its
    studies seeded from the nearest bucket tuned before (module docstring). `on_bucket(i, run)` after each. What the
    job says even when quiet (a modelled plan, a backend left out) is said once, not once per bucket."""
    from ..store import PlanStore
    from .job import Notes
    from .local import tune

    if not all(b.fingerprint for b in buckets):  # prepared already (the CLI checks the spec before opening the store)
        buckets = prepare(fn, buckets, static_argnums)
    store = tune_kwargs.pop("store", None)
    if store is not False and not isinstance(store, PlanStore):
        store = PlanStore(store)  # one connection pool for every bucket (None: the default store, as `tune`)
    options = tune_kwargs.pop("options", None) or JobOptions()
    seeder, runs, notes = Seeder(), [], Notes(tune_kwargs.get("progress", options.progress))
    for i, b in enumerate(buckets):
        if not quiet:
            print(f"autofuse: bucket {i + 1}/{len(buckets)}: {b.name} ({short_inputs(b.inputs)})", file=sys.stderr, flush=True)
        run = BucketRun(b, None)

        def warm(by_sig: dict, cands: list, spaces: dict, b: Bucket = b, run: BucketRun = run) -> dict[str, list[dict]]:
            run.seeds, run.seeded_from = seeder.seeds(b, by_sig, cands, spaces)
            run.by_sig = by_sig
            return run.seeds

        run.report = tune(fn, *b.args, store=store, quiet=quiet, **tune_kwargs,
                          options=dataclasses.replace(options, static_argnums=static_argnums, warm_start=warm, notes=notes))
        seeder.record(b, run.by_sig, run.report.candidates)
        runs.append(run)
        if on_bucket is not None:
            on_bucket(i, run)
    return runs


def summary(runs: Sequence[BucketRun]) -> str:
    """One line per bucket (its run, plan and speedup, how many studies were seeded and from where), then one line."""
    from ..tables import fmt_x, plural

    lines = []
    for r in runs:
        rep, n = r.report, len(r.seeds)
        src = sorted(set(r.seeded_from.values()))
        seeded = f"{plural(n, 'study', 'studies')} seeded from {', '.join(src)}" if n else "no study seeded"
        ids = ", ".join(x for x in (f"run {rep.run_id}" if rep.run_id is not None else "",
                                    f"plan {rep.plan_id}" if rep.plan_id is not None else "not stored") if x)
        lines.append(f"  {r.bucket.name:<24} {short_inputs(r.bucket.inputs):<32} {fmt_x(rep.speedup):>8}  {ids}; {seeded}")
    kind = "MODELLED" if runs and runs[0].report.measure == "model" else "measured"
    return f"autofuse: tuned {len(runs)} shape bucket(s) of one structure ({kind}):\n" + "\n".join(lines)

