"""The gallery store: SQLite, one row per indexed item, sharing its id with the FAISS index.

Created by the index builder for the items of a training run (source 'trained'); the service
adds and deletes items (source 'added') and keeps, for added items, the embedding and the image
so a new model can re-embed them. Schema versioned in the `meta` table.
"""

from __future__ import annotations

import datetime as _dt
import json
import sqlite3
from collections.abc import Iterable
from pathlib import Path

from .errors import ArtifactError

STORE_SCHEMA_VERSION = 1
SOURCES = ("trained", "added")

_SCHEMA = """
CREATE TABLE meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE items (
    id         INTEGER PRIMARY KEY,      -- the item's id in the FAISS index (IndexIDMap2)
    label      TEXT    NOT NULL,
    source     TEXT    NOT NULL CHECK (source IN ('trained', 'added')),
    metadata   TEXT,                     -- JSON object, or NULL
    created_at TEXT    NOT NULL,         -- ISO 8601, UTC
    embedding  BLOB,                     -- float32 x d, for added items
    image      BLOB                      -- the uploaded image, for added items
);
CREATE INDEX items_label ON items (label);
"""


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def create_store(
    path: str | Path,
    rows: Iterable[tuple[int, str, str, dict | None]],
    meta: dict[str, str] | None = None,
    batch: int = 10000,
) -> int:
    """Write a new store at `path` (which must not exist) from (id, label, source, metadata)
    rows; return the number of rows. The file is complete and fsynced when this returns."""
    path = Path(path)
    if path.exists():
        raise FileExistsError(path)
    conn = sqlite3.connect(path)
    try:
        conn.execute("PRAGMA journal_mode=DELETE")
        conn.execute("PRAGMA synchronous=FULL")
        conn.executescript(_SCHEMA)
        now = utc_now()
        m = {"schema_version": str(STORE_SCHEMA_VERSION), "created_at": now, **(meta or {})}
        conn.executemany("INSERT INTO meta (key, value) VALUES (?, ?)", sorted(m.items()))
        n, chunk = 0, []
        for item_id, label, source, metadata in rows:
            md = None if metadata is None else json.dumps(metadata, sort_keys=True)
            chunk.append((int(item_id), str(label), source, md, now))
            if len(chunk) >= batch:
                n += _insert(conn, chunk)
                chunk = []
        n += _insert(conn, chunk)
        conn.commit()
    finally:
        conn.close()
    return n


def _insert(conn: sqlite3.Connection, chunk: list) -> int:
    conn.executemany(
        "INSERT INTO items (id, label, source, metadata, created_at) VALUES (?, ?, ?, ?, ?)", chunk
    )
    return len(chunk)


def open_store(path: str | Path, readonly: bool = True) -> sqlite3.Connection:
    """Open a store and check its schema version."""
    path = Path(path)
    if not path.is_file():
        raise ArtifactError(f"missing gallery store {path}")
    uri = f"file:{path}?mode=ro" if readonly else f"file:{path}"
    try:
        conn = sqlite3.connect(uri, uri=True)
        row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    except sqlite3.DatabaseError as e:
        raise ArtifactError(f"{path} is not a readable gallery store: {e}") from None
    if row is None or row[0] != str(STORE_SCHEMA_VERSION):
        conn.close()
        raise ArtifactError(
            f"{path}: gallery store schema {row[0] if row else None!r} is not supported "
            f"(this version reads {STORE_SCHEMA_VERSION})"
        )
    return conn


def label_counts(conn: sqlite3.Connection) -> dict[str, int]:
    return dict(conn.execute("SELECT label, COUNT(*) FROM items GROUP BY label ORDER BY label"))
