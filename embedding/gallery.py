"""The gallery store: SQLite, one row per indexed item, sharing its id with the FAISS index.

Created by the index builder for the items of a training run (source 'trained'); the service
adds items (source 'added', with the uploaded image so a new model can re-embed them) and marks
deletions. Every item keeps its embedding, so the in-memory index can always be rebuilt from the
store. Writes are numbered (add_seq / deleted_seq, meta 'last_seq'): an index snapshot records
the last write it contains and start-up replays the later ones. Every write also appends one row
to `log` (seq, op, items): the ordered, gap-free change log that every serving process follows
(meta 'log_floor': writes at or below it may have left no row, e.g. before schema 3 or after a
compaction). Schema versioned in `meta`.
"""

from __future__ import annotations

import datetime as _dt
import json
import sqlite3
from collections.abc import Iterable
from pathlib import Path

from .errors import ArtifactError

STORE_SCHEMA_VERSION = 7
# Version 1 lacks items.thumbnail, 2 the log table, 3 log.token, 4 items.world, 5 the tables
# tombstones and requests, 6 the tables label_changes and review: read as is, upgraded by
# `migrate_store`.
READABLE_SCHEMAS = ("1", "2", "3", "4", "5", "6", "7")
ITEM_SOURCES = ("trained", "added")
# meta key: a store's own identity, random, given when a store is made from an index's seed (a
# copy restored from a backup keeps it); two galleries of one model made at different times
# differ in it (a carry's state names the store it follows)
STORE_ID = "store_id"

# The one schema both store backends create (service/store/sqlite.py, service/store/postgres.py):
# {ID} is the integer type of ids and sequence numbers (SQLite's INTEGER PRIMARY KEY is the rowid;
# BIGINT on PostgreSQL), {BLOB} the byte-string type (BLOB, BYTEA).
_SCHEMA = """
CREATE TABLE meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE items (
    id          {ID} PRIMARY KEY,        -- the item's id in the FAISS index (IndexIDMap2)
    label       TEXT    NOT NULL,
    source      TEXT    NOT NULL CHECK (source IN ('trained', 'added')),
    metadata    TEXT,                    -- JSON object, or NULL
    created_at  TEXT    NOT NULL,        -- ISO 8601, UTC
    embedding   {BLOB}  NOT NULL,        -- float32 x dim, little-endian, unit norm
    image       {BLOB},                  -- the uploaded image (added items, size-capped)
    image_type  TEXT,                    -- its MIME type
    thumbnail   {BLOB},                  -- small PNG/JPEG preview (embedding/thumbnails.py), or NULL
    world       {BLOB},                  -- added items: embedding/world.py statistics, float32
    add_seq     {ID} NOT NULL DEFAULT 0, -- write that added it (0: part of the built index)
    deleted_seq {ID}                     -- write that deleted it (NULL while live)
);
CREATE INDEX items_live_label ON items (label) WHERE deleted_seq IS NULL;
CREATE INDEX items_add_seq ON items (add_seq);
CREATE INDEX items_deleted_seq ON items (deleted_seq) WHERE deleted_seq IS NOT NULL;
CREATE TABLE log (
    seq   {ID} PRIMARY KEY,              -- the write's sequence number (1, 2, ... no gaps)
    op    TEXT    NOT NULL,              -- add | delete | migrate
    items INTEGER NOT NULL,              -- items it added or deleted
    at    TEXT    NOT NULL,              -- ISO 8601, UTC
    token TEXT                           -- random per write: names the history it belongs to
);
CREATE TABLE tombstones (
    kind  TEXT NOT NULL CHECK (kind IN ('label', 'trained')),
    name  TEXT NOT NULL,                 -- label: a deleted label, trained: the JSON
                                         -- [dataset, dataset_index] of a deleted trained image
    seq   {ID} NOT NULL,                 -- the write that deleted it (the last one, if several)
    PRIMARY KEY (kind, name)
);
CREATE TABLE label_changes (
    seq   {ID} NOT NULL,                 -- the write (a label's delete, a rename, a merge, a
                                         -- relabel of trained images)
    kind  TEXT NOT NULL CHECK (kind IN ('label', 'trained')),
    name  TEXT NOT NULL,                 -- label: the label whose trained items it changed,
                                         -- trained: the JSON [dataset, dataset_index] of one
    new   TEXT,                          -- their label after it (NULL: deleted)
    PRIMARY KEY (seq, kind, name)        -- one write's rows apply together (labels first)
);
CREATE TABLE review (
    id         {ID} PRIMARY KEY,         -- random, < 2^52: replicas queue without a counter
    created_at TEXT    NOT NULL,         -- ISO 8601, UTC (kept SNCA_REVIEW_RETENTION_S)
    embedding  {BLOB}  NOT NULL,         -- the query's vector under this gallery's model
    world      {BLOB},                   -- its world statistics (embedding/world.py), or NULL
    thumbnail  {BLOB},                   -- a small preview, or NULL
    image      {BLOB},                   -- the upload itself, only with SNCA_REVIEW_KEEP_IMAGES
    image_type TEXT,
    answer     TEXT,                     -- the label answered (NULL: unknown)
    nearest    TEXT,                     -- the vote's nearest label
    margin     REAL    NOT NULL,         -- top probability minus the second
    reason     TEXT,                     -- the unknown verdict, or NULL
    bytes      INTEGER NOT NULL          -- what the row holds (the queue's byte bound)
);
CREATE INDEX review_created ON review (created_at);
CREATE TABLE requests (
    key     TEXT PRIMARY KEY,            -- a write's Idempotency-Key
    digest  TEXT NOT NULL,               -- sha256 of what it asked (the same key for another
                                         -- request is refused)
    seq     {ID} NOT NULL,               -- the write it made
    outcome TEXT NOT NULL,               -- JSON: what a retry is answered
    at      TEXT NOT NULL                -- ISO 8601, UTC (kept SNCA_IDEMPOTENCY_TTL_S)
);
CREATE INDEX requests_at ON requests (at);
"""
SQL_TYPES = {
    "sqlite": {"ID": "INTEGER", "BLOB": "BLOB"},
    "postgresql": {"ID": "BIGINT", "BLOB": "BYTEA"},
}
# every column of an item row as the stores read and write it (add_seq/deleted_seq apart)
ITEM_COLUMNS = (
    "id",
    "label",
    "source",
    "metadata",
    "created_at",
    "embedding",
    "image",
    "image_type",
    "thumbnail",
    "world",
)
# Columns added after schema 1 (table, column, type): an upgrade adds the ones a store lacks.
ADDED_COLUMNS = (
    ("items", "thumbnail", "{BLOB}"),
    ("log", "token", "TEXT"),
    ("items", "world", "{BLOB}"),
)


# Tables added after schema 1 that `migrate_store` (and PostgreSQL's upgrade) create when a store
# lacks them, with their indexes: log (2) has its own step; tombstones and requests (6),
# label_changes (7: filled with the label tombstones a store had, `LABEL_CHANGES_FROM_TOMBSTONES`)
# and review (7, empty: the review queue, service/review/).
ADDED_TABLES = ("tombstones", "requests", "label_changes", "review")
LABEL_CHANGES_FROM_TOMBSTONES = (
    "INSERT INTO label_changes (seq, kind, name, new) SELECT seq, 'label', name, NULL "
    "FROM tombstones "
    "WHERE kind = 'label' ON CONFLICT DO NOTHING"
)


def added_table_statements(dialect: str = "sqlite") -> list[str]:
    """The CREATE statements (IF NOT EXISTS) of ADDED_TABLES and their indexes in `dialect`."""
    out = []
    for stmt in schema_statements(dialect):
        words = stmt.split()  # CREATE TABLE name (...) | CREATE INDEX name ON table (...)
        table = words[2] if words[1] == "TABLE" else words[4]
        if table in ADDED_TABLES:
            out.append(
                stmt.replace(f"{words[1]} {words[2]}", f"{words[1]} IF NOT EXISTS {words[2]}", 1)
            )
    return out


def schema_statements(dialect: str = "sqlite") -> list[str]:
    """The CREATE statements of a new store, in `dialect`'s types (SQL_TYPES)."""
    sql = _SCHEMA.format(**SQL_TYPES[dialect])
    return [s.strip() for s in sql.split(";") if s.strip()]


def log_table(dialect: str = "sqlite") -> str:
    """The CREATE statement of the change log as it is now (a schema-2 store gets it)."""
    return next(s for s in schema_statements(dialect) if s.startswith("CREATE TABLE log"))


def added_column_sql(table: str, column: str, type_: str, dialect: str = "sqlite") -> str:
    """ALTER TABLE adding one of ADDED_COLUMNS in `dialect`."""
    return f"ALTER TABLE {table} ADD COLUMN {column} {type_.format(**SQL_TYPES[dialect])}"


def new_token() -> str:
    """A write's token (log.token): random, so two stores that hold the same token at a seq
    share their whole history up to it (a copy of one), and a store restored from a backup
    and written past it holds other tokens from there on."""
    import os

    return os.urandom(8).hex()


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def create_store(
    path: str | Path,
    rows: Iterable[tuple],
    meta: dict[str, str] | None = None,
    batch: int = 10000,
) -> int:
    """Write a new store at `path` (which must not exist) from (id, label, source, metadata,
    embedding bytes[, thumbnail bytes or None]) rows; return the number of rows. Complete and fsynced when this returns."""
    path = Path(path)
    if path.exists():
        raise FileExistsError(path)
    conn = sqlite3.connect(path)
    try:
        conn.execute("PRAGMA journal_mode=DELETE")
        conn.execute("PRAGMA synchronous=FULL")
        for stmt in schema_statements():
            conn.execute(stmt)
        now = utc_now()
        n, chunk, max_id = 0, [], -1
        for item_id, label, source, metadata, emb, *thumb in rows:
            md = None if metadata is None else json.dumps(metadata, sort_keys=True)
            chunk.append((int(item_id), str(label), source, md, now, emb, *(thumb or [None])))
            max_id = max(max_id, int(item_id))
            if len(chunk) >= batch:
                n += _insert(conn, chunk)
                chunk = []
        n += _insert(conn, chunk)
        m = {
            "schema_version": str(STORE_SCHEMA_VERSION),
            "created_at": now,
            "last_seq": "0",
            "log_floor": "0",
            "next_id": str(max_id + 1),
            **(meta or {}),
        }
        conn.executemany("INSERT INTO meta (key, value) VALUES (?, ?)", sorted(m.items()))
        conn.commit()
    finally:
        conn.close()
    return n


def _insert(conn: sqlite3.Connection, chunk: list) -> int:
    conn.executemany(
        "INSERT INTO items (id, label, source, metadata, created_at, embedding, thumbnail) "
        "VALUES (?, ?, ?, ?, ?, ?, ?)",
        chunk,
    )
    return len(chunk)


def open_store(
    path: str | Path, readonly: bool = True, immutable: bool = False, shared: bool = False
) -> sqlite3.Connection:
    """Open a store and check its schema version. `immutable`: read without the -shm file (only
    for a file nothing can change, e.g. on a read-only filesystem); `shared`: usable from
    several threads (the caller serialises access)."""
    path = Path(path)
    if not path.is_file():
        raise ArtifactError(f"missing gallery store {path}")
    uri = f"file:{path}?mode=ro" if readonly else f"file:{path}"
    if immutable:
        uri += "&immutable=1"
    try:
        conn = sqlite3.connect(uri, uri=True, check_same_thread=not shared)
        row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    except sqlite3.DatabaseError as e:
        raise ArtifactError(f"{path} is not a readable gallery store: {e}") from None
    if row is None or row[0] not in READABLE_SCHEMAS:
        conn.close()
        raise ArtifactError(
            f"{path}: gallery store schema {row[0] if row else None!r} is not supported "
            f"(this version reads {', '.join(READABLE_SCHEMAS)})"
        )
    return conn


def migrate_store(conn: sqlite3.Connection) -> bool:
    """Upgrade a writable store to the current schema in one transaction; True if it changed.
    1 -> 2: items.thumbnail (NULL for existing items). 2 -> 3: the change log (empty; its floor
    is the last write so far, whose history lives only in items.add_seq/deleted_seq).
    3 -> 4: log.token (NULL for the writes before: a snapshot taken at one of them is not
    trusted, and start-up replays from the built index once). 4 -> 5: items.world (NULL for
    the items added before: a label of them has no world of its own until images are added).
    5 -> 6: the tables tombstones (labels and trained images deleted: a carry to another
    model deletes them there too, whichever gallery it passed through) and requests
    (Idempotency-Key records), empty. 6 -> 7: label_changes (a label's deletes and renames in
    order, which a carry applies to another index's trained items), from the label
    tombstones, and review (the review queue), empty."""
    version = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0]
    if version == str(STORE_SCHEMA_VERSION):
        return False
    conn.execute("BEGIN IMMEDIATE")
    try:
        # each step adds only what is missing: a store may have been written by a version
        # between two schema numbers (columns are only ever added)
        has_log = conn.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'log'"
        ).fetchone()
        if not has_log:  # the log table as it is now (with its token column)
            conn.execute(log_table())
            conn.execute(
                "INSERT OR REPLACE INTO meta (key, value) "
                "SELECT 'log_floor', value FROM meta WHERE key = 'last_seq'"
            )
        for table, column, type_ in ADDED_COLUMNS:
            if column not in {r[1] for r in conn.execute(f"PRAGMA table_info({table})")}:
                conn.execute(added_column_sql(table, column, type_))
        for stmt in added_table_statements():
            conn.execute(stmt)
        conn.execute(LABEL_CHANGES_FROM_TOMBSTONES)
        conn.execute(
            "INSERT OR IGNORE INTO meta (key, value) VALUES (?, ?)", (STORE_ID, new_token())
        )
        conn.execute(
            "UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(STORE_SCHEMA_VERSION),)
        )
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    return True


def label_counts(conn: sqlite3.Connection) -> dict[str, int]:
    """Live items per label."""
    return dict(
        conn.execute(
            "SELECT label, COUNT(*) FROM items WHERE deleted_seq IS NULL GROUP BY label ORDER BY label"
        )
    )


def read_meta(conn: sqlite3.Connection) -> dict[str, str]:
    return dict(conn.execute("SELECT key, value FROM meta"))
