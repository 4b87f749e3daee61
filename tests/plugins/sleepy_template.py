"""Registers the `sleepy` template (see faulty_templates)."""
from autofuse.kernels import register_template

from .faulty_templates import Faulty

register_template(Faulty("sleepy", hang=True), first=True)
