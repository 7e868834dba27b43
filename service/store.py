"""The service's durable gallery store: SQLite in WAL mode with synchronous=FULL.

A write returns only after its transaction is committed, so an acknowledged write survives a
kill -9 or a power cut. Every write gets the next sequence number (meta 'last_seq'); items carry
the write that added them (add_seq) and the write that deleted them (deleted_seq), so an index
snapshot that records the last write it contains can be brought up to date by replaying the
writes after it. The store starts as a copy of the index dir's store (the trained items).
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from embedding.artifacts import fsync_dir
from embedding.errors import ArtifactError
from embedding.gallery import STORE_SCHEMA_VERSION, migrate_store, open_store, read_meta, utc_now


class StoreUnavailable(Exception):
    """The store cannot be written (disk full, read-only, I/O error): answer 503, keep serving."""


@dataclass
class Item:
    id: int
    label: str
    source: str
    metadata: dict | None
    embedding: np.ndarray  # (d,) float32


def _blob(v: np.ndarray) -> bytes:
    return np.ascontiguousarray(v, dtype="<f4").tobytes()


def _vec(b: bytes) -> np.ndarray:
    return np.frombuffer(b, dtype="<f4")


class GalleryStore:
    def __init__(self, path: Path, seed: Path, model_fingerprint: str, index_id: str):
        self.path = Path(path)
        if not self.path.exists():
            self._seed(seed)
        self._lock = threading.Lock()
        # None while writable; else why not (read-only filesystem): reads go on, writes get 503
        self.read_only: str | None = None
        if self._on_read_only_fs():
            self.conn = self._open_read_only()
        else:
            probe = open_store(self.path, readonly=True)  # schema version check
            probe.close()
            self.conn = self._open_writable()
        meta = read_meta(self.conn)
        if meta.get("model_fingerprint") != model_fingerprint:
            raise ArtifactError(
                f"gallery store {self.path} belongs to model {meta.get('model_fingerprint', '?')[:19]}"
                f"..., not to the served model {model_fingerprint[:19]}...: point SNCA_STORE at a "
                "new file, or re-embed the gallery for this model"
            )
        if meta.get("index_id") != index_id:
            raise ArtifactError(
                f"gallery store {self.path} was seeded from another index build "
                f"({meta.get('index_id')}) than {index_id}: use the matching index dir or a new store"
            )
        self.dim = int(meta.get("dim", "0"))

    def _on_read_only_fs(self) -> bool:
        """The store's directory or file cannot be written (EROFS, a `:ro` volume, permissions)."""
        return not (os.access(self.path.parent, os.W_OK) and os.access(self.path, os.W_OK))

    def _open_writable(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            conn.execute("PRAGMA busy_timeout=5000")
            migrate_store(conn)  # a store written by an older version: add the new columns
        except sqlite3.DatabaseError as e:
            conn.close()
            raise ArtifactError(f"cannot open gallery store {self.path} for writing: {e}") from None
        return conn

    def _open_read_only(self) -> sqlite3.Connection:
        """Serve reads from a store that cannot be written. A WAL database needs its -shm file to
        be read: with -wal/-shm present (after a crash) SQLite reads them; with neither (after a
        clean stop) the file alone is the whole store, and `immutable` lets SQLite skip the -shm
        it cannot create. A -wal without -shm cannot be read safely: refuse, naming the fix."""
        wal, shm = (self.path.with_name(self.path.name + x) for x in ("-wal", "-shm"))
        has_wal = wal.exists() and wal.stat().st_size > 0
        if has_wal and not shm.exists():
            raise ArtifactError(
                f"gallery store {self.path} is read-only and has un-merged writes in {wal.name}: "
                "make its directory writable so SQLite can recover them"
            )
        conn = open_store(self.path, readonly=True, immutable=not has_wal, shared=True)
        version = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        if version[0] != str(STORE_SCHEMA_VERSION):
            conn.close()
            raise ArtifactError(
                f"gallery store {self.path} has schema {version[0]} and is read-only, so it "
                f"cannot be upgraded to {STORE_SCHEMA_VERSION}: make its directory writable"
            )
        self.read_only = f"the gallery store {self.path} is on a read-only filesystem"
        return conn

    def _ensure_writable(self) -> None:
        """Called under the lock before a write: once the filesystem is writable again, switch
        to a writable connection; until then refuse without touching anything."""
        if self.read_only is None:
            return
        if self._on_read_only_fs():
            raise StoreUnavailable(f"{self.read_only} (read-only)")
        # Close the read-only connection first: SQLite shares one -shm mapping per file within
        # a process, and the one it opened read-only would make the new connection read-only.
        self.conn.close()
        try:
            self.conn, self.read_only = self._open_writable(), None
        except ArtifactError as e:
            self.conn = self._open_read_only()
            raise StoreUnavailable(str(e)) from None

    def _seed(self, seed: Path) -> None:
        """Copy the built store into place atomically (temp file, fsync, rename)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.seed-{os.getpid()}")
        shutil.copyfile(seed, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fsync_dir(self.path.parent)

    # ------------------------------------------------------------------ reads
    def meta(self) -> dict[str, str]:
        with self._lock:
            return read_meta(self.conn)

    def last_seq(self) -> int:
        return int(self.meta()["last_seq"])

    def live_items(self, after_seq: int = -1) -> list[Item]:
        """Live items added after write `after_seq` (-1: all), in id order."""
        with self._lock:
            rows = self.conn.execute(
                "SELECT id, label, source, metadata, embedding FROM items "
                "WHERE deleted_seq IS NULL AND add_seq > ? ORDER BY id",
                (after_seq,),
            ).fetchall()
        return [Item(r[0], r[1], r[2], None, _vec(r[4])) for r in rows]

    def item_count(self) -> dict[str, int]:
        """Live items per source."""
        with self._lock:
            return dict(
                self.conn.execute(
                    "SELECT source, COUNT(*) FROM items WHERE deleted_seq IS NULL GROUP BY source"
                )
            )

    def deleted_after(self, seq: int) -> list[tuple[int, str, np.ndarray, int]]:
        """(id, label, embedding, add_seq) of items deleted by a write after `seq`."""
        with self._lock:
            rows = self.conn.execute(
                "SELECT id, label, embedding, add_seq FROM items WHERE deleted_seq > ?", (seq,)
            ).fetchall()
        return [(r[0], r[1], _vec(r[2]), r[3]) for r in rows]

    def items(self, ids: list[int]) -> dict[int, tuple[str, str, dict | None, bool]]:
        """id -> (label, source, metadata, has a thumbnail) for the live items among `ids`."""
        out = {}
        for s in range(0, len(ids), 500):  # SQLite caps the number of bound parameters
            chunk = [int(i) for i in ids[s : s + 500]]
            q = ",".join("?" * len(chunk))
            with self._lock:
                rows = self.conn.execute(
                    f"SELECT id, label, source, metadata, thumbnail IS NOT NULL FROM items "
                    f"WHERE deleted_seq IS NULL AND id IN ({q})",
                    chunk,
                ).fetchall()
            out.update(
                {r[0]: (r[1], r[2], json.loads(r[3]) if r[3] else None, bool(r[4])) for r in rows}
            )
        return out

    def with_thumbnails(self, ids: list[int]) -> set[int]:
        """The live items among `ids` (at most a few hundred) that have a thumbnail."""
        chunk = [int(i) for i in ids[:500]]
        if not chunk:
            return set()
        q = ",".join("?" * len(chunk))
        with self._lock:
            rows = self.conn.execute(
                f"SELECT id FROM items WHERE deleted_seq IS NULL AND thumbnail IS NOT NULL "
                f"AND id IN ({q})",
                chunk,
            ).fetchall()
        return {r[0] for r in rows}

    def thumbnail(self, item_id: int) -> bytes | None:
        """The thumbnail of a live item, or None (no such item, deleted, or none kept)."""
        with self._lock:
            row = self.conn.execute(
                "SELECT thumbnail FROM items WHERE id = ? AND deleted_seq IS NULL", (int(item_id),)
            ).fetchone()
        return None if row is None else row[0]

    def live_ids_of(self, label: str) -> list[int]:
        with self._lock:
            return [
                r[0]
                for r in self.conn.execute(
                    "SELECT id FROM items WHERE deleted_seq IS NULL AND label = ?", (label,)
                )
            ]

    def integrity_check(self) -> str:
        with self._lock:
            return self.conn.execute("PRAGMA integrity_check").fetchone()[0]

    # ------------------------------------------------------------------ writes
    def _write(self, fn):
        """Run fn(conn, seq) in one IMMEDIATE transaction with the next sequence number."""
        with self._lock:
            self._ensure_writable()
            try:
                self.conn.execute("BEGIN IMMEDIATE")
                try:
                    seq = (
                        int(
                            self.conn.execute(
                                "SELECT value FROM meta WHERE key = 'last_seq'"
                            ).fetchone()[0]
                        )
                        + 1
                    )
                    result = fn(self.conn, seq)
                    self.conn.execute(
                        "UPDATE meta SET value = ? WHERE key = 'last_seq'", (str(seq),)
                    )
                    self.conn.execute("COMMIT")
                except BaseException:
                    self.conn.execute("ROLLBACK")
                    raise
            except sqlite3.OperationalError as e:
                raise StoreUnavailable(f"the gallery store cannot be written: {e}") from None
            except sqlite3.DatabaseError as e:
                raise StoreUnavailable(f"the gallery store failed: {e}") from None
            return seq, result

    def add(
        self,
        label: str,
        embeddings: np.ndarray,
        metadata: list[dict | None],
        images: list[tuple[bytes, str] | None],
        thumbnails: list[bytes | None] | None = None,
    ) -> tuple[int, list[int]]:
        """Insert len(embeddings) items of `label`; return (seq, ids)."""
        thumbs = thumbnails if thumbnails is not None else [None] * len(embeddings)
        now = utc_now()

        def fn(conn, seq):
            next_id = int(
                conn.execute("SELECT value FROM meta WHERE key = 'next_id'").fetchone()[0]
            )
            ids = list(range(next_id, next_id + len(embeddings)))
            conn.executemany(
                "INSERT INTO items (id, label, source, metadata, created_at, embedding, image, "
                "image_type, thumbnail, add_seq) VALUES (?, ?, 'added', ?, ?, ?, ?, ?, ?, ?)",
                [
                    (
                        i,
                        label,
                        None if md is None else json.dumps(md, sort_keys=True),
                        now,
                        _blob(e),
                        None if img is None else img[0],
                        None if img is None else img[1],
                        th,
                        seq,
                    )
                    for i, e, md, img, th in zip(
                        ids, embeddings, metadata, images, thumbs, strict=True
                    )
                ],
            )
            conn.execute(
                "UPDATE meta SET value = ? WHERE key = 'next_id'", (str(next_id + len(embeddings)),)
            )
            return ids

        return self._write(fn)

    def delete(self, ids: list[int]) -> tuple[int, list[tuple[int, str, np.ndarray, str]]]:
        """Mark the live items among `ids` deleted; return (seq, [(id, label, embedding, source)])."""

        def fn(conn, seq):
            out = []
            for s in range(0, len(ids), 500):  # SQLite caps the number of bound parameters
                chunk = [int(i) for i in ids[s : s + 500]]
                q = ",".join("?" * len(chunk))
                rows = conn.execute(
                    f"SELECT id, label, embedding, source FROM items "
                    f"WHERE deleted_seq IS NULL AND id IN ({q})",
                    chunk,
                ).fetchall()
                conn.executemany(
                    "UPDATE items SET deleted_seq = ? WHERE id = ?", [(seq, r[0]) for r in rows]
                )
                out += [(r[0], r[1], _vec(r[2]), r[3]) for r in rows]
            return out

        return self._write(fn)

    def close(self) -> None:
        with self._lock:
            self.conn.close()
