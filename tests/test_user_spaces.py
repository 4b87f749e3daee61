"""The user's search spaces ($AUTOFUSE_SEARCH_SPACES): a file named as a bundled space replaces it, any other adds
one, the first of several directories wins, and a broken file is refused in one line that names it (the command
line refuses it before tracing the program). The candidates cache holds no space, so a job with a warm cache still
takes an edited space."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from autofuse import spaces

ROOT = Path(__file__).resolve().parent.parent
NARROW = 'template = "row_reduce"\n[parameters]\nblock_rows = {choices = [4]}\nblock_cols = {choices = [256]}\n' \
         'num_warps = {choices = [2]}\nnum_stages = {choices = [1]}\n'


def _write(d: Path, name: str, text: str) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_text(text)
    return d


def test_user_directory_overrides_a_bundled_space_and_adds_one(tmp_path, monkeypatch):
    mine = _write(tmp_path / "mine", "row_reduce.toml", NARROW)
    _write(mine, "my_template.toml", 'template = "my_template"\n[parameters]\nblock = {choices = [8, 16]}\n')
    bundled = spaces.load_spaces()
    monkeypatch.setenv(spaces.USER_SPACES, str(mine))
    got = spaces.load_spaces()
    assert got["row_reduce"].params["block_rows"] == [4] and got["row_reduce"].path == str(mine / "row_reduce.toml")
    assert got["my_template"].params == {"block": [8, 16]}
    assert set(got) == set(bundled) | {"my_template"}
    assert got["matmul"].path == bundled["matmul"].path  # the others are the bundled files

    later = _write(tmp_path / "later", "row_reduce.toml", NARROW.replace("[4]", "[8]"))
    monkeypatch.setenv(spaces.USER_SPACES, os.pathsep.join([str(later), "", str(mine)]))  # first wins, as on $PATH
    assert spaces.load_spaces()["row_reduce"].params["block_rows"] == [8]
    assert spaces.load_spaces()["my_template"].path == str(mine / "my_template.toml")


def test_a_template_space_takes_the_users_choices_with_a_warm_candidates_cache(tmp_path, monkeypatch):
    import autofuse
    from autofuse import costmodel
    from autofuse.tuning.job import distinct_candidates, enumeration_file, search_spaces
    from examples.norms import example_inputs, forward

    monkeypatch.setenv("AUTOFUSE_ENUMERATION_CACHE", str(tmp_path / "cache"))
    graph = autofuse.capture(forward, *example_inputs())
    distinct_candidates(graph)
    assert os.path.exists(enumeration_file(graph.fingerprint))
    monkeypatch.setenv(spaces.USER_SPACES, str(_write(tmp_path / "mine", "row_reduce.toml", NARROW)))
    by_sig, cands = distinct_candidates(graph)  # from the cache
    rows = [r for r in cands if r.template == "row_reduce"]
    assert rows, [r.template for r in cands]
    for r in rows:
        assert search_spaces(by_sig, [r], costmodel.H200)[r.signature].spaces["triton"].params["block_rows"] == [4]


@pytest.mark.parametrize("text, says", [
    ("template = \n", "not valid TOML"),
    ('template = "row_reduce"\ncolour = 1\n[parameters]\na = {choices = [1]}\n', "unknown keys"),
    ('template = "matmul"\n[parameters]\na = {choices = [1]}\n', "file is named for 'row_reduce'"),
])
def test_a_broken_user_file_is_one_line_naming_it(tmp_path, monkeypatch, text, says):
    mine = _write(tmp_path / "mine", "row_reduce.toml", text)
    monkeypatch.setenv(spaces.USER_SPACES, str(mine))
    with pytest.raises(spaces.SpaceError) as e:
        spaces.load_spaces()
    assert str(mine / "row_reduce.toml") in str(e.value) and says in str(e.value) and "\n" not in str(e.value)


def test_a_missing_user_directory_names_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv(spaces.USER_SPACES, str(tmp_path / "nowhere"))
    with pytest.raises(spaces.SpaceError, match=f"{tmp_path / 'nowhere'}.*{spaces.USER_SPACES}"):
        spaces.load_spaces()


def test_autofuse_tune_refuses_a_broken_user_file_in_one_line(tmp_path):
    mine = _write(tmp_path / "mine", "matmul.toml", 'template = "matmul"\n[parameters]\nblock_m = {choices = [-1]}\n')
    env = {**os.environ, "PYTHONPATH": str(ROOT), spaces.USER_SPACES: str(mine)}
    env.pop("AUTOFUSE_DEBUG", None)
    out = subprocess.run([sys.executable, "-m", "autofuse.cli", "tune", "examples.norms:forward", "--inputs",
                          "examples.norms:example_inputs", "--dry-run", "--db", f"sqlite:///{tmp_path}/x.db"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and str(mine / "matmul.toml") in lines[0] and "parameters.block_m.choices" in lines[0], out.stderr


def test_an_emptied_package_directory_falls_back_to_the_checkouts_spaces(tmp_path, monkeypatch):
    """A checkout updated past the move to the top level can keep an empty `autofuse/search_spaces/` (ignored files
    in it keep git from removing it); the bundled spaces are then the checkout's, not none (a KeyError of the first
    template's name on the GPU, before this)."""
    from autofuse import spaces

    (tmp_path / "search_spaces").mkdir()
    monkeypatch.setattr(spaces.resources, "files", lambda _pkg: tmp_path)
    spaces.bundled_dir.cache_clear()
    try:
        assert spaces.bundled_dir() == Path(spaces.__file__).resolve().parent.parent / "search_spaces"
    finally:
        spaces.bundled_dir.cache_clear()
    with pytest.raises(spaces.SpaceError, match=r"no search spaces \(\*\.toml\) in"):
        spaces.load_spaces(str(tmp_path / "search_spaces"))
