"""benchmarks/audit.py against a stand-in PyPI on loopback: which source it trusts for which
package, and when it fails. (The real databases are what `make audit` asks.)"""

import importlib.util
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("audit", ROOT / "benchmarks" / "audit.py")
audit = importlib.util.module_from_spec(spec)
spec.loader.exec_module(audit)

ADV = {"id": "PYSEC-1", "fixed_in": ["9"], "summary": "bad", "withdrawn": None}
# project JSON: `vulnerabilities` are those of the latest release
PROJECTS = {
    "latest-bad": {"info": {"version": "1.0"}, "vulnerabilities": [ADV]},
    "latest-ok": {"info": {"version": "2.0"}, "vulnerabilities": []},
    "old": {"info": {"version": "5.0"}, "vulnerabilities": []},
    "withdrawn": {"info": {"version": "1.0"}, "vulnerabilities": [{**ADV, "withdrawn": "2024"}]},
}
RELEASES = {("per-release", "3.1"): {"info": {"version": "3.2"}, "vulnerabilities": [ADV]}}


class PyPI(BaseHTTPRequestHandler):
    def do_GET(self):
        parts = self.path.strip("/").split("/")  # pypi/NAME[/VERSION]/json
        body = None
        if len(parts) == 3:
            body = PROJECTS.get(parts[1])
        elif len(parts) == 4:
            body = RELEASES.get((parts[1], parts[2]))
        if body is None:
            self.send_response(404)
            self.end_headers()
            return
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


@pytest.fixture
def pypi(monkeypatch):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), PyPI)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    monkeypatch.setattr(audit, "PYPI", f"http://127.0.0.1:{srv.server_port}/pypi")
    monkeypatch.setattr(audit, "OSV", "http://127.0.0.1:9/unreachable")  # discard port: refused
    yield
    srv.shutdown()


def run(monkeypatch, tmp_path, pkgs, *args):
    monkeypatch.setattr(audit, "installed", lambda: pkgs)
    out = tmp_path / "a.json"
    code = audit.main(["--json", str(out), *args])
    return code, {r["name"]: r for r in json.loads(out.read_text())["packages"]}


def test_sources_and_findings(pypi, monkeypatch, tmp_path, capsys):
    pkgs = {
        "latest-bad": "1.0",
        "latest-ok": "2.0",
        "old": "4.0",
        "per-release": "3.1",
        "withdrawn": "1.0",
        "missing": "0.1",
    }
    code, rows = run(monkeypatch, tmp_path, pkgs)
    assert code == 1  # two advisories apply
    assert rows["latest-bad"]["source"] == "pypi-latest"
    assert [v["id"] for v in rows["latest-bad"]["vulns"]] == ["PYSEC-1"]
    assert rows["latest-ok"]["source"] == "pypi-latest" and rows["latest-ok"]["vulns"] == []
    assert rows["per-release"]["source"] == "pypi" and len(rows["per-release"]["vulns"]) == 1
    # older than the latest release and no per-release JSON: nothing can vouch for it
    assert rows["old"]["source"] == "unverified" and rows["old"]["latest"] == "5.0"
    assert rows["missing"]["source"] == "unverified" and rows["missing"]["latest"] is None
    assert rows["withdrawn"]["vulns"] == []  # a withdrawn advisory is not a finding
    out = capsys.readouterr().out
    assert "VULNERABLE latest-bad 1.0: PYSEC-1 (fixed in 9)" in out
    assert "unverified old 4.0 (latest is 5.0" in out
    assert "2 known vulnerabilities in checked packages; 2 packages could not be checked" in out


def test_ignore_and_strict(pypi, monkeypatch, tmp_path):
    code, _ = run(monkeypatch, tmp_path, {"latest-bad": "1.0"}, "--ignore", "PYSEC-1")
    assert code == 0
    code, _ = run(monkeypatch, tmp_path, {"latest-ok": "2.0", "old": "4.0"})
    assert code == 0  # unverified is reported, not a failure ...
    code, _ = run(monkeypatch, tmp_path, {"latest-ok": "2.0", "old": "4.0"}, "--strict")
    assert code == 1  # ... unless asked
