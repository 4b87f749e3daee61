"""Test-only templates that fail on purpose; `wrong_template` and `crashy_template` register them
when named in $AUTOFUSE_TEMPLATE_PLUGINS.

`Faulty("wrong")`: matches what `elementwise` matches and claims to be very fast, but
its kernels add 1 to every output (a wrong result the search must never pick).
`Faulty("crashy", crash=True)`: the same, but building a kernel with block_rows == 2 kills the
process (a crash the trial worker must absorb); `Faulty("sleepy", hang=True)` hangs there instead.
"""
from __future__ import annotations

import os
import time

from autofuse.costmodel import H200
from autofuse.kernels import Template, elementwise
from autofuse.kernels.tiling import facts, template_space
from autofuse.spaces import DEFAULT_BACKEND, parse_space

_SPACE = parse_space(
    {"template": "x", "parameters": {"block_rows": {"choices": [1, 2, 4]}, "block_cols": {"choices": [32, 64]},
                                      "num_warps": {"choices": [4]}, "num_stages": {"choices": [1]}}},
    "faulty_templates.py",
)
_DEFAULT = {"block_rows": 1, "block_cols": 32, "num_warps": 4, "num_stages": 1}


class Faulty(Template):
    def __init__(self, name: str, crash: bool = False, hang: bool = False):
        self.name, self.crash, self.hang = name, crash, hang

    def match(self, group):
        return elementwise.match(group)

    def facts(self, group, spec):
        return facts(spec)

    def lowering_module(self, backend, name=None):  # elementwise's (its parameters; `build` wraps its kernels)
        return elementwise.TEMPLATE.lowering_module(backend, name)

    def default_config_of(self, spec, backend=DEFAULT_BACKEND):
        return dict(_DEFAULT)

    def space_of(self, group, spec=None, backend=DEFAULT_BACKEND):
        spec = spec or elementwise.match(group)
        return template_space(self.name, dict(_DEFAULT), facts(spec), _SPACE)

    def model_time_ms(self, spec, config, model=H200):
        return 1e-6

    def build(self, group, config, *, backend="triton", interpret=False, spec=None):
        if self.crash and int(config["block_rows"]) == 2:
            os._exit(7)
        if self.hang and int(config["block_rows"]) == 2:
            time.sleep(3600)
        inner = elementwise.build(group, config, backend=backend, interpret=interpret, spec=spec)
        return lambda *a: [o + 1 for o in inner(*a)]
