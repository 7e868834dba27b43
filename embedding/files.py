"""Files written whole or not at all, and JSON read with clear errors: what every stage and the
service's store share. Standard library only (no torch: `snca-gallery`'s store commands and the
service's store import this, not embedding/artifacts.py).

An atomic write: temp file in the same folder, fsync, os.replace, fsync of the folder.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from .errors import ArtifactError


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes 0600; artifacts are meant to be shared
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def publish_dir(staging: str | os.PathLike, out: str | os.PathLike) -> None:
    """fsync every file in `staging`, then swap it into place as `out` (an existing `out` is
    moved aside first and removed only after the new one is in place)."""
    import shutil

    staging, out = Path(staging), Path(out)
    for f in staging.iterdir():
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fsync_dir(staging)
    old = None
    if out.exists():
        # unique per call: two publishers (threads or processes) never share a name
        old = out.with_name(f".{out.name}.old-{os.getpid()}-{os.urandom(4).hex()}")
        os.replace(out, old)
    os.replace(staging, out)
    fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def read_json(path: str | os.PathLike) -> Any:
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ArtifactError(f"missing file: {path}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(f"cannot read {path}: {e}") from None


def check_format_version(where, kind: str, found, supported, hint: str = "") -> None:
    """Every artifact carries its format's version: one this code does not read is refused,
    naming the file, what it holds and the version this code reads (`hint`: what to do)."""
    if found != supported:
        raise ArtifactError(
            f"{where}: {kind} format_version {found!r} is not supported "
            f"(this version reads {supported}){hint}"
        )
