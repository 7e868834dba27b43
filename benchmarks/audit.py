"""Dependency audit of the installed environment: every distribution against the public
vulnerability databases, saying for each package which source vouched for it.

    python benchmarks/audit.py [--json docs/audit.json] [--ignore ID ...] [--strict]

Sources, best first (pip-audit reads the first two; this script falls back further so an
audit still means something behind a PyPI mirror that serves only part of PyPI's JSON API):
  osv          OSV's batch API (api.osv.dev): every package at its installed version.
  pypi         PyPI's per-release JSON (/pypi/NAME/VERSION/json): its `vulnerabilities`.
  pypi-latest  PyPI's project JSON (/pypi/NAME/json), whose `vulnerabilities` are those of the
               latest release: authoritative only when the installed version is that release.
  unverified   none of the above could speak for this version (named in the report).

Exit status: 1 if any advisory (not withdrawn, not --ignore'd) matches an installed version;
with --strict also 1 if any package is unverified; else 0. Network: HTTPS to api.osv.dev and
pypi.org only; nothing is installed or changed.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

OSV = "https://api.osv.dev/v1/querybatch"
PYPI = "https://pypi.org/pypi"
SELF = {"snca"}  # this project: not on PyPI


def canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def installed() -> dict[str, str]:
    out = {}
    for d in metadata.distributions():
        name = canonical(d.metadata["Name"] or "")
        if name and name not in SELF:
            out[name] = d.version
    return dict(sorted(out.items()))


def _get_json(url: str, body: dict | None = None, timeout: float = 20) -> dict | None:
    """The decoded JSON answer, or None when the service answers 404 or cannot be reached."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.load(r)
    except (urllib.error.URLError, TimeoutError, OSError, ValueError):
        return None


def via_osv(pkgs: dict[str, str]) -> dict[str, list[dict]] | None:
    """{name: [advisory]} for every package, or None when OSV is unreachable."""
    names = list(pkgs)
    found: dict[str, list[dict]] = {}
    for s in range(0, len(names), 500):  # the batch API takes at most 1000 queries
        chunk = names[s : s + 500]
        q = {
            "queries": [
                {"package": {"name": n, "ecosystem": "PyPI"}, "version": pkgs[n]} for n in chunk
            ]
        }
        ans = _get_json(OSV, q, timeout=10)
        if ans is None:
            return None
        for n, res in zip(chunk, ans.get("results", []), strict=False):
            found[n] = [{"id": v["id"]} for v in res.get("vulns", [])]
    return found


def via_pypi(name: str, version: str) -> tuple[str, list[dict], str | None]:
    """(source, advisories, latest release) from PyPI's JSON API."""
    rel = _get_json(f"{PYPI}/{name}/{version}/json")
    if rel is not None:
        return "pypi", rel.get("vulnerabilities", []), rel["info"]["version"]
    proj = _get_json(f"{PYPI}/{name}/json")
    if proj is None:
        return "unverified", [], None
    latest = proj["info"]["version"]
    if latest == version:
        return "pypi-latest", proj.get("vulnerabilities", []), latest
    return "unverified", [], latest


def audit(pkgs: dict[str, str]) -> list[dict]:
    osv = via_osv(pkgs)
    rows = []
    if osv is not None:
        for n, v in pkgs.items():
            rows.append({"name": n, "version": v, "source": "osv", "vulns": osv.get(n, [])})
        return rows
    with ThreadPoolExecutor(8) as ex:
        answers = list(ex.map(lambda nv: via_pypi(*nv), pkgs.items()))
    for (n, v), (source, vulns, latest) in zip(pkgs.items(), answers, strict=True):
        live = [
            {"id": x["id"], "fixed_in": x.get("fixed_in", []), "summary": x.get("summary")}
            for x in vulns
            if not x.get("withdrawn")
        ]
        rows.append({"name": n, "version": v, "source": source, "latest": latest, "vulns": live})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="write the full report here")
    ap.add_argument(
        "--ignore", action="append", default=[], metavar="ID", help="an advisory judged harmless"
    )
    ap.add_argument("--strict", action="store_true", help="fail when a package is unverified")
    a = ap.parse_args(argv)

    pkgs = installed()
    rows = audit(pkgs)
    findings = [
        (r, v) for r in rows for v in r["vulns"] if v["id"] not in a.ignore
    ]  # advisories that apply
    unverified = [r for r in rows if r["source"] == "unverified"]
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["source"]] = counts.get(r["source"], 0) + 1

    print(
        f"{len(rows)} installed distributions; checked by: "
        + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    )
    for r, v in findings:
        fixed = ", ".join(v.get("fixed_in") or []) or "?"
        print(
            f"VULNERABLE {r['name']} {r['version']}: {v['id']} (fixed in {fixed}) "
            f"{v.get('summary') or ''}".rstrip()
        )
    for r in unverified:
        why = f"latest is {r['latest']}" if r.get("latest") else "not found"
        print(f"unverified {r['name']} {r['version']} ({why}; no per-version data reachable)")
    print(
        f"{len(findings)} known vulnerabilities in checked packages; "
        f"{len(unverified)} packages could not be checked"
    )
    if a.json:
        a.json.write_text(json.dumps({"packages": rows, "ignored": a.ignore}, indent=1) + "\n")
    return 1 if findings or (a.strict and unverified) else 0


if __name__ == "__main__":
    sys.exit(main())
