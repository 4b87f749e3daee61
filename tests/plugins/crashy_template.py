"""Registers the `crashy` template (see faulty_templates)."""
from autofuse.kernels import register_template

from .faulty_templates import Faulty

register_template(Faulty("crashy", crash=True), first=True)
