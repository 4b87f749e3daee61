"""MkDocs hooks: the pages made from the code and the results before each build, so that they cannot drift.

`cli.md` is the `autofuse` parser's own help, every command's; `results.md` lists the tables in `results/` (each
file's first heading and the line naming its card), which are copied under `docs/results/` so the site links them.
Both are written at build time and ignored by git. The overview's "What it gains" is the README's own section, put in
where `index.md` says `GAINS` as the page is rendered.
"""
from __future__ import annotations

import argparse
import os
import shutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")


GAINS = "<!-- the README's section: What it gains -->"


def on_page_markdown(markdown: str, page, config, files, **kwargs) -> str:  # noqa: ARG001 - MkDocs' hook signature
    """The overview page with the README's measured table in it: one text for both, so that they cannot drift."""
    return markdown.replace(GAINS, readme_section("What it gains")) if page.file.src_path == "index.md" else markdown


def readme_section(heading: str) -> str:
    """The body of the README's `## heading` section (up to the next `## `), its links made the site's: `results/`
    (the directory) is the results page there."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    marker = f"\n## {heading}\n"
    start = text.index(marker) + len(marker)
    end = text.find("\n## ", start)
    return text[start:end if end >= 0 else None].strip().replace("](results/)", "](results.md)")


def on_pre_build(config, **kwargs) -> None:  # noqa: ARG001 - MkDocs' hook signature
    write_cli_reference(os.path.join(DOCS, "cli.md"))
    write_results(os.path.join(ROOT, "results"), os.path.join(DOCS, "results"), os.path.join(DOCS, "results.md"))


def write_cli_reference(path: str) -> None:
    """Every command's `--help`, as the parser prints it."""
    from autofuse.cli import build_parser

    os.environ["COLUMNS"] = "110"  # argparse wraps to the terminal's width: the page must not depend on who builds it
    parser = build_parser()
    parts = ["# CLI reference", "", "Generated from the parser itself at each build (`docs/hooks.py`).", "", "```text",
             parser.format_help().rstrip(), "```"]
    for action in parser._subparsers._group_actions:  # noqa: SLF001 - argparse keeps its subcommands there
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for name, sub in action.choices.items():
                parts += ["", f"## autofuse {name}", "", "```text", sub.format_help().rstrip(), "```"]
    with open(path, "w") as f:
        f.write("\n".join(parts) + "\n")


def write_results(src: str, dst: str, index: str) -> None:
    """The measured tables of `results/`, copied under the docs, and a page listing them."""
    shutil.rmtree(dst, ignore_errors=True)
    os.makedirs(dst)
    rows = []
    for name in sorted(os.listdir(src)):
        if not name.endswith(".md"):
            continue
        shutil.copy(os.path.join(src, name), os.path.join(dst, name))
        with open(os.path.join(src, name)) as f:
            text = f.read().splitlines()
        title = next((ln.lstrip("# ").strip() for ln in text if ln.startswith("#")), name)
        card = next((ln.strip() for ln in text if "H100" in ln or "H200" in ln or "device:" in ln), "")
        rows.append(f"| [{title.replace('|', '/')}](results/{name}) | {card[:160].replace('|', '/')} |")
    page = ["# Results", "", "Every speed number of this project, measured on a GPU, with the card, JAX version, date, commit and",
            "command in each table (`results/` in the repository). Compare only numbers from the same card and process.", "",
            "| table | card and run |", "|---|---|", *rows]
    with open(index, "w") as f:
        f.write("\n".join(page) + "\n")
