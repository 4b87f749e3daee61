"""Test-only templates that fail on purpose; `wrong_template` and `crashy_template` register them
when named in $AUTOFUSE_TEMPLATE_PLUGINS.

`make("wrong")`: matches what `elementwise` matches and claims to be very fast, but
its kernels add 1 to every output (a wrong result the search must never pick).
`make("crashy", crash=True)`: the same, but building a kernel with block_rows == 2 kills the
process (a crash the trial worker must absorb); `make("sleepy", hang=True)` hangs there instead.
"""
from __future__ import annotations

import os
import time
from types import SimpleNamespace

from autofuse.kernels import elementwise
from autofuse.spaces import parse_space

_SPACE = parse_space(
    {"template": "x", "parameters": {"block_rows": {"choices": [1, 2, 4]}, "block_cols": {"choices": [32, 64]},
                                      "num_warps": {"choices": [4]}, "num_stages": {"choices": [1]}}},
    "faulty_templates.py",
)


def make(name: str, crash: bool = False, hang: bool = False) -> SimpleNamespace:
    def space(group, spec=None):
        from autofuse.kernels.tiling import template_space

        spec = spec or elementwise.match(group)
        return template_space(name, spec, {"block_rows": 1, "block_cols": 32, "num_warps": 4, "num_stages": 1}, _SPACE)

    def build(group, config, *, interpret=False, spec=None):
        if crash and int(config["block_rows"]) == 2:
            os._exit(7)
        if hang and int(config["block_rows"]) == 2:
            time.sleep(3600)
        inner = elementwise.build(group, config, interpret=interpret, spec=spec)
        return lambda *a: [o + 1 for o in inner(*a)]

    return SimpleNamespace(
        NAME=name, PARAMS=elementwise.PARAMS, match=elementwise.match, space=space,
        default_config=lambda spec: {"block_rows": 1, "block_cols": 32, "num_warps": 4, "num_stages": 1},
        build=build, model_time_ms=lambda spec, config, model: 1e-6, __name__=f"faulty.{name}",
    )


