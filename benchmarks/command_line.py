"""What the benchmarks' command lines share: a parser whose help is the module's docstring, the
options most of them take (--port, --seconds, --rounds, --json), and the --json report.

Each benchmark names the shared options it takes and their defaults:

    ap = parser(__doc__, port=8919, seconds=10.0, rounds=3)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

_SHARED = {
    "port": (int, "the service's loopback port"),
    "seconds": (float, "seconds a measurement runs"),
    "rounds": (int, "rounds of the compared settings, alternating"),
}


def parser(
    doc: str | None, *, prog: str | None = None, report: bool = True, **shared
) -> argparse.ArgumentParser:
    """An ArgumentParser showing `doc` as written (its examples and tables), with the shared
    options named in `shared` (name=default, each from _SHARED) and --json unless `report` is
    False (a benchmark that writes no report)."""
    unknown = set(shared) - set(_SHARED)
    if unknown:
        raise TypeError(f"no shared option {sorted(unknown)}; known: {sorted(_SHARED)}")
    ap = argparse.ArgumentParser(
        prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    for name, default in shared.items():
        kind, what = _SHARED[name]
        ap.add_argument(f"--{name}", type=kind, default=default, help=f"{what} ({default})")
    if report:
        ap.add_argument("--json", type=Path, help="also write the results here (JSON)")
    return ap


def write_report(path: Path | str | None, results, indent: int = 2) -> None:
    """The --json report: `results` as JSON (paths and other objects as their str), nothing when
    no path was given."""
    if path:
        Path(path).write_text(json.dumps(results, indent=indent, default=str) + "\n")
