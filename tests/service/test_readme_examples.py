"""Every curl example of the README, as pasted, against a real server: each runs (curl exit 0)
and answers no problem. The examples name runs/demo/examples/ (what `make run` writes) and
port 8000; here they run in a directory holding those files, against a free port."""

import json
import re
import subprocess
from pathlib import Path

from service.tools.examples import write_examples

from .conftest import Server

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_curl_commands() -> list[str]:
    """The shell lines of the README's code blocks that call curl, continuation lines joined,
    in the README's order."""
    out = []
    for block in re.findall(r"```(?:bash|sh)?\n(.*?)```", README.read_text(), re.S):
        text = re.sub(r"\\\n\s*", " ", block)
        out += [line.strip() for line in text.splitlines() if re.search(r"\bcurl ", line)]
    return out


def test_every_curl_example_of_the_readme_runs_as_pasted(base_run, tmp_path):
    commands = readme_curl_commands()
    assert len(commands) >= 6 and any("/gallery/add" in c for c in commands)
    write_examples(tmp_path / "runs" / "demo" / "examples")
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
