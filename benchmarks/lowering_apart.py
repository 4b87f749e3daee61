"""Kernels lowered by CPU-only helper processes (`autofuse.runner.lowering_pool`) against this GPU process's own
lowering of the same kernels: the same module (source locations aside) for every default config of a program's
candidates, and the seconds each way. What makes a helper's export safe for the trial process to compile and time."""
from __future__ import annotations

import argparse
import os
import pickle
import sys
import tempfile
import time

import jax

from benchmarks.provenance import ROOT, header


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks profile lowering", description=__doc__)
    ap.add_argument("--helpers", type=int, default=4,
                    help="helper processes (default 4); 1 lowers in this process's order, so that Mosaic GPU's dump-name "
                         "counters (how many kernels of a name a process lowered before) agree and every module can match")
    ap.add_argument("--out", help="also write the table to this Markdown file")
    ap.add_argument("--dump", help="a folder for the first kernel whose modules differ: both modules, as text")
    ap.add_argument("--commit", help="the commit measured (else $AUTOFUSE_COMMIT or git's HEAD)")
    args = ap.parse_args(argv)

    from autofuse import kernel_cache
    from autofuse.graph import capture
    from autofuse.kernel_cache import Target
    from autofuse.kernels import TEMPLATES
    from autofuse.runner.lowering_pool import LoweringPool
    from autofuse.runner.process import ProgramSpec
    from autofuse.tuning.job import distinct_candidates
    from benchmarks.multi_gpu import gpt2_shapes
    from examples import gpt2

    shapes = gpt2_shapes()
    graph = capture(gpt2.forward, *shapes)
    by_sig, _ = distinct_candidates(graph)
    kernels = []
    for cands in by_sig.values():
        c = cands[0]
        mod = TEMPLATES[c.template]
        for backend in ("mosaic_gpu", "triton"):
            try:
                cfg = mod.default_config_of(c.spec, backend)
            except Exception:  # noqa: BLE001 - no such lowering for this template
                continue
            if mod.unsupported(c.spec, backend, cfg) is None:
                kernels.append((c, backend, cfg))
    os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])
    apart_dir = tempfile.mkdtemp(prefix="autofuse-lowered-")
    target = Target.here()
    pool = LoweringPool(pickle.dumps(ProgramSpec(gpt2.forward, shapes, fingerprint=graph.fingerprint)), sys.path, apart_dir,
                        args.helpers)
    t0 = time.perf_counter()
    futures = [pool.submit(c.group.node_ids, c.template, {"backend": b, **cfg}, target) for c, b, cfg in kernels]
    done = [f.result(600) if f is not None else False for f in futures]
    apart_s = time.perf_counter() - t0
    pool.close()
    rows, same, here_s = [], 0, 0.0
    for (c, backend, cfg), ok in zip(kernels, done):
        t = time.perf_counter()
        mod = TEMPLATES[c.template]
        try:
            here = kernel_cache.export(mod.build(c.group, cfg, backend=backend, interpret=False, spec=c.spec), c.group)
        except Exception as e:  # noqa: BLE001 - reported in its row
            rows.append(f"| {c.template} | {backend} | {len(c.group.node_ids)} | {ok} | not exported here: {type(e).__name__} |")
            continue
        here_s += time.perf_counter() - t
        verdict = "helper failed"
        if ok:
            path = kernel_cache.entry_path(apart_dir, kernel_cache.kernel_key(c.group, c.template, backend, cfg, target))
            with open(path, "rb") as f:
                kept = jax.export.deserialize(bytearray(f.read()))
            a, b = kernel_cache.code(kept), kernel_cache.code(here)
            at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            verdict = "same" if a == b else f"DIFFERENT at {at}: `{a[max(0, at - 60):at + 20]!r}` / `{b[max(0, at - 60):at + 20]!r}`"
            same += a == b
            if a != b and args.dump and not os.path.exists(os.path.join(args.dump, "apart.mlir")):
                os.makedirs(args.dump, exist_ok=True)
                for name, exp in (("apart", kept), ("here", here)):
                    with open(os.path.join(args.dump, f"{name}.mlir"), "w") as f:
                        f.write(exp.mlir_module())
                    with open(os.path.join(args.dump, f"{name}.jaxexp"), "wb") as f:
                        f.write(exp.serialize())
        rows.append(f"| {c.template} | {backend} | {len(c.group.node_ids)} | {ok} | {verdict} |")
    text = "\n".join([
        header(argv, args.commit), "",
        f"GPT-2 medium forward: {len(kernels)} default kernels of {len(by_sig)} distinct candidates; {same} the same module "
        f"from the helpers as lowered here. Helpers ({args.helpers} processes, CPU only): {apart_s:.1f} s wall for all, "
        f"{pool.seconds:.1f} s lowering in all; this process: {here_s:.1f} s lowering them one by one.", "",
        "| template | backend | nodes | helper kept it | module |", "|---|---|---|---|---|", *rows])
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0 if same == len(kernels) else 1


if __name__ == "__main__":
    sys.exit(main())
