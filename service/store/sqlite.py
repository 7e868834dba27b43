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
import time
from pathlib import Path

import numpy as np

from embedding.errors import ArtifactError
from embedding.files import fsync_dir
from embedding.gallery import (
    STORE_ID,
    STORE_SCHEMA_VERSION,
    migrate_store,
    new_token,
    open_store,
    read_meta,
    utc_now,
)
from service.store import base, records, sql
from service.store.base import Store, StoreReader
from service.store.datadir import DataDir
from service.store.records import ChangeSet

D = sql.SQLITE


WAL_FILES = ("-wal", "-shm")


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


class _Rollback(Exception):
    """Inside a write: roll it back and answer `result` (records.NothingChanged's way out)."""

    def __init__(self, result):
        self.result = result


class SqliteStore(Store):
    """The SQLite backend (the embedded default; several workers on one host share it)."""

    default_poll_s = 0.01  # how often a follower polls the head: SQLite has no notifications
    dialect = D

    @classmethod
    def claims(cls, target) -> bool:
        return True  # a path: the fallback backend (the registry asks it last)

    def __init__(
        self,
        path: Path,
        seed: Path | None,
        model_fingerprint: str,
        index_id: str,
        seed_meta: dict[str, str] | None = None,
    ) -> None:
        """Open the store at `path`, created as a copy of `seed` (an index dir's store) when it
        does not exist, with `seed_meta` in its meta from the start (a gallery built beside the
        live one is on standby before anything can open it); refused unless it belongs to this
        model and index build."""
        self.path = Path(path)
        if not self.path.exists():
            if seed is None:
                raise ArtifactError(f"missing gallery store {self.path}")
            self._seed(seed, seed_meta or {})
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
        self._take(
            read_meta(self.conn), model_fingerprint, index_id,
            other_model="point SNCA_STORE at a new file, or re-embed the gallery for this model",
            new_place="a new store",
        )  # fmt: skip

    # ------------------------------------------------------------------ as found (tools)
    @classmethod
    def sibling(cls, home, gen: str) -> str:
        """Where another model's gallery `gen` lives beside the home store `home`
        (service/store/galleries.py): HOME_DIR/galleries/<gen>/gallery.sqlite."""
        return str(Path(home).parent / "galleries" / gen / Path(home).name)

    @classmethod
    def exists(cls, target) -> bool:
        return Path(target).is_file()

    @classmethod
    @contextlib.contextmanager
    def carry_lock(cls, home, waiting=None, blocking: bool = True):
        """One carry or switch at a time among the galleries of the home store `home` (an
        exclusive flock on a file beside it, across processes; the kernel lets go of it when
        its holder dies). `waiting(why)` is told when another process holds it. Yields
        whether it is held (False only when not `blocking` and another holds it)."""
        import fcntl

        path = Path(home)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path.with_name(f".{path.name}.carry.lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not blocking:
                    yield False
                    return
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
                if waiting is not None:
                    waiting(
                        f"waiting for another carry or switch of the galleries of {path} "
                        f"(pid {holder}) to finish"
                    )
                fcntl.flock(fd, fcntl.LOCK_EX)
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
            yield True
        finally:
            os.close(fd)  # releases the lock

    @classmethod
    def meta_of(cls, target) -> dict[str, str]:
        """The meta table of the store at `target` as it is (no model needed: housekeeping)."""
        path = Path(target)
        conn = open_unwritable(path) if on_read_only_fs(path) else open_store(path, readonly=True)
        try:
            return read_meta(conn)
        finally:
            conn.close()

    @classmethod
    def dump(cls, target, dest: Path) -> None:
        """A consistent copy of the live store at `target` into the new file `dest`: VACUUM
        INTO runs in one read transaction (writers in WAL mode do not wait for it); the copy
        is brought to this version's schema."""
        path = Path(target)
        conn = open_unwritable(path) if on_read_only_fs(path) else open_store(path, readonly=True)
        try:
            conn.execute("VACUUM INTO ?", (str(dest),))
        except sqlite3.DatabaseError as e:
            raise ArtifactError(f"cannot copy the gallery store {path}: {e}") from None
        finally:
            conn.close()
        out = sqlite3.connect(dest, isolation_level=None)
        try:
            migrate_store(out)
        finally:
            out.close()

    @classmethod
    def swap_dir(cls, home) -> DataDir | None:
        """The data dir a start-up migration of the home store `home` swaps its new store into
        (store/migration.py `finish_swap` finishes one a crash left sealed)."""
        path = Path(home)
        return DataDir(path.parent, path)

    @classmethod
    def leftovers(cls, target) -> list[str]:
        """What a restore into `target` would find beside it from an earlier history: other
        models' galleries (galleries/*/STORE), a half-done migration (STORE.migrating)."""
        path = Path(target)
        found = sorted(str(p) for p in (path.parent / "galleries").glob(f"*/{path.name}"))
        migrating = path.with_name(path.name + ".migrating")
        return found + ([str(migrating)] if migrating.exists() else [])

    @classmethod
    def discard(cls, target, found: list[str], stamp: str) -> list[str]:
        """Move `found` (leftovers) out of the way, into DIR/previous/discarded-STAMP/ (kept,
        never deleted); where each went."""
        path = Path(target)
        dest = path.parent / "previous" / f"discarded-{stamp}"
        dest.mkdir(parents=True, exist_ok=True)
        out = []
        for f in map(Path, found):
            what = f.parent if f.parent.parent == path.parent / "galleries" else f
            to = dest / what.name
            os.replace(what, to)
            for suffix in WAL_FILES:  # (a migrating store's own -wal/-shm go with it)
                side = Path(str(what) + suffix)
                if what.is_file() or side.exists():
                    with contextlib.suppress(FileNotFoundError):
                        os.replace(side, Path(str(to) + suffix))
            out.append(str(to))
        fsync_dir(path.parent)
        return out

    @classmethod
    def load(cls, target, src: Path, check) -> None:
        """Restore the store file `src` to `target`, which must not exist: copied beside it,
        check(conn, dialect) run on the copy, then linked into place (never over a file)."""
        path = Path(target)
        if path.exists():
            raise ArtifactError(
                f"{path} exists: restore into an empty data dir (or name a new store file)"
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.restore-{os.getpid()}")
        shutil.copyfile(src, tmp)
        try:
            conn = sqlite3.connect(tmp)
            try:
                check(conn, D)
                conn.commit()  # (its meta clean-up: sqlite3 opened a transaction for it)
            finally:
                conn.close()
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)  # fails if a store appeared meanwhile: nothing overwritten
            except FileExistsError:
                raise ArtifactError(f"{path} appeared while restoring: left as it is") from None
            fsync_dir(path.parent)
        finally:
            tmp.unlink(missing_ok=True)

    def _on_read_only_fs(self) -> bool:
        return on_read_only_fs(self.path)

    def _open_writable(self) -> sqlite3.Connection:
        deadline = time.monotonic() + 30
        while True:
            conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            try:
                conn.execute("PRAGMA busy_timeout=5000")
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=FULL")
                migrate_store(conn)  # a store written by an older version: add the new columns
                return conn
            except sqlite3.DatabaseError as e:
                conn.close()
                # SQLite answers 'locked' without waiting where waiting could deadlock (two
                # connections upgrading their locks at once): try again, for a bounded time
                if "locked" in str(e) and time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                raise ArtifactError(
                    f"cannot open gallery store {self.path} for writing: {e}"
                ) from None

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
            raise records.StoreUnavailable(f"{self.read_only} (read-only)")
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
                raise records.StoreUnavailable(str(e)) from None

    def _seed(self, seed: Path, extra: dict[str, str]) -> None:
        """Copy the built store into place atomically (temp file, fsync, rename), once: an
        flock makes processes that start together on a new store wait for the first."""
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path.with_name(f".{self.path.name}.seed.lock"), os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if not self.path.exists():
                self._copy_seed(seed, extra)
        finally:
            os.close(fd)

    def _copy_seed(self, seed: Path, extra: dict[str, str]) -> None:
        tmp = self.path.with_name(f".{self.path.name}.seed-{os.getpid()}")
        shutil.copyfile(seed, tmp)
        conn = sqlite3.connect(tmp)
        try:  # (this store's own identity: every store seeded from one index is another)
            for k, v in {STORE_ID: new_token(), **extra}.items():
                set_meta(conn, k, v)
            conn.commit()
            # in WAL mode before anyone can open it: the switch from the seed's rollback
            # journal needs an exclusive lock, and two processes switching one file at once
            # (the servers of two replicas starting) fail one with 'database is locked'
            conn.execute("PRAGMA journal_mode=WAL")
        finally:
            conn.close()
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fsync_dir(self.path.parent)

    # ------------------------------------------------------------------ reads
    def _check_retired(self) -> None:
        if self.retired is not None:
            raise records.StoreCarriedAway(self.retired)

    def retire(self, why: str) -> None:
        """Let go of the store for good (it was carried to another model): close every
        connection, so the migration that carried it can take the file; later calls raise
        records.StoreCarriedAway(why)."""
        with self._lock, self._follow_lock:
            self.retired = why
            if self._follow_conn is not None:
                self._follow_conn.close()
                self._follow_conn = None
            with contextlib.suppress(sqlite3.Error):
                self.conn.close()

    def log_token(self, seq: int) -> str | None:
        try:
            return super().log_token(seq)
        except sqlite3.OperationalError:  # a read-only store of schema 3: no token column
            return None

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
                raise records.StoreUnavailable(why)

    def head(self) -> int:
        """The last committed write (what a follower polls: one indexed row)."""
        self._check_readable()
        with self._follow_lock:
            self._check_retired()
            try:
                return int(self._reader().execute(sql.LAST_SEQ).fetchone()[0])
            except sqlite3.DatabaseError as e:
                raise records.StoreUnavailable(f"the gallery store cannot be read: {e}") from None

    def wait_head(self, after: int, timeout: float) -> int:
        """The head after `timeout` seconds (SQLite has no notifications: a follower polls it,
        one query a call; it read the head before asking, by catching up or by the call
        before)."""
        import time

        time.sleep(timeout)
        return self.head()

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
                            "SELECT key, value FROM meta WHERE key IN "
                            "('last_seq', 'log_floor', ?, ?)",
                            (records.CARRIED_TO, records.STANDBY),
                        )
                    )
                    rows = conn.execute(D.q(sql.CHANGES), (after, after, after)).fetchall()
                    ops = dict(conn.execute(D.q(sql.LOG_OPS_AFTER), (after,)).fetchall())
                finally:
                    conn.execute("COMMIT")
            except sqlite3.DatabaseError as e:
                raise records.StoreUnavailable(f"the gallery store cannot be read: {e}") from None
        return ChangeSet(
            int(meta["last_seq"]),
            int(meta.get("log_floor", 0)),
            records.changes_from_rows(rows, after, ops),
            meta.get(records.CARRIED_TO),
            meta.get(records.STANDBY),
        )

    def log_gaps(self) -> tuple[int, int, list[int]]:
        """(floor, last_seq, the seqs in (floor, last_seq] that have no log row): the check
        that the log is gap-free."""
        with self._lock:
            self._check_retired()
            meta = read_meta(self.conn)
            have = {r[0] for r in self.conn.execute(sql.LOG_SEQS)}
        return base.gaps(meta, have)

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
                n = self.conn.execute(D.q(sql.COMPACT_ITEMS), (upto,)).rowcount
                self.conn.execute(D.q(sql.COMPACT_LOG), (upto,))
                floor = int(read_meta(self.conn).get("log_floor", 0))
                set_meta(self.conn, "log_floor", str(max(floor, upto)))
                self.conn.execute("COMMIT")
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    self.conn.execute("ROLLBACK")
                raise
        return n

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

    def select(self, query: str, params: tuple | list = ()) -> list[tuple]:
        # (a read marks the -shm mapping too: made unwritable under the process, that is a
        # SIGBUS; /readyz's count of unlearned items died of it: fresh-clone CI of b4cff0d)
        self._check_readable()
        with self._lock:
            self._check_retired()
            return self.conn.execute(query, params).fetchall()

    def integrity_check(self) -> str:
        with self._lock:
            self._check_retired()
            return self.conn.execute("PRAGMA integrity_check").fetchone()[0]

    # ------------------------------------------------------------------ writes
    def unwritable(self) -> str | None:
        """Why the store's files cannot be written now (None: they can). SQLite maps the -shm
        file into memory: one made unwritable under a running process (chattr +i, a remount)
        kills it with SIGBUS on the next write instead of an error, so writes check first."""
        # os.access on plain strings: a follower asks this before every poll of the head (100 a
        # second in each process), and the Path operations were most of an idle server's CPU
        for f in (base := os.fspath(self.path), *(base + x for x in WAL_FILES)):
            if not os.access(f, os.W_OK) and os.path.exists(f):
                return f"the gallery store file {f} is not writable"
        if not os.access(os.path.dirname(base) or ".", os.W_OK):
            return f"the gallery store's directory {self.path.parent} is not writable"
        return None

    def transaction(self, fn, op: str = "migrate", count=lambda result: 0):
        """Run fn(conn, seq) in one IMMEDIATE transaction with the next sequence number and its
        log row (`op`, count(result) items, a new token); return (seq, fn's result).
        records.StoreUnavailable when the store cannot be written, records.StoreCarriedAway once it was
        carried to another model; fn raising records.NothingChanged(result) rolls back: (0, result)."""

        def body(conn):
            meta = dict(conn.execute(sql.WRITE_GUARDS))
            base.guard_write(meta, op)  # under the write lock: the seal, the standby
            seq = int(meta["last_seq"]) + 1
            try:
                result = fn(conn, seq)
            except records.NothingChanged as e:
                raise _Rollback((0, e.args[0] if e.args else None)) from None
            set_meta(conn, "last_seq", str(seq))
            conn.execute(D.q(sql.INSERT_LOG), (seq, op, int(count(result)), utc_now(), new_token()))
            return seq, result

        with self._lock:
            self._check_retired()
            self._ensure_writable()
            why = self.unwritable()
            if why is not None:
                raise records.StoreUnavailable(why)
            return self._immediate(body)

    def plain(self, fn):
        """fn(conn) in one IMMEDIATE transaction with no seq and no log row (meta bookkeeping:
        the galleries' registry, an upgrade's progress); fn's result."""
        with self._lock:
            self._check_retired()
            self._ensure_writable()
            return self._immediate(fn)

    def _immediate(self, fn):
        """fn(conn) in one IMMEDIATE transaction (the caller holds the lock and checked the
        store): committed when it returns, rolled back when it raises (_Rollback: its result
        returned); SQLite's errors as records.StoreUnavailable."""
        try:
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                result = fn(self.conn)
                self.conn.execute("COMMIT")
            except _Rollback as r:
                self.conn.execute("ROLLBACK")
                return r.result
            except BaseException:
                # "no transaction is active": SQLite already rolled back; the error that
                # matters is the one being raised, not the ROLLBACK's
                with contextlib.suppress(sqlite3.Error):
                    self.conn.execute("ROLLBACK")
                raise
        except sqlite3.OperationalError as e:
            raise records.StoreUnavailable(f"the gallery store cannot be written: {e}") from None
        except sqlite3.DatabaseError as e:
            raise records.StoreUnavailable(f"the gallery store failed: {e}") from None
        return result

    def _next_ids(self, conn, n: int) -> list[int]:
        return allocate_ids(conn, n)

    def _mark_deleted(self, conn, seq, ids, label):
        if label is not None:
            ids = [r[0] for r in conn.execute(D.q(sql.LIVE_OF_LABEL), (label,))]
        return sorted(mark_deleted(conn, ids or [], seq))

    def reader(self) -> StoreReader:
        """A point-in-time view of the store on a connection of its own (an export reads every
        page from it: writes committed meanwhile are not in it)."""
        self._check_retired()
        conn = open_unwritable(self.path) if self.read_only else open_store(self.path, True)
        conn.execute("BEGIN")
        conn.execute("SELECT 1 FROM meta LIMIT 1").fetchone()  # the snapshot starts here
        return StoreReader(conn, D)

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
            raise records.StoreUnavailable(
                f"{self.path} is still in use elsewhere (journal mode {mode})"
            )


# ---------------------------------------------------------------------- inside a transaction
def allocate_ids(conn: sqlite3.Connection, n: int) -> list[int]:
    """The next `n` item ids (meta 'next_id' moves past them)."""
    next_id = int(conn.execute("SELECT value FROM meta WHERE key = 'next_id'").fetchone()[0])
    set_meta(conn, "next_id", str(next_id + n))
    return list(range(next_id, next_id + n))


def mark_deleted(
    conn: sqlite3.Connection, ids: list[int], seq: int
) -> list[tuple[int, str, np.ndarray, str]]:
    """Mark the live items among `ids` deleted by write `seq`; (id, label, embedding, source)
    of each."""
    out = []
    for s in range(0, len(ids), sql.CHUNK):
        chunk = [int(i) for i in ids[s : s + sql.CHUNK]]
        rows = conn.execute(sql.ids_in(D, sql.LIVE_OF_IDS, chunk), chunk).fetchall()
        conn.executemany(D.q(sql.MARK_DELETED), [(seq, r[0]) for r in rows])
        out += [(r[0], r[1], records.vec(r[2]), r[3]) for r in rows]
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
