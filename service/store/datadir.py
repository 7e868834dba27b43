"""The service's data dir: a user's gallery, kept apart from every model.

    data/<model name>/                 default (or SNCA_DATA_DIR / --data-dir)
        gallery.sqlite                 the gallery store: every item, added images, thumbnails
        snapshot/                      index snapshot: start-up replays only later writes
        previous/                      stores replaced when the model changed (never deleted)
        gallery.sqlite.migrating       while the gallery is carried to a new model

Run dirs and index dirs are build outputs, replaced whole by the next `snca-train --overwrite`
or `snca-build-index --overwrite`; nothing here is written or deleted by them. Back this folder
up: it is the one thing that cannot be recomputed.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

from embedding.artifacts import fsync_dir

SNAPSHOT_DIR = "snapshot"  # the index snapshot's folder (service/gallery/snapshot.py)

STORE_FILE = "gallery.sqlite"
PREVIOUS_DIR = "previous"
# Before the data dir existed the store lived inside the run dir, which a retrain replaces.
LEGACY_STORE = Path("serve") / STORE_FILE


def default_data_dir(model: Path) -> Path:
    """data/<model name>, relative to the working directory (where `make run` runs)."""
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
