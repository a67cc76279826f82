"""Every citation of a document section names a heading that exists.

Code and docs cite the design record as ``docs/PROTOCOL.md "Link protocol"``
(a heading, without its ``#``) and, for a paragraph inside a section, as
``PROTOCOL.md "Link protocol", Sealed frames`` (the paragraph's bold label).
A renamed heading or label would leave the next reader looking for a section
that is not there, so this test reads every citation in the source tree and
in docs/ and checks it against the cited file.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("talos_sdk", "talos", "mcp_proxy", "bench", "examples", "tests", "tools")

# FILE.md "Heading" with an optional ", Label" (a capitalised phrase ending at ) . ; : , or EOL).
CITATION = re.compile(
    r'(?<![\w/.-])((?:docs/)?(?:adr/)?([\w.-]+\.md))\)?\s*\(?"([^"\n]+)"'
    r"(?:,\s*([A-Z][\w /-]*?)(?=[).;:,\n]))?"
)


def _target(cited: str, name: str) -> Path | None:
    """The repository file a citation names (DESIGN.md means docs/DESIGN.md)."""
    if name[:4].isdigit():
        return next((ROOT / "docs" / "adr").glob(name), None)
    for candidate in (ROOT / cited, ROOT / "docs" / name, ROOT / "docs" / "adr" / name):
        if candidate.is_file():
            return candidate
    return None


@cache
def _headings(path: Path) -> frozenset[str]:
    lines = path.read_text(encoding="utf-8").splitlines()
    return frozenset(re.sub(r"^#+\s*", "", line).strip() for line in lines if line.startswith("#"))


def _citations() -> list[tuple[str, Path, str, str | None]]:
    files = [p for d in SOURCES for p in (ROOT / d).rglob("*.py")]
    files += [*(ROOT / "docs").rglob("*.md"), ROOT / "README.md"]
    found = []
    for path in files:
        text = path.read_text(encoding="utf-8")
        for match in CITATION.finditer(text):
            cited, name, heading, label = match.groups()
            target = _target(cited, name)
            if target is None:
                continue  # a file outside the repository (../shared) or a bare name in prose
            where = f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, match.start()) + 1}"
            found.append((where, target, heading, label))
    return found


def test_citations_are_found() -> None:
    # The pattern must keep matching the way the project cites: a guard against
    # a regex change that silently checks nothing.
    assert len(_citations()) > 150


def test_every_cited_heading_exists() -> None:
    broken = [
        f'{where}: {target.relative_to(ROOT)} has no heading "{heading}"'
        for where, target, heading, _ in _citations()
        if heading not in _headings(target)
    ]
    assert not broken, "\n".join(broken)


def test_every_cited_paragraph_label_exists() -> None:
    broken = [
        f"{where}: {target.relative_to(ROOT)} has no paragraph **{label}**"
        for where, target, _, label in _citations()
        if label is not None and f"**{label}" not in target.read_text(encoding="utf-8")
    ]
    assert not broken, "\n".join(broken)
