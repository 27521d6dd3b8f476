"""README.md and docs/*.md as a reader follows them: every relative link leads to a file
and, with an anchor, to one of its headings; a section named in words ("README, "A real
model"") exists; no internal issue number stands in for what happened."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
#: A section named in words: `README, "A real model"` or `docs/architecture.md, "Weight updates"`.
NAMED = re.compile(r"(README|docs/[\w-]+\.md)(?:'s)?,? \"([^\"]+)\"")
ISSUE = re.compile(r"\b[Ii]ssues? #?\d+|#\d+ \(r\d+\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def headings(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)  # not the comments in code blocks
    return [line.lstrip("#").strip() for line in text.splitlines() if re.match(r"#{1,6} ", line)]


def test_slug_is_githubs():
    assert slug("Durability: `rollout up --fsync`") == "durability-rollout-up---fsync"
    assert slug("A local cluster: `docker compose`") == "a-local-cluster-docker-compose"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_relative_link_leads_somewhere(doc):
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            broken.append(f"{target}: no file {file}")
        elif anchor and file.suffix == ".md" and anchor not in {slug(h) for h in headings(file)}:
            broken.append(f"{target}: no heading with anchor #{anchor} in {file.name}")
    assert not broken, f"{doc.name}: {broken}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_a_section_named_in_words_exists(doc):
    missing = []
    for name, section in NAMED.findall(doc.read_text()):
        file = REPO / ("README.md" if name == "README" else name)
        # A heading, or a paragraph's bold lead-in (`**Changed: a publish is one round trip.**`).
        places = headings(file) + re.findall(r"^\*\*(.+?)\*\*", file.read_text(), re.MULTILINE)
        if not any(section.lower() in place.lower() for place in places):
            missing.append(f"{name}, {section!r}")
    assert not missing, f"{doc.name} names sections that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_no_internal_issue_numbers(doc):
    cited = [line.strip()[:100] for line in doc.read_text().splitlines() if ISSUE.search(line)]
    assert not cited, f"{doc.name} cites issue numbers a reader cannot look up (say what happened): {cited}"
