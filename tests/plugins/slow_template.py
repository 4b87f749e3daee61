"""Registers `slow`: the elementwise template, correct, but every kernel build takes 2 s (a trial long
enough for a test to kill its worker mid-way)."""
import time

from autofuse.kernels import elementwise, register_template
from autofuse.kernels.elementwise import ElementwiseTemplate


class Slow(ElementwiseTemplate):
    name = "slow"

    def space(self, group, spec=None):
        return elementwise.space(group, spec)

    def build(self, group, config, *, backend="triton", interpret=False, spec=None):
        time.sleep(2.0)
        return elementwise.build(group, config, backend=backend, interpret=interpret, spec=spec)


register_template(Slow(), first=True)
