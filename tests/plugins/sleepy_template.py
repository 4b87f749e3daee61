"""Registers the `sleepy` template (see faulty_templates)."""
from autofuse.kernels import register_template

from .faulty_templates import make

register_template(make("sleepy", hang=True), first=True)
