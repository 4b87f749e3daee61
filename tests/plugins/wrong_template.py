"""Registers the `wrong` template (see faulty_templates)."""
from autofuse.kernels import register_template

from .faulty_templates import Faulty

register_template(Faulty("wrong"), first=True)
