"""The model at serving time: the embedder on its own model thread behind the micro-batcher,
and the batches (one forward, then the votes); uploads into model input: uploads.py."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
from anyio import to_thread
from threadpoolctl import ThreadpoolController

from embedding.device import resolve_device
from embedding.sysalloc import default_freed_memory
from service.config import Settings
from service.gallery.gallery import Classification, Gallery
from service.gallery.query import VoteQuery
from service.gallery.verdict import answered, explain, unknown_reason
from service.model.batcher import InlineCalls, MicroBatcher
from service.model.embedder import (
    Embedder,
    ImageError,
    Preprocessing,
)
from service.model.uploads import Prepared, Uploads

# A model slower than this per image (on one thread) gets every core; see auto_threads.
HEAVY_MODEL_MS = 2.0

log = logging.getLogger("snca.service")


@dataclass
class Job:
    kind: str  # "classify" or "embed"
    pixels: np.ndarray  # uint8 (C, H, W), Embedder.pixels
    query: VoteQuery | None = None  # classify: what the request asks of the vote


@dataclass
class ModelInfo:
    """How the model was set up at start (reported in the ready log line)."""

    device: str
    mode: str  # "optimized" or "eager: <why>"
    torch_threads: int
    fused_sizes: list[int]  # batch sizes served by a fused copy
    warmup_s: float
    warmed_sizes: int  # batch sizes 1..this were run once at start (SNCA_WARMUP_SECONDS)
    engine: str = "torch"  # what runs the forward (SNCA_ENGINE; service/model/engines)
    engine_note: str = ""  # why that one: auto's timings, or why torch serves
    max_batch: int = 64  # images a forward at most: SNCA_MAX_BATCH, or less (batch_cap)


class Runtime(ABC):
    """What the service asks of its model, implemented twice: `ModelRuntime` (the model in this
    process: a model thread) and `RemoteRuntime` (service/model/remote.py: the model in a
    process of its own, over service/model/wire.py). ServiceState, start-up and the routes
    know only this. Uploads are decoded into model input (uint8 pixels at the model's size)
    by `uploads` (service/model/uploads.py), on the process that runs the event loop; needs
    `settings` and `embedder` (a Preprocessing)."""

    settings: Settings
    embedder: Preprocessing

    @cached_property
    def uploads(self) -> Uploads:
        """Uploads into this model's input (service/model/uploads.py); made once, on first use
        (each implementation sets `settings` and `embedder` once, when it is built)."""
        return Uploads(self.settings, self.embedder)

    async def prepare_queries(self, datas: list[bytes], names: list[str]) -> list[Prepared]:
        """Uploads to classify (`answers`), as this runtime takes them: decoded here (a
        model process takes small ones encoded: RemoteRuntime)."""
        return await self.uploads.prepare_async(datas, names)

    # ------------------------------------------------------------ what each implements
    @abstractmethod
    def wait_ready(self, progress=None, waiting=None) -> None:
        """Block until the model can answer (progress(done, total), waiting(why): start-up)."""

    @abstractmethod
    def serve(self, gallery: Gallery, vote: str | None = None, k: int | None = None) -> None:
        """Vote over `gallery` from now on (with the default vote and k to warm up)."""

    @abstractmethod
    def start(self) -> None:
        """Begin answering on the running event loop."""

    @abstractmethod
    async def stop(self) -> None:
        """Finish the batches in flight."""

    @abstractmethod
    def close(self) -> None:
        """Release the model (threads, process)."""

    @abstractmethod
    def problem(self) -> str | None:
        """Why the model cannot answer now (/readyz), or None."""

    @abstractmethod
    def migration_report(self):
        """What a start-up carry in the model's process reported (None: none there)."""

    @abstractmethod
    def pid(self) -> int | None:
        """The process that runs the model."""

    def counters(self) -> dict[str, int]:
        """What /readyz says of the model's process beyond its state (none in this process)."""
        return {}

    @abstractmethod
    async def answers(
        self, prepared: list[Prepared], query: VoteQuery, tpr: float | None
    ) -> list[Answer]:
        """Classify uploads: one Answer each, in order, judged at rate `tpr`."""

    @abstractmethod
    async def embed(self, p: Prepared) -> np.ndarray:
        """The upload's row [vector | world statistics] (Embedder.split takes it apart)."""

    @abstractmethod
    async def sync(self, seq: int) -> int:
        """Return once write `seq` is applied where the model votes (the version reached)."""


@dataclass
class Answer:
    """One classification as the route formats it: the vote's result, the open-set threshold
    of its label at the request's rate (None: none or unknown=off), the gallery version the
    vote read, and the unknown verdict (service/gallery/verdict.py; None: known)."""

    c: Classification
    threshold: float | None
    version: int
    unknown_reason: str | None = None

    @classmethod
    def judged(cls, c: Classification, threshold, version: int, tpr, s: Settings) -> Answer:
        """The answer with its verdict at rate `tpr` (None: unknown=off) under `s`'s floors."""
        why = unknown_reason(c, threshold, tpr, s.unknown_similarity, s.unknown_probability)
        return cls(c, threshold, version, why)

    def result(
        self, fingerprint: str, s: Settings, vote: str, k: int, neighbors: bool, tpr
    ) -> dict:
        """The ClassifyResult (service/http/schemas.py) as a plain dict: what /classify answers
        and `snca-gallery classify` writes. `threshold`: the label's open-set threshold at
        acceptance `tpr` (None: unknown=off, or none); `unknown_reason` the verdict
        (service/gallery/verdict.py)."""
        c, threshold, reason = self.c, self.threshold, self.unknown_reason
        w = c.world
        label, confidence = answered(c, reason)
        r = {
            "label": label,
            "confidence": confidence,
            "nearest_label": c.label,
            "nearest_probability": c.confidence if c.label is not None else None,
            "probabilities": [
                {"label": lab, "probability": min(1.0, p)} for lab, p in c.probabilities
            ],
            "unknown": reason is not None,
            "unknown_reason": reason,
            "explanation": explain(
                c, reason, threshold, s.unknown_similarity, s.unknown_probability
            ),
            "unknown_score": c.unknown_score,
            "unknown_threshold": threshold,
            "unknown_tpr": tpr or None,
            "world_score": w.score,
            "world_threshold": w.threshold,
            "world_basis": w.basis,
            "best_similarity": c.best_similarity,
            "vote": vote,
            "k": k,
            "gallery_version": self.version,  # the version the vote read
            "model_fingerprint": fingerprint,
        }
        if neighbors:
            r["neighbors"] = [
                {"id": i, "label": lab, "similarity": sim} for i, lab, sim in c.neighbors
            ]
        return r


class ModelRuntime(Runtime):
    """One per process: the model thread runs every forward pass (and the warm-up)."""

    def __init__(self, settings: Settings, embedder: Embedder, on_batch=None, inline: bool = False):
        """Start the model thread and prepare the model there (optimise, fuse, warm up every
        batch size); `on_batch(size, queue wait, seconds by phase)` is called after each batch
        (metrics; the phases: `spent`). `inline`: no model thread; the caller's thread runs
        everything (the model process, service/model_process.py, whose main thread runs the
        batches)."""
        super().__init__()
        self.settings = settings
        self.embedder = embedder
        self.gallery: Gallery | None = None  # set by `serve` once the gallery is loaded
        # the last batch's seconds by phase: the forward, the votes (and world checks)
        self.spent: dict[str, float] = {}
        if inline:
            self.batcher = InlineCalls()
        else:
            done = None if on_batch is None else lambda n, w: on_batch(n, w, self.spent)
            self.batcher = MicroBatcher(
                self.run_batch, settings.max_batch, settings.max_wait_ms, done
            )
        self.info: ModelInfo = self.batcher.call(self._prepare_model)
        self.batcher.max_batch = self.info.max_batch  # (InlineCalls: unused)

    @classmethod
    def load(
        cls,
        settings: Settings,
        model,
        space: str,
        on_batch=None,
        world: bool = False,
        inline: bool = False,
    ) -> ModelRuntime:
        """`model` (an EmbeddingNet) on the settings' device, serving vectors of `space` (and
        with `world` the world statistics beside them)."""
        device = resolve_device(settings.device)
        embedder = Embedder(model, device, space=space, world=world)
        return cls(settings, embedder, on_batch, inline)

    def _prepare_model(self) -> ModelInfo:
        """On the model thread, which runs every forward."""
        s, e = self.settings, self.embedder
        # numpy's OpenBLAS (pthreads build: the world check's matmuls, a few us) keeps its
        # worker threads spinning after each call, which took a core from the next forward:
        # ResNet-50 at 224 px classified a photo in 87 ms instead of 55 (its forward 82 instead
        # of 46). FAISS's OpenBLAS (an OpenMP build, which sleeps) was not the cause: untouched.
        ThreadpoolController().select(internal_api="openblas", threading_layer="pthreads").limit(
            limits=1
        )
        torch.set_num_threads(1)
        cfg = e.model.config
        # start-up says what it is doing: a photo model takes tens of seconds here on a small CPU
        log.info("model: %s at %d px on %s: preparing", cfg.arch, cfg.image_size, e.device)
        chosen = e.use_engine(self.engine_dirs(), s.engine)
        if chosen.engine is None:  # the torch path: traced, fused copies
            if s.engine != "torch" and e.device.type == "cpu":
                log.warning("model: engine torch (%s)", chosen.note)  # the fallback, and why
            if s.optimize:
                e.optimize()
            e.warmup()
            threads = s.torch_threads or self.auto_threads()
            torch.set_num_threads(threads)
            fused = e.fuse_small_batches(s.fused_batches, s.fused_memory_mb) if s.optimize else []
        else:  # an inference engine, timed on one thread by its choice
            threads = s.torch_threads or self.threads_for(chosen.per_image_ms)
            if chosen.engine.malloc_defaults:
                default_freed_memory()
            chosen.at_threads(threads)
            e.engine = chosen.engine
            fused = []
        cap, timed = e.batch_cap(s.max_batch, s.batch_min_gain)
        if cap < s.max_batch:
            log.info(
                "model: batches of up to %d images (ms an image: %s; a batch twice as large "
                "would run an image less than %g%% faster: SNCA_BATCH_MIN_GAIN)",
                cap,
                ", ".join(f"{b}: {ms:.2f}" for b, ms in timed.items()),
                100 * s.batch_min_gain,
            )
        if s.warmup_seconds > 0:
            log.info("model: warming up batch sizes 1..%d (at most %g s)", cap, s.warmup_seconds)
        warm, sizes = e.warmup_every_size(cap, s.warmup_seconds)
        log.info(
            "model: ready (engine %s: %s; %s, %d thread(s), %.1f s warming up)",
            chosen.name,
            chosen.note,
            e.mode,
            threads,
            warm,
        )
        return ModelInfo(
            str(e.device), e.mode, threads, fused, warm, sizes, chosen.name, chosen.note, cap
        )

    def engine_dirs(self) -> list[Path]:
        """Where the engine's export is cached: the run dir, else the data dir (read-only runs)."""
        s = self.settings
        return [Path(s.model) / "engines", *([Path(s.data_dir) / "engines"] if s.data_dir else [])]

    def auto_threads(self) -> int:
        """Threads for the torch forward pass when SNCA_TORCH_THREADS is 0: `threads_for` the
        time of one batch of 32 on one thread."""
        if self.embedder.device.type != "cpu":
            return max(1, _cores() - 1)
        c, size = self.embedder.model.config.in_channels, self.embedder.model.config.image_size
        x = torch.zeros(32, c, size, size, dtype=torch.uint8)
        t0 = time.perf_counter()
        self.embedder.embed(x)
        return self.threads_for((time.perf_counter() - t0) / 32 * 1000)

    @staticmethod
    def threads_for(per_image_ms: float | None) -> int:
        """The event loop needs about half a millisecond of one core per request (HTTP,
        multipart, decoding). A light model (conv4: ~0.2 ms per image) leaves the loop a core of
        its own, cores - 1; a heavy one (ResNet: several ms per image) is the bottleneck, so it
        gets every core."""
        cores = _cores()
        if cores == 1:
            return 1
        return cores if (per_image_ms or 0) > HEAVY_MODEL_MS else cores - 1

    def wait_ready(self, progress=None, waiting=None) -> None:
        """(The model is ready once built; a model process says when it is: remote.py.)"""

    def serve(self, gallery: Gallery, vote: str | None = None, k: int | None = None) -> None:
        """Classify jobs vote over `gallery` from now on. The first classify builds the
        gallery's vote caches and compiles the kde vote (measured 16.5 ms against 2.8 ms
        after, 55,000 items): done here with `vote` and `k`, not on a request."""
        if vote is not None:
            q = np.eye(1, gallery.dim, dtype=np.float32)
            self.batcher.call(lambda: gallery.classify(q, vote, k))
        self.gallery = gallery

    def start(self) -> None:
        """Results go to the running event loop from now on."""
        self.batcher.start()

    async def stop(self) -> None:
        """Finish the batches in flight, then stop the model thread."""
        await self.batcher.stop()

    def close(self) -> None:
        self.batcher.close()

    def problem(self) -> str | None:
        """Why the model cannot answer now (None: it can; in this process it always can)."""
        return None

    def migration_report(self):
        """(A migration in this process is reported by start-up itself: startup.carry.migrate.)"""
        return None

    def pid(self) -> int:
        """The process that runs the model."""
        return os.getpid()

    async def sync(self, seq: int) -> int:
        """A write with this seq is applied where the model votes: in this process it was, by
        the write itself (ServiceState.add)."""
        return self.gallery.version

    def embed_stored(self, images: list[bytes]):
        """Embed stored images (a migration re-embedding the gallery), blocking: (vectors
        (n_ok, d) float32, world statistics (n_ok, D) or None) for those that decode, and per
        image None or why it could not be read."""
        pixels, errors = [], []
        for i, data in enumerate(images):
            try:
                pixels.append(self.uploads.prepare(data, f"item {i}").pixels)
                errors.append(None)
            except ImageError as e:
                errors.append(e.message)
        emb, stats = self.embedder.split(self.embed_pixels(pixels))
        return emb, stats, errors

    def embed_pixels(self, pixels: list[np.ndarray]) -> np.ndarray:
        """Prepared pixels (Prepared.pixels) -> (n, d [+ D]) float32 rows (Embedder.split
        takes them apart), blocking, through the model thread max_batch at a time."""
        out = []
        step = self.info.max_batch
        for s in range(0, len(pixels), step):
            chunk = pixels[s : s + step]
            out.append(
                self.batcher.call(
                    lambda c=chunk: (
                        self.embedder.forward(self.embedder.stack_pixels(c)).numpy().copy()
                    )
                )
            )
        d = self.embedder.dim + self.embedder.world_dim
        return np.concatenate(out) if out else np.zeros((0, d), np.float32)

    # ------------------------------------------------------------------ batches
    def run_batch(self, jobs: list[Job]) -> list:
        """In the model thread: one forward for the whole batch, then classification of the
        classify jobs grouped by their parameters (one matmul / search per group)."""
        # Under load every call that releases the GIL waits for the event loop to give it
        # back, so the common batch (classify jobs with the same parameters) makes three such
        # calls: the queue's wake-up, the forward pass and the vote (docs/PERFORMANCE.md).
        self.spent = {}  # (a batch that fails reports no phases of its own)
        t0 = time.perf_counter()
        rows = self.embedder.forward(self.embedder.stack_pixels([j.pixels for j in jobs]))
        t1 = time.perf_counter()
        emb, stats = self.embedder.split(rows)  # (B, d), (B, D) or None
        out: list = [None] * len(jobs)
        groups: dict[tuple, list[int]] = {}
        embeds: list[int] = []
        for i, j in enumerate(jobs):
            if j.kind == "classify":
                groups.setdefault(j.query, []).append(i)
            else:
                embeds.append(i)
        if embeds:  # gallery adds: numpy rows [vector | statistics]
            full = rows.numpy()
            for i in embeds:
                out[i] = full[i].copy()  # its own memory, not a view holding the batch
        if groups and self.gallery is None:
            raise RuntimeError("the gallery is not loaded yet")
        for query, idx in groups.items():
            whole = len(idx) == len(jobs)
            q = emb if whole else emb[idx]
            s = None if stats is None else stats if whole else stats[idx]
            res = self.gallery.answer(q, query, s)
            for i, r in zip(idx, res, strict=True):
                out[i] = r
            if self.settings.review_queue:  # (the queue keeps the vector of what it keeps)
                full = rows.numpy()
                for i in idx:
                    out[i].row = full[i].copy()
        self.spent = {"forward": t1 - t0, "vote": time.perf_counter() - t1}
        return out

    async def classify(self, p: Prepared, query: VoteQuery) -> Classification:
        return await self.batcher.submit(Job("classify", p.pixels, query))

    async def answers(
        self, prepared: list[Prepared], query: VoteQuery, tpr: float | None
    ) -> list[Answer]:
        """Classify uploads (one job each on the batcher), with each label's open-set
        threshold at `tpr` (None: unknown=off) and the gallery version after the vote."""
        if len(prepared) == 1:  # the common request: no gather (a task per job)
            cs = [await self.classify(prepared[0], query)]
        else:
            cs = await asyncio.gather(*[self.classify(p, query) for p in prepared])
        version = self.gallery.version
        thresholds = None
        if tpr:  # (no lock on the event loop: the cached thresholds, else from a pool thread)
            thresholds = self.gallery.cached_thresholds(tpr)
            if thresholds is None:
                thresholds = await to_thread.run_sync(self.gallery.thresholds_at, tpr)
        s = self.settings
        return [
            Answer.judged(c, label_threshold(thresholds, c.label_id), version, tpr, s) for c in cs
        ]

    async def embed(self, p: Prepared) -> np.ndarray:
        """The upload's row [vector | world statistics] (Embedder.split takes it apart)."""
        return await self.batcher.submit(Job("embed", p.pixels))

    def answers_now(self, prepared: list[Prepared], query: VoteQuery, tpr) -> list[Answer]:
        """`answers`, blocking, for a tool with no event loop (`snca-gallery classify`): the
        same forward, vote and verdicts, max_batch images a forward."""
        emb, stats = self.embedder.split(self.embed_pixels([p.pixels for p in prepared]))
        cs = self.gallery.answer(emb, query, stats)
        thresholds = self.gallery.thresholds_at(tpr) if tpr else None
        version, s = self.gallery.version, self.settings
        return [
            Answer.judged(c, label_threshold(thresholds, c.label_id), version, tpr, s) for c in cs
        ]


def _cores() -> int:
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return n or 1


def label_threshold(thresholds, label_id: int) -> float | None:
    """Label `label_id`'s threshold from the (C,) per-label thresholds (None: none there)."""
    if thresholds is None or not 0 <= label_id < len(thresholds):
        return None
    t = float(thresholds[label_id])
    return None if t == float("-inf") else t
