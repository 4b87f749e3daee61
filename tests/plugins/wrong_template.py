"""Registers the `wrong` template (see faulty_templates)."""
from autofuse.kernels import register_template

from .faulty_templates import make

register_template(make("wrong"), first=True)
