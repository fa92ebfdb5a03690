"""The docs site's pages: their commands name files and options that exist; the tutorial's code
blocks and the Python example of "Your own data and model" run as written; the built site works
from file:// and its API reference is Markdown, free of Sphinx markup."""

import html
import os
import re
import shlex
import shutil
import subprocess
import sys
import urllib.parse
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _blocks(page: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", (ROOT / "docs" / page).read_text(), flags=re.S)


@pytest.mark.parametrize("page", ["own-data.md", "getting-started.md", "flower.md", "gpu.md"])
def test_the_pages_commands_name_files_that_exist(page):
    for block in _blocks(page, "bash"):
        for line in block.splitlines():
            words = shlex.split(line.split("  #")[0].split(" # ")[0]) if line.strip() else []
            for word in words:
                if word.startswith("examples/") and "=" not in word:
                    assert (ROOT / word).exists() or word.endswith("clients.csv"), f"{page}: {word}"


@pytest.mark.slow
def test_the_own_data_python_example_runs_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (code,) = _blocks("own-data.md", "python")
    namespace: dict = {"__name__": "__docs__"}
    exec(compile(code.replace('rounds": 10', 'rounds": 2'), "docs/own-data.md", "exec"), namespace)
    assert namespace["summary"]["final"]["accuracy"] > 0.3
    assert (tmp_path / "runs" / "python_arrays" / "model.npz").is_file()


# The tutorial's pages in reading order; each continues from the files the earlier ones leave.
TUTORIAL = ("tutorial/first-run.md", "tutorial/own-data.md", "tutorial/bayesian.md", "tutorial/deploy.md")
# A block preceded by this marker is shown, not run; the reason is required.
SKIP = re.compile(r"<!-- docs-test: skip \((.+?)\) -->")
FEDBAYES = ".venv/bin/fedbayes "


def _tutorial_blocks(page: str) -> list[tuple[str, str, str | None]]:
    """``(language, code, skip reason or None)`` of every fenced block of a tutorial page."""
    found = re.findall(r"(<!-- docs-test: skip \((?:.+?)\) -->\n)?```(\w*)\n(.*?)```", (ROOT / "docs" / page).read_text(), flags=re.S)
    return [(language, code, SKIP.match(marker).group(1) if marker else None) for marker, language, code in found]


def test_the_tutorial_is_in_the_navigation_and_most_of_its_blocks_run():
    """In the site's navigation in reading order; every block is Python or a shell block whose
    lines the runner below knows; the blocks shown but not run are few and say why."""
    nav = (ROOT / "mkdocs.yml").read_text()
    assert [nav.index(page) for page in TUTORIAL] == sorted(nav.index(page) for page in TUTORIAL)
    blocks = [block for page in TUTORIAL for block in _tutorial_blocks(page)]
    run = [(language, code) for language, code, skip in blocks if skip is None]
    assert len(run) >= 3 * len(blocks) // 4, f"{len(blocks) - len(run)} of {len(blocks)} blocks are not run"
    for language, code in run:
        assert language in ("python", "bash"), language
        if language == "bash":
            assert all(line.startswith((FEDBAYES, "ls ")) for line in code.splitlines()), code


def _run_shell_line(line: str, cwd: Path) -> str:
    """A tutorial shell line: a ``fedbayes`` command through the CLI in this process (its imports
    and compiled programs shared), anything else through bash. Returns its output; a failure fails."""
    if not line.startswith(FEDBAYES):
        res = subprocess.run(["bash", "-c", line], cwd=cwd, capture_output=True, text=True)
        assert res.returncode == 0, f"{line}: {res.stderr}"
        return res.stdout
    from typer.testing import CliRunner

    from fedbayes.cli import app

    res = CliRunner().invoke(app, shlex.split(line)[1:], env={"COLUMNS": "100", "FEDBAYES_NO_SYSTEM_DATA": "1"})
    assert res.exit_code == 0, f"{line}: exit {res.exit_code}\n{res.output[-3000:]}"
    return res.output


@pytest.mark.slow
def test_the_tutorial_runs_as_written(tmp_path, monkeypatch, capsys):
    """Every block of the tutorial but those marked, page after page in one folder holding
    examples/, as a reader types them: shell lines as commands, Python blocks each in a fresh
    namespace. Only digits and scikit-learn's bundled data: passes with optional data absent."""
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FEDBAYES_NO_SYSTEM_DATA", "1")
    outputs = []
    for page in TUTORIAL:
        for i, (language, code, skip) in enumerate(_tutorial_blocks(page)):
            if skip is not None:
                continue
            if language == "bash":
                outputs += [_run_shell_line(line, tmp_path) for line in code.splitlines()]
            else:
                exec(compile(code, f"docs/{page} block {i + 1}", "exec"), {"__name__": "__docs__"})
                outputs.append(capsys.readouterr().out)
    text = "\n".join(outputs)
    assert "posterior std" in text and "predicted [" in text and "flower-supernode" in text
    assert (tmp_path / "runs/first/model.npz").is_file() and (tmp_path / "runs/wine/model.npz").is_file()
    assert "posterior_variance/Dense_0/kernel" in np.load(tmp_path / "runs/wine_fedep/model.npz").files


def _built_site(folder: Path) -> Path:
    """``make docs``'s build of this checkout into ``folder`` (strict: a warning fails it)."""
    pytest.importorskip("mkdocs", reason="the docs extra is not installed (make docs installs it)")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "NO_MKDOCS_2_WARNING": "1"}
    res = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--quiet", "-d", str(folder)], cwd=ROOT, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    return folder


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    return _built_site(tmp_path_factory.mktemp("site"))


def _text(page: Path) -> str:
    """A built page's article as plain text (the code of its examples included)."""
    body = page.read_text(encoding="utf-8")
    body = body[body.find("<article") :]
    return html.unescape(re.sub(r"<[^>]+>", "", body))


def test_the_built_site_links_to_files_so_it_works_from_file_urls(site):
    """Opened as site/index.html (file://), a link must name a file: a folder shows a listing."""
    pages = sorted(p for p in site.rglob("*.html") if p.name != "404.html")  # 404.html: a web server's page
    assert len(pages) > 20
    checked = 0
    for page in pages:
        for link in re.findall(r'(?:href|src)="([^"#?]+)[^"]*"', page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:|//", link):
                continue  # another site
            target = (page.parent / urllib.parse.unquote(link)).resolve()
            assert target.is_file(), f"{page.relative_to(site)}: {link} is not a file of the site"
            checked += 1
    assert checked > 500


def test_the_api_reference_shows_no_sphinx_markup(site):
    for page in ("api.html", "config.html"):
        text = _text(site / page)
        roles = re.findall(r":(?:class|func|meth|mod|attr|data|obj|exc):`?\S+", text)
        assert not roles, f"{page}: {roles[:5]}"
        assert not re.search(r"\w::\s", text), page  # a literal block's marker (Example::)
    api = (site / "api.html").read_text(encoding="utf-8")
    assert 'href="#fedbayes.sim.simulator.Simulator.run_round"' in api  # :meth:`run_round`, resolved in its scope


def test_run_config_and_every_config_section_show_their_fields(site):
    from fedbayes.config import reference

    api, config = _text(site / "api.html"), _text(site / "config.html")
    assert "Bases:" not in api.split("RunConfig", 1)[1][:300]
    top = reference.sections()[0]
    assert len(top.keys) > 10
    for key in top.keys:
        assert re.search(rf"^{key.name}$", api, flags=re.M), f"RunConfig.{key.name}"
    for section in reference.sections():
        assert section.title in config or not section.name, section.title
        for key in section.keys:
            assert re.search(rf"^{key.name}$", config, flags=re.M), f"{section.title}: {key.name}"


def _browser() -> str | None:
    return next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)


@pytest.mark.slow
@pytest.mark.skipif(_browser() is None, reason="no headless Chromium on this machine (apt-get install chromium)")
def test_a_headless_browser_follows_the_sites_links_from_file_urls(site, tmp_path):
    """Chromium opens site/index.html as file://, and the pages its navigation links to (as the
    browser resolves them) are pages, not folder listings."""

    def dom(url: str) -> str:
        args = [_browser(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"]
        args += ["--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", url]
        return subprocess.run(args, capture_output=True, text=True, timeout=60).stdout

    index = (site / "index.html").resolve().as_uri()
    home = dom(index)
    links = re.findall(r'<a href="([^"#]+)" class="md-nav__link"', home)
    targets = {urllib.parse.urljoin(index, link) for link in links}
    assert len(targets) > 10, links
    for url in sorted(t for t in targets if t.endswith(("/getting-started.html", "/api.html", "/config.html", "/getting-started/"))):
        page = dom(url)
        assert "<article" in page and "<h1" in page and "Index of" not in page, url
