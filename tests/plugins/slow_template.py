"""Registers `slow`: the elementwise template, correct, but every kernel build takes 2 s (a trial long
enough for a test to kill its worker mid-way)."""
import time
from types import SimpleNamespace

from autofuse import costmodel
from autofuse.kernels import elementwise, register_template


def _build(group, config, *, interpret=False, spec=None):
    time.sleep(2.0)
    return elementwise.build(group, config, interpret=interpret, spec=spec)


register_template(SimpleNamespace(
    NAME="slow", PARAMS=elementwise.PARAMS, DEFAULTS=elementwise.DEFAULTS, match=elementwise.match, space=elementwise.space,
    default_config=elementwise.default_config, build=_build, __name__="tests.plugins.slow_template",
    model_time_ms=lambda spec, config, model: costmodel.template_time_ms("elementwise", spec, config, model),
), first=True)
