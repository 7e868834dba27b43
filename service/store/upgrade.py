"""Carry the live gallery into another model's gallery while it keeps serving, switch the
alias to it, and back (snca-gallery upgrade / rollback). Works on any Store backend.

- The target gallery (galleries.py: a sibling of the home store, seeded with the new index's
  trained items) is on standby from its creation: servers of the new model serve it read-only
  (writes 503, /readyz 503 `standby`) while this carries into it.
- Backfill: every live added item of the source, in id order, re-embedded by the target's model
  from its stored image, written in batches (one target write per run of one label). Each
  batch's write also records how far the copy got (meta `carry:<source gen>`), so a copy killed
  at any point resumes after its last committed batch; an item already in the target (same id)
  is never written again. Ids are kept: the target's id counter moves past the source's.
- Follow: the source's log after the seq the copy started from (read before the copy began):
  adds not carried yet, deletes mapped to the target's items (added: the same id; trained: by
  dataset and dataset index). Each source write is applied in a target write that records its
  seq (exactly once). A source compacted past that seq is reconciled in full instead.
- Switch: inside a write transaction of the source (its write lock: nothing commits there
  meanwhile) the last writes are carried and the source is put on standby, recording where a
  carry back would start (the target's seq then). Then the target takes writes (standby
  removed, with a log row its servers follow) and the alias names it. A crash in between
  leaves both on standby: running the switch again finishes it.
- Rollback is the same switch the other way: the old gallery follows the new one's writes
  from the switch on (re-embedded by the old model), then takes writes again.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from embedding.errors import ArtifactError
from embedding.gallery import utc_now
from service.store import sql
from service.store.base import Store, insert_items, stored_items
from service.store.galleries import set_alias
from service.store.records import STANDBY, ChangeSet, StoredItem, blob, changes_from_rows

# (stored items) -> (embeddings (n_ok, d) float32 of those that worked, their world statistics
# (n_ok, D) or None, per item None or why it could not be embedded)
Embed = Callable[[list[StoredItem]], tuple[np.ndarray, np.ndarray | None, list[str | None]]]
Read = Callable[..., list[tuple]]  # (query, params) -> rows, on the source

CATCH_UP_ROUNDS = 8
UNCARRIED_KEPT = 100  # items that could not be carried, named in the carry's state


@dataclass
class Side:
    """One gallery of an upgrade: its store, its gen (galleries.gen_of) and registry entry."""

    store: Store
    gen: str
    info: dict


def _key(gen: str) -> str:
    return f"carry:{gen}"


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
    """Carries `source` (the live gallery) into `target`, embedding with `embed` (the target's
    model). `say(text)` reports progress lines."""

    def __init__(
        self,
        source: Side,
        target: Side,
        embed: Embed,
        batch: int = 64,
        say: Callable[[str], None] = print,
        progress: Callable[[int, int], None] | None = None,
    ):
        self.source, self.target = source, target
        self.embed = embed
        self.batch = batch
        self.say = say
        self.progress = progress or (lambda done, total: None)
        self._trained: dict[tuple, int] | None = None  # target: dataset key -> trained id
        self.carried = 0
        self.deleted = 0

    # ------------------------------------------------------------------ state
    def state(self) -> dict | None:
        rows = self.target.store._select(
            self.target.store.dialect.q(sql.META_KEY), (_key(self.source.gen),)
        )
        return json.loads(rows[0][0]) if rows else None

    def _save(self, conn, st: dict) -> None:
        self.target.store.set_meta(conn, _key(self.source.gen), json.dumps(st, sort_keys=True))

    def _save_plain(self, st: dict) -> None:
        self.target.store.plain(lambda c: self._save(c, st))

    def _write(self, fn: Callable[[object, int], None]) -> None:
        """A write of the target (it is on standby: only a carry may write it)."""
        self.target.store.transaction(fn, "carry")

    def begin(self) -> dict:
        """The carry's state: resumed (checked to come from the same history of the source),
        or started now (the source's seq read before anything is copied)."""
        src, tgt = self.source.store, self.target.store
        st = self.state()
        if st is not None:
            seq = int(st["source_seq"])
            tok = src.log_token(seq) if seq > 0 else None
            if tok is not None and st["token"] is not None and tok != st["token"]:
                raise ArtifactError(
                    f"the gallery {self.target.gen} was carried from another history of "
                    f"{self.source.gen} (its write {seq} differs): remove it and start again"
                )
            return st
        seq = src.last_seq()
        first = src.added_items(-1, 1)
        top = tgt._select("SELECT MAX(id) FROM items WHERE source = 'trained'")[0][0]
        if first and top is not None and first[0].id <= int(top):
            raise ArtifactError(
                f"item ids would clash: the new index's trained items reach id {top}, the "
                f"gallery's first added item is {first[0].id}; an upgrade keeps ids (a SQLite "
                "gallery can be carried at start-up instead: start snca-serve with the new model)"
            )
        next_id = max(int(src.meta()["next_id"]), int(tgt.meta()["next_id"]))
        dead = self._map_trained(
            [
                (r[0], "trained", r[1])
                for r in src._select(
                    "SELECT id, metadata FROM items WHERE source = 'trained' "
                    "AND deleted_seq IS NOT NULL"
                )
            ]
        )
        st = {
            "source_seq": seq,
            "token": src.log_token(seq),
            "after_id": -1,
            "backfilled": False,
            "uncarried": [],
            "started_at": utc_now(),
        }

        def fn(conn, wseq):
            tgt.set_meta(conn, "next_id", str(next_id))
            if dead:
                tgt._mark_deleted(conn, wseq, dead, None)
            self._save(conn, st)

        self._write(fn)
        self.say(f"carrying {self.source.gen} into {self.target.gen} from write {seq}")
        return st

    # ------------------------------------------------------------------ items
    def _map_trained(self, rows: list[tuple[int, str, str | None]]) -> list[int]:
        """Target ids of source items (id, source, metadata): an added item keeps its id, a
        trained one is found by its dataset and dataset index."""
        out = []
        for item_id, source, metadata in rows:
            if source == "added":
                out.append(int(item_id))
                continue
            if self._trained is None:
                self._trained = {}
                for tid, md in self.target.store._select(sql.LIVE_TRAINED):
                    k = _dataset_key(md)
                    if k is not None:
                        self._trained[k] = tid
            k = _dataset_key(metadata)
            if k is not None and k in self._trained:
                out.append(self._trained[k])
        return out

    def _add(self, items: list[StoredItem], st: dict, **moves) -> None:
        """Embed `items` with the target's model and write them (one target write per run of
        one label, in id order); the last write also saves `st` updated with `moves`."""
        tgt = self.target.store
        have = tgt.existing([it.id for it in items]) if items else set()
        items = [it for it in items if it.id not in have]
        ok: list[StoredItem] = []
        if items:
            emb, worlds, errors = self.embed(items)
            j = 0
            for it, err in zip(items, errors, strict=True):
                if err is not None:
                    # (the first UNCARRIED_KEPT named, all counted: the state is re-saved
                    # with every batch, so it stays small)
                    st["uncarried_count"] = st.get("uncarried_count", 0) + 1
                    if len(st["uncarried"]) < UNCARRIED_KEPT:
                        st["uncarried"].append([it.id, it.label, err])
                    continue
                w = None if worlds is None else blob(worlds[j])
                ok.append(replace(it, embedding=blob(emb[j]), world=w))
                j += 1
        st.update(moves)
        runs: list[list[StoredItem]] = []
        for it in ok:
            if runs and runs[-1][0].label == it.label:
                runs[-1].append(it)
            else:
                runs.append([it])
        if not runs:
            self._save_plain(st)
            return
        for n, run in enumerate(runs):
            last = n == len(runs) - 1

            def fn(conn, seq, run=run, last=last):
                insert_items(conn, tgt.dialect, run, seq)
                top = int(conn.execute(tgt.dialect.q(sql.META_KEY), ("next_id",)).fetchone()[0])
                tgt.set_meta(conn, "next_id", str(max(top, run[-1].id + 1)))
                if last:
                    self._save(conn, st)

            self._write(fn)
            self.carried += len(run)

    def backfill(self, st: dict) -> dict:
        """The bulk copy, resumed after the last batch committed."""
        src = self.source.store
        total = src._select(
            "SELECT COUNT(*) FROM items WHERE source = 'added' AND deleted_seq IS NULL"
        )[0][0]
        done = src._select(
            src.dialect.q(
                "SELECT COUNT(*) FROM items WHERE source = 'added' AND deleted_seq IS NULL "
                "AND id <= {p}"
            ),
            (int(st["after_id"]),),
        )[0][0]
        self.progress(done, total)
        while not st["backfilled"]:
            items = src.added_items(int(st["after_id"]), self.batch)
            if not items:
                st["backfilled"] = True
                self._save_plain(st)
                break
            self._add(items, st, after_id=items[-1].id)
            done += len(items)
            self.progress(done, max(total, done))
        return st

    # ------------------------------------------------------------------ the log
    def _changes(self, read: Read, after: int) -> ChangeSet:
        d = self.source.store.dialect
        meta = dict(read(sql.META))
        rows = read(d.q(sql.CHANGES), (after, after, after))
        return ChangeSet(
            int(meta["last_seq"]), int(meta.get("log_floor", 0)), changes_from_rows(rows, after)
        )

    def follow(self, st: dict, read: Read | None = None) -> int:
        """Apply the source's writes after st["source_seq"]; how many there were. `read`: the
        source's connection inside its write transaction (the switch), else its own reads."""
        src = self.source.store
        read = read or src._select
        d = src.dialect
        cs = self._changes(read, int(st["source_seq"]))
        if cs.floor > int(st["source_seq"]):
            self._reconcile(read, st, cs.last_seq)
            return 1
        n = 0
        for c in cs.changes:
            if c.seq <= int(st["source_seq"]):
                continue
            n += 1
            if c.op == "add":
                items = stored_items(_rows_of_ids(read, d, sql.STORED_OF_IDS, c.ids))
                self._add(sorted(items, key=lambda it: it.id), st, source_seq=c.seq)
            else:
                keys = _rows_of_ids(read, d, sql.SOURCE_KEYS_OF_IDS, c.ids)
                ids = self._map_trained([(r[0], r[1], r[2]) for r in keys])
                st["source_seq"] = c.seq

                def fn(conn, seq, ids=ids):
                    self.deleted += len(self.target.store._mark_deleted(conn, seq, ids, None))
                    self._save(conn, st)

                self._write(fn)
        if cs.last_seq > int(st["source_seq"]):
            st["source_seq"] = cs.last_seq  # writes that changed no item
            self._save_plain(st)
        tok = read(d.q(sql.LOG_TOKEN), (int(st["source_seq"]),))  # (names this history)
        st["token"] = tok[0][0] if tok else None
        self._save_plain(st)
        return n

    def _reconcile(self, read: Read, st: dict, last_seq: int) -> None:
        """The source's log no longer reaches back to where this carry was: compare the two
        galleries in full (adds missing in the target carried, added items gone from the
        source deleted)."""
        self.say("the source's log was compacted past this carry: reconciling in full")
        tgt, d = self.target.store, self.source.store.dialect
        live = {r[0] for r in read(sql.LIVE_ADDED_IDS)}
        after = -1
        while True:
            rows = read(d.q(sql.ADDED_ITEMS), (after, self.batch))
            if not rows:
                break
            items = stored_items(rows)
            self._add(items, st)
            after = items[-1].id
        gone = [i for (i,) in tgt._select(sql.LIVE_ADDED_IDS) if i not in live]
        dead = self._map_trained(
            [
                (r[0], "trained", r[1])
                for r in read(
                    "SELECT id, metadata FROM items WHERE source = 'trained' "
                    "AND deleted_seq IS NOT NULL"
                )
            ]
        )
        st["source_seq"] = last_seq

        def fn(conn, seq):
            self.deleted += len(tgt._mark_deleted(conn, seq, gone + dead, None))
            self._save(conn, st)

        self._write(fn)

    def catch_up(self, st: dict) -> dict:
        """Rounds of follow until the source had no new write in a round (or CATCH_UP_ROUNDS)."""
        for _ in range(CATCH_UP_ROUNDS):
            if self.follow(st) == 0:
                break
        return st

    # ------------------------------------------------------------------ the switch
    def switch(self, st: dict, home: Store) -> dict:
        """Make the target the live gallery (see the module docstring); the alias."""
        src, tgt = self.source.store, self.target.store
        standby = json.loads(src.meta().get(STANDBY) or "null")
        if standby is None or standby.get("gen") != self.target.gen:
            self.catch_up(st)
            t0 = time.perf_counter()

            def seal(conn, seq):
                # the source's write lock is held: nothing commits there until this does
                self.follow(st, lambda q, p=(): conn.execute(q, p).fetchall())
                t_last = tgt.last_seq() + 1  # (the target's switch row, written next)
                back = {
                    "source_seq": t_last,
                    "token": None,
                    "after_id": -1,
                    "backfilled": True,
                    "uncarried": [],
                    "started_at": utc_now(),
                }
                src.set_meta(conn, _key(self.target.gen), json.dumps(back, sort_keys=True))
                live = {
                    "gen": self.target.gen,
                    "model_fingerprint": self.target.info.get("model_fingerprint"),
                    "at": utc_now(),
                }
                src.set_meta(conn, STANDBY, json.dumps(live, sort_keys=True))

            src.transaction(seal, "switch")
            self.say(f"writes paused for {time.perf_counter() - t0:.2f} s while switching")
        seq, _ = tgt.transaction(lambda conn, seq: tgt.set_meta(conn, STANDBY, None), "switch")
        # the carry back starts at the target's switch row: record that write's token
        back_key = _key(self.target.gen)
        tok = tgt.log_token(seq)

        def fix(conn):
            rows = conn.execute(src.dialect.q(sql.META_KEY), (back_key,)).fetchall()
            back = json.loads(rows[0][0]) if rows else None
            if back is not None and back.get("token") is None:
                back["source_seq"], back["token"] = seq, tok
                src.set_meta(conn, back_key, json.dumps(back, sort_keys=True))

        src.plain(fix)
        return set_alias(home, self.target.gen, self.source.gen)
