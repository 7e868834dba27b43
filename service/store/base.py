"""The one interface every gallery store backend implements (service/store/sqlite.py,
service/store/postgres.py; tests/service/store/test_store_contract.py runs the same cases against
both), and the parts they share: the writes, decoding rows into records, the point-in-time
reader."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from embedding.errors import ArtifactError
from embedding.gallery import utc_now
from service.store import sql
from service.store.records import (
    CARRIED_TO,
    STANDBY,
    ChangeSet,
    Item,
    ItemRow,
    Keyed,
    NothingChanged,
    Queued,
    Refused,
    Relabelled,
    Replayed,
    StoreCarriedAway,
    StoredItem,
    StoreStandby,
    blob,
    carried_away_message,
    new_items,
    standby_message,
    vec,
)


class Store(ABC):
    """A gallery store: the system of record of the gallery's items and its ordered change
    log. Every write is one transaction with the next gap-free seq and a log row; an
    acknowledged write is durable. Errors: StoreUnavailable (cannot be read or written now:
    503), StoreCarriedAway (sealed by a migration). A backend implements the abstract methods
    (its connection, locking and the statements only its database can say); the writes every
    backend makes the same way are written here once."""

    default_poll_s: ClassVar[float]  # how often a follower polls the head without a wake-up
    url: str  # where it is, safe to show (no secret)
    dim: int  # embedding dimension
    read_only: str | None  # why writes are refused now (None: writable)
    dialect: ClassVar[sql.Dialect]  # the placeholder and types of its driver (sql.py)

    @classmethod
    @abstractmethod
    def claims(cls, target: str | Path) -> bool:
        """Whether `target` (SNCA_STORE) names a store of this backend."""

    @classmethod
    @abstractmethod
    def meta_of(cls, target: str | Path) -> dict[str, str]:
        """The meta table of the store at `target` as it is (no model needed: housekeeping);
        ArtifactError when it holds no gallery."""

    @classmethod
    def as_found(cls, target: str | Path) -> Store:
        """The store at `target` opened for the model it belongs to (housekeeping needs no
        model: compaction, backups, the carry's galleries)."""
        meta = cls.meta_of(target)
        return cls(target, None, meta.get("model_fingerprint", ""), meta.get("index_id", ""))

    def _take(self, meta: dict[str, str], model_fingerprint: str, index_id: str, *,
              other_model: str, new_place: str) -> None:  # fmt: skip
        """Serve this store only if it belongs to the served model and was seeded from its
        index build (each backend says how to fix a mismatch: `other_model`, `new_place`)."""
        if meta.get("model_fingerprint") != model_fingerprint:
            raise ArtifactError(
                f"gallery store {self.url} belongs to model "
                f"{meta.get('model_fingerprint', '?')[:19]}..., not to the served model "
                f"{model_fingerprint[:19]}...: {other_model}"
            )
        if meta.get("index_id") != index_id:
            raise ArtifactError(
                f"gallery store {self.url} was seeded from another index build "
                f"({meta.get('index_id')}) than {index_id}: use the matching index dir or "
                f"{new_place}"
            )
        self.dim = int(meta.get("dim", "0"))

    # ------------------------------------------------------------------ reads
    @abstractmethod
    def select(self, query: str, params: tuple | list = ()) -> list[tuple]:
        """A read on the store's own connection (its lock held): the rows; StoreUnavailable
        when the store cannot be read, StoreCarriedAway once it was carried away. (Public: the
        carry, the galleries' registry and the tools read with it.)"""

    def meta(self) -> dict[str, str]:
        return dict(self.select(sql.META))

    def last_seq(self) -> int:
        return int(self.meta()["last_seq"])

    def log_token(self, seq: int) -> str | None:
        """The token of write `seq` (None: no such log row, or written before tokens)."""
        rows = self.select(self.dialect.q(sql.LOG_TOKEN), (int(seq),))
        return rows[0][0] if rows else None

    def live_items(self, after_seq: int = -1, upto: int | None = None) -> list[Item]:
        """Live items added by a write after `after_seq` (-1: all) and not after `upto`, in id
        order."""
        upto = upto if upto is not None else 2**62
        return live_items(self.select(self.dialect.q(sql.LIVE_ITEMS), (after_seq, upto)))

    def deleted_after(self, seq: int) -> list[tuple[int, str, np.ndarray, int]]:
        """(id, label, embedding, add_seq) of items deleted by a write after `seq`."""
        rows = self.select(self.dialect.q(sql.DELETED_AFTER), (seq,))
        return [(r[0], r[1], vec(r[2]), r[3]) for r in rows]

    def _rows_of_ids(self, template: str, ids: list[int]) -> list[tuple]:
        """`template` (an {ids} query of sql.py) over `ids`, in chunks."""
        out = []
        for s in range(0, len(ids), sql.CHUNK):
            chunk = [int(i) for i in ids[s : s + sql.CHUNK]]
            out += self.select(sql.ids_in(self.dialect, template, chunk), chunk)
        return out

    def items(self, ids: list[int]) -> dict[int, tuple[str, str, dict | None, bool]]:
        """id -> (label, source, metadata, has a thumbnail) for the live items among `ids`."""
        return items_by_id(self._rows_of_ids(sql.ITEMS_OF_IDS, ids))

    def item_rows(
        self, after_id: int, limit: int, label: str | None = None, item_id: int | None = None
    ) -> list[ItemRow]:
        """Live items with id > `after_id` in id order, at most `limit` (of `label`, or the one
        `item_id`): a page of GET /gallery/items. Ids only grow, so a cursor of the last id
        is stable under concurrent writes (new items come at the end)."""
        params = [int(after_id), *([label] if label is not None else [])]
        params += [int(item_id)] if item_id is not None else []
        q = sql.item_rows_query(self.dialect, label, item_id)
        return item_rows(self.select(q, (*params, limit)))

    def with_thumbnails(self, ids: list[int]) -> set[int]:
        """The live items among `ids` (at most a few hundred) that have a thumbnail."""
        return {r[0] for r in self._rows_of_ids(sql.THUMBNAILS_OF_IDS, ids[:500])}

    def thumbnail(self, item_id: int) -> bytes | None:
        """The thumbnail of a live item, or None (no such item, deleted, or none kept)."""
        rows = self.select(self.dialect.q(sql.THUMBNAIL), (int(item_id),))
        return None if not rows or rows[0][0] is None else bytes(rows[0][0])

    def added_items(self, after_id: int, limit: int) -> list[StoredItem]:
        """Live items added through the service with id > `after_id`, in id order, every
        column (a migration or an export reads the store this way, `limit` at a time)."""
        return stored_items(self.select(self.dialect.q(sql.ADDED_ITEMS), (after_id, limit)))

    @abstractmethod
    def reader(self) -> StoreReader:
        """A point-in-time view of the store on a connection of its own (an export reads every
        page from it: writes committed meanwhile are not in it)."""

    # ------------------------------------------------------------------ the log (followers)
    @abstractmethod
    def head(self) -> int:
        """The last committed write (what a follower polls)."""

    @abstractmethod
    def wait_head(self, after: int, timeout: float) -> int:
        """The head once it is past `after`, or after `timeout` seconds."""

    @abstractmethod
    def changes_after(self, after: int) -> ChangeSet:
        """Every write after `after`, in seq order, read in one transaction."""

    @abstractmethod
    def log_gaps(self) -> tuple[int, int, list[int]]:
        """(floor, last_seq, the seqs in (floor, last_seq] that have no log row)."""

    @abstractmethod
    def compact(self, upto: int) -> int:
        """Forget history up to write `upto`: the rows of added items deleted by then and the
        log rows before it go (the row of `upto` stays: its token names the history a snapshot
        at the floor belongs to), the log's floor moves to `upto` (a replica behind it rebuilds
        from the store). Trained items' rows stay. Returns the item rows removed."""

    # ------------------------------------------------------------------ writes
    @abstractmethod
    def unwritable(self) -> str | None:
        """Why the store cannot be written now, if that is known without trying (None)."""

    @abstractmethod
    def transaction(
        self, fn: Callable[[Any, int], Any], op: str = "migrate", count=lambda result: 0
    ) -> tuple[int, Any]:
        """Run fn(conn, seq) in one transaction with the next sequence number and its log row
        (`op`, count(result) items, a new token); return (seq, fn's result). fn raising
        NothingChanged(result) rolls back: (0, result)."""

    @abstractmethod
    def plain(self, fn: Callable[[Any], Any]) -> Any:
        """fn(conn) in one transaction that takes no seq and writes no log row (bookkeeping in
        meta: the galleries' registry, an upgrade's progress); fn's result."""

    def set_meta(self, conn, key: str, value: str | None) -> None:
        """Inside a transaction: set (None: remove) a meta key."""
        if value is None:
            conn.execute(self.dialect.q(sql.DELETE_META), (key,))
        else:
            conn.execute(self.dialect.q(sql.UPSERT_META), (key, value))

    def stored_items(self, ids: list[int]) -> list[StoredItem]:
        """Every column of the live added items among `ids`, in id order."""
        return sorted(stored_items(self._rows_of_ids(sql.STORED_OF_IDS, ids)), key=lambda it: it.id)

    def existing(self, ids: list[int]) -> set[int]:
        """The ids among `ids` that have a row (live or deleted)."""
        return {r[0] for r in self._rows_of_ids(sql.EXISTING_OF_IDS, ids)}

    @abstractmethod
    def _next_ids(self, conn, n: int) -> list[int]:
        """Inside a write: the next `n` item ids (meta 'next_id' moves past them)."""

    @abstractmethod
    def _mark_deleted(
        self, conn, seq: int, ids: list[int] | None, label: str | None
    ) -> list[tuple[int, str, np.ndarray, str]]:
        """Inside a write: mark the live items among `ids` (or of `label`) deleted by `seq`;
        (id, label, embedding, source) of each, in id order."""

    def request(self, key: str) -> tuple[str, int, dict] | None:
        """(digest, seq, outcome) of the write made under Idempotency-Key `key`, or None."""
        rows = self.select(self.dialect.q(sql.REQUEST), (key,))
        return None if not rows else (rows[0][0], int(rows[0][1]), json.loads(rows[0][2]))

    def _keyed(self, conn, keyed: Keyed | None, seq: int, outcome: dict) -> None:
        """Inside a write: record `keyed`'s outcome with it, or raise Replayed (rolled back)
        when its key was used already (a retry that raced its first attempt)."""
        if keyed is None:
            return
        row = conn.execute(self.dialect.q(sql.REQUEST), (keyed.key,)).fetchone()
        if row is not None:
            raise Replayed(int(row[1]), json.loads(row[2]), row[0] == keyed.digest)
        now = utc_now()
        conn.execute(
            self.dialect.q(sql.INSERT_REQUEST),
            (keyed.key, keyed.digest, seq, json.dumps(outcome, sort_keys=True), now),
        )
        # records past their retention go, at most once a minute per process
        import time

        if time.monotonic() - self._pruned_at > 60:
            self._pruned_at = time.monotonic()
            conn.execute(self.dialect.q(sql.PRUNE_REQUESTS), (_ago(keyed.ttl_s),))

    _pruned_at = -1e9

    def _nothing(self, conn, keyed: Keyed | None, seq: int, outcome: dict, empty):
        """Inside a write that changes nothing in the gallery: without a key, rolled back (no
        seq taken); with one, its outcome recorded by this write (committed with a seq and a
        log row of no items: a retry, on any replica or after a carry, is answered alike, and
        the key cannot be used for another request). `empty`: the write's result."""
        if keyed is None:
            raise NothingChanged(empty)
        self._keyed(conn, keyed, seq, outcome)
        return empty

    def _refusing(self, fn, op: str, count, keyed: Keyed | None):
        """self.transaction(fn, op, count) where fn may raise Refused before it writes: without
        a key rolled back and raised; with one, the refusal is recorded as the key's outcome,
        committed, then raised with the write's seq."""
        refused: list[Refused] = []

        def body(conn, seq):
            try:
                return fn(conn, seq)
            except Refused as e:
                if keyed is None:
                    raise
                self._keyed(conn, keyed, seq, {"op": op, "refused": [e.code, str(e)]})
                refused.append(e)
                return []

        seq, result = self.transaction(body, op, count)
        if refused:
            refused[0].seq = seq
            raise refused[0]
        return seq, result

    def add(
        self,
        label: str,
        embeddings: np.ndarray,
        metadata: list[dict | None],
        images: list[tuple[bytes, str] | None],
        thumbnails: list[bytes | None] | None = None,
        worlds: np.ndarray | None = None,
        keyed: Keyed | None = None,
    ) -> tuple[int, list[int]]:
        """Insert len(embeddings) items of `label` (with their world statistics (n, D) when
        given); return (seq, ids). `keyed`: recorded with the write (Replayed when its key was
        used before: nothing written)."""
        now = utc_now()

        def fn(conn, seq):
            ids = self._next_ids(conn, len(embeddings))
            rows = new_items(ids, label, embeddings, metadata, images, thumbnails, now, worlds)
            insert_items(conn, self.dialect, rows, seq)
            self._keyed(conn, keyed, seq, {"op": "add", "ids": ids, "label": label})
            return ids

        return self.transaction(fn, "add", len)

    def delete(
        self,
        ids: list[int] | None = None,
        label: str | None = None,
        keyed: Keyed | None = None,
    ) -> tuple[int, list[tuple[int, str, np.ndarray, str]]]:
        """Mark deleted the live items among `ids`, or every live item of `label`, as the store
        has them now (not as a lagging replica remembers them); return (seq, [(id, label,
        embedding, source)]); when none was live (0, []), nothing written, or with `keyed`
        (seq, []), that outcome recorded (_nothing). Deletes leave
        tombstones: a label's (a carry to another model deletes the label's trained items there
        too, whichever images that model's index holds) and each trained image's deleted by id
        (its dataset and dataset index), so no carry brings them back."""

        def fn(conn, seq):
            rows = self._mark_deleted(conn, seq, ids, label)
            if not rows:
                outcome = {"op": "delete", "rows": [], "label": label}
                return self._nothing(conn, keyed, seq, outcome, [])
            tomb = self.dialect.q(sql.UPSERT_TOMBSTONE)
            if label is not None:  # (covers its trained items)
                conn.execute(tomb, ("label", label, seq))
                conn.execute(self.dialect.q(sql.INSERT_LABEL_CHANGE), (seq, "label", label, None))
            else:
                for name in self._trained_keys(conn, [r[0] for r in rows if r[3] == "trained"]):
                    conn.execute(tomb, ("trained", name, seq))
            deleted = [[int(r[0]), r[1]] for r in rows]
            self._keyed(conn, keyed, seq, {"op": "delete", "rows": deleted, "label": label})
            return rows

        return self.transaction(fn, "delete", len)

    def _trained_keys(self, conn, ids: list[int]) -> list[str]:
        """Inside a write: the tombstone names (trained_key) of the trained items `ids`."""
        out = []
        for s in range(0, len(ids), sql.CHUNK):
            chunk = ids[s : s + sql.CHUNK]
            q = sql.ids_in(self.dialect, "SELECT metadata FROM items WHERE id IN ({ids})", chunk)
            out += [n for (md,) in conn.execute(q, chunk).fetchall() if (n := trained_key(md))]
        return out

    def relabel(
        self, ids: list[int], label: str, keyed: Keyed | None = None
    ) -> tuple[int, list[Relabelled]]:
        """Move the live items among `ids` (trained or added) to `label`, as the store has
        them now; return (seq, the items moved, with their label before); when every live one
        has `label` already (0, []), nothing written, or with `keyed` (seq, []), that outcome
        recorded (_nothing); Refused item_unknown when none is live. Each moved row's add_seq
        becomes this write's seq: the followers' log read brings it as a correction (log op
        relabel), which they apply as a move (service/gallery/gallery.py apply); a carry moves
        the item's copy (an added item by id, a trained one by its dataset index)."""

        def fn(conn, seq):
            rows = []
            for s in range(0, len(ids), sql.CHUNK):
                chunk = [int(i) for i in ids[s : s + sql.CHUNK]]
                q = sql.ids_in(self.dialect, sql.LIVE_ROWS_OF_IDS, chunk)
                rows += conn.execute(q, chunk).fetchall()
            if not rows:
                shown = ", ".join(map(str, ids[:10])) + (" ..." if len(ids) > 10 else "")
                raise Refused("item_unknown", f"no live item among {shown}")
            moved = sorted((relabelled(r) for r in rows if r[1] != label), key=lambda m: m.id)
            if not moved:  # (every one has the label already)
                return self._nothing(
                    conn, keyed, seq, {"op": "relabel", "rows": [], "label": label}, []
                )
            conn.cursor().executemany(
                self.dialect.q(sql.SET_LABEL), [(label, seq, m.id) for m in moved]
            )
            # a trained image's new label travels by its dataset index, like its delete
            for name in self._trained_keys(conn, [m.id for m in moved if m.source == "trained"]):
                change = (seq, "trained", name, label)
                conn.execute(self.dialect.q(sql.INSERT_LABEL_CHANGE), change)
            outcome = {"op": "relabel", "rows": [[m.id, m.old] for m in moved], "label": label}
            self._keyed(conn, keyed, seq, outcome)
            return moved

        return self._refusing(fn, "relabel", len, keyed)

    def rename(
        self, old: str, new: str, merge: bool = False, keyed: Keyed | None = None
    ) -> tuple[int, list[Relabelled]]:
        """Every live item of label `old` moved to `new`: a rename (`new` must have no live
        item: Refused label_exists) or, `merge`, a merge into `new` (which must have one:
        Refused label_unknown); when `old` has none (0, []), nothing written, or with `keyed`
        (seq, []), that outcome recorded (_nothing). A row of label_changes goes with it: a
        carry into another model's gallery renames that gallery's trained items of `old` too,
        whichever images its index holds."""
        op = "merge" if merge else "rename"

        def fn(conn, seq):
            d = self.dialect
            moved = [relabelled(r) for r in conn.execute(d.q(sql.LIVE_ROWS_OF_LABEL), (old,))]
            if not moved:  # (first: what is renamed must exist, whatever the new name)
                outcome = {"op": op, "from": old, "label": new, "count": 0}
                return self._nothing(conn, keyed, seq, outcome, [])
            exists = conn.execute(d.q(sql.HAS_LABEL), (new,)).fetchone() is not None
            if exists and not merge:
                raise Refused(
                    "label_exists",
                    f"label {new!r} has items already: merge {old!r} into it instead",
                )
            if merge and not exists:
                raise Refused("label_unknown", f"no live items with label {new!r}")
            conn.execute(d.q(sql.RENAME_LABEL), (new, seq, old))
            conn.execute(d.q(sql.INSERT_LABEL_CHANGE), (seq, "label", old, new))
            self._keyed(
                conn, keyed, seq, {"op": op, "from": old, "label": new, "count": len(moved)}
            )
            return moved

        return self._refusing(fn, op, len, keyed)

    # ------------------------------------------------------------------ the review queue
    def queue(self, rows: list[Queued], max_items: int, max_bytes: int, keep_s: float) -> int:
        """Keep `rows` for review, then hold the queue to its bounds: rows older than `keep_s`
        seconds go, then the oldest until at most `max_items` rows and `max_bytes` remain.
        Bookkeeping outside the log (no seq: the gallery did not change; a replica reads the
        queue from the store). Returns the rows dropped."""
        now = utc_now()
        values = [
            (
                int(r.id), r.created_at or now, blob(r.embedding),
                None if r.world is None else blob(r.world), r.thumbnail, r.image,
                r.image_type, r.answer, r.nearest, float(r.margin), r.reason, r.size(),
            )
            for r in rows
        ]  # fmt: skip

        def fn(conn):
            d = self.dialect
            self._take_turns(conn, "review")  # (the totals below count every writer's rows)
            if values:
                conn.cursor().executemany(d.q(sql.INSERT_REVIEW), values)
            dropped = max(0, conn.execute(d.q(sql.REVIEW_EXPIRED), (_ago(keep_s),)).rowcount)
            n, b = (int(x) for x in conn.execute(sql.REVIEW_TOTALS).fetchone())
            if n <= max_items and b <= max_bytes:
                return dropped
            gone = []
            for item_id, size in conn.execute(d.q(sql.REVIEW_OLDEST), (n,)).fetchall():
                if n <= max_items and b <= max_bytes:
                    break
                gone.append(int(item_id))
                n, b = n - 1, b - int(size)
            for s in range(0, len(gone), sql.CHUNK):
                chunk = gone[s : s + sql.CHUNK]
                dropped += max(
                    0, conn.execute(sql.ids_in(d, sql.REVIEW_DELETE, chunk), chunk).rowcount
                )
            return dropped

        return self.plain(fn)

    def _take_turns(self, conn, what: str) -> None:
        """Inside a transaction: until it ends, every other process's transaction that takes
        turns on `what` waits (bookkeeping that reads totals, then writes by them). Nothing
        here: a backend whose write transactions already take turns (SQLite's IMMEDIATE)."""
        return None

    def queued(self, limit: int) -> list[Queued]:
        """The newest `limit` rows of the review queue (without thumbnails and images)."""
        return [_queued(r) for r in self.select(self.dialect.q(sql.REVIEW_ROWS), (int(limit),))]

    def queued_items(self, ids: list[int]) -> list[Queued]:
        """The queue's rows among `ids`, every column."""
        return [_queued(r) for r in self._rows_of_ids(sql.REVIEW_OF_IDS, ids)]

    def queued_thumbnail(self, item_id: int) -> bytes | None:
        rows = self.select(self.dialect.q(sql.REVIEW_THUMBNAIL), (int(item_id),))
        return None if not rows or rows[0][0] is None else bytes(rows[0][0])

    def queue_totals(self) -> tuple[int, int]:
        """(rows, bytes) of the review queue."""
        n, b = self.select(sql.REVIEW_TOTALS)[0]
        return int(n), int(b)

    def dismiss(self, ids: list[int]) -> int:
        """Take `ids` out of the review queue (no seq); how many were there."""

        def fn(conn):
            out = 0
            for s in range(0, len(ids), sql.CHUNK):
                chunk = [int(i) for i in ids[s : s + sql.CHUNK]]
                out += max(
                    0,
                    conn.execute(
                        sql.ids_in(self.dialect, sql.REVIEW_DELETE, chunk), chunk
                    ).rowcount,
                )
            return out

        return self.plain(fn)

    def name_queued(
        self, ids: list[int], label: str, keyed: Keyed | None = None
    ) -> tuple[int, list[int], list[Queued]]:
        """The queued queries among `ids` become items of `label` and leave the queue, in one
        write (an add: in the log, followed, carried); (seq, new item ids, the rows named, in
        the new ids' order); when none is queued any more (0, [], []), nothing written, or with
        `keyed` (seq, [], []), that outcome recorded (_nothing)."""
        now = utc_now()

        def fn(conn, seq):
            rows = []
            for s in range(0, len(ids), sql.CHUNK):
                chunk = [int(i) for i in ids[s : s + sql.CHUNK]]
                rows += conn.execute(
                    sql.ids_in(self.dialect, sql.REVIEW_OF_IDS, chunk), chunk
                ).fetchall()
            queued = sorted((_queued(r) for r in rows), key=lambda q: q.id)
            if not queued:
                outcome = {"op": "name", "ids": [], "label": label, "queued": []}
                return self._nothing(conn, keyed, seq, outcome, ([], []))
            new = self._next_ids(conn, len(queued))
            emb = np.stack([q.embedding for q in queued])
            md = [{"review": {"queued_at": q.created_at, "answered": q.answer}} for q in queued]
            images = [None if q.image is None else (q.image, q.image_type) for q in queued]
            worlds = None
            if all(q.world is not None for q in queued):
                worlds = np.stack([q.world for q in queued])
            thumbs = [q.thumbnail for q in queued]
            items = new_items(new, label, emb, md, images, thumbs, now, worlds)
            insert_items(conn, self.dialect, items, seq)
            done = [q.id for q in queued]
            for s in range(0, len(done), sql.CHUNK):
                chunk = done[s : s + sql.CHUNK]
                conn.execute(sql.ids_in(self.dialect, sql.REVIEW_DELETE, chunk), chunk)
            outcome = {"op": "name", "ids": new, "label": label, "queued": done}
            self._keyed(conn, keyed, seq, outcome)
            return new, queued

        seq, (new, queued) = self.transaction(fn, "add", lambda r: len(r[0]))
        return seq, new, queued

    # ------------------------------------------------------------------ lifetime
    @abstractmethod
    def retire(self, why: str) -> None:
        """Let go of the store for good (it was carried to another model); later calls raise
        StoreCarriedAway(why)."""

    @abstractmethod
    def close(self) -> None: ...


def _queued(r) -> Queued:
    """A REVIEW_ROWS / REVIEW_OF_IDS row as a Queued."""
    extra = [None if v is None else bytes(v) for v in r[9:11]] + list(r[11:12])
    return Queued(
        int(r[0]), r[1], vec(r[2]), None if r[3] is None else vec(r[3]), r[4], r[5],
        float(r[6]), r[7], bool(r[8]), *extra,
    )  # fmt: skip


def relabelled(row) -> Relabelled:
    """A LIVE_ROWS_* row (id, label, embedding, source, world) as the item a correction moves."""
    return Relabelled(
        int(row[0]), row[1], vec(row[2]), row[3], None if row[4] is None else vec(row[4])
    )


def trained_key(metadata: str | None) -> str | None:
    """The tombstone name of a trained item: the JSON [dataset, dataset_index] of its metadata
    (None: it has no dataset index)."""
    m = json.loads(metadata) if metadata else {}
    if not isinstance(m, dict) or "dataset_index" not in m:
        return None
    return json.dumps([m.get("dataset"), m["dataset_index"]])


def _ago(seconds: float) -> str:
    """utc_now()'s format, `seconds` ago (the records' `at` compare as text)."""
    import datetime as dt

    t = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=seconds)
    return t.isoformat(timespec="seconds")


# the writes a gallery on standby admits: a carry into it, and the promotion that makes it live
STANDBY_WRITES = ("carry", "promote")


def guard_write(meta: dict[str, str], op: str) -> None:
    """Inside a write, under the write lock: refuse it on a store sealed by a migration
    (StoreCarriedAway) or on a gallery on standby (StoreStandby), the seal of a switch
    included (a switch's source must be the live gallery: the fence against a second switch);
    only STANDBY_WRITES pass a standby."""
    if CARRIED_TO in meta:
        raise StoreCarriedAway(carried_away_message(meta[CARRIED_TO]))
    if STANDBY in meta and op not in STANDBY_WRITES:
        raise StoreStandby(standby_message(meta[STANDBY]))


def insert_items(conn, dialect: sql.Dialect, items: list[StoredItem], seq: int) -> None:
    """Insert `items` as added by write `seq` (inside a transaction)."""
    conn.cursor().executemany(
        dialect.q(sql.INSERT_ITEM), [(*dataclasses.astuple(it), seq) for it in items]
    )


# ------------------------------------------------------------------------ rows into records
def item_rows(rows) -> list[ItemRow]:
    return [
        ItemRow(r[0], r[1], r[2], json.loads(r[3]) if r[3] else None, r[4], bool(r[5]))
        for r in rows
    ]


def items_by_id(rows) -> dict[int, tuple[str, str, dict | None, bool]]:
    return {r[0]: (r[1], r[2], json.loads(r[3]) if r[3] else None, bool(r[4])) for r in rows}


def live_items(rows) -> list[Item]:
    """LIVE_ITEMS rows as Items."""
    return [
        Item(r[0], r[1], r[2], None, vec(r[3]), r[4], None if r[5] is None else vec(r[5]))
        for r in rows
    ]


def stored_items(rows) -> list[StoredItem]:
    return [StoredItem(*[bytes(v) if isinstance(v, memoryview) else v for v in r]) for r in rows]


def gaps(meta: dict[str, str], have: set[int]) -> tuple[int, int, list[int]]:
    """(floor, last_seq, the seqs in (floor, last_seq] without a log row)."""
    floor, last = int(meta.get("log_floor", 0)), int(meta["last_seq"])
    return floor, last, [s for s in range(floor + 1, last + 1) if s not in have]


class StoreReader:
    """Pages of a store read inside one transaction (Store.reader): every page sees the store
    as it was when the reader opened."""

    def __init__(self, conn, dialect: sql.Dialect, close=None):
        self.conn = conn
        self.d = dialect
        self._close = close or conn.close

    def __enter__(self) -> StoreReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.execute("ROLLBACK")
        self._close()

    def last_seq(self) -> int:
        return int(self.conn.execute(sql.LAST_SEQ).fetchone()[0])

    def meta(self) -> dict[str, str]:
        return dict(self.conn.execute(sql.META).fetchall())

    def live_items(self) -> list[Item]:
        """Every live item, in id order (as Store.live_items)."""
        return live_items(self.conn.execute(self.d.q(sql.LIVE_ITEMS), (-1, 2**62)).fetchall())

    def deleted_after(self, seq: int) -> list[tuple[int, str, np.ndarray, int]]:
        """As Store.deleted_after."""
        rows = self.conn.execute(self.d.q(sql.DELETED_AFTER), (seq,)).fetchall()
        return [(r[0], r[1], vec(r[2]), r[3]) for r in rows]

    def added_items(self, after_id: int, limit: int) -> list[StoredItem]:
        rows = self.conn.execute(self.d.q(sql.ADDED_ITEMS), (after_id, limit)).fetchall()
        return stored_items(rows)

    def item_rows(self, after_id: int, limit: int) -> list[ItemRow]:
        q = sql.item_rows_query(self.d, None, None)
        return item_rows(self.conn.execute(q, (after_id, limit)).fetchall())

    def label_counts(self) -> dict[str, int]:
        """Live items per label."""
        return dict(self.conn.execute(sql.LABEL_COUNTS).fetchall())
