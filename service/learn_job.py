"""`snca-gallery learn` started from the service (POST /admin/learn, the page's Labels tab): one
background process at a time per data dir, at low priority (nice 10: serving goes first), its
output in DATA_DIR/learn/learn.log, its state in the learned run dir's learn.json. The command
itself holds DATA_DIR/learn/learn.lock (an flock) while it runs, whoever started it (the page or
a terminal), so a second start, from anywhere on that data dir, is told the first one runs."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

LOG_LINES = 40  # the last lines of its output GET /admin/learn shows
_started: dict[str, subprocess.Popen] = {}  # data dir -> the learn this process started


def job_dir(data_dir: Path) -> Path:
    return Path(data_dir) / "learn"


@contextlib.contextmanager
def held(data_dir: Path):
    """The learn lock of `data_dir`, held for the block; yields False (and holds nothing)
    when another learn holds it."""
    d = job_dir(data_dir)
    d.mkdir(parents=True, exist_ok=True)
    fd = os.open(d / "learn.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "started_at": time.time()}).encode())
        yield True
    finally:
        os.close(fd)


def running(data_dir: Path) -> dict | None:
    """{pid, started_at} of the learn that holds the lock now (None: none runs)."""
    path = job_dir(data_dir) / "learn.lock"
    if not path.is_file():
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            with contextlib.suppress(ValueError, OSError):
                return json.loads(path.read_text() or "{}")
            return {}
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def start(settings) -> dict:
    """Start `snca-gallery learn` on the served gallery in the background (nice 10); its
    status. The command takes the lock itself: a start while one runs is refused by status()
    before it gets here (and by the command, had two starts raced)."""
    d = job_dir(settings.data_dir)
    d.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "service.tools.gallery_tool", "learn", "--no-progress"]
    cmd += ["--model", str(settings.model), "--index", str(settings.index)]
    cmd += ["--data-dir", str(settings.data_dir)]
    cmd += ["--store", settings.store_url] if settings.store_url else []
    log = open(d / "learn.log", "w")  # noqa: SIM115 (the child holds it)
    try:
        p = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            preexec_fn=lambda: os.nice(10),  # (serving first)
            start_new_session=True,  # (a stopped server does not take it down)
        )
    finally:
        log.close()
    _started[str(settings.data_dir)] = p  # (running until it exits, lock taken or not yet)
    (d / "job.json").write_text(json.dumps({"pid": p.pid, "started_at": time.time()}))
    return {"started": True, "pid": p.pid}


def busy(data_dir: Path) -> dict | None:
    """running(data_dir), or the learn this process started that has not taken the lock yet
    (it is starting up)."""
    now = running(data_dir)
    p = _started.get(str(data_dir))
    if now is None and p is not None and p.poll() is None:
        return {"pid": p.pid, "starting": True}
    return now


def status(settings) -> dict:
    """What the last learn started from here did: running or not, its last output lines,
    the learned run's state (learn.json) when its output names it."""
    d = job_dir(settings.data_dir)
    now = busy(settings.data_dir)
    try:
        lines = (d / "learn.log").read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    out = {"running": now is not None, "log": lines[-LOG_LINES:]}
    if now:
        out["pid"] = now.get("pid")
        out["started_at"] = now.get("started_at")
    with contextlib.suppress(OSError, ValueError):
        out["job"] = json.loads((d / "job.json").read_text())
    return out
