"""Every document the code and docs cite exists, and every cited section of docs/design.md is one of its headings."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [
    ROOT / "README.md",
    *(
        p
        for d in ("llamagym", "tests", "benchmarks", "examples", "scripts", "docs")
        for p in (ROOT / d).rglob("*")
        if p.suffix in (".py", ".md")
    ),
]
CITATION = re.compile(r"\b(docs/[\w./-]+\.md)(?: §(\d+))?")


def test_cited_documents_and_sections_exist():
    sections = set(re.findall(r"^## (\d+)\. ", (ROOT / "docs/design.md").read_text(), flags=re.M))
    cited = 0
    for path in SOURCES:
        for document, section in CITATION.findall(path.read_text()):
            cited += 1
            assert (ROOT / document).is_file(), f"{path.relative_to(ROOT)} cites {document}, which does not exist"
            if section:
                assert document == "docs/design.md" and section in sections, (
                    f"{path.relative_to(ROOT)}: {document} §{section}"
                )
    assert cited >= 5  # the pattern still finds the citations the code makes


def test_no_code_cites_the_design_document_outside_the_repository():
    for path in SOURCES:
        if path == Path(__file__).resolve():
            continue
        assert "DESIGN.md" not in path.read_text(), f"{path.relative_to(ROOT)} cites DESIGN.md; cite docs/design.md"
