"""Carry a user's gallery to a new model.

A gallery store belongs to the model (fingerprint) and index build (index_id) it was seeded
from. When the service starts on a store made under others (the model was retrained or
replaced, or the index rebuilt), it builds the new model's store before it serves:

- the trained items come from the new index dir's store, as on a first start;
- every live item added through the service is carried with its label, metadata, image,
  thumbnail and creation time; its embedding is recomputed from the stored image by the new
  model (kept as it is when the model and vector space are the same: an index rebuilt with
  other options);
- trained items the user deleted stay deleted (matched by dataset and dataset index);
- an item that cannot be carried (no stored image, and a new model) is reported by id,
  listed in the new store's `uncarried` table, and stays in the old store.

Ids: carried items keep their ids when they lie above the new index's (the usual case: a
retrain of the same data); otherwise they get new ones, in the same order, and the `carried`
table maps old to new.

Crash safety: the new store is written beside the old one (gallery.sqlite.migrating), in
batches, each one transaction that also records the old ids it carried; a restart resumes
after them. Only when it is complete is the old store merged into one file, linked into
previous/ and the new one renamed over it. The old store's items are never changed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from embedding.artifacts import fsync_dir
from embedding.errors import ArtifactError
from embedding.gallery import open_store, read_meta, utc_now

from .datadir import DataDir
from .store import (
    GalleryStore,
    StoredItem,
    allocate_ids,
    insert_items,
    mark_deleted,
    on_read_only_fs,
    open_unwritable,
    set_meta,
)

log = logging.getLogger("snca.migration")

_TABLES = """
CREATE TABLE IF NOT EXISTS carried (old_id INTEGER PRIMARY KEY, new_id INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS uncarried (
    old_id INTEGER PRIMARY KEY, label TEXT NOT NULL, reason TEXT NOT NULL
);
"""

# (stored items) -> (embeddings (n_ok, d) float32 of those that worked, one error per item:
# None where it worked, else why not)
Embed = Callable[[list[StoredItem]], tuple[np.ndarray, list[str | None]]]


@dataclass(frozen=True)
class Target:
    """The model and index build a store must belong to."""

    fingerprint: str
    index_id: str
    space: str
    dim: int


@dataclass
class Plan:
    """A store made under another model or index build, and what carrying it involves."""

    old: Path
    old_meta: dict[str, str]
    target: Target
    total: int  # live added items
    with_image: int  # of which with a stored image
    reuse: bool  # same model and vector space: stored embeddings stay valid

    @property
    def source(self) -> dict[str, str]:
        """What identifies the old store (a half-done migration resumes only from the same)."""
        m = self.old_meta
        keys = ("model_fingerprint", "index_id", "created_at", "last_seq")
        return {k: m.get(k, "") for k in keys}

    def describe(self) -> str:
        why = (
            "the index was rebuilt"
            if self.reuse
            else f"the model changed ({self.old_meta.get('model_fingerprint', '?')[:19]}... -> "
            f"{self.target.fingerprint[:19]}...)"
        )
        return f"{why}: carrying {self.total} added items of {self.old} to the new model"


@dataclass
class Report:
    carried: int = 0
    uncarried: list[tuple[int, str, str]] = field(default_factory=list)  # (old id, label, why)
    deleted_trained: int = 0
    renumbered: bool = False
    reembedded: bool = True
    archive: str = ""
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {
            "carried": self.carried,
            "uncarried": [{"id": i, "label": lab, "reason": r} for i, lab, r in self.uncarried],
            "deleted_trained": self.deleted_trained,
            "renumbered": self.renumbered,
            "reembedded": self.reembedded,
            "archive": self.archive,
            "seconds": round(self.seconds, 2),
        }


def plan(store: Path, target: Target) -> Plan | None:
    """None when `store` belongs to `target` (nothing to carry); else the migration's plan."""
    conn = open_unwritable(store) if on_read_only_fs(store) else open_store(store, readonly=True)
    try:
        meta = read_meta(conn)
        if (meta.get("model_fingerprint"), meta.get("index_id")) == (
            target.fingerprint,
            target.index_id,
        ):
            return None
        total, with_image = conn.execute(
            "SELECT COUNT(*), COUNT(image) FROM items "
            "WHERE source = 'added' AND deleted_seq IS NULL"
        ).fetchone()
    except sqlite3.DatabaseError as e:
        raise ArtifactError(f"{store} is not a readable gallery store: {e}") from None
    finally:
        conn.close()
    reuse = (
        meta.get("model_fingerprint") == target.fingerprint
        and meta.get("space", "embedding") == target.space
        and int(meta.get("dim", "0")) == target.dim
    )
    return Plan(store, meta, target, int(total), int(with_image), reuse)


class Migration:
    """Runs a Plan: `run()` returns the Report once the new store is in place."""

    def __init__(
        self,
        plan: Plan,
        data: DataDir,
        seed: Path,
        embed: Embed,
        batch: int = 64,
        progress: Callable[[int, int], None] | None = None,
    ):
        self.plan = plan
        self.data = data
        self.seed = seed  # the new index dir's store (the trained items)
        self.embed = embed
        self.batch = batch
        self.progress = progress or (lambda done, total: None)

    def run(self) -> Report:
        t0 = time.perf_counter()
        p = self.plan
        if not self.data.writable():
            raise ArtifactError(
                f"the gallery store {p.old} was made for another model and must be carried to "
                f"this one, but {p.old.parent} is not writable"
            )
        old = GalleryStore(
            p.old, None, p.old_meta.get("model_fingerprint", ""), p.old_meta.get("index_id", "")
        )
        new = None
        try:
            new = self._open_target(old)
            report = self._report(new)
            if new.meta().get("migrated_from") is None:
                self._carry(old, new, report)
                report.seconds = time.perf_counter() - t0

                def finish(conn, seq):
                    set_meta(conn, "migrated_from", json.dumps(self._summary(report)))
                    set_meta(conn, "migrating_from", None)

                new.transaction(finish)
            for s in (new, old):  # both become single files (no WAL): safe to rename
                s.close_as_one_file()
        finally:
            for s in (new, old):
                if s is not None:
                    with contextlib.suppress(sqlite3.Error):
                        s.close()
        self._swap(report)
        report.seconds = time.perf_counter() - t0
        return report

    # ------------------------------------------------------------------ the new store
    def _open_target(self, old: GalleryStore) -> GalleryStore:
        """The half-done new store of this very migration (resumed), or a fresh one."""
        t, p = self.data.migrating, self.plan
        if t.exists():
            try:
                new = GalleryStore(t, self.seed, p.target.fingerprint, p.target.index_id)
                meta = new.meta()
                if meta.get("migrated_from") is not None or (
                    json.loads(meta.get("migrating_from", "null")) == p.source
                ):
                    log.info("resuming the migration in %s", t)
                    return new
                new.close()
            except (ArtifactError, ValueError) as e:
                log.warning("discarding %s: %s", t, e)
            for suffix in ("", "-wal", "-shm"):
                Path(str(t) + suffix).unlink(missing_ok=True)
        new = GalleryStore(t, self.seed, p.target.fingerprint, p.target.index_id)
        first = old.added_items(-1, 1)
        next_id = int(new.meta()["next_id"])
        keep_ids = not first or first[0].id >= next_id
        old_next = int(p.old_meta.get("next_id", "0"))
        stamp = utc_now().replace(":", "").replace("+0000", "Z")
        archive = f"gallery-{stamp}-{p.old_meta.get('model_fingerprint', 'unknown')[7:19]}.sqlite"
        gone = old.deleted_trained()
        by_source = new.trained_ids_by_source() if gone else {}
        dead = [
            by_source[k]
            for k in ((m.get("dataset"), m.get("dataset_index")) for m in gone)
            if k in by_source
        ]

        def setup(conn, seq):
            for stmt in _TABLES.strip().split(";"):  # (executescript would commit)
                if stmt.strip():
                    conn.execute(stmt)
            set_meta(conn, "migrating_from", json.dumps(p.source))
            set_meta(conn, "carry_ids", "kept" if keep_ids else "renumbered")
            set_meta(conn, "archive", archive)
            set_meta(conn, "deleted_trained", str(len(dead)))
            if keep_ids:  # ids are never reused: stay above every id the old store gave out
                set_meta(conn, "next_id", str(max(next_id, old_next)))
            mark_deleted(conn, dead, seq)

        new.transaction(setup)
        return new

    def _report(self, new: GalleryStore) -> Report:
        meta = new.meta()
        rows = new.select("SELECT old_id, label, reason FROM uncarried ORDER BY old_id")
        carried = new.select("SELECT COUNT(*) FROM carried")[0][0]
        return Report(
            carried=int(carried),
            uncarried=[tuple(r) for r in rows],
            deleted_trained=int(meta.get("deleted_trained", "0")),
            renumbered=meta.get("carry_ids") == "renumbered",
            reembedded=not self.plan.reuse,
            archive=str(self.data.previous / meta["archive"]),
        )

    def _summary(self, report: Report) -> dict:
        return {**self.plan.source, "finished_at": utc_now(), **report.to_dict()}

    # ------------------------------------------------------------------ carrying items
    def _carry(self, old: GalleryStore, new: GalleryStore, report: Report) -> None:
        p = self.plan
        after = new.select(
            "SELECT MAX(m) FROM (SELECT MAX(old_id) AS m FROM carried "
            "UNION ALL SELECT MAX(old_id) FROM uncarried)"
        )[0][0]
        after = -1 if after is None else int(after)
        done = report.carried + len(report.uncarried)
        self.progress(done, p.total)
        while True:
            items = old.added_items(after, self.batch)
            if not items:
                break
            ok, failed = self._embed(items)
            renumber = report.renumbered

            def write(conn, seq, ok=ok, failed=failed, renumber=renumber):
                ids = allocate_ids(conn, len(ok)) if renumber else [it.id for it, _ in ok]
                insert_items(
                    conn,
                    [replace(it, id=i, embedding=e) for (it, e), i in zip(ok, ids, strict=True)],
                    seq,
                )
                conn.executemany(
                    "INSERT INTO carried (old_id, new_id) VALUES (?, ?)",
                    [(it.id, i) for (it, _), i in zip(ok, ids, strict=True)],
                )
                conn.executemany(
                    "INSERT INTO uncarried (old_id, label, reason) VALUES (?, ?, ?)",
                    failed,
                )

            new.transaction(write)
            report.carried += len(ok)
            report.uncarried += failed
            for item_id, label, why in failed:
                log.warning("item %s (%r) not carried: %s", item_id, label, why)
            after = items[-1].id
            done += len(items)
            self.progress(done, p.total)

    def _embed(
        self, items: list[StoredItem]
    ) -> tuple[list[tuple[StoredItem, bytes]], list[tuple[int, str, str]]]:
        """(item, its new embedding bytes) for those carried, (old id, label, why) for the rest."""
        if self.plan.reuse:
            return [(it, it.embedding) for it in items], []
        with_image = [it for it in items if it.image is not None]
        failed = [
            (it.id, it.label, "no stored image (added with SNCA_STORE_IMAGES off, or too large)")
            for it in items
            if it.image is None
        ]
        ok = []
        if with_image:
            emb, errors = self.embed(with_image)
            rows = iter(np.ascontiguousarray(emb, dtype="<f4"))
            for it, err in zip(with_image, errors, strict=True):
                if err is None:
                    ok.append((it, next(rows).tobytes()))
                else:
                    failed.append((it.id, it.label, f"the stored image cannot be read: {err}"))
        return ok, failed

    # ------------------------------------------------------------------ the swap
    def _swap(self, report: Report) -> None:
        """Archive the old store (a hard link, else a copy) and rename the new one over it."""
        old, new = self.plan.old, self.data.migrating
        archive = Path(report.archive)
        archive.parent.mkdir(parents=True, exist_ok=True)
        if not archive.exists():
            tmp = archive.with_name(archive.name + ".tmp")
            tmp.unlink(missing_ok=True)
            try:
                os.link(old, tmp)
            except OSError:
                shutil.copyfile(old, tmp)
                with open(tmp, "rb+") as f:
                    os.fsync(f.fileno())
            os.replace(tmp, archive)
            fsync_dir(archive.parent)
        for suffix in ("-wal", "-shm"):  # left by no one now (both stores are single files)
            Path(str(old) + suffix).unlink(missing_ok=True)
        os.replace(new, old)
        fsync_dir(old.parent)
        shutil.rmtree(self.data.snapshot, ignore_errors=True)  # a snapshot of the old index
