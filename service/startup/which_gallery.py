"""Which gallery a start serves, and the models a gallery knows (start-up's choice): a
gallery beside this model's (`beside`: the data dir's store of another model, to carry from);
what a killed switch left, settled (`settle_galleries`); this model registered with the gallery
(`register_model`); the model the gallery was carried to, for `--follow-alias` and the tools
(`follow_alias`)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from embedding.errors import SNCAError
from embedding.index import IndexDir
from embedding.rundir import RunDir
from service.config import Settings
from service.store.postgres import redact
from service.store.registry import locate_gallery

log = logging.getLogger("snca.service")


@dataclass
class Beside:
    """A start on a store whose galleries hold none of this model: its gallery is built beside
    the live one by the carry engine and switched to (store/upgrade.py `run`, as `snca-gallery
    upgrade --to THIS_RUN --switch` does)."""

    home: str
    gen: str
    info: dict
    seed: Path

    def describe(self) -> str:
        return (
            f"no gallery of this model in {redact(self.home)}: building it beside the live one "
            f"({self.gen}) and switching to it"
        )


def gallery_beside(settings: Settings, where: str, fingerprint: str, ix: IndexDir) -> Beside | None:
    """The alias ending at start-up, when the store at `where` (what locate found) is the home
    store of another model and cannot be swapped: on PostgreSQL always (no file to swap), on
    SQLite when it has day-two galleries (an alias, or it is on standby). None otherwise."""
    from service.store.galleries import gen_of
    from service.store.records import STANDBY
    from service.store.registry import backend_class

    home = settings.home_store
    cls = backend_class(home)
    if where != home or not cls.exists(home):
        return None
    meta = cls.meta_of(home)
    if (meta.get("model_fingerprint"), meta.get("index_id")) == (fingerprint, ix.manifest.index_id):
        return None
    day_two = any(k.startswith("alias:") for k in meta) or STANDBY in meta
    if settings.store_url is None and not day_two:
        return None  # (SQLite without day-two galleries: the swap ending)
    info = {
        "model_fingerprint": fingerprint,
        "index_id": ix.manifest.index_id,
        "model_dir": str(Path(settings.model).resolve()),
        "index_dir": str(Path(settings.index).resolve()),
    }
    return Beside(home, gen_of(fingerprint, ix.manifest.index_id), info, ix.store)


def settle_galleries(settings: Settings) -> str | None:
    """A start finishes what a killed `snca-gallery upgrade --switch` or `rollback` left (the
    live gallery sealed for another, not yet made live: store/upgrade.py `settle`), when no
    carry runs now (it would finish it itself); what it did, in words (None: nothing)."""
    from service.store.galleries import alias_key
    from service.store.records import STANDBY
    from service.store.registry import backend_class
    from service.store.upgrade import open_galleries, settle

    home = settings.home_store
    cls = backend_class(home)
    if not cls.exists(home):
        return None
    meta = cls.meta_of(home)
    if alias_key() not in meta and STANDBY not in meta:
        return None  # (never switched, nothing sealed: nothing to finish)
    said: list[str] = []
    with cls.carry_lock(home, blocking=False) as held:
        if not held:
            return None  # an upgrade runs: it settles first
        g = open_galleries(cls, home)
        try:
            settle(g, said.append)
        finally:
            g.close()
            g.home.close()
    return "; ".join(said) or None


def register_model(settings: Settings) -> None:
    """Record in the home store's registry which run and index dirs serve this model's gallery
    (when it exists and the registry does not say yet): a rollback to it, or a server started
    with --follow-alias, needs them, also when its gallery was never upgraded to by name."""
    from embedding.index import read_manifest
    from service.store.galleries import gen_of, register_served
    from service.store.registry import backend_class, open_as_found

    home = settings.home_store
    cls = backend_class(home)
    if not cls.exists(home) or (settings.store_url is None and not os.access(home, os.W_OK)):
        return
    try:
        fingerprint = RunDir(settings.model).load_model_card()[1]
        gen = gen_of(fingerprint, read_manifest(settings.index).index_id)
    except (SNCAError, OSError, ValueError):
        return  # (open_service says what is wrong with the model, if it is served)
    info = {
        "model_fingerprint": fingerprint,
        "index_id": read_manifest(settings.index).index_id,
        "model_dir": str(Path(settings.model).resolve()),
        "index_dir": str(Path(settings.index).resolve()),
    }
    h = open_as_found(home)
    try:
        register_served(h, gen, info)
    finally:
        h.close()


def follow_alias(settings: Settings) -> str | None:
    """With SNCA_FOLLOW_ALIAS: when the store's alias (store/galleries.py) names another model
    than settings.model as live, serve that one (its run and index dirs as registered by
    `snca-gallery upgrade`); with no alias, the model the home store was last carried to when
    it is another (a retrained run started on this data dir: `make photos` then serves it, not
    carries the gallery back). The data dir and store stay. What it did, in words (None:
    kept)."""
    import json

    from service.store.galleries import alias_key, gallery_key, gen_of
    from service.store.registry import backend_class

    if not settings.follow_alias:
        return None
    home = settings.home_store
    cls = backend_class(home)
    if not cls.exists(home):
        return None
    meta = cls.meta_of(home)
    if alias_key() in meta:
        gen = json.loads(meta[alias_key()])["gen"]
    elif meta.get("model_fingerprint") and meta.get("index_id") and not _has_own(settings, home):
        # no switch made: the model the home store was last carried to (by a start of another
        # model on this data dir), as registered when it served; not when this model has a
        # gallery of its own beside it (an upgrade's, on standby until its switch)
        gen = gen_of(meta["model_fingerprint"], meta["index_id"])
    else:
        return None
    info = json.loads(meta.get(gallery_key(gen), "{}"))
    model, index = info.get("model_dir"), info.get("index_dir")
    if not model or Path(model).resolve() == Path(settings.model).resolve():
        return None
    if not (Path(model) / "model.json").is_file():
        log.warning("the gallery's live model %s is not there: serving %s", model, settings.model)
        return None
    settings.model, settings.index = Path(model), Path(index or Path(model) / "index")
    if alias_key() in meta:
        return f"the gallery's alias names {gen} as live: serving {model}"
    return f"the gallery was carried to another model when it last served: serving {model}"


def _has_own(settings: Settings, home: str) -> bool:
    """Whether settings.model has a gallery beside the home store (an upgrade built it)."""
    from embedding.index import read_manifest

    try:
        fingerprint = RunDir(settings.model).load_model_card()[1]
        index_id = read_manifest(settings.index).index_id
    except (SNCAError, OSError, ValueError):
        return False
    return locate_gallery(home, settings.data_dir, fingerprint, index_id)[0] != home
