"""The one carry engine: a gallery carried into another model's gallery while it keeps taking
writes, with two endings (service/store/migration.py: the new store swapped into place at
start-up; service/store/upgrade.py: the alias switched to it, and back).

    begin      the carry's state, resumed (checked to come from the same history of the source)
               or started: the source's head read first, the target reconciled with the source
               (tombstones: added items the source no longer holds, trained items the source
               deleted, labels the source deleted), the target's id counter moved past the
               source's
    backfill   every live added item of the source, in id order, re-embedded by the target's
               model from its stored image (or kept, same model), one target write per run of
               one label; each write also records how far the copy got
    follow     the source's log after the saved seq: each source write applied in one target
               write that records that seq and its token (exactly once, resumable anywhere)
    seal       the last follow inside a write transaction of the source (its write lock:
               nothing commits there meanwhile), and the ending's own writes in it

Rules, the same for every ending:
- **Ids.** An added item keeps its id in every gallery of a home store (the target's counter
  moves past the source's). Only a target that replaces its source for good (the swap ending)
  may renumber, when the new index's trained items reach the first added id; the `carried`
  table then maps old ids to new ones.
- **Tombstones.** A delete is never undone by a carry, whatever the order: deletes by id are
  applied by id (added items) or by dataset and dataset index (trained ones); a label's delete
  (the source's `tombstones` table) deletes every trained item of that label in the target,
  whichever images the target's index holds; a carry into a target that already holds items
  first deletes there what the source no longer holds.
- **Corrections** (relabel, rename, merge: store/base.py) move an item's label in place and its
  add_seq to their write: follow and backfill move the target's copy (an added item by id, a
  trained one by dataset and dataset index: `_with_moves`). A label's delete, rename or merge
  is also a row of label_changes, which a carry applies to the target's trained items of that
  label whatever images its index holds (composed in order: `compose_label_changes`); at the
  start, the source's relabelled trained rows are applied after them (the rows are the truth
  for the items the source holds).
- **Idempotency records** (Idempotency-Key) travel with the writes they answer, so a client's
  retry after a switch is answered as the first attempt was.
- **Resumable.** Every target write saves the state with it (`carry:<source gen>` in the target's
  meta); a carry killed anywhere resumes after its last committed write.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace

import numpy as np

from embedding.errors import ArtifactError
from embedding.gallery import SQL_TYPES, STORE_ID, utc_now
from service.store import sql
from service.store.base import Store, insert_items, stored_items, trained_key
from service.store.records import ChangeSet, StoredItem, blob, changes_from_rows

# (stored items) -> (embeddings (n_ok, d) float32 of those that worked, their world statistics
# (n_ok, D) or None, per item None or why it could not be embedded)
Embed = Callable[[list[StoredItem]], tuple[np.ndarray, np.ndarray | None, list[str | None]]]
Read = Callable[..., list[tuple]]  # (query, params) -> rows, on the source

CATCH_UP_ROUNDS = 8  # follow rounds outside the source's write lock before the seal
UNCARRIED_KEPT = 100  # items that could not be carried, named in the carry's state
NO_IMAGE = "no stored image (added with SNCA_STORE_IMAGES off, or too large)"

CARRIED_TABLE = "CREATE TABLE IF NOT EXISTS carried (old_id {ID} PRIMARY KEY, new_id {ID} NOT NULL)"
DELETED_TRAINED = (
    "SELECT id, metadata FROM items WHERE source = 'trained' AND deleted_seq IS NOT NULL"
)
ADDED_ROWS = "SELECT id, deleted_seq, image IS NOT NULL FROM items WHERE source = 'added'"
REQUESTS_AFTER = "SELECT key, digest, seq, outcome, at FROM requests WHERE seq > {p}"
REQUESTS_UPTO = "SELECT key, digest, seq, outcome, at FROM requests WHERE seq <= {p}"


@dataclass
class Side:
    """One gallery of a carry: its store, its gen (galleries.gen_of) and registry entry."""

    store: Store
    gen: str
    info: dict = field(default_factory=dict)


def state_key(gen: str) -> str:
    """The target's meta key holding the state of a carry from the gallery `gen`."""
    return f"carry:{gen}"


@dataclass(slots=True)  # (slots: a misspelt field is an error, not a silent new attribute)
class CarryState:
    """Everything a carry has done, saved with every target write it makes (JSON under
    `state_key(source gen)` in the target's meta): a carry killed anywhere resumes from it, so
    these fields are the whole of its resumability contract.

    source_seq      the last source write the target holds; follow applies those after it
    source_store    the source store's STORE_ID: a state from another store of the same gen
                    (swapped away and made again) is stale, and the carry starts again
    token           the source's log token at source_seq: another history of the source
                    (restored, replaced) differs, and the carry refuses to resume
    after_id        the last source id the backfill copied (-1: none yet)
    backfilled      every live added item of the source at the start copied
    ids             "kept" (ids as in the source) or "renumbered" (the `carried` table maps them)
    uncarried       [old id, label, why] of items that could not be carried, the first
                    UNCARRIED_KEPT; uncarried_count counts them all
    started_at      when this carry began (UTC, ISO)
    target_seq      the target's seq this state describes: a target written since by anything
                    else is no longer described, and the carry starts again
    source_next_id  the source's id counter last seen: the target's moves past it (ids kept)
    caught_up       source writes applied by follow (reported by the endings)
    """

    source_seq: int
    source_store: str | None = None
    token: str | None = None
    after_id: int = -1
    backfilled: bool = False
    ids: str = "kept"
    uncarried: list = field(default_factory=list)
    uncarried_count: int = 0
    started_at: str | None = None
    target_seq: int | None = None
    source_next_id: int = 0
    caught_up: int = 0

    def encode(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def decode(cls, text: str) -> CarryState:
        """From `encode`'s JSON (also a state saved before this record: the same keys, some
        absent, which take their defaults)."""
        d = json.loads(text)
        known = {f.name for f in fields(cls)}
        d.setdefault("uncarried_count", len(d.get("uncarried", [])))
        return cls(**{k: v for k, v in d.items() if k in known})


def _rows_of_ids(read: Read, d: sql.Dialect, template: str, ids: list[int]) -> list[tuple]:
    out = []
    for s in range(0, len(ids), sql.CHUNK):
        chunk = [int(i) for i in ids[s : s + sql.CHUNK]]
        out += read(sql.ids_in(d, template, chunk), chunk)
    return out


def _dataset_key(metadata: str | None) -> tuple | None:
    m = json.loads(metadata) if metadata else {}
    return (m.get("dataset"), m.get("dataset_index")) if "dataset_index" in m else None


class Carry:
    """Carries `source` into `target` (see the module docstring). `embed`: the target's model
    (None: the same model and vector space, stored embeddings kept); `renumber`: False (ids
    kept; a clash is refused), "auto" (kept unless the target's trained ids reach the first
    added id: only for a target that replaces its source). `say(text)` reports progress
    lines, `progress(done, total)` the backfill."""

    def __init__(
        self,
        source: Side,
        target: Side,
        embed: Embed | None,
        batch: int = 64,
        say: Callable[[str], None] = print,
        progress: Callable[[int, int], None] | None = None,
        renumber: bool | str = False,
    ):
        self.source, self.target = source, target
        self.embed = embed
        self.batch = batch
        self.say = say
        self.progress = progress or (lambda done, total: None)
        self.renumber = renumber
        self._trained: dict[tuple, int] | None = None  # target: dataset key -> trained id
        self.carried = 0  # items written into the target by this run
        self.deleted = 0  # items deleted in the target by this run
        self.relabelled = 0  # items whose label a correction in the source changed, moved here
        self.caught_up = 0  # source writes applied by follow in this run
        self._ids = "kept"  # or "renumbered" (the state says, once begun)
        self.discard_hint = "remove that gallery and run the command again"

    # ------------------------------------------------------------------ state
    def state(self) -> CarryState | None:
        rows = self.target.store.select(
            self.target.store.dialect.q(sql.META_KEY), (state_key(self.source.gen),)
        )
        return CarryState.decode(rows[0][0]) if rows else None

    def _save(self, conn, st: CarryState, seq: int | None = None) -> None:
        """Inside a target write (`seq`; None: bookkeeping with no seq): the state, with the
        target's seq it describes (a resume finding the target written since by anything else
        starts again, reconciled), and (ids kept) the id counter past every id the source gave
        out by then (an id the source used for an item deleted before it was carried must
        never be given out again by the target once live)."""
        tgt = self.target.store
        if seq is not None:
            st.target_seq = int(seq)
        tgt.set_meta(conn, state_key(self.source.gen), st.encode())
        want = int(st.source_next_id)
        if want and not self._renumbered():
            row = conn.execute(tgt.dialect.q(sql.META_KEY), ("next_id",)).fetchone()
            if int(row[0]) < want:
                tgt.set_meta(conn, "next_id", str(want))

    def _save_plain(self, st: CarryState) -> None:
        self.target.store.plain(lambda c: self._save(c, st))

    def _write(self, fn: Callable[[object, int], None]) -> None:
        """A write of the target (one on standby admits only a carry's writes)."""
        self.target.store.transaction(fn, "carry")

    def begin(self) -> CarryState:
        """The carry's state: resumed, or started now (see the module docstring)."""
        src, tgt = self.source.store, self.target.store
        st = self.state()
        here = src.meta().get(STORE_ID)
        stale = None
        if st is not None and st.source_store not in (None, here):
            # another store of the same model and index build (the gallery was swapped away at
            # a start-up and made again since): the state follows a store that is gone
            stale = f"it was carried from an earlier store of {self.source.gen}"
        elif st is not None and st.target_seq not in (None, tgt.last_seq()):
            # the target was written since by something else (a carry from another gallery,
            # its own writes while live): the state no longer describes what it holds
            stale = "it was written since by another carry or while it was live"
        if stale is not None:
            self.say(f"carrying into {self.target.gen} again from the start: {stale}")
            tgt.plain(lambda c: self.forget(c))
            st = None
        if st is not None:
            seq = int(st.source_seq)
            tok = src.log_token(seq) if seq > 0 else None
            if tok is not None and st.token is not None and tok != st.token:
                raise ArtifactError(
                    f"the gallery {self.target.gen} was carried from another history of "
                    f"{self.source.gen} (its write {seq} differs: that gallery was restored or "
                    f"replaced since); it cannot be resumed: {self.discard_hint}"
                )
            self._ids = st.ids
            return st
        seq = src.last_seq()  # read before anything is copied: later writes are followed
        self._load_trained()
        renumber = self._renumbers()
        self._ids = "renumbered" if renumber else "kept"
        next_id = int(tgt.meta()["next_id"])
        if not renumber:
            next_id = max(int(src.meta()["next_id"]), next_id)
        gone = [] if renumber else self._gone_from_source()
        tombs = self._tombstones(src.select)
        moves = self._trained_moves(src.select(sql.RELABELLED_TRAINED))
        requests = [] if renumber else src.select(src.dialect.q(REQUESTS_UPTO), (seq,))
        st = CarryState(
            source_seq=seq,
            source_store=here,
            token=src.log_token(seq),
            ids="renumbered" if renumber else "kept",
            started_at=utc_now(),
        )

        def fn(conn, wseq):
            d = tgt.dialect
            if renumber:
                conn.execute(CARRIED_TABLE.format(**SQL_TYPES[d.name]))
            tgt.set_meta(conn, "next_id", str(next_id))
            self._bury(conn, wseq, tombs, gone)
            self._with_moves(moves)(conn, wseq)  # (after the renames: the rows are the truth)
            self._copy_requests(conn, requests, wseq)
            self._save(conn, st, wseq)

        self._write(fn)
        self.say(f"carrying {self.source.gen} into {self.target.gen} from write {seq}")
        return st

    def _renumbers(self) -> bool:
        """Whether added items get new ids: never unless allowed ("auto") and needed (the
        target's trained ids reach the first added id); refused when needed and not allowed."""
        src, tgt = self.source.store, self.target.store
        first = src.added_items(-1, 1)
        top = tgt.select("SELECT MAX(id) FROM items WHERE source = 'trained'")[0][0]
        clash = bool(first) and top is not None and first[0].id <= int(top)
        if clash and self.renumber != "auto":
            raise ArtifactError(
                f"item ids would clash: the new index's trained items reach id {top}, the "
                f"gallery's first added item is {first[0].id}; an upgrade keeps ids (a SQLite "
                "gallery can be carried at start-up instead: start snca-serve with the new model)"
            )
        return clash

    def _gone_from_source(self, read: Read | None = None) -> list[int]:
        """Live added items of the target that the source no longer holds: deleted there, or
        gone from it (compacted after their delete) while they had an image to carry them by
        (an item with no stored image is never carried, so its absence proves nothing)."""
        read = read or self.source.store.select
        src_rows = {r[0]: r[1] for r in read(ADDED_ROWS)}  # id -> deleted_seq
        gone = []
        for item_id, deleted_seq, has_image in self.target.store.select(ADDED_ROWS):
            if deleted_seq is not None:
                continue
            if item_id in src_rows:
                if src_rows[item_id] is not None:
                    gone.append(int(item_id))
            elif has_image:
                gone.append(int(item_id))
        return gone

    def _tombstones(self, read: Read, after: int | None = None) -> list[tuple[str, str, int]]:
        """(kind, name, seq) of the source's deletes and label changes that a carry must never
        undo: its tombstones and label_changes (kind "change", name the JSON [old, new]) after
        write `after`, or all; at the start also the trained items its rows say are deleted (a
        store written before tombstones existed)."""
        d = self.source.store.dialect
        if after is not None:
            out = [tuple(r) for r in read(d.q(sql.TOMBSTONES_AFTER), (after,))]
        else:
            out = [tuple(r) for r in read(sql.TOMBSTONES)]
            for _, md in read(DELETED_TRAINED):
                name = trained_key(md)
                if name is not None:
                    out.append(("trained", name, 0))
        changes = read(d.q(sql.LABEL_CHANGES_AFTER), (-1 if after is None else after,))
        return out + [("change", json.dumps(list(r[1:])), int(r[0])) for r in changes]

    def _bury(self, conn, seq: int, tombs: list[tuple[str, str, int]], ids: list[int]) -> None:
        """Inside a target write: delete `ids` and the trained images the tombstones `tombs`
        name by dataset index; apply the label changes among them to the target's trained
        items, whichever images its index holds (composed in seq order into one mapping,
        applied at once: a rename chain, a swap, a delete after a merge all come out as they
        did in the source); keep the tombstones and the mapping (they travel on, even where
        nothing matched)."""
        tgt = self.target.store
        d = tgt.dialect
        kill = list(ids)
        changes = []
        for kind, name, at in tombs:
            if kind == "change":
                changes.append((int(at), *json.loads(name)))
                continue
            if kind == "trained":
                tid = (self._trained or {}).get(_dataset_key(json.dumps(_key_meta(name))))
                kill += [] if tid is None else [tid]
            conn.execute(d.q(sql.UPSERT_TOMBSTONE), (kind, name, seq))
        labels, images = compose_label_changes(changes)
        moves = []
        for old, new in sorted(labels.items()):  # (simultaneous: read all, then write)
            live = [r[0] for r in conn.execute(d.q(sql.LIVE_TRAINED_OF_LABEL), (old,))]
            if new is None:
                kill += live
            else:
                moves += [(tid, new) for tid in live]
            conn.execute(d.q(sql.INSERT_LABEL_CHANGE), (seq, "label", old, new))
        for name, new in sorted(images.items()):  # (after the labels: they are final)
            tid = (self._trained or {}).get(_dataset_key(json.dumps(_key_meta(name))))
            if tid is not None:
                moves = [m for m in moves if m[0] != tid]
                if new is None:  # (its label was deleted after it was relabelled)
                    kill.append(tid)
                else:
                    moves.append((tid, new))
            conn.execute(d.q(sql.INSERT_LABEL_CHANGE), (seq, "trained", name, new))
        if moves:
            conn.cursor().executemany(
                d.q(sql.SET_LABEL), [(new, seq, int(tid)) for tid, new in moves]
            )
            self.relabelled += len(moves)
        if kill:
            self.deleted += len(tgt._mark_deleted(conn, seq, sorted(set(kill)), None))

    # ------------------------------------------------------------------ items
    def _load_trained(self) -> None:
        """The target's trained items by dataset key (read once, outside any target write:
        _map_trained runs inside them too; a key whose item was deleted since only finds
        nothing live to delete)."""
        if self._trained is None:
            self._trained = {}
            for tid, md in self.target.store.select(sql.LIVE_TRAINED):
                k = _dataset_key(md)
                if k is not None:
                    self._trained[k] = tid

    def _map_trained(self, rows: list[tuple[int, str, str | None]]) -> list[int]:
        """Target ids of source items (id, source, metadata): an added item keeps its id (or its
        renumbered one), a trained one is found by its dataset and dataset index."""
        self._load_trained()
        out, added = [], []
        for item_id, source, metadata in rows:
            if source == "added":
                added.append(int(item_id))
                continue
            k = _dataset_key(metadata)
            if k is not None and k in self._trained:
                out.append(self._trained[k])
        return out + list(self._new_ids(added).values())

    def _new_ids(self, ids: list[int]) -> dict[int, int]:
        """Source id -> target id of the added items among `ids` that the target holds."""
        tgt = self.target.store
        if not self._renumbered():
            return {i: i for i in tgt.existing(ids)}
        rows = _rows_of_ids(
            tgt.select,
            tgt.dialect,
            "SELECT old_id, new_id FROM carried WHERE old_id IN ({ids})",
            ids,
        )
        return {int(a): int(b) for a, b in rows}

    def _renumbered(self) -> bool:
        return self._ids == "renumbered"

    def _embed(self, items: list[StoredItem], st: CarryState) -> list[StoredItem]:
        """`items` as the target stores them (re-embedded, or as they were); those that cannot
        be are counted and named in `st` (the first UNCARRIED_KEPT: it is saved with every
        write, so it stays small)."""
        if self.embed is None:
            return list(items)
        errors: list[str | None] = [None] * len(items)
        with_image = [i for i, it in enumerate(items) if it.image is not None]
        for i, it in enumerate(items):
            if it.image is None:
                errors[i] = NO_IMAGE
        ok: list[StoredItem] = []
        if with_image:
            emb, worlds, errs = self.embed([items[i] for i in with_image])
            j = 0
            for i, err in zip(with_image, errs, strict=True):
                if err is not None:
                    errors[i] = f"the stored image cannot be read: {err}"
                    continue
                w = None if worlds is None else blob(worlds[j])
                ok.append(replace(items[i], embedding=blob(emb[j]), world=w))
                j += 1
        for it, err in zip(items, errors, strict=True):
            if err is not None:
                st.uncarried_count = st.uncarried_count + 1
                if len(st.uncarried) < UNCARRIED_KEPT:
                    st.uncarried.append([it.id, it.label, err])
        return sorted(ok, key=lambda it: it.id)

    def _add(self, items: list[StoredItem], st: CarryState, extra=None) -> None:
        """Embed `items` with the target's model and write them (one target write per run of
        one label, in id order); the last write also saves `st` and runs `extra(conn, seq)`."""
        tgt = self.target.store
        have = self._new_ids([it.id for it in items]) if items else {}
        todo = [it for it in items if it.id not in have]
        ok = self._embed(todo, st) if todo else []
        # items the target holds already take the source's label (a correction made since)
        moves = [(have[it.id], it.label) for it in items if it.id in have]
        if moves:
            extra = self._with_moves(moves, extra)
        runs: list[list[StoredItem]] = []
        for it in ok:
            if runs and runs[-1][0].label == it.label:
                runs[-1].append(it)
            else:
                runs.append([it])
        if not runs:
            if extra is None:
                self._save_plain(st)
            else:
                self._write(lambda conn, seq: (extra(conn, seq), self._save(conn, st, seq)))
            return
        renumber = self._renumbered()
        for n, run in enumerate(runs):
            last = n == len(runs) - 1

            def fn(conn, seq, run=run, last=last):
                d = tgt.dialect
                top = int(conn.execute(d.q(sql.META_KEY), ("next_id",)).fetchone()[0])
                if renumber:
                    new = [replace(it, id=top + k) for k, it in enumerate(run)]
                    conn.cursor().executemany(
                        d.q("INSERT INTO carried (old_id, new_id) VALUES ({p}, {p})"),
                        [(a.id, b.id) for a, b in zip(run, new, strict=True)],
                    )
                    run, top = new, top + len(new)
                insert_items(conn, d, run, seq)
                tgt.set_meta(conn, "next_id", str(max(top, run[-1].id + 1)))
                if last:
                    if extra is not None:
                        extra(conn, seq)
                    self._save(conn, st, seq)

            self._write(fn)
            self.carried += len(run)

    def _with_moves(self, moves: list[tuple[int, str]], then=None):
        """An `extra` for a target write: the target's live items `moves` (target id, label)
        moved to their label where it differs (a correction in the source), then `then`."""

        def extra(conn, seq):
            q = self.target.store.dialect.q(sql.MOVE_LABEL)
            for tid, label in moves:
                self.relabelled += conn.execute(q, (label, seq, int(tid), label)).rowcount
            if then is not None:
                then(conn, seq)

        return extra

    def _trained_moves(self, rows: list[tuple[str | None, str]]) -> list[tuple[int, str]]:
        """(target id, label) of the target's trained items that source trained rows
        (metadata, label) name by dataset and dataset index."""
        self._load_trained()
        out = []
        for metadata, label in rows:
            tid = (self._trained or {}).get(_dataset_key(metadata))
            if tid is not None:
                out.append((tid, label))
        return out

    def backfill(self, st: CarryState) -> CarryState:
        """The bulk copy, resumed after the last batch committed."""
        src = self.source.store
        live = "SELECT COUNT(*) FROM items WHERE source = 'added' AND deleted_seq IS NULL"
        total = src.select(live)[0][0]
        done = src.select(src.dialect.q(live + " AND id <= {p}"), (int(st.after_id),))[0][0]
        self.progress(done, total)
        while not st.backfilled:
            items = src.added_items(int(st.after_id), self.batch)
            if not items:
                st.backfilled = True
                if self._renumbered():  # (the records from before begin, once their ids are)
                    reqs = src.select(src.dialect.q(REQUESTS_UPTO), (int(st.source_seq),))
                    self._write(
                        lambda conn, seq, reqs=reqs: (
                            self._copy_requests(conn, reqs, seq),
                            self._save(conn, st, seq),
                        )
                    )
                else:
                    self._save_plain(st)
                break
            st.after_id = items[-1].id
            self._add(items, st)
            done += len(items)
            self.progress(done, max(total, done))
        return st

    # ------------------------------------------------------------------ the log
    def _changes(self, read: Read, after: int) -> ChangeSet:
        d = self.source.store.dialect
        meta = dict(read(sql.META))
        rows = read(d.q(sql.CHANGES), (after, after, after))
        ops = dict(read(d.q(sql.LOG_OPS_AFTER), (after,)))
        return ChangeSet(
            int(meta["last_seq"]),
            int(meta.get("log_floor", 0)),
            changes_from_rows(rows, after, ops),
        )

    def _copy_requests(self, conn, rows, seq: int) -> None:
        """Idempotency records of the source into the target, inside the target's write `seq`,
        which they then name (a record's seq is a write of the gallery that holds it: a later
        carry from the target copies it by the target's own log; a retry answered from it
        reports a version of the target). With ids renumbered, the ids an outcome names are
        given in the target's numbering (-1: an item gone before it could be carried)."""
        if not rows:
            return
        rows = [(r[0], r[1], int(seq), r[3], r[4]) for r in rows]
        if self._renumbered():
            rows = self._renumber_outcomes(conn, rows)
        conn.cursor().executemany(self.target.store.dialect.q(sql.UPSERT_REQUEST), rows)

    def _renumber_outcomes(self, conn, rows: list[tuple]) -> list[tuple]:
        """Records whose outcomes' ids ("ids"; "rows" of [id, label]) are mapped through the
        carried table (read on the target write's `conn`: this write's mappings included)."""
        outcomes = [json.loads(r[3]) for r in rows]
        ids = sorted(
            {int(i) for o in outcomes for i in o.get("ids", [])}
            | {int(x[0]) for o in outcomes for x in o.get("rows", [])}
        )
        new: dict[int, int] = {}
        for s in range(0, len(ids), sql.CHUNK):
            chunk = ids[s : s + sql.CHUNK]
            q = "SELECT old_id, new_id FROM carried WHERE old_id IN ({ids})"
            new |= dict(conn.execute(sql.ids_in(self.target.store.dialect, q, chunk), chunk))
        out = []
        for r, o in zip(rows, outcomes, strict=True):
            if "ids" in o:
                o["ids"] = [new.get(int(i), -1) for i in o["ids"]]
            if "rows" in o:
                o["rows"] = [[new.get(int(x[0]), -1), *x[1:]] for x in o["rows"]]
            out.append((r[0], r[1], r[2], json.dumps(o, sort_keys=True), r[4]))
        return out

    def follow(self, st: CarryState, read: Read | None = None) -> int:
        """Apply the source's writes after st.source_seq; how many there were. `read`: the
        source's connection inside its write transaction (the seal), else its own reads."""
        src = self.source.store
        read = read or src.select
        d = src.dialect
        after = int(st.source_seq)
        self._load_trained()
        cs = self._changes(read, after)
        if cs.floor > after:
            self._reconcile(read, st, cs.last_seq)
            return 1
        tokens = dict(read(d.q(sql.LOG_TOKENS), (after, cs.last_seq)))
        st.source_next_id = int(dict(read(sql.META)).get("next_id", 0))
        tombs: dict[int, list] = {}
        for t in self._tombstones(read, after):
            tombs.setdefault(int(t[2]), []).append(t)
        reqs: dict[int, list] = {}
        for r in read(d.q(REQUESTS_AFTER), (after,)):
            reqs.setdefault(int(r[2]), []).append(r)
        # A write of the source that changed none of its items is not among the changes, yet
        # may hold tombstones and Idempotency records: a delete carried into the source from a
        # gallery with an item the source lacks (a trained image of another model's index)
        # deleted nothing there, and must delete it here. Each change's target write takes
        # those of the writes up to it (the state it saves moves past them), the rest go last.
        n = 0
        for c in cs.changes:
            if c.seq <= int(st.source_seq):
                continue
            n += 1
            st.source_seq, st.token = c.seq, tokens.get(c.seq)
            st.caught_up = int(st.caught_up) + 1  # (saved with this write)
            tomb, keyed = _upto(tombs, c.seq), _upto(reqs, c.seq)

            def extra(conn, seq, tomb=tomb, keyed=keyed):
                self._bury(conn, seq, tomb, [])
                self._copy_requests(conn, keyed, seq)

            if c.op != "delete":  # (new items, or moved ones: _add tells them apart by id)
                items = stored_items(_rows_of_ids(read, d, sql.STORED_OF_IDS, c.ids))
                trained = [r for r in (c.sources or []) if r == "trained"]
                if trained:  # a correction moved trained items: the target's, by dataset key
                    keys = _rows_of_ids(read, d, sql.SOURCE_KEYS_OF_IDS, c.ids)
                    rows = [(r[2], c.label) for r in keys if r[1] == "trained"]
                    extra = self._with_moves(self._trained_moves(rows), extra)
                self._add(sorted(items, key=lambda it: it.id), st, extra)
            else:
                keys = _rows_of_ids(read, d, sql.SOURCE_KEYS_OF_IDS, c.ids)
                ids = self._map_trained([(r[0], r[1], r[2]) for r in keys])

                def fn(conn, seq, ids=ids, tomb=tomb, keyed=keyed):
                    self._bury(conn, seq, tomb, ids)
                    self._copy_requests(conn, keyed, seq)
                    self._save(conn, st, seq)

                self._write(fn)
        self.caught_up += n
        if cs.last_seq > int(st.source_seq):  # writes after the last change
            st.source_seq, st.token = cs.last_seq, tokens.get(cs.last_seq)
            tomb, keyed = _upto(tombs, cs.last_seq), _upto(reqs, cs.last_seq)
            if tomb or keyed:

                def rest(conn, seq):
                    self._bury(conn, seq, tomb, [])
                    self._copy_requests(conn, keyed, seq)
                    self._save(conn, st, seq)

                self._write(rest)
            else:
                self._save_plain(st)
        return n

    def _reconcile(self, read: Read, st: CarryState, last_seq: int) -> None:
        """The source's log no longer reaches back to where this carry was (compacted): compare
        the two galleries in full (adds missing in the target carried, what the source no
        longer holds deleted, its tombstones applied, its Idempotency records since copied)."""
        self.say("the source's log was compacted past this carry: reconciling in full")
        tgt, d = self.target.store, self.source.store.dialect
        after = -1
        while True:
            rows = read(d.q(sql.ADDED_ITEMS), (after, self.batch))
            if not rows:
                break
            items = stored_items(rows)
            self._add(items, st)
            after = items[-1].id
        gone = [] if self._renumbered() else self._gone_from_source(read)
        if self._renumbered():  # (ids differ: compare through the carried table)
            live = {r[0] for r in read(sql.LIVE_ADDED_IDS)}
            mapped = self._new_ids([r[0] for r in tgt.select("SELECT old_id FROM carried")])
            gone = [new for old, new in mapped.items() if old not in live]
        tombs = self._tombstones(read)
        moves = self._trained_moves(read(sql.RELABELLED_TRAINED))
        # the Idempotency records of the writes the log no longer holds (a client's retry on
        # the target must be answered by the first outcome, not made again)
        requests = read(d.q(REQUESTS_AFTER), (int(st.source_seq),))
        tok = read(d.q(sql.LOG_TOKEN), (last_seq,))
        st.source_seq, st.token = last_seq, tok[0][0] if tok else None
        st.source_next_id = int(dict(read(sql.META)).get("next_id", 0))

        def fn(conn, seq):
            self._bury(conn, seq, tombs, gone)
            self._with_moves(moves)(conn, seq)
            self._copy_requests(conn, requests, seq)
            self._save(conn, st, seq)

        self._write(fn)

    def catch_up(self, st: CarryState) -> CarryState:
        """Rounds of follow until the source had no new write in a round (or CATCH_UP_ROUNDS)."""
        for _ in range(CATCH_UP_ROUNDS):
            if self.follow(st) == 0:
                break
        return st

    def seal(self, st: CarryState, ending: Callable, op: str) -> int:
        """Inside one write transaction of the source (`op`, guarded as any write: refused on a
        gallery sealed or on standby): the last follow, then `ending(conn, seq, read)`; the
        source's seq of that write."""

        def fn(conn, seq):
            read = lambda q, p=(): conn.execute(q, p).fetchall()  # noqa: E731
            self.follow(st, read)
            ending(conn, seq, read)

        seq, _ = self.source.store.transaction(fn, op)
        return seq

    def forget(self, conn) -> None:
        """Inside a target write: drop this carry's state (the target replaced its source)."""
        self.target.store.set_meta(conn, state_key(self.source.gen), None)


def compose_label_changes(
    changes: list[tuple[int, str, str, str | None]],
) -> tuple[dict[str, str | None], dict[str, str | None]]:
    """(seq, kind, name, new) rows of label_changes composed in seq order into what they make
    of a gallery's trained items: ({label: its items' label after all of them (None:
    deleted)}, {trained image key: its label after all of them}), identities left out. One
    write's rows apply together, its label rows before its image rows; an image relabelled is
    moved on by the label changes after it. Applied in that order (labels, then images), the
    two give every trained item the label the source's history gives it."""
    f: dict[str, str | None] = {}
    img: dict[str, str | None] = {}
    by_seq: dict[int, tuple[dict, dict]] = {}
    for q, kind, name, new in changes:
        by_seq.setdefault(q, ({}, {}))[0 if kind == "label" else 1][name] = new
    for q in sorted(by_seq):
        g, relabelled = by_seq[q]
        for m in (f, img):  # what earlier writes made of a label, moved on by this one
            for k, v in m.items():
                if v is not None and v in g:
                    m[k] = g[v]
        for old, new in g.items():
            f.setdefault(old, new)
        img.update(relabelled)
    return {k: v for k, v in f.items() if v != k}, img


def _upto(by_seq: dict[int, list], seq: int) -> list:
    """Take out of `by_seq` (source seq -> rows) every row of a write up to `seq`."""
    out = []
    for q in sorted(q for q in by_seq if q <= seq):
        out += by_seq.pop(q)
    return out


def _key_meta(name: str) -> dict:
    """The metadata a trained tombstone's name stands for (base.trained_key's inverse)."""
    dataset, index = json.loads(name)
    return {"dataset": dataset, "dataset_index": index}
