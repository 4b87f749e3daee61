"""Registers the `crashy` template (see faulty_templates)."""
from autofuse.kernels import register_template

from .faulty_templates import make

register_template(make("crashy", crash=True), first=True)
