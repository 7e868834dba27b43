"""The documentation site (mkdocs.yml: README.md as its home, the pages of docs/) builds with
--strict: a link to a page or an anchor that does not exist, or a page left out of the
navigation, fails the build and so this test."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def build(root: Path, out: Path) -> subprocess.CompletedProcess:
    # (not -q: mkdocs then drops its warnings, and --strict counts none of them)
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
        cwd=root, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip


def test_the_docs_site_builds_strictly(tmp_path):
    p = build(ROOT, tmp_path / "site")
    assert p.returncode == 0, p.stdout + p.stderr
    home = (tmp_path / "site" / "index.html").read_text()
    assert "Two commands" in home and 'href="getting-started/' in home  # README, links rewritten
    for page in ("getting-started", "serving", "configuration", "operations", "deployment"):
        assert (tmp_path / "site" / page / "index.html").is_file(), page


def test_a_dead_link_fails_the_build(tmp_path):
    # the same site with one link to an anchor that does not exist: the check above can fail
    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "docs", copy / "docs")
    shutil.copy(ROOT / "mkdocs.yml", copy)
    shutil.copy(ROOT / "README.md", copy)
    page = copy / "docs" / "operations.md"
    page.write_text(page.read_text() + "\nSee [the keys](configuration.md#no-such-setting).\n")
    p = build(copy, tmp_path / "site")
    assert p.returncode != 0 and "no-such-setting" in p.stdout + p.stderr
