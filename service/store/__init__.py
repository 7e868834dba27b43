"""The gallery's system of record: one Store interface (base.py), its backends (sqlite.py,
postgres.py, chosen by registry.py), the statements they share (sql.py), the records they hand
out (records.py), the data dir's layout (datadir.py) and carrying a gallery to a new model
(migration.py)."""

from service.store.base import Store, StoreReader
from service.store.records import (
    Change,
    ChangeSet,
    Item,
    ItemRow,
    NothingChanged,
    StoreCarriedAway,
    StoredItem,
    StoreUnavailable,
)
from service.store.registry import BACKENDS, backend_of, open_gallery_store

__all__ = [
    "BACKENDS",
    "Change",
    "ChangeSet",
    "Item",
    "ItemRow",
    "NothingChanged",
    "Store",
    "StoreCarriedAway",
    "StoreReader",
    "StoreUnavailable",
    "StoredItem",
    "backend_of",
    "open_gallery_store",
]
