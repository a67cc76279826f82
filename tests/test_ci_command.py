"""CI runs exactly the README's check command (.ci/run), and installs only once."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _commands(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("python3 -m venv .venv")]


def test_ci_runs_the_readme_check_command_once() -> None:
    readme = _commands((ROOT / "README.md").read_text())
    ci = _commands((ROOT / ".ci" / "run").read_text())
    assert len(ci) == 1, "one venv, one `pip install -e`: a second one re-resolves and rebuilds"
    assert ci[0] in readme
    assert re.search(r"ruff check \. && ruff format --check \. && mypy && python -m pytest$", ci[0])
