"""Start-up: from settings to a serving ServiceState, in two steps.

`open` (before the port is bound, so that a bad model, index or store is an exit status 2 with
a message): load the model and its index dir, start the model thread, find the data dir and
decide whether its gallery store must first be carried to this model (service/store/migration.py).

`finish`: carry the gallery if needed (in the background when started by snca-serve, with
/readyz saying "migrating N of M" meanwhile), open the store, load the index snapshot or the
built index, replay the writes after it, load the gallery, warm the vote up.

`ServiceHost` is what the app holds from the first request on: settings, metrics, where
start-up is, and the ServiceState once it is built.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from embedding import collapse
from embedding.errors import ArtifactError, SNCAError
from embedding.index import IndexDir, open_index_dir
from embedding.progress import Progress
from embedding.rundir import RunDir
from embedding.world import WORLD_FILE, WorldFit, unfitted
from embedding.world import load as load_world_fit
from service.config import Settings
from service.gallery import Gallery, VectorIndex
from service.gallery.snapshot import discard_snapshot, load_snapshot
from service.metrics import Metrics
from service.model.runtime import ModelRuntime, Runtime
from service.state import ServiceState
from service.store.datadir import STORE_FILE, DataDir
from service.store.migration import Migration, Plan, Report, Target, exclusive, plan, settle
from service.store.postgres import redact
from service.store.registry import locate_gallery, open_gallery_store

log = logging.getLogger("snca.service")


@dataclass
class Opening:
    """What `open` found: the model running, its index, the data dir, and the migration its
    store needs first (None: none)."""

    runtime: Runtime  # ModelRuntime, or RemoteRuntime (the model in its own process)
    index: IndexDir
    fingerprint: str
    temperature: float
    data: DataDir
    plan: Plan | None
    adopted: Path | None  # a store found at the old default place and copied into the data dir
    world: WorldFit | None = None  # the world check's Gaussian (None: no world check)
    # the model process carries the gallery to this model (its plan, described); the front
    # plans none itself
    carried_elsewhere: str | None = None
    store_target: str = ""  # this model's gallery store: the home store or a sibling
    # the live gallery carried into this model's gallery built beside it, then switched (the
    # alias ending at start-up: PostgreSQL, or a SQLite store with day-two galleries)
    beside: Beside | None = None

    @property
    def migrating(self) -> str | None:
        """What start-up carries first (None: nothing): the data dir's store to this model."""
        if self.plan is not None:
            return self.plan.describe()
        if self.beside is not None:
            return self.beside.describe()
        return self.carried_elsewhere


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


def load_world(settings: Settings, ix: IndexDir, fingerprint: str) -> WorldFit | None:
    """The index dir's world statistics (embedding/world.py); an unfitted gallery world for an
    index of nothing trained (service/gallery/world.py fits it on the registered images); or
    None: none there (an index built before them: rebuild it to get the world check), or the
    check turned off."""
    path = ix.path / WORLD_FILE
    if settings.world_tpr <= 0:
        return None
    if not path.is_file():
        built = ix.manifest.build or {}
        nothing_trained = ix.manifest.count == 0 and not ix.manifest.class_names  # --epochs 0
        if nothing_trained or built.get("world") == "gallery":  # nothing indexed from training
            log.info(
                "no training world (nothing trained): the world check is fitted on the "
                "registered images themselves (from the second one on)"
            )
            return unfitted()
        log.warning(
            "the index dir %s has no world statistics (built before the world check): serving "
            "without it; snca-build-index builds them",
            ix.path,
        )
        return None
    return load_world_fit(path, fingerprint)


# where the model runs (ServiceHost's `model`): "thread": a model thread of this process;
# "process": a model process of its own (service/model/remote.py), this process is the front;
# "inline": this process's main thread (it is that model process, service/model_process.py)
MODEL_PLACES = ("thread", "process", "inline")


def open_service(settings: Settings, metrics: Metrics, model_place: str = "thread") -> Opening:
    if model_place == "process":
        return _open_front(settings, metrics)
    model = RunDir(settings.model).load_model()
    ix = open_index_dir(settings.index, expected_fingerprint=model.fingerprint)
    space = ix.manifest.space  # queries are embedded in the space the index was built in
    world = load_world(settings, ix, model.fingerprint)
    runtime = ModelRuntime.load(
        settings,
        model,
        space,
        _batch_metrics(metrics),
        world=world is not None,
        inline=model_place == "inline",
    )
    try:
        if runtime.embedder.dim != ix.dim:
            raise ArtifactError(
                f"index {ix.path} holds {ix.dim}-d vectors but the model gives "
                f"{runtime.embedder.dim}-d ones in space {space!r}"
            )
        data = DataDir(settings.data_dir, settings.store_path)
        data.path.mkdir(parents=True, exist_ok=True)
        adopted = None
        if settings.store_is_default and data.writable():
            adopted = data.adopt_legacy_store(settings.model)
        data, where = _locate(settings, data, model.fingerprint, ix.manifest.index_id)
        target = Target(model.fingerprint, ix.manifest.index_id, space, ix.dim)
        p = None
        beside = _beside(settings, where, model.fingerprint, ix)
        if beside is None and settings.store_url is None and data.store.exists():
            # under the data dir's migration lock: wait for one in progress elsewhere, finish
            # the swap of one that was sealed but not swapped, then look at what is there
            with exclusive(data):
                settle(data)
                p = plan(data.store, target)
        if p is not None and not data.writable():
            raise ArtifactError(
                f"the gallery store {data.store} was made for another model and must be "
                f"carried to this one, but {data.store.parent} is not writable"
            )
    except BaseException:
        runtime.close()
        raise
    return Opening(
        runtime,
        ix,
        model.fingerprint,
        model.config.temperature,
        data,
        p,
        adopted,
        world,
        store_target=where,
        beside=beside,
    )


def _beside(settings: Settings, where: str, fingerprint: str, ix: IndexDir) -> Beside | None:
    """The alias ending at start-up, when the store at `where` (what _locate found) is the home
    store of another model and cannot be swapped: on PostgreSQL always (no file to swap), on
    SQLite when it has day-two galleries (an alias, or it is on standby). None otherwise."""
    from service.store.galleries import gen_of
    from service.store.records import STANDBY
    from service.store.registry import backend_class

    home = settings.store_url or str(settings.store_path)
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

    home = settings.store_url or str(settings.store_path)
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

    home = settings.store_url or str(settings.store_path)
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
    home = settings.store_url or str(settings.store_path)
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


def _locate(settings: Settings, data: DataDir, fingerprint: str, index_id: str):
    """(data dir, store target) of this model's gallery (store/registry.locate_gallery): the
    home store's, or a sibling's that `snca-gallery upgrade` built."""
    home = settings.store_url or str(settings.store_path)
    where, path = locate_gallery(home, settings.data_dir, fingerprint, index_id)
    if where == home:
        return data, home
    log.info("serving this model's gallery beside the home store: %s", redact(where))
    store = None if settings.store_url else Path(where)
    return DataDir(path, store or Path(path) / STORE_FILE), where


def _open_front(settings: Settings, metrics: Metrics) -> Opening:
    """The front of a worker: the model process opens the model and the data dir (and carries
    the gallery to this model when it must); this process then opens the same index."""
    from service.model.remote import RemoteRuntime

    runtime = RemoteRuntime(settings, _batch_metrics(metrics))
    try:
        o = runtime.opened
        ix = open_index_dir(settings.index, expected_fingerprint=o["fingerprint"])
        world = load_world(settings, ix, o["fingerprint"])
        data = DataDir(settings.data_dir, settings.store_path)
        data, where = _locate(settings, data, o["fingerprint"], ix.manifest.index_id)
        adopted = Path(o["adopted"]) if o["adopted"] else None
    except BaseException:
        runtime.close()
        raise
    return Opening(
        runtime,
        ix,
        o["fingerprint"],
        o["temperature"],
        data,
        None,
        adopted,
        world,
        carried_elsewhere=o["migrating"],
        store_target=where,
    )


def _batch_metrics(metrics: Metrics) -> Callable[[int, float], None]:
    def on_batch(size: int, waited: float) -> None:
        metrics.batch_size.observe(size)
        metrics.queue_wait.observe(waited)

    return on_batch


def finish_service(
    o: Opening,
    settings: Settings,
    metrics: Metrics,
    progress: Callable[[int, int], None] | None = None,
    status: Callable[[str], None] | None = None,
    ready_message: str = "ready",
    model_ready: Callable[[], None] | None = None,
) -> ServiceState:
    """Carry the gallery if the plan says so, then load it; the ready ServiceState.
    `model_ready()`: blocks until the model process has loaded its own replica (it loads
    meanwhile, on the other core, while this one loads the front's)."""
    t0 = time.perf_counter()
    report = None
    if o.plan is not None:
        report = _migrate(o, settings, progress, status)
    if o.beside is not None:
        report = _carry_beside(o, settings, progress, status)
    if o.beside is not None or o.carried_elsewhere is not None:  # (this model's gallery now)
        o.data, o.store_target = _locate(
            settings,
            DataDir(settings.data_dir, settings.store_path),
            o.fingerprint,
            o.index.manifest.index_id,
        )
    ix, data = o.index, o.data
    target = o.store_target or settings.store_url or settings.store_path
    home = settings.store_url or str(settings.store_path)
    # (a sibling is never made here: only an upgrade makes one, on standby from its start)
    seed = ix.store if str(target) == str(home) else None
    store = open_gallery_store(target, seed, o.fingerprint, ix.manifest.index_id)
    try:
        loaded = load_gallery(store, ix.index, ix.manifest, o.fingerprint, data, snapshot=True)
        g = Gallery(
            loaded.vectors,
            ix.dim,
            o.temperature,
            settings.candidates,
            settings.exact_vote_max,
            settings.unknown_k,
            o.world,
            settings.world_tpr,
        )
        g.load_items(loaded.items)
        g.version = loaded.version
        o.runtime.serve(g, settings.vote, settings.k)
    except BaseException:
        store.close()
        raise

    if model_ready is not None:
        model_ready()
    report = report or o.runtime.migration_report()  # carried by the model process, if it did

    def rebuild() -> tuple[VectorIndex, list, int]:
        """The built index read again from disk, brought up to the store (no snapshot)."""
        fresh = open_index_dir(settings.index, expected_fingerprint=o.fingerprint)
        r = load_gallery(store, fresh.index, fresh.manifest, o.fingerprint, data, snapshot=False)
        return r.vectors, r.items, r.version

    state = ServiceState(
        settings, metrics, o.runtime, store, g, data, ix.manifest, o.fingerprint, report, rebuild
    )
    info = o.runtime.info
    log.info(
        ready_message,
        extra={
            "fields": {
                "model": str(settings.model),
                "index": str(settings.index),
                "data_dir": str(data.path),
                "store": store.url,
                "items": g.size(),
                "snapshot_seq": loaded.base_seq,
                "store_seq": loaded.version,
                "replayed_adds": loaded.replayed_adds,
                "replayed_deletes": loaded.replayed_deletes,
                "device": info.device,
                "model_mode": info.mode,
                "engine": info.engine,
                "space": ix.manifest.space,
                "world_check": g.worlds.enabled,
                "warmup_s": round(info.warmup_s, 2),
                "warmed_batch_sizes": info.warmed_sizes,
                "fused_batch_sizes": info.fused_sizes,
                "torch_threads": info.torch_threads,
                "model_pid": o.runtime.pid(),
                "seconds": round(time.perf_counter() - t0, 2),
            }
        },
    )
    said = collapse.warning(ix.manifest.build.get("pair_similarity"), "the index's vectors")
    if said is not None:
        log.warning(said)
    return state


@dataclass
class Loaded:
    vectors: VectorIndex
    items: list  # every live item (store.Item)
    version: int  # the store's last write, which the index now reflects
    base_seq: int  # the snapshot's seq (0: the built index)
    replayed_adds: int
    replayed_deletes: int


def load_gallery(store, built, manifest, fingerprint: str, data: DataDir, snapshot: bool) -> Loaded:
    """The index snapshot (or the built index `built`) brought up to the store: writes after
    it replayed. A snapshot older than the log's floor is not used (the deletes it misses may
    be compacted away); the built index holds only trained items, whose rows are never
    compacted, so it can always be brought up to date.

    The store is read in one transaction (Store.reader: one point in time), so a write that
    commits meanwhile (another process's correction, which moves an item's add_seq past the
    version read here) is either wholly in what is loaded or wholly after it, for the follower.
    Then the index is checked against the store's live items (the same ids, each once); a
    snapshot that disagrees is discarded and the gallery loaded from the built index."""
    with store.reader() as r:
        meta = r.meta()
        last_seq, floor = int(meta["last_seq"]), int(meta.get("log_floor", 0))
        snap = (
            load_snapshot(data.path, fingerprint, manifest.index_id, last_seq, store.log_token)
            if snapshot
            else None
        )
        if snap is not None and 0 < snap.seq < floor:
            log.warning(
                "ignoring the snapshot at write %d: the log starts after %d", snap.seq, floor
            )
            snap = None
        items = r.live_items()
        deleted = r.deleted_after(0 if snap is None else snap.seq)
    loaded = _bring_up(built, manifest, snap, items, deleted, last_seq)
    wrong = index_disagrees(loaded.vectors, items)
    if wrong is not None and snap is not None:
        log.warning(
            "the snapshot at write %d disagrees with the gallery store (%s): discarded, the "
            "gallery is loaded from the built index",
            snap.seq,
            wrong,
            extra={"fields": {"snapshot_seq": snap.seq, "store_seq": last_seq}},
        )
        discard_snapshot(data.path, snap.seq)
        with store.reader() as r:  # (the built index from write 0: every delete)
            deleted = r.deleted_after(0)
        loaded = _bring_up(built, manifest, None, items, deleted, last_seq)
        wrong = index_disagrees(loaded.vectors, items)
    if wrong is not None:  # (the built index and the store disagree: made to agree)
        log.error("the built index disagrees with the gallery store (%s): repaired", wrong)
        repair_index(loaded.vectors, items)
    return loaded


def _bring_up(built, manifest, snap, items: list, deleted: list, last_seq: int) -> Loaded:
    """The index of `snap` (None: the built index) with the writes after it: the live `items`
    it lacks added, the `deleted` (after it) it holds removed. Whether the index holds an item
    is read from the index, not inferred from add_seq (a correction moves an item's add_seq to
    its own write: store/base.py relabel)."""
    if snap is None:
        vectors, base_seq = VectorIndex(built, manifest.search_params), 0
    else:
        vectors = VectorIndex(snap.index, manifest.search_params, snap.tombstones)
        base_seq = snap.seq
    held = vectors.held()
    replay_add = [it for it in items if it.add_seq > base_seq and it.id not in held]
    for item in replay_add:
        vectors.add(np.array([item.id], dtype=np.int64), item.embedding[None, :])
    replay_del = [row for row in deleted if row[0] in held]
    vectors.remove(np.array([row[0] for row in replay_del], dtype=np.int64))
    return Loaded(vectors, items, last_seq, base_seq, len(replay_add), len(replay_del))


def index_disagrees(vectors: VectorIndex, items: list) -> str | None:
    """How the index differs from the store's live `items` (ids it lacks, ids it holds that
    are not live, ids it holds twice), in words; None when they agree."""
    held = vectors.ids()
    live = {it.id for it in items}
    ids = set(held.tolist())
    missing, extra = live - ids, ids - live
    twice = len(held) - len(ids)
    if not (missing or extra or twice):
        return None
    said = []
    for n, what, which in ((len(missing), "live items missing", missing),
                           (len(extra), "items not live", extra)):  # fmt: skip
        if n:
            said.append(f"{n} {what} (ids {', '.join(map(str, sorted(which)[:5]))})")
    if twice:
        said.append(f"{twice} vectors held twice")
    return "; ".join(said)


def repair_index(vectors: VectorIndex, items: list) -> None:
    """Make the index hold each live item once (a last resort after index_disagrees): the ids
    that are not live removed, the missing added; an id held twice removed and added once
    where the index can remove (Flat), else left (a search may then return it twice)."""
    held = vectors.ids()
    ids, counts = np.unique(held, return_counts=True)
    live = {it.id: it for it in items}
    gone = [i for i in ids.tolist() if i not in live]
    twice = [i for i in ids[counts > 1].tolist() if i in live] if vectors.removable() else []
    vectors.remove(np.array(gone + twice, dtype=np.int64))
    have = set(vectors.ids().tolist())
    for it in items:
        if it.id not in have:
            vectors.add(np.array([it.id], dtype=np.int64), it.embedding[None, :])


def _carry_beside(o: Opening, settings: Settings, progress, status=None) -> Report:
    """The alias ending at start-up (Beside): store/upgrade.py `run` with this model, under the
    home store's carry lock (an upgrade running meanwhile is waited for); what it did."""
    from service.store.registry import backend_class
    from service.store.upgrade import To, open_galleries, run

    b = o.beside
    log.info(b.describe())
    cls = backend_class(b.home)
    g = open_galleries(cls, b.home)
    t0 = time.perf_counter()

    def resolve(g, live):
        def open_target(seed_meta):
            target = g.target_of(b.gen)
            return cls(target, b.seed, o.fingerprint, o.index.manifest.index_id, seed_meta)

        def embed(items):
            emb, stats, errs = o.runtime.embed_stored([it.image for it in items])
            return emb, stats, list(errs)

        return To(b.gen, b.info, open_target), embed

    def say(line: str) -> None:
        log.info(line)
        if status is not None and line.startswith("waiting"):
            status(line)

    try:
        out = run(g, resolve, True, settings.migration_batch, say, progress)
    finally:
        g.close()
        g.home.close()
    st = out.state or {}
    carried = out.carry.carried if out.carry is not None else 0
    r = Report(
        carried=carried,
        uncarried=[tuple(u) for u in st.get("uncarried", [])],
        reembedded=True,
        archive="",
        seconds=time.perf_counter() - t0,
        caught_up=int(st.get("caught_up", 0)),
    )
    log.info("gallery carried beside the live one and switched", extra={"fields": r.to_dict()})
    return r


def _migrate(o: Opening, settings: Settings, progress, status=None) -> Report | None:
    p = o.plan
    log.info(p.describe(), extra={"fields": {"total": p.total, "with_image": p.with_image}})
    bar = Progress(p.total, "migrating the gallery", "items", write=log.info)
    last = {"done": 0}

    def report(done: int, total: int) -> None:
        bar.update(done - last["done"])
        last["done"] = done
        if progress is not None:
            progress(done, total)

    m = Migration(
        p,
        o.data,
        o.index.store,
        lambda items: o.runtime.embed_stored([it.image for it in items]),
        settings.migration_batch,
        report,
        status,
    )
    with bar:
        r = m.run()
    if r is None:
        log.info("the gallery was carried to this model by another process meanwhile")
        return None
    fields = {k: v for k, v in r.to_dict().items() if k != "uncarried"}
    fields["uncarried_ids"] = [i for i, _, _ in r.uncarried]
    log.info("gallery carried to the new model", extra={"fields": fields})
    if r.uncarried:
        log.warning(
            "%d added items could not be carried (ids %s); they stay in %s",
            len(r.uncarried),
            ", ".join(str(i) for i, _, _ in r.uncarried[:50]),
            r.archive,
        )
    from service.store.datadir import prune_previous

    removed, _ = prune_previous(o.data, settings.keep_previous)
    if removed:
        log.info(
            "pruned previous stores",
            extra={
                "fields": {"removed": [p.name for p in removed], "keep": settings.keep_previous}
            },
        )
    return r


def photo_model(settings: Settings) -> bool:
    """Whether the served model reads photographs (over 64 px): their registered images get a
    thumbnail unless SNCA_THUMBNAILS says otherwise (a gallery of photos shown as "no preview"
    is what a user following the photo recipe met). False when the card cannot be read (the
    start-up says why)."""
    try:
        cfg, _ = RunDir(settings.model).load_model_card()
    except (ArtifactError, OSError, ValueError):
        return False
    return cfg.image_size > 64


class ServiceHost:
    """What the app holds: settings and metrics from the start, the ServiceState once built,
    and meanwhile the start-up phase (/readyz reports it)."""

    def __init__(self, settings: Settings, metrics: Metrics | None = None, model: str = "thread"):
        """`model`: where the model runs, one of MODEL_PLACES (snca-serve: "process" unless
        SNCA_MODEL_PROCESS=0; tools and tests that embed in-process: "thread")."""
        if model not in MODEL_PLACES:
            raise ValueError(f"model {model!r}: one of {', '.join(MODEL_PLACES)}")
        self.settings = settings
        if "thumbnails" not in settings.model_fields_set:  # not said: on for a photo model
            settings.thumbnails = photo_model(settings)
        self.model_place = model
        self.metrics = metrics or Metrics()
        # the model process relays its start-up to the front (service/model_process.py)
        self.on_progress: Callable[[int, int], None] | None = None
        self.on_waiting: Callable[[str], None] | None = None
        self.opening: Opening | None = None
        self.state: ServiceState | None = None
        self.phase = "starting"  # starting | migrating | ready | failed | stopping
        self.progress = (0, 0)  # migration: (items done, items to carry)
        self.waiting: str | None = None  # migration: what it waits for (other processes)
        self.error: str | None = None
        self.on_failure: Callable[[], None] | None = None  # snca-serve: stop the server
        # called with the ServiceState once built, before the host says ready (the app hooks
        # its parked-request waits to the gallery's versions there: service/http/admission.py)
        self.on_ready: list[Callable[[ServiceState], None]] = []
        self._thread: threading.Thread | None = None

    @property
    def ready(self) -> bool:
        return self.phase == "ready" and self.state is not None

    def open(self) -> Opening:
        if self.opening is None:
            self.opening = open_service(self.settings, self.metrics, self.model_place)
        return self.opening

    def finish(self) -> ServiceState:
        o = self.open()
        if o.plan is not None:
            self.phase = "migrating"
            self.progress = (0, o.plan.total)
        elif o.beside is not None or o.carried_elsewhere is not None:
            self.phase = "migrating"  # in the model process: it reports the progress
        message = "model process ready" if self.model_place == "inline" else "ready"
        try:
            if self.model_place == "process" and o.carried_elsewhere is None:
                # nothing to carry first: the front loads its replica while the model process
                # loads its own and warms up (start-up ~ the longer of the two, not their sum)
                model_ready = self._model_ready_in_background(o)
            else:
                o.runtime.wait_ready(self._report, self._waiting)
                model_ready = None
            self.state = finish_service(
                o, self.settings, self.metrics, self._report, self._waiting, message, model_ready
            )
        except BaseException:
            o.runtime.close()
            raise
        if self.model_place != "inline":  # (once per worker: the front does it)
            try:
                register_model(self.settings)
            except Exception as e:  # (bookkeeping for rollbacks: never fails a start)
                log.warning("could not record this model in the galleries' registry: %s", e)
        for hook in self.on_ready:
            hook(self.state)
        self.phase = "ready"
        return self.state

    def _model_ready_in_background(self, o: Opening) -> Callable[[], None]:
        """Wait for the model process on a thread; the returned call joins it (re-raising)."""
        failed: list[BaseException] = []

        def wait() -> None:
            try:
                o.runtime.wait_ready(self._report, self._waiting)
            except BaseException as e:  # (handed to the joining thread)
                failed.append(e)

        t = threading.Thread(target=wait, name="model-process-start", daemon=True)
        t.start()

        def join() -> None:
            t.join()
            if failed:
                raise failed[0]

        return join

    def finish_in_background(self) -> None:
        """`finish` on a thread (a migration can take minutes); a failure is logged, kept for
        /readyz and handed to `on_failure`."""

        def run() -> None:
            try:
                self.finish()
            except Exception as e:
                self.error = str(e)
                self.phase = "failed"
                log.exception("start-up failed")
                if self.on_failure is not None:
                    self.on_failure()

        self._thread = threading.Thread(target=run, name="start-up", daemon=True)
        self._thread.start()

    def _report(self, done: int, total: int) -> None:
        self.progress = (done, total)
        if self.on_progress is not None:
            self.on_progress(done, total)

    def _waiting(self, why: str) -> None:
        self.waiting = why
        if self.on_waiting is not None:
            self.on_waiting(why)

    def status(self) -> str:
        """One line for /readyz and the 503s of the other routes while not ready."""
        if self.phase == "migrating":
            done, total = self.progress
            line = f"migrating the gallery to the new model: {done} of {total} added items"
            return line + (f"; {self.waiting}" if self.waiting else "")
        if self.phase == "failed":
            return f"start-up failed: {self.error}"
        return "the service is not ready yet" if self.phase != "stopping" else "shutting down"

    def stop(self) -> None:
        self.phase = "stopping"
        if self.state is not None:
            self.state.stop()
        elif self.opening is not None and (self._thread is None or not self._thread.is_alive()):
            self.opening.runtime.close()
