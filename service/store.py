"""The service's durable gallery store: SQLite in WAL mode with synchronous=FULL.

A write returns only after its transaction is committed, so an acknowledged write survives a
kill -9 or a power cut. Every write gets the next sequence number (meta 'last_seq'); items carry
the write that added them (add_seq) and the write that deleted them (deleted_seq), so an index
snapshot that records the last write it contains can be brought up to date by replaying the
writes after it. The store starts as a copy of the index dir's store (the trained items).

It is also the change log that every serving process follows (several workers share one store
file in WAL mode): each write appends a row to `log` with the next seq inside the same IMMEDIATE
transaction, and SQLite lets one writer at a time hold it, so seqs are gap-free in commit order.
`changes_after(v)` reads, in one read transaction, the writes after v in seq order.
"""

from __future__ import annotations

import contextlib
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
from embedding.gallery import (
    STORE_SCHEMA_VERSION,
    migrate_store,
    new_token,
    open_store,
    read_meta,
    utc_now,
)


class StoreUnavailable(Exception):
    """The store cannot be written (disk full, read-only, I/O error): answer 503, keep serving."""


class StoreCarriedAway(StoreUnavailable):
    """The store was carried to another model (service/migration.py sealed it): this process
    serves a model whose gallery lives elsewhere now and must be restarted with the new one."""


# meta key set on a store that a migration carried to a new model, in the same transaction as
# its last write: every later write on it is refused (JSON: fingerprint, index_id, at)
CARRIED_TO = "carried_to"


def carried_away_message(value: str) -> str:
    try:
        to = json.loads(value)
        what = f"model {to.get('model_fingerprint', '?')[:19]}... (index {to.get('index_id')})"
    except (ValueError, AttributeError):
        what = "another model"
    return (
        f"the gallery was carried to {what} by another process; this process serves the model "
        "it had before and can no longer write it: restart it with the new model"
    )


class NothingChanged(Exception):
    """Raised inside a write transaction that turned out to change nothing: rolled back, no
    seq taken (a delete of ids that are not live)."""


@dataclass
class Item:
    id: int
    label: str
    source: str
    metadata: dict | None
    embedding: np.ndarray  # (d,) float32
    add_seq: int = 0
    world: np.ndarray | None = None  # (D,) float32 world statistics (added items; else None)


@dataclass
class StoredItem:
    """An item as stored, every column (what a migration carries to a new store)."""

    id: int
    label: str
    source: str
    metadata: str | None  # JSON text, as stored
    created_at: str
    embedding: bytes  # float32 x dim, little-endian
    image: bytes | None
    image_type: str | None
    thumbnail: bytes | None
    world: bytes | None = None  # float32 x D, little-endian (embedding/world.py), added items


@dataclass
class ItemRow:
    """What GET /gallery/items tells of an item."""

    id: int
    label: str
    source: str
    metadata: dict | None
    created_at: str
    has_thumbnail: bool


@dataclass
class Change:
    """One write of the log, as a follower applies it: an add (ids, label, embeddings) or a
    delete (rows: id, label, embedding, source)."""

    seq: int
    op: str  # add | delete
    ids: list[int]
    label: str | None = None
    embeddings: np.ndarray | None = None  # (n, d) float32, adds
    rows: list[tuple[int, str, np.ndarray, str]] | None = None  # deletes
    worlds: list[np.ndarray | None] | None = None  # adds: each item's world statistics


@dataclass
class ChangeSet:
    """The writes after a version, read in one transaction: `last_seq` the store's version then,
    `floor` the log's floor (a follower below it cannot be brought up to date from the log),
    `carried_to` set when the store was carried to another model (CARRIED_TO)."""

    last_seq: int
    floor: int
    changes: list[Change]
    carried_to: str | None = None


def changes_from_rows(rows, after: int) -> list[Change]:
    """Changes in seq order from (id, label, source, embedding, add_seq, deleted_seq, world)
    rows of the items added or deleted by a write after `after`."""
    adds: dict[int, Change] = {}
    dels: dict[int, Change] = {}
    for item_id, label, source, emb, add_seq, deleted_seq, world in rows:
        v = _vec(emb)
        if add_seq > after:
            c = adds.setdefault(add_seq, Change(add_seq, "add", [], label, None, worlds=[]))
            c.ids.append(item_id)
            c.rows = (c.rows or []) + [(item_id, label, v, source)]
            c.worlds.append(None if world is None else _vec(world))
        if deleted_seq is not None and deleted_seq > after:
            c = dels.setdefault(deleted_seq, Change(deleted_seq, "delete", [], rows=[]))
            c.ids.append(item_id)
            c.rows.append((item_id, label, v, source))
    out = []
    for c in adds.values():
        c.embeddings = np.stack([r[2] for r in c.rows]).astype(np.float32)
        c.rows = None
        out.append(c)
    return sorted([*out, *dels.values()], key=lambda c: (c.seq, c.op != "add"))


CHANGE_QUERY = (
    "SELECT id, label, source, embedding, add_seq, deleted_seq, world FROM items "
    "WHERE add_seq > {p} UNION ALL "
    "SELECT id, label, source, embedding, add_seq, deleted_seq, NULL FROM items "
    "WHERE deleted_seq > {p} AND add_seq <= {p} ORDER BY id"
)


WAL_FILES = ("-wal", "-shm")

_COLUMNS = "id, label, source, metadata, created_at, embedding, image, image_type, thumbnail, world"


def _blob(v: np.ndarray) -> bytes:
    return np.ascontiguousarray(v, dtype="<f4").tobytes()


def _vec(b: bytes) -> np.ndarray:
    return np.frombuffer(b, dtype="<f4")


def on_read_only_fs(path: Path) -> bool:
    """The store's directory or file cannot be written (EROFS, a `:ro` volume, permissions)."""
    return not (os.access(path.parent, os.W_OK) and (not path.exists() or os.access(path, os.W_OK)))


def open_unwritable(path: Path, shared: bool = False) -> sqlite3.Connection:
    """Read a store that cannot be written. A WAL database needs its -shm file to be read: with
    -wal/-shm present (after a crash) SQLite reads them; with neither (after a clean stop) the
    file alone is the whole store, and `immutable` lets SQLite skip the -shm it cannot create.
    A -wal without -shm cannot be read safely: refuse, naming the fix."""
    wal, shm = (path.with_name(path.name + x) for x in ("-wal", "-shm"))
    has_wal = wal.exists() and wal.stat().st_size > 0
    if has_wal and not shm.exists():
        raise ArtifactError(
            f"gallery store {path} is read-only and has un-merged writes in {wal.name}: "
            "make its directory writable so SQLite can recover them"
        )
    return open_store(path, readonly=True, immutable=not has_wal, shared=shared)


class GalleryStore:
    """The SQLite backend (the embedded default; several workers on one host share it)."""

    default_poll_s = 0.01  # how often a follower polls the head: SQLite has no notifications

    def __init__(
        self, path: Path, seed: Path | None, model_fingerprint: str, index_id: str
    ) -> None:
        """Open the store at `path`, created as a copy of `seed` (an index dir's store) when it
        does not exist; refused unless it belongs to this model and index build."""
        self.path = Path(path)
        if not self.path.exists():
            if seed is None:
                raise ArtifactError(f"missing gallery store {self.path}")
            self._seed(seed)
        self._lock = threading.Lock()
        self._follow_lock = threading.Lock()
        self._follow_conn: sqlite3.Connection | None = None
        self.url = str(self.path)
        # None while writable; else why not (read-only filesystem): reads go on, writes get 503
        self.read_only: str | None = None
        self.retired: str | None = None  # set by retire(): every later call raises
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
        return on_read_only_fs(self.path)

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
        conn = open_unwritable(self.path, shared=True)
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
        # Close the read-only connections first (the follower's too): SQLite shares one -shm
        # mapping per file within a process, and one opened read-only would make the new
        # connection read-only. The follower's lock is held until the switch is done, so it
        # cannot reopen its connection read-only in between.
        with self._follow_lock:
            if self._follow_conn is not None:
                self._follow_conn.close()
                self._follow_conn = None
            self.conn.close()
            try:
                self.conn, self.read_only = self._open_writable(), None
            except ArtifactError as e:
                self.conn = self._open_read_only()
                raise StoreUnavailable(str(e)) from None

    def _seed(self, seed: Path) -> None:
        """Copy the built store into place atomically (temp file, fsync, rename), once: an
        flock makes processes that start together on a new store wait for the first."""
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path.with_name(f".{self.path.name}.seed.lock"), os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if not self.path.exists():
                self._copy_seed(seed)
        finally:
            os.close(fd)

    def _copy_seed(self, seed: Path) -> None:
        tmp = self.path.with_name(f".{self.path.name}.seed-{os.getpid()}")
        shutil.copyfile(seed, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fsync_dir(self.path.parent)

    # ------------------------------------------------------------------ reads
    def meta(self) -> dict[str, str]:
        with self._lock:
            self._check_retired()
            return read_meta(self.conn)

    def _check_retired(self) -> None:
        if self.retired is not None:
            raise StoreCarriedAway(self.retired)

    def retire(self, why: str) -> None:
        """Let go of the store for good (it was carried to another model): close every
        connection, so the migration that carried it can take the file; later calls raise
        StoreCarriedAway(why)."""
        with self._lock, self._follow_lock:
            self.retired = why
            if self._follow_conn is not None:
                self._follow_conn.close()
                self._follow_conn = None
            with contextlib.suppress(sqlite3.Error):
                self.conn.close()

    def log_token(self, seq: int) -> str | None:
        """The token of write `seq` (None: no such log row, or written before tokens)."""
        with self._lock:
            self._check_retired()
            try:
                row = self.conn.execute(
                    "SELECT token FROM log WHERE seq = ?", (int(seq),)
                ).fetchone()
            except sqlite3.OperationalError:  # a read-only store of schema 3: no token column
                return None
        return None if row is None else row[0]

    def last_seq(self) -> int:
        return int(self.meta()["last_seq"])

    # ------------------------------------------------------------------ the log (followers)
    def _reader(self) -> sqlite3.Connection:
        """A connection of the follower's own (reads never wait behind this process's writes)."""
        if self._follow_conn is None:
            self._follow_conn = (
                open_unwritable(self.path, shared=True)
                if self.read_only
                else (sqlite3.connect(self.path, check_same_thread=False, isolation_level=None))
            )
            self._follow_conn.execute("PRAGMA busy_timeout=5000")
        return self._follow_conn

    def _check_readable(self) -> None:
        """A reader writes its read marks into the -shm mapping too: with a store file made
        unwritable under the process (chattr +i) that is a SIGBUS, not an error, so the
        follower checks first, as writes do (read-only stores are opened without -shm writes)."""
        if self.read_only is None:
            why = self.unwritable()
            if why is not None:
                raise StoreUnavailable(why)

    def head(self) -> int:
        """The last committed write (what a follower polls: one indexed row)."""
        self._check_readable()
        with self._follow_lock:
            self._check_retired()
            try:
                return int(
                    self._reader()
                    .execute("SELECT value FROM meta WHERE key = 'last_seq'")
                    .fetchone()[0]
                )
            except sqlite3.DatabaseError as e:
                raise StoreUnavailable(f"the gallery store cannot be read: {e}") from None

    def wait_head(self, after: int, timeout: float) -> int:
        """The head once it is past `after`, or after `timeout` seconds (SQLite: polled)."""
        import time

        h = self.head()
        if h <= after:
            time.sleep(timeout)
            h = self.head()
        return h

    def changes_after(self, after: int) -> ChangeSet:
        """Every write after `after`, in seq order, read in one transaction."""
        self._check_readable()
        with self._follow_lock:
            self._check_retired()
            conn = self._reader()
            try:
                conn.execute("BEGIN")
                try:
                    meta = dict(
                        conn.execute(
                            "SELECT key, value FROM meta WHERE key IN ('last_seq', 'log_floor', ?)",
                            (CARRIED_TO,),
                        )
                    )
                    rows = conn.execute(
                        CHANGE_QUERY.format(p="?"), (after, after, after)
                    ).fetchall()
                finally:
                    conn.execute("COMMIT")
            except sqlite3.DatabaseError as e:
                raise StoreUnavailable(f"the gallery store cannot be read: {e}") from None
        return ChangeSet(
            int(meta["last_seq"]),
            int(meta.get("log_floor", 0)),
            changes_from_rows(rows, after),
            meta.get(CARRIED_TO),
        )

    def log_gaps(self) -> tuple[int, int, list[int]]:
        """(floor, last_seq, the seqs in (floor, last_seq] that have no log row): the check
        that the log is gap-free."""
        with self._lock:
            self._check_retired()
            meta = read_meta(self.conn)
            have = {r[0] for r in self.conn.execute("SELECT seq FROM log")}
        floor, last = int(meta.get("log_floor", 0)), int(meta["last_seq"])
        return floor, last, [s for s in range(floor + 1, last + 1) if s not in have]

    def compact(self, upto: int) -> int:
        """Forget history up to write `upto`: the rows of added items deleted by then and the
        log rows before it go (the row of `upto` stays: its token names the history a snapshot
        at the floor belongs to), the log's floor moves to `upto` (a replica behind it rebuilds
        from the store). Trained items' rows stay: a rebuild starts from the built index, which
        holds them. Returns the item rows removed."""
        with self._lock:
            self._check_retired()
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                n = self.conn.execute(
                    "DELETE FROM items WHERE source = 'added' AND deleted_seq <= ?", (upto,)
                ).rowcount
                self.conn.execute("DELETE FROM log WHERE seq < ?", (upto,))
                floor = int(read_meta(self.conn).get("log_floor", 0))
                set_meta(self.conn, "log_floor", str(max(floor, upto)))
                self.conn.execute("COMMIT")
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    self.conn.execute("ROLLBACK")
                raise
        return n

    def live_items(self, after_seq: int = -1, upto: int | None = None) -> list[Item]:
        """Live items added by a write after `after_seq` (-1: all) and not after `upto`, in id
        order."""
        with self._lock:
            self._check_retired()
            rows = self.conn.execute(
                "SELECT id, label, source, metadata, embedding, add_seq, world FROM items "
                "WHERE deleted_seq IS NULL AND add_seq > ? AND add_seq <= ? ORDER BY id",
                (after_seq, upto if upto is not None else 2**62),
            ).fetchall()
        return [
            Item(r[0], r[1], r[2], None, _vec(r[4]), r[5], None if r[6] is None else _vec(r[6]))
            for r in rows
        ]

    def deleted_after(self, seq: int) -> list[tuple[int, str, np.ndarray, int]]:
        """(id, label, embedding, add_seq) of items deleted by a write after `seq`."""
        with self._lock:
            self._check_retired()
            rows = self.conn.execute(
                "SELECT id, label, embedding, add_seq FROM items WHERE deleted_seq > ?", (seq,)
            ).fetchall()
        return [(r[0], r[1], _vec(r[2]), r[3]) for r in rows]

    def _live_rows(self, columns: str, ids: list[int], extra: str = "") -> list[tuple]:
        """`columns` of the live items among `ids` (chunked: SQLite caps bound parameters)."""
        out = []
        for s in range(0, len(ids), 500):
            chunk = [int(i) for i in ids[s : s + 500]]
            q = ",".join("?" * len(chunk))
            with self._lock:
                self._check_retired()
                out += self.conn.execute(
                    f"SELECT {columns} FROM items WHERE deleted_seq IS NULL{extra} AND id IN ({q})",
                    chunk,
                ).fetchall()
        return out

    def items(self, ids: list[int]) -> dict[int, tuple[str, str, dict | None, bool]]:
        """id -> (label, source, metadata, has a thumbnail) for the live items among `ids`."""
        rows = self._live_rows("id, label, source, metadata, thumbnail IS NOT NULL", ids)
        return {r[0]: (r[1], r[2], json.loads(r[3]) if r[3] else None, bool(r[4])) for r in rows}

    def item_rows(
        self, after_id: int, limit: int, label: str | None = None, item_id: int | None = None
    ) -> list[ItemRow]:
        """Live items with id > `after_id` in id order, at most `limit` (of `label`, or the one
        `item_id`): a page of GET /gallery/items. Ids only grow, so a cursor of the last id
        is stable under concurrent writes (new items come at the end)."""
        sql = (
            "SELECT id, label, source, metadata, created_at, thumbnail IS NOT NULL FROM items "
            "WHERE deleted_seq IS NULL AND id > ?"
        )
        params: list = [int(after_id)]
        if label is not None:
            sql += " AND label = ?"
            params.append(label)
        if item_id is not None:
            sql += " AND id = ?"
            params.append(int(item_id))
        with self._lock:
            self._check_retired()
            rows = self.conn.execute(sql + " ORDER BY id LIMIT ?", (*params, limit)).fetchall()
        return [
            ItemRow(r[0], r[1], r[2], json.loads(r[3]) if r[3] else None, r[4], bool(r[5]))
            for r in rows
        ]

    def with_thumbnails(self, ids: list[int]) -> set[int]:
        """The live items among `ids` (at most a few hundred) that have a thumbnail."""
        return {r[0] for r in self._live_rows("id", ids[:500], " AND thumbnail IS NOT NULL")}

    def added_items(self, after_id: int, limit: int) -> list[StoredItem]:
        """Live items added through the service with id > `after_id`, in id order, every
        column (a migration reads the store this way, `limit` at a time)."""
        with self._lock:
            self._check_retired()
            rows = self.conn.execute(
                f"SELECT {_COLUMNS} FROM items WHERE source = 'added' AND deleted_seq IS NULL "
                "AND id > ? ORDER BY id LIMIT ?",
                (after_id, limit),
            ).fetchall()
        return [StoredItem(*r) for r in rows]

    def deleted_trained(self) -> list[dict]:
        """Metadata (dataset, dataset_index) of the trained items deleted through the service."""
        with self._lock:
            self._check_retired()
            rows = self.conn.execute(
                "SELECT metadata FROM items WHERE source = 'trained' AND deleted_seq IS NOT NULL"
            ).fetchall()
        return [json.loads(r[0]) for r in rows if r[0]]

    def trained_ids_by_source(self) -> dict[tuple, int]:
        """(dataset, dataset_index) -> id of every live trained item."""
        with self._lock:
            self._check_retired()
            rows = self.conn.execute(
                "SELECT id, metadata FROM items WHERE source = 'trained' AND deleted_seq IS NULL"
            ).fetchall()
        out = {}
        for item_id, md in rows:
            m = json.loads(md) if md else {}
            out[(m.get("dataset"), m.get("dataset_index"))] = item_id
        return out

    def thumbnail(self, item_id: int) -> bytes | None:
        """The thumbnail of a live item, or None (no such item, deleted, or none kept)."""
        with self._lock:
            self._check_retired()
            row = self.conn.execute(
                "SELECT thumbnail FROM items WHERE id = ? AND deleted_seq IS NULL", (int(item_id),)
            ).fetchone()
        return None if row is None else row[0]

    def select(self, sql: str, params: tuple = ()) -> list[tuple]:
        """A read-only query on the store's connection (e.g. a migration's own tables)."""
        with self._lock:
            self._check_retired()
            return self.conn.execute(sql, params).fetchall()

    def integrity_check(self) -> str:
        with self._lock:
            self._check_retired()
            return self.conn.execute("PRAGMA integrity_check").fetchone()[0]

    # ------------------------------------------------------------------ writes
    def unwritable(self) -> str | None:
        """Why the store's files cannot be written now (None: they can). SQLite maps the -shm
        file into memory: one made unwritable under a running process (chattr +i, a remount)
        kills it with SIGBUS on the next write instead of an error, so writes check first."""
        for p in (self.path, *(self.path.with_name(self.path.name + x) for x in WAL_FILES)):
            if p.exists() and not os.access(p, os.W_OK):
                return f"the gallery store file {p} is not writable"
        if not os.access(self.path.parent, os.W_OK):
            return f"the gallery store's directory {self.path.parent} is not writable"
        return None

    def transaction(self, fn, op: str = "migrate", count=lambda result: 0):
        """Run fn(conn, seq) in one IMMEDIATE transaction with the next sequence number and its
        log row (`op`, count(result) items, a new token); return (seq, fn's result).
        StoreUnavailable when the store cannot be written, StoreCarriedAway once it was
        carried to another model; fn raising NothingChanged(result) rolls back: (0, result)."""
        with self._lock:
            self._check_retired()
            self._ensure_writable()
            why = self.unwritable()
            if why is not None:
                raise StoreUnavailable(why)
            try:
                self.conn.execute("BEGIN IMMEDIATE")
                try:
                    meta = dict(
                        self.conn.execute(
                            "SELECT key, value FROM meta WHERE key IN ('last_seq', ?)",
                            (CARRIED_TO,),
                        )
                    )
                    if CARRIED_TO in meta:  # under the write lock: no write after the seal
                        raise StoreCarriedAway(carried_away_message(meta[CARRIED_TO]))
                    seq = int(meta["last_seq"]) + 1
                    try:
                        result = fn(self.conn, seq)
                    except NothingChanged as e:
                        self.conn.execute("ROLLBACK")
                        return 0, e.args[0] if e.args else None
                    set_meta(self.conn, "last_seq", str(seq))
                    self.conn.execute(
                        "INSERT INTO log (seq, op, items, at, token) VALUES (?, ?, ?, ?, ?)",
                        (seq, op, int(count(result)), utc_now(), new_token()),
                    )
                    self.conn.execute("COMMIT")
                except BaseException:
                    # "no transaction is active": SQLite already rolled back; the error
                    # that matters is the one being raised, not the ROLLBACK's
                    with contextlib.suppress(sqlite3.Error):
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
        worlds: np.ndarray | None = None,
    ) -> tuple[int, list[int]]:
        """Insert len(embeddings) items of `label` (with their world statistics (n, D) when
        given); return (seq, ids)."""
        now = utc_now()

        def fn(conn, seq):
            ids = allocate_ids(conn, len(embeddings))
            rows = new_items(ids, label, embeddings, metadata, images, thumbnails, now, worlds)
            insert_items(conn, rows, seq)
            return ids

        return self.transaction(fn, "add", len)

    def delete(
        self, ids: list[int] | None = None, label: str | None = None
    ) -> tuple[int, list[tuple[int, str, np.ndarray, str]]]:
        """Mark deleted the live items among `ids`, or every live item of `label`, as the store
        has them now (not as a lagging replica remembers them); return (seq, [(id, label,
        embedding, source)]), (0, []) when none was live (nothing written)."""

        def fn(conn, seq):
            todo = ids
            if label is not None:
                todo = [
                    r[0]
                    for r in conn.execute(
                        "SELECT id FROM items WHERE label = ? AND deleted_seq IS NULL", (label,)
                    )
                ]
            rows = mark_deleted(conn, todo or [], seq)
            if not rows:
                raise NothingChanged([])
            return rows

        return self.transaction(fn, "delete", len)

    def reader(self) -> StoreReader:
        """A point-in-time view of the store on a connection of its own (an export reads every
        page from it: writes committed meanwhile are not in it)."""
        self._check_retired()
        conn = open_unwritable(self.path) if self.read_only else open_store(self.path, True)
        conn.execute("BEGIN")
        conn.execute("SELECT 1 FROM meta LIMIT 1").fetchone()  # the snapshot starts here
        return StoreReader(conn, "?")

    def close(self) -> None:
        with self._lock, contextlib.suppress(sqlite3.Error):
            self.conn.close()
        with self._follow_lock:
            if self._follow_conn is not None:
                self._follow_conn.close()
                self._follow_conn = None

    def close_as_one_file(self) -> None:
        """Merge the write-ahead log into the database file, leave WAL mode and close: the store
        is then one self-contained file, safe to rename (a -wal beside another file would be
        read as that file's log)."""
        with self._follow_lock:
            if self._follow_conn is not None:
                self._follow_conn.close()
                self._follow_conn = None
        with self._lock:
            self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            mode = self.conn.execute("PRAGMA journal_mode=DELETE").fetchone()[0]
            self.conn.close()
        if mode != "delete":
            raise StoreUnavailable(f"{self.path} is still in use elsewhere (journal mode {mode})")


class StoreReader:
    """Pages of a store read inside one transaction (GalleryStore.reader, PostgresStore.reader):
    every page sees the store as it was when the reader opened."""

    def __init__(self, conn, param: str, close=None):
        self.conn = conn
        self.p = param  # the driver's placeholder: ? (sqlite3) or %s (psycopg)
        self._close = close or conn.close

    def __enter__(self) -> StoreReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.execute("ROLLBACK")
        self._close()

    def last_seq(self) -> int:
        p = self.p
        return int(
            self.conn.execute(f"SELECT value FROM meta WHERE key = {p}", ("last_seq",)).fetchone()[
                0
            ]
        )

    def added_items(self, after_id: int, limit: int) -> list[StoredItem]:
        p = self.p
        rows = self.conn.execute(
            f"SELECT {_COLUMNS} FROM items WHERE source = 'added' AND deleted_seq IS NULL "
            f"AND id > {p} ORDER BY id LIMIT {p}",
            (after_id, limit),
        ).fetchall()
        return [
            StoredItem(*[bytes(v) if isinstance(v, memoryview) else v for v in r]) for r in rows
        ]

    def item_rows(self, after_id: int, limit: int) -> list[ItemRow]:
        p = self.p
        rows = self.conn.execute(
            "SELECT id, label, source, metadata, created_at, thumbnail IS NOT NULL FROM items "
            f"WHERE deleted_seq IS NULL AND id > {p} ORDER BY id LIMIT {p}",
            (after_id, limit),
        ).fetchall()
        return [
            ItemRow(r[0], r[1], r[2], json.loads(r[3]) if r[3] else None, r[4], bool(r[5]))
            for r in rows
        ]


def new_items(
    ids, label, embeddings, metadata, images, thumbnails, now, worlds=None
) -> list[StoredItem]:
    """The rows of an add through the service (both backends store the same columns)."""
    thumbs = thumbnails if thumbnails is not None else [None] * len(embeddings)
    ws = [None] * len(embeddings) if worlds is None else [_blob(w) for w in worlds]
    return [
        StoredItem(
            i,
            label,
            "added",
            None if md is None else json.dumps(md, sort_keys=True),
            now,
            _blob(e),
            None if img is None else img[0],
            None if img is None else img[1],
            th,
            w,
        )
        for i, e, md, img, th, w in zip(ids, embeddings, metadata, images, thumbs, ws, strict=True)
    ]


# ---------------------------------------------------------------------- inside a transaction
def allocate_ids(conn: sqlite3.Connection, n: int) -> list[int]:
    """The next `n` item ids (meta 'next_id' moves past them)."""
    next_id = int(conn.execute("SELECT value FROM meta WHERE key = 'next_id'").fetchone()[0])
    set_meta(conn, "next_id", str(next_id + n))
    return list(range(next_id, next_id + n))


def insert_items(conn: sqlite3.Connection, items: list[StoredItem], seq: int) -> None:
    """Insert `items` as added by write `seq`."""
    conn.executemany(
        f"INSERT INTO items ({_COLUMNS}, add_seq) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        [
            (
                it.id,
                it.label,
                it.source,
                it.metadata,
                it.created_at,
                it.embedding,
                it.image,
                it.image_type,
                it.thumbnail,
                it.world,
                seq,
            )
            for it in items
        ],
    )


def mark_deleted(
    conn: sqlite3.Connection, ids: list[int], seq: int
) -> list[tuple[int, str, np.ndarray, str]]:
    """Mark the live items among `ids` deleted by write `seq`; (id, label, embedding, source)
    of each."""
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


def set_meta(conn: sqlite3.Connection, key: str, value: str | None) -> None:
    """Set (or, with None, remove) a meta key."""
    if value is None:
        conn.execute("DELETE FROM meta WHERE key = ?", (key,))
    else:
        conn.execute(
            "INSERT INTO meta (key, value) VALUES (?, ?) "
            "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            (key, value),
        )
