"""Store backends: SNCA_STORE picks one (a postgresql:// URL, else a SQLite file).

A new backend is one file implementing service/store/base.py's Store and one entry here (asked
in order: the first whose `claims` says yes opens the store)."""

from __future__ import annotations

from pathlib import Path

from service.store.base import Store
from service.store.postgres import PostgresStore
from service.store.sqlite import SqliteStore

BACKENDS: dict[str, type] = {"postgresql": PostgresStore, "sqlite": SqliteStore}


def backend_of(target: str | Path) -> str:
    """The name of the backend that opens `target`."""
    return next(name for name, cls in BACKENDS.items() if cls.claims(target))


def open_gallery_store(
    target: str | Path, seed: Path | None, fingerprint: str, index_id: str
) -> Store:
    """The service's store at `target` (a URL, or a SQLite file), seeded from `seed` (the
    index dir's store) when it is new."""
    return BACKENDS[backend_of(target)](target, seed, fingerprint, index_id)
