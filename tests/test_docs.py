"""The docs site's pages: their commands name files and options that exist; the Python example of
"Your own data and model" runs as written."""

import re
import shlex
from pathlib import Path

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
