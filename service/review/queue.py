"""The review queue (issue 43; off unless SNCA_REVIEW_QUEUE): queries the service could not name
well enough (answered unknown, or with a margin between its two best labels below
SNCA_REVIEW_MARGIN) kept with their vector, a thumbnail and the query as the model saw it (its
input size, PNG: what an upgrade re-embeds a named item from; the upload itself only with
SNCA_REVIEW_KEEP_IMAGES) in the gallery's store, so a person can name them later (GET /review,
service/review/groups.py) and they become items that no upgrade loses.

The classify route only chooses and hands over (`offer`, on the event loop: no I/O); a writer
thread makes the thumbnails and writes what it was handed in batches (one store transaction
per batch, outside the log: the gallery does not change). A classify answer never waits for the
queue and never fails because of it: when the writer falls behind, offers beyond
SNCA_REVIEW_BUFFER_BYTES are dropped and counted. The store holds the queue to its bounds
(SNCA_REVIEW_MAX_ITEMS rows, SNCA_REVIEW_MAX_BYTES, SNCA_REVIEW_RETENTION_S) at every write:
the oldest go first."""

from __future__ import annotations

import io
import logging
import secrets
import threading
from dataclasses import dataclass

import numpy as np

from embedding.gallery import utc_now
from embedding.thumbnails import make_thumbnail
from service.store.records import Queued

log = logging.getLogger("snca.review")

FLUSH_S = 0.5  # the writer writes at least this often while offers wait


def margin(probabilities) -> float:
    """The top probability minus the second ([(label, p)] best first; one label: p itself)."""
    ps = [float(p) for _, p in probabilities[:2]]
    if not ps:
        return 0.0
    return ps[0] - (ps[1] if len(ps) > 1 else 0.0)


@dataclass
class Offer:
    row: np.ndarray  # [vector | world statistics]
    data: bytes  # the upload (its thumbnail is made by the writer)
    mime: str
    pixels: np.ndarray  # uint8 (C, H, W): the query as the model saw it
    answer: str | None
    nearest: str | None
    margin: float
    reason: str | None
    at: str


class ReviewQueue:
    """One per serving front. `store_of()`: the gallery's store now (a migration replaces it);
    `dim`: the vector's length (the rest of a row is world statistics)."""

    def __init__(self, store_of, settings, dim: int):
        self.store_of, self.s, self.dim = store_of, settings, dim
        self._pending: list[Offer] = []
        self._bytes = 0
        self._cv = threading.Condition()
        self._closed = False
        self._writing = 0  # offers taken by the writer, not written yet
        self.queued = 0  # offers written (this process)
        self.dropped = 0  # offers dropped: the buffer was full, or the write failed
        self.pruned = 0  # rows the bounds took out of the store
        self.error: str | None = None  # the last write's failure, until one works
        self._thread = threading.Thread(target=self._run, name="snca-review", daemon=True)
        self._thread.start()

    def wants(self, a) -> bool:
        """Whether an answer (runtime.Answer) goes to review: unknown, or not sure enough."""
        if a.c.row is None:
            return False
        return a.unknown_reason is not None or margin(a.c.probabilities) < self.s.review_margin

    def offer(self, answers: list, prepared: list) -> int:
        """Hand the answers that go to review to the writer (on the event loop: no I/O);
        how many were taken."""
        took = 0
        at = utc_now()
        for a, p in zip(answers, prepared, strict=True):
            if not self.wants(a):
                continue
            from service.gallery.verdict import answered

            label, _ = answered(a.c, a.unknown_reason)
            o = Offer(
                a.c.row, p.data, p.mime, p.pixels, label, a.c.label,
                margin(a.c.probabilities), a.unknown_reason, at,
            )  # fmt: skip
            size = len(p.data) + p.pixels.nbytes + 4 * len(a.c.row)
            with self._cv:
                if self._bytes + size > self.s.review_buffer_bytes:
                    self.dropped += 1
                    continue
                self._pending.append(o)
                self._bytes += size
                self._cv.notify()
            took += 1
        return took

    def flush(self, timeout: float = 10.0) -> None:
        """Wait until every offer made so far is written (tests, shutdown)."""
        with self._cv:
            self._cv.notify()
            self._cv.wait_for(lambda: not self._pending and not self._writing, timeout)

    def close(self) -> None:
        self.flush(timeout=5.0)
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=5.0)

    # ------------------------------------------------------------------ the writer thread
    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._pending or self._closed, FLUSH_S)
                if self._closed and not self._pending:
                    return
                batch, self._pending, self._bytes = self._pending, [], 0
                self._writing = len(batch)
            try:
                if batch:
                    self._write(batch)
            except Exception as e:  # (never let the writer die: the queue is best effort)
                self.dropped += len(batch)
                if self.error is None:
                    log.warning("the review queue could not be written: %s", e)
                self.error = str(e)
            finally:
                with self._cv:
                    self._writing = 0
                    self._cv.notify_all()

    def _write(self, batch: list[Offer]) -> None:
        s = self.s
        rows = []
        for o in batch:
            # the upload itself only when asked; else the query as the model saw it (its input
            # size, lossless): what a named item is re-embedded from by an upgrade's carry
            if s.review_keep_images and len(o.data) <= s.max_stored_image_bytes:
                image, mime = o.data, o.mime
            else:
                image, mime = _model_view(o.pixels), "image/png"
            rows.append(
                Queued(
                    secrets.randbits(52),  # (a JSON number any client reads exactly: < 2^53)
                    o.at,
                    np.ascontiguousarray(o.row[: self.dim], dtype=np.float32),
                    None if len(o.row) == self.dim else o.row[self.dim :].astype(np.float32),
                    o.answer,
                    o.nearest,
                    o.margin,
                    o.reason,
                    thumbnail=_thumbnail(o.data, s.thumbnail_side, s.max_image_pixels),
                    image=image,
                    image_type=mime,
                )
            )
        self.pruned += self.store_of().queue(
            rows, s.review_max_items, s.review_max_bytes, s.review_retention_s
        )
        self.queued += len(rows)
        self.error = None


def _model_view(pixels: np.ndarray) -> bytes:
    """uint8 (C, H, W) model input pixels -> PNG bytes (grey or RGB)."""
    from PIL import Image

    a = pixels[0] if pixels.shape[0] == 1 else np.moveaxis(pixels[:3], 0, -1)
    b = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(a)).save(b, "PNG")
    return b.getvalue()


def _thumbnail(data: bytes, side: int, max_pixels: int) -> bytes | None:
    """A thumbnail of an upload the service decoded already (its limits were checked then)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            if img.size[0] * img.size[1] > max_pixels:
                return None
            img.draft("RGB", (side * 2, side * 2))  # (JPEG: decode reduced)
            return make_thumbnail(img, side)
    except Exception:  # (an image that decoded for the model always decodes here)
        return None
