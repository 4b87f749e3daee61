"""Digests of autofuse's own source, for the caches kept between jobs: an entry is keyed by the code that made it,
so that a changed template, partitioner or lowering never serves another version's answer."""
from __future__ import annotations

import functools
import glob
import hashlib
import os
import sys

ROOT = os.path.dirname(os.path.abspath(__file__))


@functools.cache
def file_digest(path: str) -> str:
    """sha256 of the file's bytes (its path where it cannot be read), read once per process."""
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return path


@functools.cache
def sources(*relative: str) -> str:
    """The digests of these files of the package (paths relative to it; globs allowed), in order, as one string."""
    files = [f for r in relative for f in sorted(glob.glob(os.path.join(ROOT, r), recursive=True))]
    return "".join(file_digest(f) for f in files)


def templates_digest(h: "hashlib._Hash") -> None:
    """Add to `h` the templates registered now (a plugin's too): each one's name and its module's source."""
    from .kernels import TEMPLATES

    for name, tmpl in TEMPLATES.items():
        h.update(name.encode())
        h.update(file_digest(sys.modules[type(tmpl).__module__].__file__ or "").encode())
