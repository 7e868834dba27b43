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

This is the swap ending of the one carry engine (service/store/carry.py: its id, tombstone and
resume rules): the new store is written beside the old one (gallery.sqlite.migrating) by the
engine (backfill in id order, then the old store's log, every write resumable); its seal runs
inside a write transaction of the old store (its write lock, so nothing can commit meanwhile)
and also seals it (meta `carried_to`): every later write on it is refused, and the processes
still serving it let go of it (service/state.py). Only then, once no process has the old store
open, is it merged into one file, linked into previous/ and the new one renamed over it. A crash
after the seal leaves a sealed store and a complete new one: the next start of any model
finishes the swap. Ids: kept when they lie above the new index's (the usual case: a retrain of
the same data); otherwise renumbered in the same order (the new store's `carried` table maps
old to new): the old store is retired, so no other gallery shares its ids.

One migration at a time per data dir, across processes: an flock on
`.gallery.sqlite.migrate.lock`, which every start takes to look at the store (it waits for a
migration in progress, then plans from what it left), and the carry lock that upgrades take
too (service/store/upgrade.py). A store that has day-two galleries (an alias, or a standby
flag) is not swapped: its model's gallery is built beside it by `snca-gallery upgrade`.
A half-done `.migrating` store left by an older version is discarded and the carry starts
again (the old store still holds everything).
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
from dataclasses import dataclass, field
from pathlib import Path

from embedding.errors import ArtifactError
from embedding.files import fsync_dir
from embedding.gallery import open_store, read_meta, utc_now
from service.store import sql
from service.store.carry import Carry, CarryState, Embed, Side, state_key
from service.store.datadir import DataDir
from service.store.galleries import gen_of
from service.store.records import CARRIED_TO, STANDBY
from service.store.sqlite import SqliteStore, on_read_only_fs, open_unwritable, set_meta

log = logging.getLogger("snca.migration")

MIGRATING_FROM = "migrating_from"  # the new store's meta while it is carried into


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


def finish_swap(data: DataDir, waiting: Callable[[str], None] | None = None) -> bool:
    """A start-up migration sealed the home store but a crash came before its new store was
    swapped in: swap it now, under the migration lock (the day-two settle calls this); whether
    it did."""
    with exclusive(data, waiting):
        return settle(data, waiting) is not None


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
        day_two = [k for k in meta if k.startswith("alias:") or k == STANDBY]
        if day_two:
            raise ArtifactError(
                f"the gallery store {store} belongs to another model and has galleries switched "
                "by `snca-gallery upgrade` (an alias, or it is on standby): it is not replaced at "
                "start-up; build this model's gallery beside the live one with `snca-gallery "
                "upgrade --to THIS_RUN_DIR --switch` (then start with --follow-alias, or with "
                "this model)"
            )
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
            with SqliteStore.carry_lock(p.old, self.status):
                new = self._open_target()
                carry = Carry(
                    Side(old, gen_of(old.meta()["model_fingerprint"], old.meta()["index_id"])),
                    Side(new, gen_of(p.target.fingerprint, p.target.index_id)),
                    None if p.reuse else self.embed,
                    self.batch,
                    lambda line: log.info(line),
                    self.progress,
                    renumber="auto",
                )
                carry.discard_hint = f"delete {new.path} and start again"
                st = carry.begin()
                carry.backfill(st)
                carry.catch_up(st)
                report = self._report(new, st)

                def ending(conn, seq, read):
                    # the old store's write lock is held: nothing commits there until this does
                    report.seconds = time.perf_counter() - t0
                    report.caught_up = st.caught_up
                    self._finish(new, carry, report, st, dict(read(sql.META)))
                    target = {
                        "model_fingerprint": p.target.fingerprint,
                        "index_id": p.target.index_id,
                        "at": utc_now(),
                        "pid": os.getpid(),
                    }
                    set_meta(conn, CARRIED_TO, json.dumps(target))

                carry.seal(st, ending, "seal")
                self._tidy(new, carry)
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
    def _open_target(self) -> SqliteStore:
        """The half-done new store of this very migration (resumed: the engine checks it comes
        from the same history), or a fresh one. One written by an older version (no engine
        state) or for another store is discarded: the old store still holds everything."""
        t, p = self.data.migrating, self.plan
        if t.exists():
            try:
                new = SqliteStore(t, self.seed, p.target.fingerprint, p.target.index_id)
                meta = new.meta()
                source = gen_of(
                    p.old_meta.get("model_fingerprint", ""), p.old_meta.get("index_id", "")
                )
                same = json.loads(meta.get(MIGRATING_FROM, "null")) == p.source
                if same and state_key(source) in meta:
                    log.info("resuming the migration in %s", t)
                    return new
                new.close()
                why = (
                    "a half-done migration written by an older version"
                    if MIGRATING_FROM in meta and not any(k.startswith("carry:") for k in meta)
                    else "a copy of another store"
                )
                log.warning("discarding %s (%s): carrying the gallery again", t, why)
            except (ArtifactError, ValueError) as e:
                log.warning("discarding %s: %s", t, e)
            for suffix in ("", "-wal", "-shm"):
                Path(str(t) + suffix).unlink(missing_ok=True)
        new = SqliteStore(t, self.seed, p.target.fingerprint, p.target.index_id)
        stamp = utc_now().replace(":", "").replace("+0000", "Z")
        archive = f"gallery-{stamp}-{p.old_meta.get('model_fingerprint', 'unknown')[7:19]}.sqlite"

        def setup(conn):
            set_meta(conn, MIGRATING_FROM, json.dumps(p.source))
            set_meta(conn, "archive", archive)

        new.plain(setup)
        return new

    def _report(self, new: SqliteStore, st: CarryState) -> Report:
        meta = new.meta()
        added = new.select(
            "SELECT COUNT(*) FROM items WHERE source = 'added' AND deleted_seq IS NULL"
        )[0][0]
        deleted = new.select(
            "SELECT COUNT(*) FROM items WHERE source = 'trained' AND deleted_seq IS NOT NULL"
        )[0][0]
        return Report(
            carried=int(added),
            uncarried=[tuple(u) for u in st.uncarried],
            deleted_trained=int(deleted),
            renumbered=st.ids == "renumbered",
            reembedded=not self.plan.reuse,
            archive=str(self.data.previous / meta["archive"]),
        )

    def _finish(
        self, new: SqliteStore, carry: Carry, report: Report, st: CarryState, old_meta: dict
    ) -> None:
        """The new store's last write before the seal: what was carried (the report,
        re-counted: the seal's follow may have carried more). Its carry state stays until the
        seal commits (a crash before that resumes the carry)."""
        fresh = self._report(new, st)
        report.carried, report.uncarried = fresh.carried, fresh.uncarried
        report.deleted_trained = fresh.deleted_trained

        # galleries built beside the old store by upgrades stay registered (not the old store's
        # own entry, nor the new one's: neither is a gallery beside it)
        own = {f"gallery:{carry.source.gen}", f"gallery:{carry.target.gen}"}
        registered = {
            k: v for k, v in old_meta.items() if k.startswith("gallery:") and k not in own
        }

        def fn(nconn):  # (bookkeeping: no seq, so the carry's state still describes it)
            set_meta(nconn, "migrated_from", json.dumps(self._summary(report)))
            for k, v in registered.items():  # galleries built beside it by upgrades
                set_meta(nconn, k, v)

        new.plain(fn)

    def _tidy(self, new: SqliteStore, carry: Carry) -> None:
        """The old store is sealed: the new one replaces it, no carry state left (a crash
        before this leaves them: harmless, the swap goes on)."""

        def fn(nconn):
            set_meta(nconn, MIGRATING_FROM, None)
            carry.forget(nconn)

        new.plain(fn)

    def _summary(self, report: Report) -> dict:
        return {**self.plan.source, "finished_at": utc_now(), **report.to_dict()}


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
