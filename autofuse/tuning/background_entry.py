"""The process a background tuning job runs: ``python -P -m autofuse.tuning.background_entry MODULE:FUNCTION JOBFILE``.

It lives on the tuning side so that the deploy side (`autofuse.deploy.background`, which writes the job file, starts
this process and lowers its priority) never imports the tuner. It imports the function its command line names
(and refuses a job file that names another), tunes it with `autofuse.tuning.local.tune` into the store (its URL
reaches it through ``$AUTOFUSE_DB``, never on a command line) and removes its job file and lock, and its log when it
succeeded (the plan is in the store; a failed job's log stays, for the caller's warning to point at). A later trace
of that shape finds the plan.
"""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence

from ..codec import decode_call
from ..deploy.background import ENTRY, BackgroundTune, release
from ..refs import resolve


def main(argv: Sequence[str] | None = None) -> int:
    """Tune the function at the job's shapes into ``$AUTOFUSE_DB``. Only the function named on the command line is
    imported; a job file naming another is refused (exit 2)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 2:
        print(f"usage: python -m {ENTRY} MODULE:FUNCTION JOBFILE", file=sys.stderr)
        return 2
    function, path = argv
    with open(path) as f:
        job = json.load(f)
    ok = False
    try:
        if job["function"] != function:
            print(f"autofuse: the job file {path} tunes {job['function']}, not {function}: refused", file=sys.stderr)
            return 2
        budget = BackgroundTune(**job["budget"])
        fn = resolve(function)
        fn = getattr(fn, "fn", fn)  # an autofuse.jit of the function: tune the function itself
        from .local import tune  # the tuner's imports, once the job is accepted and at the priority the caller lowered
        from .options import JobOptions

        args, kwargs = decode_call(job["args"], job["kwargs"])
        options = JobOptions(name=function, isolate=budget.isolate, static_argnums=tuple(job["static_argnums"]),
                             static_argnames=tuple(job["static_argnames"]))
        report = tune(fn, *args, kwargs=kwargs, trials=budget.trials, time_budget_s=budget.seconds, store=os.environ.get("AUTOFUSE_DB"),
                      measure=budget.measure, quiet=True, options=options)
        print(report.summary(), flush=True)
        if report.fingerprint != job["fingerprint"]:
            print(f"autofuse: the background job tuned program {report.fingerprint}, not the missed {job['fingerprint']}", flush=True)
            return 1
        ok = True
        return 0
    finally:
        release(job["lock"])
        release(path)
        if ok:
            release(job["log"])


if __name__ == "__main__":
    sys.exit(main())
