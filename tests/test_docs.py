"""The manual's generated pages (docs/hooks.py): the CLI reference is the parser's own help, every command's; the
results page lists every table in results/ and the site links copies of them. CI builds the whole site with
warnings as errors (`scripts/docs`)."""
from __future__ import annotations

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", os.path.join(ROOT, "docs", "hooks.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_cli_reference_is_every_commands_own_help(tmp_path):
    from autofuse.cli import build_parser

    path = tmp_path / "cli.md"
    _hooks().write_cli_reference(str(path))
    text = path.read_text()
    for command in ("tune", "worker", "runs", "plans", "trials", "show", "compare", "report", "db"):
        assert f"## autofuse {command}\n" in text, command
    assert "--effort LEVEL" in text and "--max-memory SIZE" in text  # options come from the parser, not from prose
    assert build_parser().format_help().splitlines()[0] in text


def test_the_results_page_lists_and_copies_every_table(tmp_path):
    _hooks().write_results(os.path.join(ROOT, "results"), str(tmp_path / "results"), str(tmp_path / "results.md"))
    tables = sorted(n for n in os.listdir(os.path.join(ROOT, "results")) if n.endswith(".md"))
    assert sorted(os.listdir(tmp_path / "results")) == tables
    page = (tmp_path / "results.md").read_text()
    assert all(f"](results/{name})" in page for name in tables)


def test_the_overview_shows_the_readmes_own_gains(tmp_path):
    """docs/index.md leaves its "What it gains" to the README's section, filled in as the page renders."""
    from types import SimpleNamespace

    hooks = _hooks()
    with open(os.path.join(ROOT, "docs", "index.md")) as f:
        index = f.read()
    assert hooks.GAINS in index and "| program (bf16) |" not in index  # no copy of its own to drift
    page = hooks.on_page_markdown(index, SimpleNamespace(file=SimpleNamespace(src_path="index.md")), None, None)
    section = hooks.readme_section("What it gains")
    assert hooks.GAINS not in page and section in page and "| GPT-2 medium, plain-`jnp` attention (B8 S2048) |" in section
    assert "## Two commands" not in section and "](results/)" not in section  # one section; the site's link to the results page
    other = "text " + hooks.GAINS
    assert hooks.on_page_markdown(other, SimpleNamespace(file=SimpleNamespace(src_path="tuning.md")), None, None) == other
