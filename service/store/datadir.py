"""The service's data dir: a user's gallery, kept apart from every model.

    data/<model name>/                 default (or SNCA_DATA_DIR / --data-dir)
        gallery.sqlite                 the gallery store: every item, added images, thumbnails
        snapshot/                      index snapshot: start-up replays only later writes
        previous/                      stores replaced when the model changed (pruned: the
                                       newest SNCA_KEEP_PREVIOUS, and any that is the only
                                       copy of an item, stay)
        gallery.sqlite.migrating       while the gallery is carried to a new model
        galleries/<gen>/               another model's gallery built beside this one by
                                       `snca-gallery upgrade` (its store and snapshot/)

Run dirs and index dirs are build outputs, replaced whole by the next `snca-train --overwrite`
or `snca-build-index --overwrite`; nothing here is written or deleted by them. Back the gallery
up (`snca-gallery backup`: consistent while servers write): it is the one thing that cannot be
recomputed.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

from embedding.files import fsync_dir

SNAPSHOT_DIR = "snapshot"  # the index snapshot's folder (service/gallery/snapshot.py)

STORE_FILE = "gallery.sqlite"
PREVIOUS_DIR = "previous"
KEEP_PREVIOUS = 3  # stores kept in previous/ by default (the newest ones)
# Before the data dir existed the store lived inside the run dir, which a retrain replaces.
LEGACY_STORE = Path("serve") / STORE_FILE


def default_data_dir(model: Path) -> Path:
    """The data dir of the gallery the model was trained from when its run dir records one
    (RunDir.GALLERY: a model retrained on a gallery serves that gallery), else data/<model
    name>, relative to the working directory (where `make run` runs)."""
    from embedding.rundir import RunDir

    trained_from = RunDir(model).gallery_data_dir()
    if trained_from is not None:
        return trained_from
    return Path("data") / (Path(model).resolve().name or "default")


class DataDir:
    def __init__(self, path: str | Path, store: str | Path | None = None):
        self.path = Path(path)
        self.store = Path(store) if store is not None else self.path / STORE_FILE

    @property
    def snapshot(self) -> Path:
        return self.path / SNAPSHOT_DIR

    @property
    def previous(self) -> Path:
        return self.path / PREVIOUS_DIR

    @property
    def migrating(self) -> Path:
        return self.store.with_name(self.store.name + ".migrating")

    def writable(self) -> bool:
        return os.access(self.store.parent, os.W_OK)

    def adopt_legacy_store(self, model: Path) -> Path | None:
        """When this data dir has no store yet and MODEL/serve/gallery.sqlite (the old default)
        exists, copy it here (SQLite's online backup: its WAL included; atomic rename) and
        return its path; the old file is left as it is."""
        legacy = Path(model) / LEGACY_STORE
        if self.store.exists() or not legacy.is_file() or legacy.resolve() == self.store.resolve():
            return None
        self.store.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.store.with_name(f".{self.store.name}.adopt-{os.getpid()}")
        src = sqlite3.connect(f"file:{legacy}?mode=ro", uri=True)
        dst = sqlite3.connect(tmp)
        try:
            src.backup(dst)
        finally:
            dst.close()
            src.close()
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, self.store)
        fsync_dir(self.store.parent)
        return legacy


def only_copies(path: Path) -> int:
    """Live added items of the archived store at `path` that have no stored image: they could
    not be carried to the next model, so this store is their only copy."""
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            return int(
                conn.execute(
                    "SELECT COUNT(*) FROM items WHERE source = 'added' "
                    "AND deleted_seq IS NULL AND image IS NULL"
                ).fetchone()[0]
            )
        finally:
            conn.close()
    except sqlite3.DatabaseError:
        return -1  # unreadable: not ours to judge, kept


def prune_previous(data: DataDir, keep: int = KEEP_PREVIOUS, dry_run: bool = False):
    """Delete the stores in previous/ beyond the newest `keep` (at least 1: never the only
    archive), except those that are the only copy of some item (only_copies) or that cannot be
    read. Returns ([removed paths], [(kept path, why)])."""
    keep = max(1, int(keep))
    folder = data.previous
    if not folder.is_dir():
        return [], []
    stores = sorted(
        (p for p in folder.iterdir() if p.is_file() and p.suffix == ".sqlite"),
        key=lambda p: (p.stat().st_mtime_ns, p.name),
        reverse=True,
    )
    removed, kept = [], []
    for i, p in enumerate(stores):
        if i < keep:
            kept.append((p, f"one of the newest {keep}"))
            continue
        n = only_copies(p)
        if n != 0:
            why = "unreadable" if n < 0 else f"the only copy of {n} items (no stored image)"
            kept.append((p, why))
            continue
        if not dry_run:
            for suffix in ("", "-wal", "-shm"):
                Path(str(p) + suffix).unlink(missing_ok=True)
        removed.append(p)
    if removed and not dry_run:
        fsync_dir(folder)
    return removed, kept
