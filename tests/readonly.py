"""Making a directory and its files read-only for a test, as a deploy image is: `chattr +i` where the tests run as root
(root ignores permission bits), else the permission bits; the test is skipped where neither can be done."""
from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def read_only(*paths: Path) -> Iterator[None]:
    """`paths` (directories and files) unwritable inside the block, writable again after it."""
    root = os.geteuid() == 0
    if root:
        made = subprocess.run(["chattr", "+i", *map(str, paths)], capture_output=True, text=True, check=False)
        if made.returncode != 0:
            pytest.skip(f"running as root and chattr +i is not available here ({made.stderr.strip()}): no way to make a directory read-only")
    else:
        for p in paths:
            p.chmod(0o555 if p.is_dir() else 0o444)
    assert not any(os.access(p, os.W_OK) for p in paths)
    try:
        yield
    finally:
        if root:
            subprocess.run(["chattr", "-i", *map(str, paths)], check=True)
        else:
            for p in paths:
                p.chmod(0o755 if p.is_dir() else 0o644)
