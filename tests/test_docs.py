"""The documents point at what exists: links, `python -m` modules, files of the repository and make targets."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import ROOT

DOCS = sorted(
    [ROOT / "README.md", ROOT / "SECURITY.md", *(ROOT / "docs").glob("*.md"), ROOT / "bench/README.md"]
    + list((ROOT / "bench/results").rglob("*.md"))
)


def _names(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("doc", DOCS, ids=_names)
def test_what_a_document_names_exists(doc):
    text = doc.read_text()
    missing = [
        link
        for link in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
        if not link.startswith(("http://", "https://", "mailto:")) and not (doc.parent / link).exists()
    ]
    missing += [
        f"python -m {module}"
        for module in re.findall(r"python -m (src(?:\.\w+)+)", text)
        if not (ROOT / (module.replace(".", "/") + ".py")).exists()
    ]
    files = re.findall(r"(?<![\w/.])((?:src|tests|bench|conf)/[\w/.-]+\.(?:py|yaml|sh))", text)
    made_by_reader = doc.name == "extending.md"  # its conf/ files are the ones a reader adds
    missing += [
        f
        for f in files
        if not (ROOT / f).exists()
        and not (doc.parent / f).exists()
        and "NAME" not in f  # a placeholder, e.g. conf/model/NAME.yaml
        and not (made_by_reader and f.startswith("conf/"))
    ]
    targets = set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))
    missing += [f"make {t}" for t in re.findall(r"`make ([a-z][\w-]*)", text) if t not in targets]
    assert not missing, f"{_names(doc)} names what does not exist: {missing}"
