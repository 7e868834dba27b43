"""Every file a document names exists: README.md and docs/*.md name code, tests, benchmarks and
figures by their path in the repository (`service/store/carry.py`,
`tests/service/model/test_wire.py::test_...`); a renamed or removed file makes the sentence that
points at it false. A path is a repository folder, slashes and a file name with an extension;
placeholders (`<rule>`, `*`) and generated outputs (under runs/) are not paths."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = (
    "service",
    "training",
    "embedding",
    "index_builder",
    "experiments",
    "benchmarks",
    "tests",
    "docs",
    "docker",
    ".ci",
)
PATH = re.compile(
    rf"(?<![\w/.-])((?:{'|'.join(re.escape(f) for f in FOLDERS)})/[\w./-]*\w\.[a-z]{{1,5}})"
    r"(?![\w<*])"
)
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def named_paths(text: str) -> set[str]:
    return {m.group(1) for m in PATH.finditer(text)}


def test_every_path_a_document_names_exists():
    missing = [
        f"{doc.relative_to(ROOT)} names {p}"
        for doc in DOCS
        for p in sorted(named_paths(doc.read_text()))
        if not (ROOT / p).exists() and not (doc.parent / p).exists()
    ]
    assert not missing, "\n".join(missing)
    # a file outside the repository is no reference for its readers
    outside = [
        f"{d.relative_to(ROOT)}" for d in DOCS if re.search(r"(?<![\w/])DESIGN\.md", d.read_text())
    ]
    assert not outside, f"{outside} name DESIGN.md, which is not in the repository"


def test_the_check_finds_paths():
    text = "see `service/store/carry.py`, tests/service/model/test_wire.py::test_x and docs/figures/a.png"
    assert named_paths(text) == {
        "service/store/carry.py",
        "tests/service/model/test_wire.py",
        "docs/figures/a.png",
    }
    assert not named_paths("embedding/votes/<rule>.py, a run's runs/x/service/a.py")
    assert len(named_paths((ROOT / "docs" / "ARCHITECTURE.md").read_text())) > 30
