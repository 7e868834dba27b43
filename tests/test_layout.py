"""The layout's one rule (docs/ARCHITECTURE.md): the three stages import only the shared
contract, never each other, and the contract imports no stage. Checked on the source (every
import statement, also the ones inside functions)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("training", "index_builder", "service")
ALLOWED = {
    "embedding": set(),
    "training": {"embedding"},
    "index_builder": {"embedding"},
    "service": {"embedding"},
    "experiments": {"embedding", "training"},  # a driver over the stages; no stage imports it
}
PROJECT = set(ALLOWED)


def imported_packages(package: str) -> dict[str, set[str]]:
    """{file: top-level project packages it imports} for every .py file of `package`."""
    out = {}
    for f in (ROOT / package).rglob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
        out[str(f.relative_to(ROOT))] = (found & PROJECT) - {package}
    return out


def test_no_stage_imports_a_sibling_and_the_contract_imports_no_stage():
    bad = [
        f"{f} imports {', '.join(sorted(pkgs - ALLOWED[package]))}"
        for package in ALLOWED
        for f, pkgs in imported_packages(package).items()
        if pkgs - ALLOWED[package]
    ]
    assert not bad, bad
    # the check sees imports at all: the stages do import the contract
    for stage in STAGES:
        assert any("embedding" in p for p in imported_packages(stage).values()), stage
