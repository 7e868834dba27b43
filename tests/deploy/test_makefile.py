"""`make run` a second time only serves: it trains when there is no finished run of EPOCHS
epochs in OUT (or RETRAIN=1), and asks the index builder to keep a current index. The README's
command itself, with PY replaced by a recorder (python -c still runs, so the Makefile's own
check of the run dir is the real one)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _make(tmp: Path, out: Path, *args: str) -> list[str]:
    """Run `make run` and return the commands PY was asked to run (one line each)."""
    log = tmp / "calls.log"
    log.unlink(missing_ok=True)
    py = tmp / "py"
    py.write_text(
        f'#!/bin/sh\nif [ "$1" = "-c" ]; then exec {sys.executable} "$@"; fi\necho "$*" >> {log}\n'
    )
    py.chmod(0o755)
    venv = tmp / "venv"
    venv.mkdir(exist_ok=True)
    stamp = venv / ".snca-installed"  # installed: newer than pyproject.toml
    stamp.touch()
    now = time.time() + 10
    os.utime(stamp, (now, now))
    p = subprocess.run(
        ["make", "-s", "run", f"PY={py}", f"VENV={venv}", f"OUT={out}", "PORT=1", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    return log.read_text().splitlines() if log.exists() else []


def _trains(calls: list[str]) -> bool:
    return any(c.startswith("-m training") for c in calls)


def test_make_run_reuses_a_finished_run_and_retrains_when_asked(tmp_path):
    out = tmp_path / "runs" / "demo"
    calls = _make(tmp_path, out)
    assert _trains(calls)  # nothing there yet
    index = next(c for c in calls if c.startswith("-m index_builder"))
    assert "--reuse" in index and "--overwrite" not in index
    assert calls[-1].startswith("-m service") and "--thumbnails" in calls[-1]

    out.mkdir(parents=True)
    (out / "summary.json").write_text(json.dumps({"epochs": 3}))
    calls = _make(tmp_path, out)
    assert not _trains(calls) and calls[-1].startswith("-m service")  # only serves
    assert _trains(_make(tmp_path, out, "RETRAIN=1"))
    assert _trains(_make(tmp_path, out, "EPOCHS=5"))  # another budget than the run's
