"""docs/: every reference into the design resolves, and every file a section lists exists.

Code, config and docs cite docs/architecture.md and docs/conventions.md by section name
(``docs/architecture.md, 'Block hashes'``); these tests fail when a cited section is renamed
or gone, when a section's ``Files:`` link points at a moved file, or when a reference to a
document outside the repository comes back.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SOURCE_FOLDERS = ("bench", "cache_node", "deploy", "docs", "proto", "services", "tenants",
                  "tests", "workloads")
SOURCE_SUFFIXES = {".py", ".yaml", ".md", ".proto"}
# "docs/architecture.md, 'Tiers'" or "docs/architecture.md, 'Scheduling' and 'Tiers'"
REFERENCE = re.compile(r"docs/(architecture|conventions)\.md,\s*'([^']+)'(?:\s+and\s+'([^']+)')?")
LINK = re.compile(r"\]\(([^)#]+)\)")


def _sources() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "Makefile"]
    for folder in SOURCE_FOLDERS:
        files += [p for p in (ROOT / folder).rglob("*")
                  if p.is_file() and (p.suffix in SOURCE_SUFFIXES or p.name == "Dockerfile")]
    return sorted(files)


def _flat(text: str) -> str:
    """Join wrapped lines (docstring indents, ``#`` comment leaders) into one line."""
    return re.sub(r"\s*\n\s*(?:#\s*)?", " ", text)


def sections(doc: str) -> list[str]:
    return re.findall(r"^## (.+)$", (DOCS / f"{doc}.md").read_text(), flags=re.MULTILINE)


def references() -> list[tuple[str, str, str]]:
    """``(file, document, section)`` for every section reference in the repository."""
    found = []
    for path in _sources():
        if path.name == "test_docs.py":
            continue
        for doc, *names in REFERENCE.findall(_flat(path.read_text())):
            found += [(str(path.relative_to(ROOT)), doc, name) for name in names
                      if name and "{" not in name]  # a test's f-string is not a reference
    return found


def test_no_reference_to_documents_outside_the_repository() -> None:
    """issue 19: 18 docstrings, the deploy YAMLs and tests cited a design and a style document
    kept outside the repository, which a reader of it cannot open."""
    outside = ("DESIGN" + ".md", "STYLE" + ".md")
    offenders = [str(p.relative_to(ROOT)) for p in _sources()
                 if any(name in p.read_text() for name in outside)]
    assert offenders == []


def test_references_are_found() -> None:
    """The parser sees the references the code makes (so the next test cannot pass vacuously)."""
    refs = references()
    assert ("deploy/cluster.yaml", "architecture", "Process environment") in refs
    assert ("services/convert.py", "conventions", "Protobuf stays at the edge") in refs
    assert ("cache_node/scheduling/kvstrata.py", "architecture", "Admission and SLO floors") in refs
    assert len(refs) >= 20


@pytest.mark.parametrize("doc", ["architecture", "conventions"])
def test_every_reference_names_an_existing_section(doc: str) -> None:
    known = set(sections(doc))
    missing = [(f, name) for f, d, name in references() if d == doc and name not in known]
    assert missing == [], f"sections not in docs/{doc}.md (known: {sorted(known)})"


def test_section_names_are_unique() -> None:
    for doc in ("architecture", "conventions"):
        names = sections(doc)
        assert len(names) == len(set(names)), doc


def test_architecture_cross_references_name_existing_sections() -> None:
    text = (DOCS / "architecture.md").read_text()
    cited = set(re.findall(r"\('([A-Z][^']+)'\)|see '([A-Z][^']+)'", text))
    names = {a or b for a, b in cited}
    assert names, "docs/architecture.md cites none of its own sections"
    assert names <= set(sections("architecture")), names - set(sections("architecture"))


def test_every_architecture_section_ends_with_its_files() -> None:
    """A reader can go from each section to the files that implement it ('Terms' defines words)."""
    text = (DOCS / "architecture.md").read_text()
    for body in text.split("\n## ")[1:]:
        name, _, rest = body.partition("\n")
        if name == "Terms":
            continue
        last = rest.strip().split("\n\n")[-1]
        assert last.startswith("Files: ") and LINK.search(last), name


@pytest.mark.parametrize("doc", ["architecture", "conventions"])
def test_every_link_resolves(doc: str) -> None:
    links = LINK.findall((DOCS / f"{doc}.md").read_text())
    broken = [link for link in links if not (DOCS / link).exists()]
    assert broken == []
    if doc == "architecture":
        assert len(links) > 50
