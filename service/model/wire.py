"""Frames between a worker's front process and its model process (service/model/remote.py,
service/model_process.py), over one Unix stream socket.

A frame is two lengths, a JSON header and a binary payload: images cross as their raw uint8
pixels and embeddings as raw float32 rows, never pickled; everything else is a named record
below (a dataclass, sent as a JSON object with its `type` and its fields by name), a few hundred
bytes. A new answer field is one dataclass field here and where it is made and read.

    front -> model   ClassifyJob + pixels (or the upload, to decode: `encoded`), EmbedJob +
                     pixels (an embedding: adds, search),
                     SyncJob (apply the log up to seq; seq 0: a ping)
    model -> front   Batch + float32 rows: one frame per batch, a result per job:
                     ClassifyAnswer, Embedded (its row's offset and length in floats in the
                     payload), Synced (the version), Failed (a status and why; an image's
                     problem for an upload it decoded)

`min_version`: the front's own gallery version when it sent the job; the model process applies
the log up to it before voting, so an answer never reads an older gallery than the front had
(a write the front acknowledged, or waited for with X-Min-Gallery-Version, is seen).
"""

from __future__ import annotations

import contextlib
import json
import struct
from dataclasses import dataclass, fields
from typing import ClassVar

import numpy as np
import orjson

from service.gallery.query import VoteQuery
from service.model.embedder import ImageError
from service.model.runtime import Job

HEAD = struct.Struct("<II")  # header bytes, payload bytes
# a frame's header is small; a payload is a batch's pixels or rows (64 x 224 x 224 x 3 = 9.6 MB)
MAX_HEADER = 16 << 20
MAX_PAYLOAD = 1 << 30

_dumps = json.JSONEncoder(separators=(",", ":")).encode


def _loads(header) -> object:
    """A frame's JSON header: orjson (a few times faster), json for what orjson refuses and
    json.dumps writes (NaN, Infinity, integers beyond 64 bits), so every header reads back."""
    try:
        return orjson.loads(header)
    except orjson.JSONDecodeError:
        return json.loads(header)


def frame(record, payload=b"") -> bytes:
    """A record (below) and its payload as one frame: written by orjson where every float
    it holds is finite (`finite`: it writes NaN and infinities as null, json as NaN and
    Infinity), by json otherwise."""
    obj = encode(record)
    h = None
    if record.finite:
        with contextlib.suppress(TypeError):  # (an integer beyond 64 bits)
            h = orjson.dumps(obj)
    if h is None:
        h = _dumps(obj).encode()
    return b"".join((HEAD.pack(len(h), len(payload)), h, payload))


class FrameReader:
    """Bytes as they arrive -> whole frames (record, payload bytes); ValueError: corrupt."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[object, bytes]]:
        buf = self._buf
        buf += data
        out, at = [], 0
        while len(buf) - at >= HEAD.size:
            nh, npl = HEAD.unpack_from(buf, at)
            if nh > MAX_HEADER or npl > MAX_PAYLOAD:
                raise ValueError(f"a frame of {nh} + {npl} bytes: the stream is corrupt")
            end = at + HEAD.size + nh + npl
            if len(buf) < end:
                break
            h0 = at + HEAD.size
            out.append((decode(_loads(buf[h0 : h0 + nh])), bytes(buf[h0 + nh : end])))
            at = end
        if at:
            del buf[:at]
        return out


# ---------------------------------------------------------------------------- the records
class ModelUnavailable(Exception):
    """The model process is down, restarting or cannot serve now: the request is answered 503
    `code` + Retry-After `retry_after` seconds."""

    code = "model_unavailable"
    retry_after = 1


class ModelBusy(ModelUnavailable):
    """The model process has more work queued than it can do within SNCA_MODEL_QUEUE_S (or
    SNCA_MODEL_QUEUE_MAX jobs): the request is answered 503 `model_busy` at once, before it
    waits, with Retry-After `retry_after` seconds."""

    code = "model_busy"

    def __init__(self, why: str, retry_after: int):
        super().__init__(why)
        self.retry_after = retry_after


def raw_pixels(payload: bytes, shape: tuple) -> np.ndarray | None:
    """A payload of raw uint8 pixels as the batch's (C, H, W) image; None for none."""
    return np.frombuffer(payload, np.uint8).reshape(shape) if payload else None


# Jobs (front -> model). `pixels(payload, shape, uploads)`: the model input the payload
# carries (ImageError: an upload it could not decode); `model_job(pixels)`: what the model
# thread runs (None: nothing, the answer is the gallery's version); `result(out, ctx)`: the model
# thread's output -> the record sent back (ctx: the batch's payload rows, thresholds and
# version: model_process.Server).
@dataclass(slots=True)
class ClassifyJob:
    finite: ClassVar[bool] = True  # its floats are validated finite (frame)
    id: int
    min_version: int
    query: VoteQuery  # whole, as the route made it (sent as an object of its fields)
    tpr: float | None  # the open-set acceptance rate (None: unknown=off)
    # the payload: the upload's raw pixels, or (with its name here) the upload itself, its header
    # checked by the front, for the model process to decode (Uploads.prepare_async(encoded=True))
    encoded: str | None = None

    def pixels(self, payload: bytes, shape: tuple, uploads):
        if self.encoded is not None and payload:
            return uploads.decode(payload, self.encoded)
        return raw_pixels(payload, shape)

    def model_job(self, pixels):
        return Job("classify", pixels, self.query)

    def result(self, c, ctx) -> ClassifyAnswer:
        a = ClassifyAnswer.of(self.id, c, ctx.threshold(self.tpr, c.label_id), ctx.version)
        if c.row is not None:  # (the review queue: the query's row rides in the payload)
            a.row_offset, a.row_length = ctx.add_row(c.row), len(c.row)
        return a


@dataclass(slots=True)
class EmbedJob:
    finite: ClassVar[bool] = True  # no float (frame)
    id: int
    min_version: int

    def pixels(self, payload: bytes, shape: tuple, uploads):
        return raw_pixels(payload, shape)

    def model_job(self, pixels):
        return Job("embed", pixels)

    def result(self, row, ctx) -> Embedded:
        offset = ctx.add_row(row)
        return Embedded(self.id, offset, len(row))


@dataclass(slots=True)
class SyncJob:
    finite: ClassVar[bool] = True  # no float (frame)
    id: int
    seq: int  # apply the log up to this write (0: a ping)

    @property
    def min_version(self) -> int:
        return self.seq

    def pixels(self, payload: bytes, shape: tuple, uploads) -> None:
        return None

    def model_job(self, pixels) -> None:
        return None


# Results (model -> front). `value(payload)`: what the front's waiting job gets (or raises).
@dataclass(slots=True)
class ClassifyAnswer:
    """A Classification (service/gallery/gallery.py), its label's open-set threshold at the
    job's rate, and the gallery version the vote read."""

    finite: ClassVar[bool] = False  # a similarity may be -inf (frame)
    id: int
    label: str | None
    confidence: float
    probabilities: list  # [[label, probability], ...]
    best_similarity: float
    unknown_score: float | None
    label_id: int
    neighbors: list  # [[id, label, similarity], ...]
    world: dict  # WorldVerdict's fields by name
    threshold: float | None
    version: int
    row_offset: int = -1  # the query's row in the batch's payload (floats), -1: not sent
    row_length: int = 0
    row: np.ndarray | None = None  # (set on the front from the payload)

    @classmethod
    def of(cls, job_id: int, c, threshold: float | None, version: int) -> ClassifyAnswer:
        w = c.world
        world = {"score": w.score, "threshold": w.threshold, "ok": w.ok, "basis": w.basis}
        return cls(
            job_id,
            c.label,
            c.confidence,
            c.probabilities,
            c.best_similarity,
            c.unknown_score,
            c.label_id,
            c.neighbors,
            world,
            threshold,
            version,
        )

    def value(self, payload: bytes) -> ClassifyAnswer:
        if self.row_offset >= 0:
            off = self.row_offset * 4
            self.row = np.frombuffer(payload, np.float32, self.row_length, off).copy()
        return self


@dataclass(slots=True)
class Embedded:
    finite: ClassVar[bool] = True  # no float (frame)
    id: int
    offset: int  # in floats, in the batch's payload
    length: int

    def value(self, payload: bytes):
        return np.frombuffer(payload, np.float32, self.length, self.offset * 4).copy()


@dataclass(slots=True)
class Synced:
    finite: ClassVar[bool] = True  # no float (frame)
    id: int
    version: int

    def value(self, payload: bytes) -> int:
        return self.version


@dataclass(slots=True)
class Failed:
    finite: ClassVar[bool] = True  # no float (frame)
    id: int
    status: int  # 503: the model process cannot serve now (model_unavailable); 4xx: the image
    why: str
    code: str | None = None  # an image's problem (ImageError's code)

    def value(self, payload: bytes):
        if self.status == 503:
            raise ModelUnavailable(self.why)
        if 400 <= self.status < 500:  # an upload it decoded (ClassifyJob.encoded)
            raise ImageError(self.status, self.why, self.code)
        raise RuntimeError(self.why)


@dataclass(slots=True)
class Batch:
    finite: ClassVar[bool] = False  # its answers' similarities may be -inf (frame)
    size: int  # jobs that went through the model
    waited: float  # seconds the oldest job waited
    results: list  # one result record per job
    phases: dict  # seconds the batch took by phase (Metrics.model_seconds)


RECORDS = {
    c.__name__: c
    for c in (ClassifyJob, EmbedJob, SyncJob, ClassifyAnswer, Embedded, Synced, Failed, Batch)
}
_FIELDS = {c: tuple(f.name for f in fields(c)) for c in RECORDS.values()}


def encode(r) -> dict:
    """A record -> its JSON object (a Batch's results too)."""
    out = {"type": type(r).__name__}
    for f in _FIELDS[type(r)]:
        v = getattr(r, f)
        if f == "results":
            v = [encode(x) for x in v]
        elif f == "query":  # (a VoteQuery: its fields by name, the label filter a list)
            v = {g.name: getattr(v, g.name) for g in fields(VoteQuery)}
        out[f] = v
    return out


def decode(obj):
    """A JSON object -> its record; ValueError for anything else (the stream is corrupt)."""
    try:
        cls = RECORDS[obj.pop("type")]
        if cls is Batch:
            obj["results"] = [decode(x) for x in obj["results"]]
        if cls is ClassifyJob:
            q = obj["query"]
            labels = q.pop("labels")
            obj["query"] = VoteQuery(**q, labels=None if labels is None else tuple(labels))
        return cls(**obj)
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"not a record of the wire: {str(e)[:100]}") from None
