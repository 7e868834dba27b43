"""What a gallery store holds and hands out, the same for every backend (service/store/base.py's
Store): the records, the errors, and the byte layout of vectors."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np


class StoreUnavailable(Exception):
    """The store cannot be written (disk full, read-only, I/O error): answer 503, keep serving.
    `committed`: whether the write was made (False: nothing changed; None: unknown)."""

    committed: bool | None = False


class CommitUnknown(StoreUnavailable):
    """The connection to the store broke while a write committed: it may or may not have
    been committed (answer 503 saying so; a retry with the same Idempotency-Key settles it)."""

    committed = None


class WriteNotApplied(Exception):
    """A write that was committed (durable, as gallery version `seq`) but is not applied where
    its answer comes from yet (the model process did not answer in time, or the store could
    not be read after the commit): answered 503 saying it was committed; a retry with the same
    Idempotency-Key is answered with its outcome once applied."""

    def __init__(self, seq: int, why: str):
        super().__init__(
            f"the write was committed (gallery version {seq}) but is not applied here yet: "
            f"{why}; a retry with the same Idempotency-Key is answered with its outcome"
        )
        self.seq = seq


class StoreCarriedAway(StoreUnavailable):
    """The store was carried to another model (service/store/migration.py sealed it): this process
    serves a model whose gallery lives elsewhere now and must be restarted with the new one."""


# meta key set on a store that a migration carried to a new model, in the same transaction as
# its last write: every later write on it is refused (JSON: fingerprint, index_id, at)
CARRIED_TO = "carried_to"
# meta key of a gallery that is on standby (service/store/upgrade.py): another model's gallery
# is the live one; writes are refused, the log is still followed (it is carried into)
STANDBY = "standby"


class StoreStandby(StoreUnavailable):
    """The gallery is on standby: another model's gallery is live (an upgrade switched to it,
    or one is being built from this one). Writes answer 503; reads go on."""


def _model_named(value: str, field: str, prefix: str = "") -> str:
    """'model <fingerprint>... (<prefix><field's value>)' of a JSON record naming a gallery's
    model, "another model" when the record cannot be read."""
    try:
        rec = json.loads(value)
        return f"model {str(rec.get('model_fingerprint', '?'))[:19]}... ({prefix}{rec.get(field)})"
    except (ValueError, AttributeError):
        return "another model"


def standby_message(value: str) -> str:
    what = _model_named(value, "gen")
    return (
        f"this gallery is on standby: the live gallery is {what}; write through the replicas "
        "of the live model (snca-gallery galleries lists them)"
    )


def carried_away_message(value: str) -> str:
    what = _model_named(value, "index_id", "index ")
    return (
        f"the gallery was carried to {what} by another process; this process serves the model "
        "it had before and can no longer write it: restart it with the new model"
    )


@dataclass(frozen=True)
class Keyed:
    """A write made under a client's Idempotency-Key: the key, the sha256 of what the request
    asked (`digest`), and how long its record is kept (`ttl_s`)."""

    key: str
    digest: str
    ttl_s: float = 86400.0


class Replayed(Exception):
    """Raised by a keyed write whose key was used before (the write rolled back, nothing
    changed): the first write's `seq` and `outcome`; `same` when it asked the same thing."""

    def __init__(self, seq: int, outcome: dict, same: bool):
        super().__init__(f"the Idempotency-Key was used by write {seq}")
        self.seq, self.outcome, self.same = seq, outcome, same


class NothingChanged(Exception):
    """Raised inside a write transaction that turned out to change nothing: rolled back, no
    seq taken (a delete of ids that are not live)."""


class Refused(Exception):
    """A write that cannot be made as asked; nothing in the gallery changed: a rename onto a
    label that has items (that is a merge), a merge into a label that has none, a relabel of
    ids none of which is live. `code`: the problem's code (label_exists, label_unknown,
    item_unknown). Without an Idempotency-Key it was rolled back (`seq` 0); with one, the
    refusal is the key's outcome, recorded by write `seq` (a retry is refused alike)."""

    def __init__(self, code: str, message: str, seq: int = 0):
        super().__init__(message)
        self.code, self.seq = code, seq


@dataclass
class Relabelled:
    """One item a correction moved to another label: what the gallery needs to move it."""

    id: int
    old: str  # its label before
    embedding: np.ndarray  # (d,) float32
    source: str  # trained | added
    world: np.ndarray | None  # (D,) world statistics (added items), or None


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
class Queued:
    """A query kept for review (service/review/): what the service answered and could not
    name well enough, its vector under this gallery's model, a thumbnail, the upload if kept."""

    id: int
    created_at: str
    embedding: np.ndarray  # (d,) float32
    world: np.ndarray | None
    answer: str | None  # the label answered (None: unknown)
    nearest: str | None
    margin: float
    reason: str | None
    has_thumbnail: bool = False
    thumbnail: bytes | None = None  # (when written; reads leave it in the store)
    image: bytes | None = None
    image_type: str | None = None

    def size(self) -> int:
        """Bytes the row holds (the queue's byte bound)."""
        w = 0 if self.world is None else 4 * len(self.world)
        return 4 * len(self.embedding) + w + len(self.thumbnail or b"") + len(self.image or b"")


@dataclass
class ItemRow:
    """What GET /gallery/items tells of an item."""

    id: int
    label: str
    source: str
    metadata: dict | None
    created_at: str
    has_thumbnail: bool


# How a follower applies a write's item rows, by the op of its log row (Store.transaction's
# `op`): an add's rows are new items, a correction's (relabel, rename, merge) move items it
# holds, a delete's are gone. Any other write (a carry into this gallery, a start-up migration)
# may hold new items and moved ones in one write: "mixed", each id applied by whether the
# replica holds it. A write with no log row (below the log's floor) is "mixed" too.
KIND_OF_OP = {"add": "add", "relabel": "relabel", "rename": "relabel", "merge": "relabel"}


def kind_of(op: str | None) -> str:
    """The kind (add | relabel | mixed) of the item rows a write of log op `op` added."""
    return KIND_OF_OP.get(op or "", "mixed")


@dataclass
class Change:
    """One write of the log, as a follower applies it, by `op`: "add" (new items: ids, label,
    embeddings), "relabel" (items the follower holds, moved to `label` by a correction),
    "mixed" (a carry's or migration's write: new items and moved ones, told apart by whether
    the follower holds them) or "delete" (rows: id, label, embedding, source)."""

    seq: int
    op: str  # add | relabel | mixed | delete
    ids: list[int]
    label: str | None = None
    embeddings: np.ndarray | None = None  # (n, d) float32: add, relabel, mixed
    rows: list[tuple[int, str, np.ndarray, str]] | None = None  # deletes
    worlds: list[np.ndarray | None] | None = None  # each item's world statistics
    sources: list[str] | None = None  # each item's source (trained | added)


@dataclass
class ChangeSet:
    """The writes after a version, read in one transaction: `last_seq` the store's version then,
    `floor` the log's floor (a follower below it cannot be brought up to date from the log),
    `carried_to` set when the store was carried to another model (CARRIED_TO)."""

    last_seq: int
    floor: int
    changes: list[Change]
    carried_to: str | None = None
    standby: str | None = None  # STANDBY's value: writes are refused (not carried away)


def changes_from_rows(rows, after: int, ops: dict[int, str] | None = None) -> list[Change]:
    """Changes in seq order from (id, label, source, embedding, add_seq, deleted_seq, world)
    rows of the items added or deleted by a write after `after`; `ops`: the log's op of each
    write (seq -> op: what kind its rows are, kind_of; a seq it lacks is "mixed")."""
    ops = ops or {}
    adds: dict[int, Change] = {}
    dels: dict[int, Change] = {}
    for item_id, label, source, emb, add_seq, deleted_seq, world in rows:
        v = vec(emb)
        if add_seq > after:
            c = adds.setdefault(
                add_seq,
                Change(add_seq, kind_of(ops.get(add_seq)), [], label, None, worlds=[], sources=[]),
            )
            c.ids.append(item_id)
            c.sources.append(source)
            c.rows = (c.rows or []) + [(item_id, label, v, source)]
            c.worlds.append(None if world is None else vec(world))
        if deleted_seq is not None and deleted_seq > after:
            c = dels.setdefault(deleted_seq, Change(deleted_seq, "delete", [], rows=[]))
            c.ids.append(item_id)
            c.rows.append((item_id, label, v, source))
    out = []
    for c in adds.values():
        c.embeddings = np.stack([r[2] for r in c.rows]).astype(np.float32)
        c.rows = None
        out.append(c)
    # a write's new and moved items before its deletes
    return sorted([*out, *dels.values()], key=lambda c: (c.seq, c.op == "delete"))


def blob(v: np.ndarray) -> bytes:
    """A vector as stored: float32, little-endian."""
    return np.ascontiguousarray(v, dtype="<f4").tobytes()


def vec(b: bytes | memoryview) -> np.ndarray:
    return np.frombuffer(bytes(b) if isinstance(b, memoryview) else b, dtype="<f4")


def new_items(
    ids, label, embeddings, metadata, images, thumbnails, now, worlds=None
) -> list[StoredItem]:
    """The rows of an add through the service (both backends store the same columns)."""
    thumbs = thumbnails if thumbnails is not None else [None] * len(embeddings)
    ws = [None] * len(embeddings) if worlds is None else [blob(w) for w in worlds]
    return [
        StoredItem(
            i,
            label,
            "added",
            None if md is None else json.dumps(md, sort_keys=True),
            now,
            blob(e),
            None if img is None else img[0],
            None if img is None else img[1],
            th,
            w,
        )
        for i, e, md, img, th, w in zip(ids, embeddings, metadata, images, thumbs, ws, strict=True)
    ]
