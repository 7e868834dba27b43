"""Finishing a service (start-up's second step): carry the gallery if needed, open the store,
load the index snapshot or the built index, replay the writes after it, check the index against
the store's live ids (a disagreeing snapshot is discarded), load the gallery."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from embedding import collapse
from embedding.index import open_index_dir
from service.config import Settings
from service.gallery.gallery import Gallery
from service.gallery.snapshot import discard_snapshot, load_snapshot
from service.gallery.vectors import VectorIndex
from service.metrics import Metrics
from service.startup.carry import carry_beside, migrate
from service.startup.opening import Opening, locate
from service.state import ServiceState
from service.store.datadir import DataDir
from service.store.registry import open_gallery_store

log = logging.getLogger("snca.service")


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
        report = migrate(o, settings, progress, status)
    if o.beside is not None:
        report = carry_beside(o, settings, progress, status)
    if o.beside is not None or o.carried_elsewhere is not None:  # (this model's gallery now)
        o.data, o.store_target = locate(
            settings,
            DataDir(settings.data_dir, settings.store_path),
            o.fingerprint,
            o.index.manifest.index_id,
        )
    ix, data = o.index, o.data
    target = o.store_target or settings.store_url or settings.store_path
    home = settings.home_store
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
                "max_batch": info.max_batch,
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
