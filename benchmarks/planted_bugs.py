"""Are the checkers checked? Each bug of tests/planted/*.patch planted in a scratch copy of this
tree, then the short checker run that CI makes (tests/service/test_history.py at its default
SNCA_HISTORY_SECONDS, tests/service/store/test_carry_model.py at its default examples) run there:
a bug that leaves both green was missed. Prints, per bug and run, which checker caught it (its
seed and the first line of what it found) and how long it took; `--json` writes them.

    python benchmarks/planted_bugs.py                  # every bug once (~12 min on 2 cores)
    python benchmarks/planted_bugs.py --runs 3 --bugs records_not_followed
    make planted                                       # the same, RUNS=1

A new write path gets a patch here too: the smallest change that loses what it must keep
(made with `diff -u` against the tree, paths a/... b/...; the first line of the patch that
starts with `# ` says what it plants). A patch that no longer applies is reported as such:
refresh it with the code it plants into. Exit status 1 when a bug was missed or did not apply.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLANTED = ROOT / "tests" / "planted"
# the short checker runs, as `make test` runs them (a module each: its own pytest process)
CHECKERS = {
    "history": "tests/service/test_history.py",
    "carry model": "tests/service/store/test_carry_model.py",
}


def scratch_copy() -> Path:
    """This tree's files (tracked and untracked, not ignored) copied to a temp dir."""
    out = Path(tempfile.mkdtemp(prefix="snca-planted-"))
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for f in files:
        if not f:
            continue
        src = ROOT / f.decode()
        if src.is_file():
            dst = out / f.decode()
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    return out


def what(patch: Path) -> str:
    for line in patch.read_text().splitlines():
        m = re.search(r"PLANTED: (.*)$", line)
        if line.startswith("+") and m:
            return m.group(1).strip()
    return patch.stem


def run_checker(tree: Path, name: str, path: str, timeout: float) -> dict:
    """One checker module in `tree` (its own pytest process); what it said."""
    t0 = time.monotonic()
    # (a failure reported as found: hypothesis's shrinking of the carry model's takes minutes)
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONUNBUFFERED="1", SNCA_CARRY_SHRINK="0")
    try:
        p = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-s", "-x", "-p", "no:cacheprovider", path],
            cwd=tree,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
        out, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        out, rc = (e.stdout or b"").decode(errors="replace"), -1
    seeds = re.findall(r"SNCA_HISTORY_SEED=(\d+)", out)
    found = [ln.strip() for ln in out.splitlines() if ln.startswith("E ")]
    return {
        "checker": name,
        "caught": rc != 0,
        "rc": rc,
        "seconds": round(time.monotonic() - t0, 1),
        "seeds": sorted(set(seeds)),
        "found": found[0][:400] if found else None,
    }


def plant(patch: Path, runs: int, timeout: float, say) -> list[dict]:
    results = []
    for k in range(runs):
        tree = scratch_copy()
        try:
            p = subprocess.run(
                ["git", "apply", str(patch)], cwd=tree, capture_output=True, text=True
            )
            if p.returncode != 0:
                say(f"{patch.stem}: the patch does not apply: {p.stderr.strip()}")
                return [{"bug": patch.stem, "applied": False, "error": p.stderr.strip()}]
            t0 = time.monotonic()
            checks = []
            for name, path in CHECKERS.items():
                c = run_checker(tree, name, path, timeout)
                checks.append(c)
                say(
                    f"{patch.stem} run {k + 1}: {name}: "
                    + ("CAUGHT" if c["caught"] else "missed")
                    + f" in {c['seconds']:.0f} s (seeds {', '.join(c['seeds']) or '-'})"
                    + (f": {c['found']}" if c["found"] else "")
                )
            results.append(
                {
                    "bug": patch.stem,
                    "what": what(patch),
                    "run": k + 1,
                    "applied": True,
                    "caught": any(c["caught"] for c in checks),
                    "seconds": round(time.monotonic() - t0, 1),
                    "checks": checks,
                }
            )
        finally:
            shutil.rmtree(tree, ignore_errors=True)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bugs", nargs="*", help="patch names (default: every tests/planted/*.patch)")
    ap.add_argument("--runs", type=int, default=1, help="scratch runs of each bug")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per checker run")
    ap.add_argument("--json", type=Path, help="write the results here")
    a = ap.parse_args(argv)
    patches = sorted(PLANTED.glob("*.patch"))
    if a.bugs:
        patches = [p for p in patches if p.stem in a.bugs]
        if len(patches) != len(a.bugs):
            ap.error(f"unknown bug among {a.bugs}: {[p.stem for p in PLANTED.glob('*.patch')]}")
    out = []
    for p in patches:
        print(f"planting {p.stem}: {what(p)}", flush=True)
        out += plant(p, a.runs, a.timeout, lambda s: print("  " + s, flush=True))
    caught = sum(1 for r in out if r.get("caught"))
    print(f"caught {caught} of {len(out)} planted runs")
    if a.json:
        a.json.write_text(json.dumps({"results": out}, indent=2) + "\n")
    return 0 if out and all(r.get("caught") for r in out) else 1


if __name__ == "__main__":
    sys.exit(main())
