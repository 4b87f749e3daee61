"""Registers `slow`: the elementwise template, correct, but every kernel build takes 2 s (a trial long
enough for a test to kill its worker mid-way)."""
import time

from autofuse.kernels import elementwise, register_template
from autofuse.kernels.elementwise import ElementwiseTemplate
from autofuse.spaces import DEFAULT_BACKEND


class Slow(ElementwiseTemplate):
    name = "slow"

    def lowering_module(self, backend, name=None):  # elementwise's lowerings and search space, under its own name
        return elementwise.TEMPLATE.lowering_module(backend, name)

    def space_of(self, group, spec=None, backend=DEFAULT_BACKEND):
        return elementwise.TEMPLATE.space_of(group, spec, backend)

    def build(self, group, config, *, backend="triton", interpret=False, spec=None):
        time.sleep(2.0)
        return elementwise.build(group, config, backend=backend, interpret=interpret, spec=spec)


register_template(Slow(), first=True)
