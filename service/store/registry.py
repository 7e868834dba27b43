"""Store backends: SNCA_STORE picks one (a postgresql:// URL, else a SQLite file).

A new backend is one file implementing service/store/base.py's Store and one entry here (asked
in order: the first whose `claims` says yes opens the store)."""

from __future__ import annotations

from pathlib import Path

from service.store.base import Store
from service.store.galleries import gallery_key, gen_of, sibling_data_dir
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


def backend_class(target: str | Path) -> type:
    """The backend class that opens `target` (for its classmethods: meta_of, dump, load)."""
    return BACKENDS[backend_of(target)]


def open_as_found(target: str | Path) -> Store:
    """The store at `target` opened for the model it belongs to (housekeeping needs no
    model: compaction, backups)."""
    return backend_class(target).as_found(target)


def locate_gallery(
    home: str | Path, data_dir: Path, fingerprint: str, index_id: str
) -> tuple[str, Path]:
    """(store target, data dir) of this model's gallery: the home store when it belongs to
    the model (or does not exist yet), else the sibling an upgrade registered and built for it
    (galleries.py), else the home store again (the start-up carries this model's gallery from
    it: swapped in, or built beside it). A server never makes a sibling: only an upgrade does,
    on standby from its first moment."""
    cls = backend_class(home)
    if not cls.exists(home):
        return str(home), Path(data_dir)
    meta = cls.meta_of(home)
    if (meta.get("model_fingerprint"), meta.get("index_id")) == (fingerprint, index_id):
        return str(home), Path(data_dir)
    gen = gen_of(fingerprint, index_id)
    if gallery_key(gen) in meta and cls.exists(cls.sibling(home, gen)):
        return cls.sibling(home, gen), sibling_data_dir(data_dir, gen)
    return str(home), Path(data_dir)
