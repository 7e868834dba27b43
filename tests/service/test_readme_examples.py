"""Every curl example of the README and of the documentation site's pages, as pasted, against a
real server: each runs (curl exit 0) and answers no problem. The examples name
runs/demo/examples/ (what `make run` writes), runs/photos-lite0/examples/ (`make photos`) and
port 8000; here they run in a directory holding
those files, against a free port."""

import json
import re
import subprocess
from pathlib import Path

import yaml

from service.tools.examples import write_examples, write_photo_examples

from .helpers import Server

ROOT = Path(__file__).resolve().parents[2]


def site_pages() -> list[Path]:
    """README.md (the site's home), then every page of mkdocs.yml's navigation in its order."""

    def walk(nav):
        for entry in nav:
            for value in entry.values() if isinstance(entry, dict) else [entry]:
                yield from walk(value) if isinstance(value, list) else [value]

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    return [ROOT / "README.md"] + [ROOT / "docs" / p for p in walk(nav) if p != "index.md"]


def curl_commands(text: str) -> list[str]:
    """The shell lines of the code blocks of `text` that call curl, continuation lines joined,
    in order."""
    out = []
    for block in re.findall(r"```(?:bash|sh)?\n(.*?)```", text, re.S):
        block = re.sub(r"\\\n\s*", " ", block)
        out += [line.strip() for line in block.splitlines() if re.search(r"\bcurl ", line)]
    return out


def readme_curl_commands() -> list[str]:
    return [c for page in site_pages() for c in curl_commands(page.read_text())]


def test_the_examples_are_found_on_the_readme_and_the_pages():
    pages = {p.name: curl_commands(p.read_text()) for p in site_pages()}
    assert len(pages["README.md"]) >= 3 and len(pages["serving.md"]) >= 4
    assert any("X-Min-Gallery-Version" in c for c in pages["operations.md"])


def test_every_curl_example_of_the_readme_runs_as_pasted(base_run, tmp_path):
    commands = readme_curl_commands()
    assert len(commands) >= 6 and any("/gallery/add" in c for c in commands)
    write_examples(tmp_path / "runs" / "demo" / "examples")
    write_photo_examples(tmp_path / "runs" / "photos-lite0" / "examples")  # make photos'
    srv = Server(base_run, tmp_path / "data", None)
    try:
        for cmd in commands:
            if "$v" in cmd:
                continue  # runs in the shell of the assignment it follows (below)
            line = cmd.replace("http://127.0.0.1:8000", srv.url)
            # an example that sets a shell variable is run with what follows it in one shell
            script = f"set -e -o pipefail\n{line}\n"
            if line.startswith("v=$("):
                follow = next(c for c in commands if "$v" in c)
                script += follow.replace("http://127.0.0.1:8000", srv.url) + "\n"
            p = subprocess.run(
                ["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True,
                env={"PATH": "/usr/bin:/bin", "KEY": ""},
            )  # fmt: skip
            assert p.returncode == 0, (cmd, p.returncode, p.stderr)
            if not p.stdout.strip():
                continue  # (an assignment)
            body = json.loads(p.stdout.splitlines()[-1])
            assert not (isinstance(body, dict) and body.get("status", 0) >= 400), (cmd, body)
    finally:
        srv.kill(15)
