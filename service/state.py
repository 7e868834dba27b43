"""ServiceState: everything the routes share once the service is up, complete when built
(service/startup/ builds it): the model runtime, the store, the gallery, the write path
(store commit, then the gallery, in sequence order; snapshots) and the follower.

Every serving process is a replica of the store's change log. Its own writes are applied
before they are answered (read-your-writes); the follower thread applies everyone else's, in
seq order, as the store reports them (SQLite: polled; PostgreSQL: LISTEN/NOTIFY, polled as a
fallback). X-Min-Gallery-Version waits on `gallery.version` (deps.wait_for_version)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from embedding.index import IndexManifest
from service.config import Settings
from service.gallery.gallery import Gallery
from service.gallery.snapshot import Snapshotter, write_snapshot
from service.learned import Unlearned
from service.metrics import Metrics
from service.model.runtime import Runtime
from service.store import ChangeSet, Store, StoreCarriedAway, StoreUnavailable
from service.store.datadir import DataDir
from service.store.migration import Report
from service.store.records import (
    STANDBY,
    Keyed,
    Relabelled,
    StoreStandby,
    WriteNotApplied,
    carried_away_message,
    standby_message,
)

log = logging.getLogger("snca.service")

# A follower that polls (SQLite) looks every IDLE_POLL_S instead of every SNCA_FOLLOW_POLL_S once
# no write has been seen for IDLE_AFTER_S: an idle worker spent ~4 % of a core on each of its two
# processes polling every 10 ms (docs/PERFORMANCE.md); a first write after a quiet spell is then
# seen up to IDLE_POLL_S late by the other processes, unless a request waits for it.
IDLE_AFTER_S = 2.0
IDLE_POLL_S = 0.1


class ServiceState:
    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        runtime: Runtime,
        store: Store,
        gallery: Gallery,
        data: DataDir,
        manifest: IndexManifest,
        fingerprint: str,
        migration: Report | None = None,
        rebuild=None,
    ):
        self.settings = settings
        self.metrics = metrics
        self.runtime = runtime
        self.store = store
        self.gallery = gallery
        self.data = data
        self.manifest = manifest
        self.fingerprint = fingerprint
        self.index_id = manifest.index_id
        self.migration = migration  # what this start carried from a store of another model
        self.write_lock = threading.Lock()  # store commit + gallery apply, in sequence order
        self.writes_since_snapshot = 0
        self.snapshots = Snapshotter(self._take_snapshot)
        self.last_write_error: str | None = None
        self.follow_error: str | None = None  # why the log cannot be read now (store down)
        self.rebuilds = 0  # times this replica rebuilt from the store (log truncated past it)
        self.carried_away: str | None = None  # the store was carried to another model
        # another model's gallery is live (store/upgrade.py): writes refused, reads served
        self.standby: str | None = None
        with contextlib.suppress(StoreUnavailable):
            flag = store.meta().get(STANDBY)
            self.standby = None if flag is None else standby_message(flag)
        self._rebuild = rebuild  # () -> (VectorIndex, items, version): the start-up load again
        self._unlearned = Unlearned(settings.model)  # what snca-gallery learn would teach it
        self._closed = False
        self.started = time.time()
        self.update_gauges()
        self._poll_s = settings.follow_poll_s or store.default_poll_s
        # while no write has come for IDLE_AFTER_S, a polling follower (SQLite) looks every
        # IDLE_POLL_S instead (~4 % of a core per process at 10 ms), unless requests wait for
        # a version (`eager`: set by the app, service/http/admission.py)
        self._changed_at = time.monotonic()
        self.eager: Callable[[], bool] = lambda: False
        self._follower = threading.Thread(target=self._follow, name="snca-follow", daemon=True)
        self._follower.start()

    # ------------------------------------------------------------------ writes
    def _write(self, commit, apply):
        """The one write path: `commit()` -> (seq, result) in the store (seq 0: nothing
        written), then, under the write lock, `apply(seq, result)` to the gallery if nobody
        else wrote meanwhile, else the log up to seq (the other processes' writes first, then
        this one, as the follower applies them). A write that changed nothing in the gallery
        (an Idempotency-Key's recorded no-op) only moves the version. (seq, result)."""
        with self.write_lock:
            with self._store_write():
                seq, result = commit()
            if seq and self.gallery.version == seq - 1:
                apply(seq, result)
                self.gallery.version = max(self.gallery.version, seq)
                self._after_write()
            elif seq:
                self._applied_after_commit(seq)
            return seq, result

    def add(
        self,
        label: str,
        emb: np.ndarray,
        metadata: list,
        images: list,
        thumbnails=None,
        stats: np.ndarray | None = None,
        keyed: Keyed | None = None,
    ) -> tuple[list[int], int]:
        """Store and apply an add; `stats` (n, D) the images' world statistics, when known;
        `keyed`: the client's Idempotency-Key (Replayed: it was used before, nothing written)."""
        seq, ids = self._write(
            lambda: self.store.add(label, emb, metadata, images, thumbnails, stats, keyed),
            lambda seq, ids: self.gallery.apply_add(ids, label, emb, seq, stats),
        )
        return ids, seq

    def delete(
        self, ids: list[int] | None = None, label: str | None = None, keyed: Keyed | None = None
    ) -> tuple[list, int]:
        """Delete the live items among `ids` (or of `label`) as the store has them, not as this
        replica remembers them: an item added on another replica a moment ago is found even
        before this one applied it. ([], version) when none was live ([], seq with `keyed`:
        that outcome recorded)."""
        seq, rows = self._write(
            lambda: self.store.delete(ids, label, keyed),
            lambda seq, rows: rows and self.gallery.apply_delete(rows, seq),
        )
        return rows, seq or self.gallery.version

    def relabel(
        self, ids: list[int], label: str, keyed: Keyed | None = None
    ) -> tuple[list[Relabelled], int]:
        """Move the live items among `ids` to `label` (as the store has them); ([], version)
        when every live one has it already; records.Refused item_unknown when none is live."""
        return self._correct(lambda: self.store.relabel(ids, label, keyed), label)

    def rename(
        self, old: str, new: str, merge: bool = False, keyed: Keyed | None = None
    ) -> tuple[list[Relabelled], int]:
        """Every live item of `old` moved to `new` (a rename, or with `merge` a merge into
        `new`: records.Refused when `new` has items, or has none); ([], version) when `old`
        has none."""
        return self._correct(lambda: self.store.rename(old, new, merge, keyed), new)

    def name_queued(
        self, ids: list[int], label: str, keyed: Keyed | None = None
    ) -> tuple[list[int], list, int]:
        """The queued queries among `ids` become items of `label` (store.name_queued: one
        add) and are applied here: (new ids, the queued rows named, seq); ([], [], version)
        when none is queued."""

        def commit():
            seq, new, queued = self.store.name_queued(ids, label, keyed)
            return seq, (new, queued)

        def apply(seq, result):
            new, queued = result
            if queued:
                emb = np.stack([q.embedding for q in queued])
                self.gallery.apply_add(new, label, emb, seq, [q.world for q in queued])

        seq, (new, queued) = self._write(commit, apply)
        return new, queued, seq or self.gallery.version

    def _correct(self, write, label: str) -> tuple[list[Relabelled], int]:
        def apply(seq, moved):
            if moved:
                self.gallery.apply_relabel(moved, label, seq)

        seq, moved = self._write(write, apply)
        return moved, seq or self.gallery.version

    @contextlib.contextmanager
    def _store_write(self):
        """Around a store write (under the write lock): what its failure tells of the store is
        kept for /readyz and the next writes; a success clears it (the store works again)."""
        try:
            yield
        except StoreCarriedAway as e:
            self._retire(str(e))
            raise
        except StoreStandby as e:
            self.standby = str(e)  # (the follower clears it once this gallery is live)
            raise
        except StoreUnavailable as e:
            self.last_write_error = str(e)
            raise
        self.last_write_error = self.follow_error = None

    def _applied_after_commit(self, seq: int) -> None:
        """Under the write lock, after write `seq` committed: the log up to it applied (the
        writes of other processes first). The store failing now does not undo the commit: the
        answer says it was made (WriteNotApplied), and the follower applies it later."""
        try:
            self._catch_up_locked()
        except StoreUnavailable as e:
            self.follow_error = str(e)
            raise WriteNotApplied(
                seq, f"the store could not be read after the commit: {e}"
            ) from None

    # ------------------------------------------------------------------ following the log
    def catch_up(self) -> int:
        """Apply every write committed after the gallery's version; the version after."""
        with self.write_lock:
            return self._catch_up_locked()

    def _catch_up_locked(self) -> int:
        g = self.gallery
        cs: ChangeSet = self.store.changes_after(g.version)
        if cs.carried_to is not None:
            self._retire(carried_away_message(cs.carried_to))
            raise StoreCarriedAway(self.carried_away)
        self.standby = None if cs.standby is None else standby_message(cs.standby)
        if cs.floor > g.version > 0:
            self._rebuild_locked(cs.floor)
            return g.version
        applied = g.version  # (a write may be two changes: a carry's adds and deletes)
        for c in cs.changes:
            if c.seq <= applied:
                continue
            g.apply(c)  # (by its kind: an add, a correction, a carry's write, a delete)
            self._after_write()
        # writes that changed no item (a delete of ids already gone) move the version too
        g.version = max(g.version, cs.last_seq)
        return g.version

    def _retire(self, why: str) -> None:
        """The store was carried to another model (sealed by the migration of a process that
        serves it): stop following and writing it, and let go of its file so that migration
        can put the new store in its place. Reads go on from memory; /readyz says why."""
        if self.carried_away is None:
            self.carried_away = why
            log.warning(why)
        self.store.retire(why)

    def _rebuild_locked(self, floor: int) -> None:
        """The log no longer reaches back to this replica's version (compacted past it): load
        the gallery again from the built index and the store, as a start does."""
        was = self.gallery.version
        vectors, items, version = self._rebuild()
        self.gallery.replace(vectors, items, version)
        self.rebuilds += 1
        self.update_gauges()
        log.warning(
            "rebuilt the gallery from the store: the log starts after write %d, this replica "
            "was at %d",
            floor,
            was,
            extra={"fields": {"was": was, "floor": floor, "version": version}},
        )

    def _follow(self) -> None:
        """The follower thread: wait for the store's head to move, then catch up."""
        while not self._closed and self.carried_away is None:
            try:
                head = self.store.wait_head(self.gallery.version, self._follow_timeout())
                if head > self.gallery.version and not self._closed:
                    self._changed_at = time.monotonic()
                    self.catch_up()
                if self.follow_error is not None:  # the store is back: so may writes be
                    log.info("following the gallery store again")
                    self.follow_error = self.last_write_error = None
            except StoreUnavailable as e:
                if self.carried_away is not None:
                    return  # for good: this process must be restarted with the new model
                if self.follow_error is None:
                    log.warning("cannot follow the gallery store: %s", e)
                self.follow_error = str(e)
                time.sleep(1.0)
            except Exception:  # never let the follower die: log, back off, retry
                log.exception("following the gallery store failed")
                time.sleep(1.0)

    def _follow_timeout(self) -> float:
        """How long the follower waits for the head: SNCA_FOLLOW_POLL_S, or IDLE_POLL_S (if
        longer) once nothing was written for IDLE_AFTER_S and no request waits for a version."""
        if time.monotonic() - self._changed_at < IDLE_AFTER_S or self.eager():
            return self._poll_s
        return max(self._poll_s, IDLE_POLL_S)

    def _after_write(self) -> None:
        self._changed_at = time.monotonic()  # (writes here: others' may follow soon)
        self.update_gauges()
        self.writes_since_snapshot += 1
        if (
            self.settings.snapshot_every
            and self.writes_since_snapshot >= self.settings.snapshot_every
        ):
            self.snapshots.request()

    def snapshot(self) -> tuple[int, Path]:
        """A snapshot now (after any in progress): see _take_snapshot."""
        return self.snapshots.now()

    def _take_snapshot(self) -> tuple[int, Path]:
        """Serialize the index and take its seq under the write lock (writes paused, reads go
        on): the pair is consistent. Then write it to disk."""
        with self.write_lock, self.gallery.lock.read():
            blob, tombstones = self.gallery.vectors.serialize()
            seq = self.gallery.version
            self.writes_since_snapshot = 0
        token = self.store.log_token(seq) if seq else None  # (log rows never change)
        path = write_snapshot(
            self.data.path, blob, seq, tombstones, self.fingerprint, self.index_id, token
        )
        log.info("snapshot written", extra={"fields": {"seq": seq, "path": str(path)}})
        return seq, path

    # ------------------------------------------------------------------ status
    def unlearned(self) -> tuple[int, int]:
        """(live items the served model has not learned from, the version counted at):
        service/learned.py; recounted at most every few seconds."""
        return self._unlearned.count(self.store, self.gallery.version)

    def update_gauges(self) -> None:
        added = self.gallery.added_size()
        self.metrics.gallery_items.labels("added").set(added)
        self.metrics.gallery_items.labels("trained").set(self.gallery.size() - added)

    def store_writable(self) -> bool:
        return (
            self.carried_away is None
            and self.standby is None
            and self.last_write_error is None
            and self.follow_error is None
            and self.store.unwritable() is None
        )

    def store_problem(self) -> str | None:
        """Why the store cannot be written or followed now (None: it can)."""
        return (
            self.carried_away
            or self.standby
            or self.last_write_error
            or self.follow_error
            or self.store.read_only
            or self.store.unwritable()
        )

    def stop(self) -> None:
        self._closed = True
        self._follower.join(timeout=5)
        self.snapshots.close()
        self.runtime.close()
        self.store.close()
