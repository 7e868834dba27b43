"""The documentation site (mkdocs.yml: README.md as its home, the pages of docs/) builds with
--strict: a link to a page or an anchor that does not exist, or a page left out of the
navigation, fails the build and so this test. Opened from disk in Chromium with no network,
every link of every page leads to a page or file (not a folder's listing) and nothing is
fetched from outside (issue 53)."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[2]


def build(root: Path, out: Path) -> subprocess.CompletedProcess:
    # (not -q: mkdocs then drops its warnings, and --strict counts none of them)
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
        cwd=root, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("docs") / "site"
    p = build(ROOT, out)
    assert p.returncode == 0, p.stdout + p.stderr
    return out


def test_the_docs_site_builds_strictly(site):
    home = (site / "index.html").read_text()
    assert "Two commands" in home and 'href="getting-started.html' in home  # README, rewritten
    for page in ("getting-started", "serving", "configuration", "operations", "deployment"):
        assert (site / f"{page}.html").is_file(), page


def test_the_site_works_from_disk_offline(site, browser):
    """Every page reachable from the home page by its links, opened as file:// URLs: each link
    to the site names a file that exists (a folder would open as a listing), each page shows
    its content, and the only requests are to the site's own files (no fonts or scripts from
    outside: none can load here, nor for many users)."""
    outside: list[str] = []
    page = browser.new_page()
    page.on("request", lambda r: None if r.url.startswith(("file:", "data:", "blob:"))
            else outside.append(r.url))  # fmt: skip
    root = site.resolve()
    todo, seen, files = [root / "index.html"], set(), set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        page.goto(path.as_uri())
        assert page.locator("article h1, article h2").count() > 0, path  # its content, shown
        for href in page.eval_on_selector_all("a[href]", "els => els.map(e => e.href)"):
            u = urlsplit(href)
            if u.scheme != "file":
                continue  # (links out are fine to have; nothing is fetched without a click)
            target = Path(unquote(u.path))
            assert target.is_file(), f"{path.name} links to {href}: no such file"
            if target.suffix == ".html":
                todo.append(target)
            else:
                files.add(target)
    nav = re.findall(r":\s*(\S+)\.md\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)
    assert {f"{n}.html" for n in nav} <= {p.name for p in seen}  # every page of the navigation
    assert outside == [], outside[:5]
    page.close()


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
