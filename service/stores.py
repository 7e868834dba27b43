"""Store backends: a setting picks one (a postgresql:// URL, else a SQLite file).

A new backend is one file with GalleryStore's interface (service/store.py) and one entry here.
"""

from __future__ import annotations

from pathlib import Path

from .config import Settings
from .pgstore import PostgresStore, is_postgres_url
from .store import GalleryStore

BACKENDS = {"sqlite": GalleryStore, "postgresql": PostgresStore}


def backend_of(store: str) -> str:
    return "postgresql" if is_postgres_url(store) else "sqlite"


def open_gallery_store(settings: Settings, seed: Path | None, fingerprint: str, index_id: str):
    """The service's store for `settings.store`, seeded from `seed` (the index dir's store)
    when it is new."""
    name = backend_of(settings.store)
    where = settings.store_url if name == "postgresql" else settings.store_path
    return BACKENDS[name](where, seed, fingerprint, index_id)
