"""Everything the routes share: model, store, gallery, batcher, metrics; start-up and writes."""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np
import torch
from starlette.concurrency import run_in_threadpool

from embedding import load_model
from embedding.errors import ArtifactError
from embedding.index import STORE_FILE, open_index_dir
from embedding.thumbnails import make_thumbnail

from .batcher import MicroBatcher
from .config import Settings
from .embedder import Embedder, load_image, open_image
from .gallery import Classification, Gallery
from .metrics import Metrics
from .snapshot import load_snapshot, write_snapshot
from .store import GalleryStore, StoreUnavailable

log = logging.getLogger("snca.service")

# Images up to this many pixels (per request) are decoded on the event loop: ~50 us for a
# 28x28 PNG, against ~150 us+ for a hop to a worker thread and back under load.
INLINE_PIXELS = 96 * 96
# A model slower than this per image (on one thread) gets every core; see _auto_threads.
HEAVY_MODEL_MS = 2.0


@dataclass
class Job:
    kind: str  # "classify" or "embed"
    pixels: np.ndarray  # uint8 (C, H, W), Embedder.pixels
    params: tuple = ()  # classify: (vote, k, labels tuple or None, neighbors)


@dataclass
class Prepared:
    pixels: np.ndarray  # uint8 (C, H, W), Embedder.pixels
    data: bytes
    mime: str
    thumbnail: bytes | None = None  # when asked for (gallery adds with SNCA_THUMBNAILS)


class ServiceState:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.metrics = Metrics()
        self.ready = False
        self.write_lock = threading.Lock()  # store commit + gallery apply, in sequence order
        self.writes_since_snapshot = 0
        self.last_write_error: str | None = None
        self.started = time.time()
        self.fused_sizes: list[int] = []  # batch sizes served by a fused model copy

    # ------------------------------------------------------------------ start-up
    def start(self) -> None:
        s = self.settings
        t0 = time.perf_counter()
        device = torch.device("cuda" if s.device != "cpu" and torch.cuda.is_available() else "cpu")
        if s.device == "cuda" and device.type != "cuda":
            raise RuntimeError("SNCA_DEVICE=cuda but no CUDA device is available")
        model = load_model(s.model)
        self.fingerprint = model.fingerprint
        ix = open_index_dir(s.index, expected_fingerprint=model.fingerprint)
        # queries are embedded in the space the index was built in (index_builder --space)
        self.embedder = Embedder(model, device, space=ix.manifest.get("space", "embedding"))
        if self.embedder.dim != ix.dim:
            raise ArtifactError(
                f"index {ix.path} holds {ix.dim}-d vectors but the model gives "
                f"{self.embedder.dim}-d ones in space {self.embedder.space!r}"
            )
        self.batcher = MicroBatcher(self._run_batch, s.max_batch, s.max_wait_ms, self._on_batch)

        def prepare_model() -> None:  # on the model thread, which runs every forward
            torch.set_num_threads(1)
            if s.optimize:
                self.embedder.optimize()
            self.embedder.warmup()
            self.torch_threads = s.torch_threads or self._auto_threads()
            torch.set_num_threads(self.torch_threads)
            if s.optimize:
                self.fused_sizes = self.embedder.fuse_small_batches(
                    s.fused_batches, s.fused_memory_mb
                )
            self.warmup_s = self.embedder.warmup_every_size(s.max_batch)

        self.batcher.call(prepare_model)
        self.manifest = ix.manifest
        self.index_id = ix.manifest.get("index_id", "")
        s.data_dir.mkdir(parents=True, exist_ok=True)
        self.store = GalleryStore(s.store, ix.path / STORE_FILE, model.fingerprint, self.index_id)
        last_seq = self.store.last_seq()
        snap = load_snapshot(s.data_dir, model.fingerprint, self.index_id, last_seq)
        index, base_seq, tombstones = (
            (ix.index, 0, set()) if snap is None else (snap.index, snap.seq, snap.tombstones)
        )
        g = Gallery(index, ix.manifest["search_params"], ix.dim, model.config.temperature)
        g.tombstones = tombstones
        g.load_items(self.store.live_items())
        # Bring the index up to the store: writes after the snapshot (or after the build).
        replay_add = self.store.live_items(after_seq=base_seq)
        for item in replay_add:
            g._index_add(np.array([item.id], dtype=np.int64), item.embedding[None, :])
        replay_del = [r for r in self.store.deleted_after(base_seq) if r[3] <= base_seq]
        if replay_del:
            g._index_remove(np.array([r[0] for r in replay_del], dtype=np.int64))
        g.version = last_seq
        # The first classify builds the gallery's vote caches and compiles the kde vote
        # (measured 16.5 ms against 2.8 ms after, 55,000 items): done here, not on a request.
        q = np.eye(1, ix.dim, dtype=np.float32)
        self.batcher.call(lambda: g.classify(q, s.vote, s.k))
        self.gallery = g
        self._update_gauges()
        self.ready = True
        log.info(
            "ready",
            extra={
                "fields": {
                    "model": str(s.model),
                    "index": str(s.index),
                    "store": str(s.store),
                    "items": g.size(),
                    "snapshot_seq": base_seq,
                    "store_seq": last_seq,
                    "replayed_adds": len(replay_add),
                    "replayed_deletes": len(replay_del),
                    "device": str(device),
                    "model_mode": self.embedder.mode,
                    "space": self.embedder.space,
                    "warmup_s": round(self.warmup_s, 2),
                    "fused_batch_sizes": self.fused_sizes,
                    "torch_threads": self.torch_threads,
                    "seconds": round(time.perf_counter() - t0, 2),
                }
            },
        )

    def _auto_threads(self) -> int:
        """Threads for the forward pass when SNCA_TORCH_THREADS is 0. The event loop needs
        about half a millisecond of one core per request (HTTP, multipart, decoding). A light
        model (conv4: ~0.2 ms per image) leaves the loop a core of its own, cores - 1; a heavy
        one (ResNet: several ms per image) is the bottleneck, so it gets every core."""
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        cores = cores or 1
        if cores == 1 or self.embedder.device.type != "cpu":
            return max(1, cores - 1)
        c, size = self.embedder.model.config.in_channels, self.embedder.model.config.image_size
        x = torch.zeros(32, c, size, size, dtype=torch.uint8)
        t0 = time.perf_counter()
        self.embedder.embed(x)
        per_image_ms = (time.perf_counter() - t0) / 32 * 1000
        return cores if per_image_ms > HEAVY_MODEL_MS else cores - 1

    def stop(self) -> None:
        self.ready = False
        if hasattr(self, "batcher"):
            self.batcher.close()
        if hasattr(self, "store"):
            self.store.close()

    # ------------------------------------------------------------------ images and batches
    def prepare(self, data: bytes, name: str) -> Prepared:
        """Decode + preprocess one upload (blocking; see `prepare_async`)."""
        return self._finish(open_image(data, self.settings.max_image_pixels, name), data, name)

    def _finish(self, img, data: bytes, name: str, thumbnail: bool = False) -> Prepared:
        img, mime = load_image(img, name)
        thumb = make_thumbnail(img, self.settings.thumbnail_side) if thumbnail else None
        return Prepared(self.embedder.pixels(img), data, mime, thumb)

    async def prepare_async(
        self, datas: list[bytes], names: list[str], thumbnails: bool = False
    ) -> list[Prepared]:
        """Decode + preprocess uploads. The header is read on the event loop (cheap, bounded);
        small images (at most INLINE_PIXELS in all, e.g. 28x28 or 64x64) are decoded there
        too, because a thread hop costs more than decoding them; larger ones in a thread."""
        imgs = [
            open_image(d, self.settings.max_image_pixels, n)
            for d, n in zip(datas, names, strict=True)
        ]
        t = thumbnails
        if sum(i.size[0] * i.size[1] for i in imgs) <= INLINE_PIXELS:
            return [self._finish(i, d, n, t) for i, d, n in zip(imgs, datas, names, strict=True)]
        return await run_in_threadpool(
            lambda: [self._finish(i, d, n, t) for i, d, n in zip(imgs, datas, names, strict=True)]
        )

    def _run_batch(self, jobs: list[Job]) -> list:
        """In the model thread: one forward for the whole batch, then classification of the
        classify jobs grouped by their parameters (one matmul / search per group)."""
        # Under load every call that releases the GIL waits for the event loop to give it
        # back, so the common batch (classify jobs with the same parameters) makes three such
        # calls: the queue's wake-up, the forward pass and the vote (docs/PERFORMANCE.md).
        emb = self.embedder.forward(self.embedder.stack_pixels([j.pixels for j in jobs]))  # (B, d)
        out: list = [None] * len(jobs)
        groups: dict[tuple, list[int]] = {}
        embeds: list[int] = []
        for i, j in enumerate(jobs):
            if j.kind == "classify":
                groups.setdefault(j.params, []).append(i)
            else:
                embeds.append(i)
        if embeds:  # gallery adds: numpy rows
            rows = emb.numpy()
            for i in embeds:
                out[i] = rows[i].copy()  # its own memory, not a view holding the batch
        for (vote, k, labels, neighbors), idx in groups.items():
            q = emb if len(idx) == len(jobs) else emb[idx]
            res = self.gallery.classify(q, vote, k, list(labels) if labels else None, neighbors)
            for i, r in zip(idx, res, strict=True):
                out[i] = r
        return out

    def _on_batch(self, size: int, waited: float) -> None:
        self.metrics.batch_size.observe(size)
        self.metrics.queue_wait.observe(waited)

    async def classify(
        self, p: Prepared, vote: str, k: int, labels: tuple | None, neighbors: bool
    ) -> Classification:
        return await self.batcher.submit(Job("classify", p.pixels, (vote, k, labels, neighbors)))

    async def embed(self, p: Prepared) -> np.ndarray:
        return await self.batcher.submit(Job("embed", p.pixels))

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
            self._after_write(len(ids))
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
            self._after_write(len(rows))
            return rows, seq

    def _after_write(self, n: int) -> None:
        self._update_gauges()
        self.writes_since_snapshot += 1
        if (
            self.settings.snapshot_every
            and self.writes_since_snapshot >= self.settings.snapshot_every
        ):
            threading.Thread(target=self._snapshot_quietly, daemon=True).start()

    def _snapshot_quietly(self) -> None:
        try:
            self.snapshot()
        except Exception:  # a failed snapshot only makes the next start replay more
            log.exception("snapshot failed")

    def snapshot(self) -> tuple[int, Path]:
        """Serialize the index (writes paused, reads go on), then write it to disk."""
        with self.write_lock, self.gallery.lock.read():
            blob = faiss.serialize_index(self.gallery.index)
            seq = self.gallery.version
            tombstones = set(self.gallery.tombstones)
            self.writes_since_snapshot = 0
        path = write_snapshot(
            self.settings.data_dir, blob, seq, tombstones, self.fingerprint, self.index_id
        )
        log.info("snapshot written", extra={"fields": {"seq": seq, "path": str(path)}})
        return seq, path

    def _update_gauges(self) -> None:
        added = int(self.gallery.added.sum())
        self.metrics.gallery_items.labels("added").set(added)
        self.metrics.gallery_items.labels("trained").set(self.gallery.size() - added)

    def store_writable(self) -> bool:
        p = Path(self.settings.store)
        return (
            self.last_write_error is None and os.access(p, os.W_OK) and os.access(p.parent, os.W_OK)
        )
