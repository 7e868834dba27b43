"""Backups of a live gallery, and restoring one into an empty store (snca-gallery backup /
restore / verify).

A backup is a folder:

    OUT/gallery.sqlite     every table of the store (meta, items with their images, the log),
                           as a SQLite store whatever the source backend
    OUT/backup.json        format, the source (no secret), the log position (last_seq and that
                           write's token), the model fingerprint and index build, item counts,
                           the gallery checksum at that position, the file's sha256

Consistency: the copy is one read transaction of the source (SQLite: `VACUUM INTO`, a read
transaction that writers never wait for in WAL mode; PostgreSQL: one REPEATABLE READ, READ ONLY
transaction), so it is the store exactly as it was after write `last_seq`. The promise: every
write acknowledged before the backup started is in it (its commit came before the transaction
began), and no write is in it partly.

The checksum (`gallery_checksum`) is sha256 over every item live after write `at` (added by a
write <= at and not deleted by one <= at), in id order, every column: it can be computed on the
live source later too (rows keep the writes that added and deleted them), as long as the log
was not compacted past `at`. A restore checks the file's sha256 and the checksum before it
writes anything, and again on what it wrote, before that is committed (PostgreSQL) or renamed
into place (SQLite).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sqlite3
from collections.abc import Callable
from pathlib import Path

from embedding.errors import ArtifactError
from embedding.files import atomic_write_json, fsync_dir
from embedding.gallery import ITEM_COLUMNS, utc_now
from embedding.index import sha256_file
from service.store import sql

FORMAT = "snca-gallery-backup/1"
STORE_NAME = "gallery.sqlite"
MANIFEST = "backup.json"
ALL_COLUMNS = (*ITEM_COLUMNS, "add_seq", "deleted_seq")
LOG_COLUMNS = ("seq", "op", "items", "at", "token")
EXTRA_TABLES = {
    "tombstones": ("kind", "name", "seq"),
    "requests": ("key", "digest", "seq", "outcome", "at"),
    "label_changes": ("seq", "kind", "name", "new"),
    "review": (
        *("id", "created_at", "embedding", "world", "thumbnail", "image", "image_type"),
        *("answer", "nearest", "margin", "reason", "bytes"),
    ),
}
PAGE = 1000  # item rows read at a time (images included: bounded memory)
PARTIAL = f".{STORE_NAME}.partial"  # the copy while it is written
# what a restored store drops of its source's meta (both backends): it stands alone, with no
# other galleries' registry, alias, carry state, standby flag, seal or live epoch; it keeps its
# items, log, tombstones, label changes, the review queue, Idempotency-Key records, model,
# index build and counters
DROPPED_META = ("gallery:%", "alias:%", "carry:%", "standby", "carried_to", "live_epoch")

LIVE_AT = (
    f"SELECT {sql.COLUMNS}, add_seq FROM items WHERE add_seq <= {{p}} "
    "AND (deleted_seq IS NULL OR deleted_seq > {p}) AND id > {p} ORDER BY id LIMIT {p}"
)


def _value(h, v) -> None:
    """One column into the hash: a type tag, the length and the bytes (no two rows collide by
    shifting bytes between columns)."""
    if v is None:
        h.update(b"N")
        return
    if isinstance(v, memoryview):
        v = bytes(v)
    if isinstance(v, int):
        b, tag = str(v).encode(), b"I"
    elif isinstance(v, str):
        b, tag = v.encode(), b"T"
    else:
        b, tag = bytes(v), b"B"
    h.update(tag + len(b).to_bytes(8, "little") + b)


def gallery_checksum(conn, dialect: sql.Dialect, at: int) -> tuple[str, int]:
    """(sha256 hex, item count) of the gallery as it stood after write `at` (see the module
    docstring), read on `conn` (a sqlite3 or psycopg connection, inside the caller's
    transaction if any)."""
    floor = conn.execute(dialect.q(sql.META_KEY), ("log_floor",)).fetchone()
    if floor is not None and int(floor[0]) > at:
        raise ArtifactError(
            f"the store's log was compacted up to write {floor[0]}, past write {at}: the gallery "
            "as it stood then cannot be read any more"
        )
    h = hashlib.sha256(b"snca-gallery/1")
    after, n = -(2**62), 0
    q = dialect.q(LIVE_AT)
    while True:
        rows = conn.execute(q, (at, at, after, PAGE)).fetchall()
        for row in rows:
            for v in row:
                _value(h, v)
        n += len(rows)
        if len(rows) < PAGE:
            return h.hexdigest(), n
        after = rows[-1][0]


def _meta(conn) -> dict[str, str]:
    return dict(conn.execute("SELECT key, value FROM meta").fetchall())


def _counts(conn, at: int) -> dict[str, int]:
    live = "add_seq <= ? AND (deleted_seq IS NULL OR deleted_seq > ?)"
    rows = conn.execute(
        f"SELECT source, COUNT(*), COUNT(image) FROM items WHERE {live} GROUP BY source", (at, at)
    ).fetchall()
    by = {r[0]: (r[1], r[2]) for r in rows}
    return {
        "items": sum(v[0] for v in by.values()),
        "added": by.get("added", (0, 0))[0],
        "added_with_image": by.get("added", (0, 0))[1],
    }


def _open_out(out: Path) -> None:
    """A new or empty folder (one left by a killed backup, holding only its partial copy,
    counts as empty: the copy is removed)."""
    if out.exists() and out.is_dir():
        left = list(out.iterdir())
        if left and all(p.name == PARTIAL for p in left):
            for p in left:
                p.unlink()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ArtifactError(f"{out} exists and is not an empty folder: give a new folder")
    out.mkdir(parents=True, exist_ok=True)


def backup(backend, target: str, url: str, out: Path, say=print) -> dict:
    """Copy the live store at `target` (shown as `url`) into the new folder `out` through
    `backend.dump`; the manifest (backup.json) it wrote."""
    out = Path(out)
    _open_out(out)
    part = out / PARTIAL
    part.unlink(missing_ok=True)
    say(f"copying {url} ...")
    backend.dump(target, part)
    conn = sqlite3.connect(f"file:{part}?mode=ro", uri=True)
    try:
        meta = _meta(conn)
        at = int(meta["last_seq"])
        token = conn.execute("SELECT token FROM log WHERE seq = ?", (at,)).fetchone()
        digest, n = gallery_checksum(conn, sql.SQLITE, at)
        counts = _counts(conn, at)
    finally:
        conn.close()
    with open(part, "rb+") as f:
        os.fsync(f.fileno())
    manifest = {
        "format": FORMAT,
        "created_at": utc_now(),
        "source": url,
        "backend": backend.__name__,
        "last_seq": at,
        "token": token[0] if token else None,
        "log_floor": int(meta.get("log_floor", 0)),
        "model_fingerprint": meta.get("model_fingerprint"),
        "index_id": meta.get("index_id"),
        "dim": int(meta.get("dim", 0)),
        "schema_version": meta.get("schema_version"),
        **counts,
        "checksum": digest,
        "file": STORE_NAME,
        "file_sha256": sha256_file(part),
    }
    assert n == counts["items"]
    os.replace(part, out / STORE_NAME)
    atomic_write_json(out / MANIFEST, manifest)  # last: a folder without it is no backup
    fsync_dir(out)
    return manifest


MANIFEST_FIELDS = (
    "format",
    "last_seq",
    "token",
    "log_floor",
    "model_fingerprint",
    "index_id",
    "dim",
    "items",
    "added",
    "added_with_image",
    "checksum",
    "file_sha256",
)


def verify(folder: Path) -> dict:
    """The manifest of the backup in `folder`, once every field of it is what the file says
    (its sha256, the gallery checksum at its log position, that write's token, the floor, the
    model and index build, the dimension and the counts); ArtifactError naming what differs."""
    folder = Path(folder)
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        raise ArtifactError(f"{folder} holds no {MANIFEST}: not a (complete) backup") from None
    except (OSError, ValueError) as e:
        raise ArtifactError(f"{folder / MANIFEST} cannot be read: {e}") from None
    if not isinstance(manifest, dict):
        raise ArtifactError(f"{folder / MANIFEST} is not a JSON object")
    missing = [k for k in MANIFEST_FIELDS if k not in manifest]
    if missing:
        raise ArtifactError(
            f"{folder / MANIFEST} lacks {', '.join(missing)}: not a backup manifest"
        )
    if manifest.get("format") != FORMAT:
        raise ArtifactError(
            f"{folder} is a backup of format {manifest.get('format')!r}, not {FORMAT}"
        )
    path = folder / STORE_NAME
    if not path.is_file():
        raise ArtifactError(f"{path} is missing")
    if sha256_file(path) != manifest["file_sha256"]:
        raise ArtifactError(f"{path} does not match its sha256 in {MANIFEST}: the file changed")
    try:
        at = int(manifest["last_seq"])
    except (TypeError, ValueError):
        raise ArtifactError(
            f"{MANIFEST}: last_seq {manifest['last_seq']!r} is not a number"
        ) from None
    conn = sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True)
    try:
        meta = _meta(conn)
        token = conn.execute("SELECT token FROM log WHERE seq = ?", (at,)).fetchone()
        digest, n = gallery_checksum(conn, sql.SQLITE, at)
        counts = _counts(conn, at)
    except sqlite3.DatabaseError as e:
        raise ArtifactError(f"{path} is not a readable gallery store: {e}") from None
    finally:
        conn.close()
    found = {
        "last_seq": int(meta.get("last_seq", -1)),
        "token": token[0] if token else None,
        "log_floor": int(meta.get("log_floor", 0)),
        "model_fingerprint": meta.get("model_fingerprint"),
        "index_id": meta.get("index_id"),
        "dim": int(meta.get("dim", 0)),
        **counts,
        "checksum": digest,
    }
    wrong = [k for k, v in found.items() if manifest[k] != v]
    if n != counts["items"]:
        wrong.append("items")
    if wrong:
        raise ArtifactError(
            f"{folder / MANIFEST} does not describe {path}: "
            + "; ".join(f"{k} says {manifest[k]!r}, the file {found[k]!r}" for k in wrong)
        )
    return manifest


def restore(backend, folder: Path, target: str, url: str, say=print) -> dict:
    """Verify the backup in `folder`, then write it into the empty store at `target` (shown as
    `url`) through `backend.load`, which calls back to check the checksum of what it wrote
    before making it visible; the manifest."""
    manifest = verify(folder)
    at, want = int(manifest["last_seq"]), manifest["checksum"]
    say(f"backup verified: {manifest['items']} items at write {at}; restoring into {url} ...")

    def check(conn, dialect: sql.Dialect) -> None:
        # a restored store stands alone (DROPPED_META; items and log are untouched)
        for pattern in DROPPED_META:
            conn.execute(dialect.q("DELETE FROM meta WHERE key LIKE {p}"), (pattern,))
        got, _ = gallery_checksum(conn, dialect, at)
        if got != want:
            raise ArtifactError(f"the restored gallery's checksum {got[:16]} is not the backup's")

    backend.load(target, Path(folder) / STORE_NAME, check)
    return manifest


def copy_rows(
    src, src_d: sql.Dialect, write: Callable[[str, tuple[str, ...], list[tuple]], None]
) -> None:
    """Every row of meta, items and log on `src`, handed to `write(table, columns, rows)` a
    page at a time (items in id order)."""
    write("meta", ("key", "value"), src.execute("SELECT key, value FROM meta").fetchall())
    cols = ", ".join(ALL_COLUMNS)
    after = -(2**62)
    q = src_d.q(f"SELECT {cols} FROM items WHERE id > {{p}} ORDER BY id LIMIT {{p}}")
    while rows := src.execute(q, (after, PAGE)).fetchall():
        write("items", ALL_COLUMNS, rows)
        after = rows[-1][0]
    write("log", LOG_COLUMNS, src.execute(f"SELECT {', '.join(LOG_COLUMNS)} FROM log").fetchall())
    for table, cols in EXTRA_TABLES.items():  # (a backup of an older schema lacks them)
        if _has_table(src, src_d, table):
            write(table, cols, src.execute(f"SELECT {', '.join(cols)} FROM {table}").fetchall())


def _has_table(conn, dialect: sql.Dialect, table: str) -> bool:
    q = (
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?"
        if dialect.name == "sqlite"
        else "SELECT 1 FROM information_schema.tables WHERE table_name = %s "
        "AND table_schema = current_schema()"
    )
    return conn.execute(q, (table,)).fetchone() is not None


@contextlib.contextmanager
def new_sqlite(path: Path):
    """A new SQLite store file at `path` with the schema's tables, in one transaction."""
    from embedding.gallery import schema_statements

    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("BEGIN")
        for stmt in schema_statements("sqlite"):
            conn.execute(stmt)
        yield conn
        conn.execute("COMMIT")
    finally:
        conn.close()
