"""MkDocs hook: pages generated at build time from their one source.

* ``<!-- cli-reference -->`` (docs/cli.md): every command's ``--help`` from the typer app, so a
  command added to the app appears without editing the page;
* ``<!-- readme: HEADING -->``: the README's section under that heading (its body, without the
  heading), with its links to ``docs/`` made relative to the site;
* ``<!-- results-gallery -->`` (docs/results.md): every page and plot of ``docs/results/``;
* ``<!-- config-reference: SECTION -->``: the config keys of ``SECTION`` (as ``fedbayes config
  SECTION`` selects them; ``all`` for every section), one table per section, from the config's
  own definitions (:mod:`fedbayes.config.reference`).
"""

from __future__ import annotations

import html
import re
from pathlib import Path

import click

MARKER = "<!-- cli-reference -->"
README = Path(__file__).resolve().parents[1] / "README.md"
RESULTS = Path(__file__).resolve().parent / "results"


def _commands(group: click.Group, prefix: str):
    ctx = click.Context(group, info_name=prefix)
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        yield f"{prefix} {name}", command
        if hasattr(command, "list_commands"):  # a group (typer may bundle its own click)
            yield from _commands(command, f"{prefix} {name}")


def cli_reference() -> str:
    """Markdown: one section per command with its help text (100 columns)."""
    import typer

    from fedbayes.cli import app

    group = typer.main.get_command(app)
    parts = []
    for path, command in _commands(group, "fedbayes"):
        ctx = click.Context(command, info_name=path, terminal_width=100, max_content_width=100)
        parts += [f"## `{path}`", "", "```text", command.get_help(ctx), "```", ""]
    return "\n".join(parts)


def readme_section(heading: str) -> str:
    """The README's section under ``heading`` (up to the next heading of the same level)."""
    text = README.read_text(encoding="utf-8")
    level = heading.split(" ")[0]
    start = text.index(heading + "\n") + len(heading) + 1
    end = text.find("\n" + level + " ", start)
    body = text[start : end if end >= 0 else len(text)]
    return re.sub(r"\]\(docs/", "](", body)


def results_gallery() -> str:
    """Markdown: a link to every results page (by its first heading), then every plot."""
    lines = ["## Tables", ""]
    for page in sorted(RESULTS.glob("*.md")):
        heading = page.read_text(encoding="utf-8").splitlines()[0].lstrip("# ").strip()
        lines.append(f"- [{heading}](results/{page.name})")
    lines += ["", "## Plots", ""]
    for plot in sorted(RESULTS.glob("*.png")):
        lines += [f"`{plot.name}`", "", f"![{plot.stem}](results/{plot.name})", ""]
    return "\n".join(lines)


def _cell(text: str) -> str:
    """Table-cell text: HTML's special characters and the column separator escaped."""
    return html.escape(text, quote=False).replace("|", "\\|") or " "


def config_tables(section: str) -> str:
    """Markdown: per config section its title, doc line and a table of its keys."""
    from fedbayes.config import reference

    parts = []
    for s in reference.select(None if section == "all" else section):
        if section == "all":
            parts += [f"### `{s.title}`" if s.name else "### Top level", ""]
        parts += [s.doc, ""] if s.doc and section == "all" else []
        if not s.keys:
            parts += ["No keys besides `name`.", ""]
            continue
        parts += ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        parts += [f"| `{k.name}` | {_cell(k.type)} | `{k.default}` | {_cell(k.meaning)} |" for k in s.keys]
        parts.append("")
    return "\n".join(parts)


def on_page_markdown(markdown: str, page, config, files) -> str:
    markdown = re.sub(r"<!-- config-reference: (\S+) -->", lambda m: config_tables(m.group(1)), markdown)
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, cli_reference())
    markdown = markdown.replace("<!-- results-gallery -->", results_gallery())
    return re.sub(r"<!-- readme: (.+?) -->", lambda m: readme_section(m.group(1)), markdown)
