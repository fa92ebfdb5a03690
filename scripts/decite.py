"""Rewrites internal citations into ones a user of the package can follow (run from the repo root).

* "seed 000" (and "seed A") -> the paper by author, year and short title, e.g.
  "Guo et al. 2023 (FedEP)"; full titles are in README.md, "Papers".
* "spec 7.3" / "spec Sec. 13.1" -> "docs/algorithms.md §7.3".
* "../shared/spec/algorithms.md" -> "docs/algorithms.md"; "DESIGN.md" -> "docs/design.md";
  "STYLE.md" -> "docs/style.md".

Idempotent: run it again after a merge brings back old wording. ``--check`` lists what is left
and exits 1 if anything is (``.ci/run`` does not call it; the test suite does).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

PAPERS = {
    "000": "Guo et al. 2023 (FedEP)",
    "001": "Swaroop et al. 2025 (ADMM and Bayes)",
    "002": "Al-Shedivat 2021 (blog)",
    "003": "Al-Shedivat et al. 2021 (FedPA)",
    "004": "Ozer et al. 2022 (VBNN aggregation)",
}
LETTERS = {"A": "000", "B": "001", "C": "002", "D": "003", "E": "004"}

RULES: list[tuple[re.Pattern, object]] = [
    (re.compile(r"\b[Ss]eeds (\d{3})/(\d{3})\b"), lambda m: f"{PAPERS[m[1]]} and {PAPERS[m[2]]}"),
    (re.compile(r"\b[Ss]eeds (\d{3}) and (\d{3})\b"), lambda m: f"{PAPERS[m[1]]} and {PAPERS[m[2]]}"),
    (re.compile(r"\b[Ss]eed (\d{3})\b"), lambda m: PAPERS[m[1]]),
    (re.compile(r"\b[Ss]eed ([A-E])\b"), lambda m: PAPERS[LETTERS[m[1]]]),
    (re.compile(r"\.\./shared/spec/algorithms\.md"), "docs/algorithms.md"),
    (re.compile(r"(?:\.\./shared/|(?<![\w/]))DESIGN\.md"), "docs/design.md"),
    (re.compile(r"(?:\.\./shared/|(?<![\w/]))STYLE\.md"), "docs/style.md"),
    (re.compile(r"\b[Ss]pec(?:\.|ification)?,? (?:[Ss]ec(?:tion|\.)? ?|§ ?)?(\d+(?:\.\d+)?)"), r"docs/algorithms.md §\1"),
]
LEFT = re.compile(r"\b[Ss]eeds? (?:\d{3}|[A-E]\b)|\.\./shared|\b[Ss]pec \d|\b[Ii]ssue \d")
SUFFIXES = {".py", ".md", ".toml", ".txt", ".cfg", ".yaml", ".yml", ""}
SKIP = {".git", ".venv", ".venv-flower", "runs", ".hypothesis", "__pycache__", ".pytest_cache", "node_modules"}
SELF = {"scripts/decite.py"}


def files(root: Path):
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if p.is_file() and not (set(rel.parts) & SKIP) and p.suffix in SUFFIXES and str(rel) not in SELF:
            yield p


def rewrite(text: str) -> str:
    for pattern, repl in RULES:
        text = pattern.sub(repl, text)
    return text


def main(argv: list[str]) -> int:
    root = Path.cwd()
    check = "--check" in argv
    left = []
    for p in files(root):
        try:
            text = p.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        if not check:
            new = rewrite(text)
            if new != text:
                p.write_text(new)
                text = new
        for i, line in enumerate(text.splitlines(), 1):
            if LEFT.search(line):
                left.append(f"{p.relative_to(root)}:{i}: {line.strip()[:120]}")
    if left:
        print("\n".join(left))
    return 1 if (check and left) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
