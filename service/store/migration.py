"""Carry a user's gallery to a new model.

A gallery store belongs to the model (fingerprint) and index build (index_id) it was seeded
from. When the service starts on a store made under others (the model was retrained or
replaced, or the index rebuilt), it builds the new model's store before it serves:

- the trained items come from the new index dir's store, as on a first start;
- every live item added through the service is carried with its label, metadata, image,
  thumbnail and creation time; its embedding is recomputed from the stored image by the new
  model (kept as it is when the model and vector space are the same: an index rebuilt with
  other options);
- trained items the user deleted stay deleted (matched by dataset and dataset index);
- an item that cannot be carried (no stored image, and a new model) is reported by id,
  listed in the new store's `uncarried` table, and stays in the old store.

Ids: carried items keep their ids when they lie above the new index's (the usual case: a
retrain of the same data); otherwise they get new ones, in the same order, and the `carried`
table maps old to new.

Crash safety: the new store is written beside the old one (gallery.sqlite.migrating), in
batches, each one transaction that also records the old ids it carried; a restart resumes
after them. The old store's items are never changed.

Writers meanwhile (a server with the old model, `snca-gallery import`) are followed, not
raced: the copy records the old store's seq it started from (`source_seq`, and that write's
token: a resumed copy must come from the same history), and rounds of catch-up carry every
add and delete committed after it. The last round runs inside a write transaction of the old
store (its write lock, so nothing can commit meanwhile) that also seals it (meta
`carried_to`): every later write on it is refused, and the processes still serving it let go
of it (service/state.py). Only then, once no process has the old store open, is it merged into
one file, linked into previous/ and the new one renamed over it. A crash after the seal leaves
a sealed store and a complete new one: the next start of any model finishes the swap.

One migration at a time per data dir, across processes: an flock on
`.gallery.sqlite.migrate.lock`, which every start takes to look at the store (it waits for a
migration in progress, then plans from what it left).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from embedding.artifacts import fsync_dir
from embedding.errors import ArtifactError
from embedding.gallery import open_store, read_meta, utc_now
from service.store import sql
from service.store.base import insert_items
from service.store.datadir import DataDir
from service.store.records import CARRIED_TO, StoredItem
from service.store.sqlite import (
    SqliteStore,
    allocate_ids,
    mark_deleted,
    on_read_only_fs,
    open_unwritable,
    set_meta,
)

log = logging.getLogger("snca.migration")

_TABLES = """
CREATE TABLE IF NOT EXISTS carried (old_id INTEGER PRIMARY KEY, new_id INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS uncarried (
    old_id INTEGER PRIMARY KEY, label TEXT NOT NULL, reason TEXT NOT NULL
);
"""

# (stored items) -> (embeddings (n_ok, d) float32 of those that worked, their world statistics
# (n_ok, D) or None, one error per item: None where it worked, else why not)
Embed = Callable[[list[StoredItem]], tuple[np.ndarray, np.ndarray | None, list[str | None]]]

CATCH_UP_ROUNDS = 8  # rounds outside the old store's write lock before the last one inside it
RELEASE_POLL_S = 0.1  # how often to look whether other processes let go of the old store


@dataclass(frozen=True)
class Target:
    """The model and index build a store must belong to."""

    fingerprint: str
    index_id: str
    space: str
    dim: int


@dataclass
class Plan:
    """A store made under another model or index build, and what carrying it involves."""

    old: Path
    old_meta: dict[str, str]
    target: Target
    total: int  # live added items
    with_image: int  # of which with a stored image
    reuse: bool  # same model and vector space: stored embeddings stay valid

    @property
    def source(self) -> dict[str, str]:
        """What identifies the old store (a half-done migration resumes only from the same
        store; that it is the same history is checked by the token of its source_seq)."""
        m = self.old_meta
        keys = ("model_fingerprint", "index_id", "created_at")
        return {k: m.get(k, "") for k in keys}

    def describe(self) -> str:
        why = (
            "the index was rebuilt"
            if self.reuse
            else f"the model changed ({self.old_meta.get('model_fingerprint', '?')[:19]}... -> "
            f"{self.target.fingerprint[:19]}...)"
        )
        return f"{why}: carrying {self.total} added items of {self.old} to the new model"


@dataclass
class Report:
    carried: int = 0
    uncarried: list[tuple[int, str, str]] = field(default_factory=list)  # (old id, label, why)
    deleted_trained: int = 0
    renumbered: bool = False
    reembedded: bool = True
    archive: str = ""
    seconds: float = 0.0
    caught_up: int = 0  # writes to the old store made while it was carried, carried too

    def to_dict(self) -> dict:
        return {
            "carried": self.carried,
            "uncarried": [{"id": i, "label": lab, "reason": r} for i, lab, r in self.uncarried],
            "deleted_trained": self.deleted_trained,
            "renumbered": self.renumbered,
            "reembedded": self.reembedded,
            "archive": self.archive,
            "caught_up": self.caught_up,
            "seconds": round(self.seconds, 2),
        }

    @classmethod
    def from_summary(cls, d: dict) -> Report:
        return cls(
            carried=int(d.get("carried", 0)),
            uncarried=[(u["id"], u["label"], u["reason"]) for u in d.get("uncarried", [])],
            deleted_trained=int(d.get("deleted_trained", 0)),
            renumbered=bool(d.get("renumbered")),
            reembedded=bool(d.get("reembedded", True)),
            archive=str(d.get("archive", "")),
            seconds=float(d.get("seconds", 0.0)),
            caught_up=int(d.get("caught_up", 0)),
        )


# ---------------------------------------------------------------------- one at a time
def lock_path(data: DataDir) -> Path:
    return data.store.with_name(f".{data.store.name}.migrate.lock")


@contextlib.contextmanager
def exclusive(data: DataDir, waiting: Callable[[str], None] | None = None):
    """The data dir's migration lock (an exclusive flock, across processes), held while a
    start looks at the store and while a migration runs. A data dir that cannot be written
    needs none (nothing can be carried there). `waiting(why)` is told when another process
    holds it."""
    import fcntl

    try:
        data.store.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock_path(data), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        if os.access(data.store.parent, os.W_OK):
            raise
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            why = (
                f"waiting for another process (pid {holder}) that is carrying the gallery in "
                f"{data.store.parent} to a new model"
            )
            log.warning(why)
            if waiting is not None:
                waiting(why)
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def settle(data: DataDir, waiting: Callable[[str], None] | None = None) -> Report | None:
    """Under the lock: a store sealed by a migration whose swap did not happen (a crash, or
    processes that kept it open) is swapped for its complete new store now; the Report of that
    migration, else None. Needs no model: any start does it."""
    store, new = data.store, data.migrating
    if not store.exists() or on_read_only_fs(store):
        return None
    meta = _read_meta(store)
    if CARRIED_TO not in meta:
        return None
    to = json.loads(meta[CARRIED_TO])
    done = _read_meta(new) if new.exists() else {}
    if done.get("migrated_from") is None or (
        done.get("model_fingerprint"),
        done.get("index_id"),
    ) != (to.get("model_fingerprint"), to.get("index_id")):
        raise ArtifactError(
            f"the gallery store {store} was sealed by a migration to model "
            f"{to.get('model_fingerprint', '?')[:19]}... whose new store {new.name} is missing "
            "or incomplete; if that migration is abandoned, delete the 'carried_to' row of the "
            "store's meta table to use it again"
        )
    log.info("finishing the swap of a migration that carried %s", store)
    report = Report.from_summary(json.loads(done["migrated_from"]))
    _release(store, waiting)
    _swap(data, Path(report.archive))
    return report


def _read_meta(path: Path) -> dict[str, str]:
    conn = open_store(path, readonly=True)
    try:
        return read_meta(conn)
    finally:
        conn.close()


def plan(store: Path, target: Target) -> Plan | None:
    """None when `store` belongs to `target` (nothing to carry); else the migration's plan."""
    conn = open_unwritable(store) if on_read_only_fs(store) else open_store(store, readonly=True)
    try:
        meta = read_meta(conn)
        if (meta.get("model_fingerprint"), meta.get("index_id")) == (
            target.fingerprint,
            target.index_id,
        ):
            return None
        total, with_image = conn.execute(
            "SELECT COUNT(*), COUNT(image) FROM items "
            "WHERE source = 'added' AND deleted_seq IS NULL"
        ).fetchone()
    except sqlite3.DatabaseError as e:
        raise ArtifactError(f"{store} is not a readable gallery store: {e}") from None
    finally:
        conn.close()
    reuse = (
        meta.get("model_fingerprint") == target.fingerprint
        and meta.get("space", "embedding") == target.space
        and int(meta.get("dim", "0")) == target.dim
    )
    return Plan(store, meta, target, int(total), int(with_image), reuse)


class Migration:
    """Runs a Plan: `run()` returns the Report once the new store is in place (None when
    another process carried the store to this model meanwhile)."""

    def __init__(
        self,
        plan: Plan,
        data: DataDir,
        seed: Path,
        embed: Embed,
        batch: int = 64,
        progress: Callable[[int, int], None] | None = None,
        status: Callable[[str], None] | None = None,
    ):
        self.plan = plan
        self.data = data
        self.seed = seed  # the new index dir's store (the trained items)
        self.embed = embed
        self.batch = batch
        self.progress = progress or (lambda done, total: None)
        self.status = status or (lambda why: None)

    def run(self) -> Report | None:
        if not self.data.writable():
            raise ArtifactError(
                f"the gallery store {self.plan.old} was made for another model and must be "
                f"carried to this one, but {self.plan.old.parent} is not writable"
            )
        with exclusive(self.data, self.status):
            done = settle(self.data, self.status)
            p = plan(self.plan.old, self.plan.target)  # again: the store may have moved on
            if p is None:
                return done  # carried to this model already (by another process, or `done`)
            self.plan = p
            return self._run()

    def _run(self) -> Report:
        t0 = time.perf_counter()
        p = self.plan
        old = SqliteStore(
            p.old, None, p.old_meta.get("model_fingerprint", ""), p.old_meta.get("index_id", "")
        )
        new = None
        try:
            new = self._open_target(old)
            report = self._report(new)
            if new.meta().get("migrated_from") is None:
                self._carry(old, new, report)
            rounds = 0
            while rounds < CATCH_UP_ROUNDS and self._catch_up(old, new, report) > 0:
                rounds += 1  # writers on the old store meanwhile: follow them

            def seal(conn, seq):
                # the old store's write lock is held: nothing commits there until this does
                self._catch_up(old, new, report, conn)
                report.seconds = time.perf_counter() - t0

                def finish(nconn, nseq):
                    set_meta(nconn, "migrated_from", json.dumps(self._summary(report)))
                    set_meta(nconn, "migrating_from", None)

                new.transaction(finish)
                target = {
                    "model_fingerprint": p.target.fingerprint,
                    "index_id": p.target.index_id,
                    "at": utc_now(),
                    "pid": os.getpid(),
                }
                set_meta(conn, CARRIED_TO, json.dumps(target))

            old.transaction(seal, "seal")
            new.close_as_one_file()
        finally:
            for s in (new, old):
                if s is not None:
                    with contextlib.suppress(sqlite3.Error):
                        s.close()
        _release(p.old, self.status)
        _swap(self.data, Path(report.archive))
        report.seconds = time.perf_counter() - t0
        return report

    # ------------------------------------------------------------------ the new store
    def _open_target(self, old: SqliteStore) -> SqliteStore:
        """The half-done new store of this very migration (resumed), or a fresh one."""
        t, p = self.data.migrating, self.plan
        if t.exists():
            try:
                new = SqliteStore(t, self.seed, p.target.fingerprint, p.target.index_id)
                meta = new.meta()
                same = json.loads(meta.get("migrating_from", "null")) == p.source or (
                    meta.get("migrated_from") is not None
                    and {k: json.loads(meta["migrated_from"]).get(k) for k in p.source} == p.source
                )
                seq = int(meta.get("source_seq", "-1"))
                if same and seq >= 0 and old.log_token(seq) == meta.get("source_token"):
                    log.info("resuming the migration in %s", t)
                    return new
                new.close()
                log.warning("discarding %s: a copy of another store or of another history", t)
            except (ArtifactError, ValueError) as e:
                log.warning("discarding %s: %s", t, e)
            for suffix in ("", "-wal", "-shm"):
                Path(str(t) + suffix).unlink(missing_ok=True)
        new = SqliteStore(t, self.seed, p.target.fingerprint, p.target.index_id)
        # Where the copy starts in the old store's history: every write after it is caught up
        # later; read before the copy, so a write between the two is carried twice (harmless)
        # rather than never.
        source_seq = old.last_seq()
        source_token = old.log_token(source_seq)
        first = old.added_items(-1, 1)
        next_id = int(new.meta()["next_id"])
        keep_ids = not first or first[0].id >= next_id
        old_next = int(old.meta().get("next_id", "0"))
        stamp = utc_now().replace(":", "").replace("+0000", "Z")
        archive = f"gallery-{stamp}-{p.old_meta.get('model_fingerprint', 'unknown')[7:19]}.sqlite"
        gone = old.deleted_trained()
        by_source = new.trained_ids_by_source() if gone else {}
        dead = [
            by_source[k]
            for k in ((m.get("dataset"), m.get("dataset_index")) for m in gone)
            if k in by_source
        ]

        def setup(conn, seq):
            for stmt in _TABLES.strip().split(";"):  # (executescript would commit)
                if stmt.strip():
                    conn.execute(stmt)
            set_meta(conn, "migrating_from", json.dumps(p.source))
            set_meta(conn, "source_seq", str(source_seq))
            set_meta(conn, "source_token", source_token)
            set_meta(conn, "carry_ids", "kept" if keep_ids else "renumbered")
            set_meta(conn, "archive", archive)
            if keep_ids:  # ids are never reused: stay above every id the old store gave out
                set_meta(conn, "next_id", str(max(next_id, old_next)))
            mark_deleted(conn, dead, seq)

        new.transaction(setup)
        return new

    def _report(self, new: SqliteStore) -> Report:
        meta = new.meta()
        rows = new.select("SELECT old_id, label, reason FROM uncarried ORDER BY old_id")
        carried = new.select("SELECT COUNT(*) FROM carried")[0][0]
        deleted = new.select(
            "SELECT COUNT(*) FROM items WHERE source = 'trained' AND deleted_seq IS NOT NULL"
        )[0][0]
        done = json.loads(meta.get("migrated_from") or "{}")
        return Report(
            carried=int(carried),
            uncarried=[tuple(r) for r in rows],
            deleted_trained=int(deleted),
            renumbered=meta.get("carry_ids") == "renumbered",
            reembedded=not self.plan.reuse,
            archive=str(self.data.previous / meta["archive"]),
            caught_up=int(done.get("caught_up", 0)),
        )

    def _summary(self, report: Report) -> dict:
        return {**self.plan.source, "finished_at": utc_now(), **report.to_dict()}

    # ------------------------------------------------------------------ carrying items
    def _carry(self, old: SqliteStore, new: SqliteStore, report: Report) -> None:
        """The bulk copy: every live added item of the old store, in id order, a batch per
        transaction (resumed after the last batch carried)."""
        p = self.plan
        after = new.select(
            "SELECT MAX(m) FROM (SELECT MAX(old_id) AS m FROM carried "
            "UNION ALL SELECT MAX(old_id) FROM uncarried)"
        )[0][0]
        after = -1 if after is None else int(after)
        done = report.carried + len(report.uncarried)
        self.progress(done, p.total)
        while True:
            items = old.added_items(after, self.batch)
            if not items:
                break
            self._write(new, items, report)
            after = items[-1].id
            done += len(items)
            self.progress(done, max(p.total, done))

    def _catch_up(self, old: SqliteStore, new: SqliteStore, report: Report, conn=None) -> int:
        """Carry the writes the old store committed after the new store's `source_seq`: adds
        not carried yet, deletes of carried (or trained) items. `conn`: the old store's
        connection inside its write transaction (the last round), else a read transaction of
        its own. Returns the writes found."""
        after = int(new.meta()["source_seq"])
        if conn is None:
            reader = old.reader()
            try:
                last, adds, dels, next_id = _changes(reader.conn, after)
            finally:
                reader.close()
        else:
            last, adds, dels, next_id = _changes(conn, after)
        if last == after:
            return 0
        carried = dict(new.select("SELECT old_id, new_id FROM carried"))
        uncarried = {r[0] for r in new.select("SELECT old_id FROM uncarried")}
        adds = [it for it in adds if it.id not in carried and it.id not in uncarried]
        for s in range(0, len(adds), self.batch):
            self._write(new, adds[s : s + self.batch], report)
        carried = dict(new.select("SELECT old_id, new_id FROM carried"))
        trained = new.trained_ids_by_source() if any(d[1] == "trained" for d in dels) else {}
        kill, forget = [], []
        for old_id, source, md in dels:
            if source == "added":
                if old_id in carried:
                    kill.append(carried[old_id])
                else:
                    forget.append(old_id)  # never carried (uncarried): nothing to report
            else:
                m = json.loads(md) if md else {}
                new_id = trained.get((m.get("dataset"), m.get("dataset_index")))
                if new_id is not None:
                    kill.append(new_id)
        keep_ids = not report.renumbered
        token = old.log_token(last) if conn is None else _token(conn, last)

        def write(nconn, seq):
            mark_deleted(nconn, kill, seq)
            nconn.executemany("DELETE FROM uncarried WHERE old_id = ?", [(i,) for i in forget])
            set_meta(nconn, "source_seq", str(last))
            set_meta(nconn, "source_token", token)
            if keep_ids:
                cur = int(
                    nconn.execute("SELECT value FROM meta WHERE key = 'next_id'").fetchone()[0]
                )
                set_meta(nconn, "next_id", str(max(cur, next_id)))

        new.transaction(write)
        report.uncarried = [u for u in report.uncarried if u[0] not in set(forget)]
        report.deleted_trained = int(
            new.select(
                "SELECT COUNT(*) FROM items WHERE source = 'trained' AND deleted_seq IS NOT NULL"
            )[0][0]
        )
        report.caught_up += last - after
        log.info(
            "caught up with writes %d..%d of the old store: %d adds, %d deletes",
            after + 1,
            last,
            len(adds),
            len(dels),
        )
        return last - after

    def _write(self, new: SqliteStore, items: list[StoredItem], report: Report) -> None:
        """Embed `items` and insert them (one transaction), recording what was carried."""
        ok, failed = self._embed(items)
        renumber = report.renumbered

        def write(conn, seq, ok=ok, failed=failed, renumber=renumber):
            ids = allocate_ids(conn, len(ok)) if renumber else [it.id for it, _, _ in ok]
            insert_items(
                conn,
                sql.SQLITE,
                [
                    replace(it, id=i, embedding=e, world=w)
                    for (it, e, w), i in zip(ok, ids, strict=True)
                ],
                seq,
            )
            conn.executemany(
                "INSERT INTO carried (old_id, new_id) VALUES (?, ?)",
                [(it.id, i) for (it, _, _), i in zip(ok, ids, strict=True)],
            )
            conn.executemany(
                "INSERT INTO uncarried (old_id, label, reason) VALUES (?, ?, ?)",
                failed,
            )

        new.transaction(write)
        report.carried += len(ok)
        report.uncarried += failed
        for item_id, label, why in failed:
            log.warning("item %s (%r) not carried: %s", item_id, label, why)

    def _embed(
        self, items: list[StoredItem]
    ) -> tuple[list[tuple[StoredItem, bytes, bytes | None]], list[tuple[int, str, str]]]:
        """(item, its new embedding bytes, its world statistics bytes) for those carried,
        (old id, label, why) for the rest."""
        if self.plan.reuse:  # the same model: the statistics stay valid too
            return [(it, it.embedding, it.world) for it in items], []
        with_image = [it for it in items if it.image is not None]
        failed = [
            (it.id, it.label, "no stored image (added with SNCA_STORE_IMAGES off, or too large)")
            for it in items
            if it.image is None
        ]
        ok = []
        if with_image:
            emb, stats, errors = self.embed(with_image)
            rows = iter(np.ascontiguousarray(emb, dtype="<f4"))
            worlds = iter(np.ascontiguousarray(stats, dtype="<f4")) if stats is not None else None
            for it, err in zip(with_image, errors, strict=True):
                if err is None:
                    w = next(worlds).tobytes() if worlds is not None else None
                    ok.append((it, next(rows).tobytes(), w))
                else:
                    failed.append((it.id, it.label, f"the stored image cannot be read: {err}"))
        return ok, failed


def _changes(conn, after: int):
    """What the old store committed after write `after`, read on `conn` (inside one
    transaction): (its last seq, live added items added after it, (id, source, metadata) of
    items deleted after it, its next_id)."""
    meta = dict(conn.execute("SELECT key, value FROM meta WHERE key IN ('last_seq', 'next_id')"))
    adds = [
        StoredItem(*r)
        for r in conn.execute(
            f"SELECT {sql.COLUMNS} FROM items WHERE source = 'added' AND deleted_seq IS NULL "
            "AND add_seq > ? ORDER BY id",
            (after,),
        )
    ]
    dels = conn.execute(
        "SELECT id, source, metadata FROM items WHERE deleted_seq > ? ORDER BY id", (after,)
    ).fetchall()
    return int(meta["last_seq"]), adds, dels, int(meta.get("next_id", "0"))


def _token(conn, seq: int) -> str | None:
    row = conn.execute(sql.SQLITE.q(sql.LOG_TOKEN), (seq,)).fetchone()
    return None if row is None else row[0]


# ---------------------------------------------------------------------- the swap
def _release(store: Path, waiting: Callable[[str], None] | None) -> None:
    """Wait until no other process has the sealed old store open (the servers still serving
    it let go once they see the seal; an old version's processes when they are stopped), then
    merge its write-ahead log and leave WAL mode: one self-contained file, safe to rename (a
    -wal beside another file would be read as that file's log)."""
    told = 0.0
    while True:
        conn = sqlite3.connect(store, isolation_level=None)
        try:
            conn.execute("PRAGMA busy_timeout=1000")
            with contextlib.suppress(sqlite3.OperationalError):
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            try:
                mode = conn.execute("PRAGMA journal_mode=DELETE").fetchone()[0]
            except sqlite3.OperationalError:
                mode = "wal"
        finally:
            conn.close()
        if mode == "delete":
            return
        if time.monotonic() - told > 10:
            why = (
                f"the gallery is carried to the new model and {store.name} is sealed; waiting "
                "for the processes that still have it open (the old model's servers) to let go "
                "of it or stop"
            )
            log.warning(why)
            if waiting is not None:
                waiting(why)
            told = time.monotonic()
        time.sleep(RELEASE_POLL_S)


def _swap(data: DataDir, archive: Path) -> None:
    """Archive the old store (a hard link, else a copy) and rename the new one over it."""
    old, new = data.store, data.migrating
    archive.parent.mkdir(parents=True, exist_ok=True)
    if not archive.exists():
        tmp = archive.with_name(archive.name + ".tmp")
        tmp.unlink(missing_ok=True)
        try:
            os.link(old, tmp)
        except OSError:
            shutil.copyfile(old, tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, archive)
        fsync_dir(archive.parent)
    for suffix in ("-wal", "-shm"):  # left by no one now (both stores are single files)
        Path(str(old) + suffix).unlink(missing_ok=True)
    os.replace(new, old)
    fsync_dir(old.parent)
    shutil.rmtree(data.snapshot, ignore_errors=True)  # a snapshot of the old index
