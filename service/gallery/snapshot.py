"""Index snapshots: the in-memory FAISS index written atomically with the last store write it
contains, so start-up replays only the writes after it.

    <data dir>/snapshot/index.faiss + snapshot.json (seq, the token of write seq, tombstones,
    fingerprint, index_id, sha256). A snapshot that is missing, corrupt, for another
    model/index, or of another history of the store (the store's write at seq has another
    token: e.g. the store was restored from a backup and written past it) is ignored: the
    service then starts from the built index and replays every write (documented fallback).

One snapshot at a time per data dir: threads of a process take the Snapshotter's lock, and
processes an exclusive flock on <data dir>/.snapshot.lock, held while a snapshot is staged
(under a name unique to the attempt) and published, and while a start removes what a crash
left behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np

from embedding.files import atomic_write_json, publish_dir
from embedding.gallery import utc_now
from embedding.index import sha256_file
from service.store.datadir import SNAPSHOT_DIR

log = logging.getLogger("snca.snapshot")


@dataclass
class Snapshot:
    index: object
    seq: int
    tombstones: set[int]


def write_snapshot(
    data_dir: Path,
    blob: np.ndarray,
    seq: int,
    tombstones: set[int],
    fingerprint: str,
    index_id: str,
    token: str | None = None,
) -> Path:
    """blob: faiss.serialize_index output; `token` the store's token of write `seq`. Written
    under a temp name, then swapped in."""
    with data_dir_lock(data_dir):
        return _write(Path(data_dir), blob, seq, tombstones, fingerprint, index_id, token)


@contextlib.contextmanager
def data_dir_lock(data_dir: Path):
    """The data dir's snapshot lock (an exclusive flock, across processes). A data dir that
    cannot be written (a read-only volume) needs none: nobody can change its snapshot."""
    try:
        Path(data_dir).mkdir(parents=True, exist_ok=True)
        fd = os.open(Path(data_dir) / ".snapshot.lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        if os.access(data_dir, os.W_OK):
            raise
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def remove_leftovers(data_dir: Path) -> list[str]:
    """What a crash in the middle of a snapshot left (staging dirs, the previous snapshot
    moved aside): removed, under the lock; if the crash came between moving the old snapshot
    aside and putting the new one in place, the old one is put back. Returns what it did."""
    d = Path(data_dir)
    if not d.is_dir() or not os.access(d, os.W_OK):
        return []
    done = []
    with data_dir_lock(d):
        olds = sorted(d.glob(f".{SNAPSHOT_DIR}.old-*"), key=lambda p: p.stat().st_mtime)
        if olds and not (d / SNAPSHOT_DIR).exists():
            os.replace(olds.pop(), d / SNAPSHOT_DIR)
            done.append(f"restored {SNAPSHOT_DIR}/ from a snapshot moved aside")
        for p in [*olds, *d.glob(f".{SNAPSHOT_DIR}.tmp-*")]:
            shutil.rmtree(p, ignore_errors=True)
            done.append(f"removed {p.name}")
    return done


def _write(data_dir, blob, seq, tombstones, fingerprint, index_id, token) -> Path:
    out = data_dir / SNAPSHOT_DIR
    stage = out.with_name(f".{SNAPSHOT_DIR}.tmp-{os.getpid()}-{os.urandom(4).hex()}")
    stage.mkdir(parents=True)
    try:
        with open(stage / "index.faiss", "wb") as f:
            f.write(blob.tobytes())
        atomic_write_json(
            stage / "snapshot.json",
            {
                "seq": seq,
                "token": token,
                "tombstones": sorted(tombstones),
                "model_fingerprint": fingerprint,
                "index_id": index_id,
                "created_at": utc_now(),
                "sha256": sha256_file(stage / "index.faiss"),
            },
        )
        publish_dir(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return out


def load_snapshot(
    data_dir: Path,
    fingerprint: str,
    index_id: str,
    max_seq: int,
    token_at: Callable[[int], str | None] = lambda seq: None,
) -> Snapshot | None:
    """The data dir's snapshot if it is usable (after removing what a crash left behind);
    `token_at(seq)`: the store's token of write seq, which the snapshot's must equal."""
    for what in remove_leftovers(data_dir):
        log.warning("snapshot leftovers: %s", what)
    with data_dir_lock(data_dir):
        return _load(Path(data_dir), fingerprint, index_id, max_seq, token_at)


def discard_snapshot(data_dir: Path, seq: int) -> bool:
    """Remove the data dir's snapshot if it is still the one at write `seq` (found to disagree
    with the store: service/startup/finishing.py load_gallery); a newer one another process wrote
    meanwhile stays. Whether it was removed."""
    d = Path(data_dir) / SNAPSHOT_DIR
    with data_dir_lock(data_dir):
        try:
            if int(json.loads((d / "snapshot.json").read_text())["seq"]) != seq:
                return False
        except (OSError, ValueError, KeyError):
            return False
        try:
            shutil.rmtree(d)
        except OSError as e:  # (a read-only data dir: the next start checks it again)
            log.warning("cannot remove the snapshot %s: %s", d, e)
            return False
    return True


def _load(
    data_dir: Path, fingerprint: str, index_id: str, max_seq: int, token_at
) -> Snapshot | None:
    d = data_dir / SNAPSHOT_DIR
    if not (d / "snapshot.json").is_file():
        return None
    try:
        meta = json.loads((d / "snapshot.json").read_text())
        if meta.get("model_fingerprint") != fingerprint or meta.get("index_id") != index_id:
            log.warning("ignoring snapshot %s: made for another model or index", d)
            return None
        if int(meta["seq"]) > max_seq:
            log.warning(
                "ignoring snapshot %s: newer (seq %s) than the store (%s)", d, meta["seq"], max_seq
            )
            return None
        seq = int(meta["seq"])
        if seq > 0 and (meta.get("token") is None or meta.get("token") != token_at(seq)):
            # written before tokens, or of another history of the store: the writes it holds
            # up to seq are not (all) the store's; replaying from the built index is always right
            log.warning(
                "ignoring snapshot %s: its write %d is not the store's write %d (the store was "
                "restored or replaced since, or the snapshot predates write tokens)",
                d,
                seq,
                seq,
            )
            return None
        if sha256_file(d / "index.faiss") != meta.get("sha256"):
            log.warning("ignoring snapshot %s: index.faiss does not match its checksum", d)
            return None
        index = faiss.read_index(str(d / "index.faiss"))
        return Snapshot(index, int(meta["seq"]), set(int(t) for t in meta.get("tombstones", [])))
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        log.warning("ignoring unreadable snapshot %s: %s", d, e)
        return None


class Snapshotter:
    """Takes snapshots one at a time: `now()` on the caller's thread (POST /admin/snapshot),
    `request()` on one background worker (after SNCA_SNAPSHOT_EVERY writes: many requests
    while one runs make one more snapshot, not a thread each)."""

    def __init__(self, take: Callable[[], tuple[int, Path]]):
        self._take = take
        self._lock = threading.Lock()
        self._wanted = threading.Event()
        self._closed = False
        self._worker = threading.Thread(target=self._run, name="snca-snapshot", daemon=True)
        self._worker.start()

    def now(self) -> tuple[int, Path]:
        with self._lock:
            return self._take()

    def request(self) -> None:
        self._wanted.set()

    def _run(self) -> None:
        while True:
            self._wanted.wait()
            if self._closed:
                return
            self._wanted.clear()
            try:
                self.now()
            except Exception:  # a failed snapshot only makes the next start replay more
                log.exception("snapshot failed")

    def close(self) -> None:
        self._closed = True
        self._wanted.set()
        self._worker.join(timeout=60)
