"""An installed wheel works on its own, away from the source tree.

The wheel is built from a copy of what the build reads (pyproject.toml, README.md, autofuse/, search_spaces/), so nothing is
written into the shared working tree and no stale `build/` can leak into it; pip builds it in an isolated build
environment, as `scripts/setup`'s own `pip install -e` does (the project's .venv has no setuptools).

It is installed with `--no-deps --no-index` into a fresh venv (`--without-pip`, through the running pip's
`--python`). Its dependencies are the ones already installed for this interpreter: a `.pth` file in the fresh venv
lists this interpreter's site-packages directories. Directories named in a `.pth` file are appended to sys.path
as they are, their own `.pth` files are not run, so the editable install's finder (`__editable__.autofuse-*.pth`)
never activates there: `import autofuse` can only find the wheel's copy, which the test asserts. This takes seconds
and needs no download of jax, jaxlib, scipy...; installing those from the pip cache into every fresh venv would
take minutes of CI time and fail on a cold cache.

Then the bundled example is tuned with the installed `autofuse` command from a directory that holds only a copy
of `examples/`, and the stored plan is listed. Without the search spaces in the wheel (they live outside the
package, in the top-level search_spaces/, mapped into it at build time) the first tuning trial fails.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROGRAM = "examples.norms:forward"


def _run(cmd: list, cwd: Path, env: dict, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(map(str, cmd))} exited {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.mark.slow
def test_installed_wheel_tunes_the_example_and_lists_its_plan(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}

    # The wheel.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "MANIFEST.in", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, src / name)
    for tree in ("autofuse", "search_spaces"):
        shutil.copytree(ROOT / tree, src / tree, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", dist, src], tmp_path, env)
    (wheel,) = dist.glob("autofuse-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    spaces = sorted(p.name for p in (ROOT / "search_spaces").glob("*.toml"))
    assert spaces, "no search spaces in search_spaces/"
    assert {f"autofuse/search_spaces/{n}" for n in spaces} <= shipped, "the wheel lacks the search spaces"

    # A fresh venv with the wheel, and this interpreter's installed dependencies.
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], tmp_path, env)
    vpy = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", vpy, "install", "-q", "--no-deps", "--no-index", wheel], tmp_path, env)
    site = Path(_run([vpy, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], tmp_path, env).stdout.strip())
    deps = [p for p in dict.fromkeys(sys.path) if Path(p).name in ("site-packages", "dist-packages") and Path(p).is_dir()]
    (site / "_autofuse_test_deps.pth").write_text("".join(f"{p}\n" for p in deps))

    # A working directory where `examples` is importable and autofuse is not (but for the venv's copy).
    work = tmp_path / "work"
    work.mkdir()
    shutil.copytree(ROOT / "examples", work / "examples", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    probe = ("import json, autofuse, autofuse.spaces as s; print(json.dumps({'file': autofuse.__file__, 'dir': str(s.bundled_dir()), "
             "'spaces': sorted(f'{k}.toml' for k in s.load_spaces()), 'row_reduce': s.load_spaces()['row_reduce'].path}))")
    found = json.loads(_run([vpy, "-c", probe], work, env).stdout)
    assert Path(found["file"]).resolve().is_relative_to(site.resolve()), f"autofuse imported from {found['file']}, not the venv"
    assert Path(found["dir"]).resolve().is_relative_to(site.resolve()), f"spaces read from {found['dir']}, not the wheel's"
    assert found["spaces"] == spaces
    mine = work / "my_spaces"  # the installed autofuse takes the user's spaces too
    mine.mkdir()
    shutil.copy2(ROOT / "search_spaces" / "row_reduce.toml", mine / "row_reduce.toml")
    found = json.loads(_run([vpy, "-c", probe], work, {**env, "AUTOFUSE_SEARCH_SPACES": str(mine)}).stdout)
    assert found["row_reduce"] == str(mine / "row_reduce.toml") and found["spaces"] == spaces

    autofuse = venv / "bin" / "autofuse"
    db = "sqlite:///fresh.db"  # relative: in `work`
    _run([autofuse, "tune", PROGRAM, "--inputs", "examples.norms:example_inputs", "--trials", "2", "--measure", "model",
          "--db", db], work, env, timeout=900)
    assert (work / "fresh.db").exists()
    listed = _run([autofuse, "plans", "--db", db], work, env)
    assert PROGRAM in listed.stdout, listed.stdout


def test_every_package_directory_is_listed_for_the_wheel():
    """pyproject.toml lists the packages (`packages.find` cannot map the top-level search_spaces/ into autofuse), so a
    new subpackage left off the list would be missing from the wheel: every directory of autofuse/ is listed."""
    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    dirs = {".".join(p.relative_to(ROOT).parts) for p in [ROOT / "autofuse", *(ROOT / "autofuse").rglob("*")]
            if p.is_dir() and p.name != "__pycache__" and any(p.glob("*.py"))}
    assert dirs <= set(listed), f"pyproject.toml's [tool.setuptools] packages lacks {sorted(dirs - set(listed))}"
    assert "autofuse.search_spaces" in listed
