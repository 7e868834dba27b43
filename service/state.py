"""ServiceState: everything the routes share once the service is up, complete when built
(service/startup.py builds it): the model runtime, the store, the gallery, and the write path
(store commit, then the gallery, in sequence order; snapshots)."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import numpy as np

from embedding.index import IndexManifest

from .config import Settings
from .datadir import DataDir
from .gallery import Gallery
from .metrics import Metrics
from .migration import Report
from .runtime import ModelRuntime
from .snapshot import Snapshotter, write_snapshot
from .store import GalleryStore, StoreUnavailable

log = logging.getLogger("snca.service")


class ServiceState:
    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        runtime: ModelRuntime,
        store: GalleryStore,
        gallery: Gallery,
        data: DataDir,
        manifest: IndexManifest,
        fingerprint: str,
        migration: Report | None = None,
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
        self.started = time.time()
        self.update_gauges()

    # ------------------------------------------------------------------ writes
    def add(
        self, label: str, emb: np.ndarray, metadata: list, images: list, thumbnails=None
    ) -> tuple[list[int], int]:
        with self.write_lock:
            try:
                seq, ids = self.store.add(label, emb, metadata, images, thumbnails)
            except StoreUnavailable as e:
                self.last_write_error = str(e)
                raise
            self.last_write_error = None
            self.gallery.apply_add(ids, label, emb, seq)
            self._after_write()
            return ids, seq

    def delete(self, ids: list[int]) -> tuple[list, int]:
        with self.write_lock:
            try:
                seq, rows = self.store.delete(ids)
            except StoreUnavailable as e:
                self.last_write_error = str(e)
                raise
            self.last_write_error = None
            self.gallery.apply_delete(rows, seq)
            self._after_write()
            return rows, seq

    def _after_write(self) -> None:
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
        path = write_snapshot(
            self.data.path, blob, seq, tombstones, self.fingerprint, self.index_id
        )
        log.info("snapshot written", extra={"fields": {"seq": seq, "path": str(path)}})
        return seq, path

    # ------------------------------------------------------------------ status
    def update_gauges(self) -> None:
        added = self.gallery.added_size()
        self.metrics.gallery_items.labels("added").set(added)
        self.metrics.gallery_items.labels("trained").set(self.gallery.size() - added)

    def store_writable(self) -> bool:
        return self.last_write_error is None and self.store.unwritable() is None

    def stop(self) -> None:
        self.snapshots.close()
        self.runtime.close()
        self.store.close()
