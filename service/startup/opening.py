"""Opening a service (start-up's first step, before the port is bound: a bad model, index or
store is an exit status 2 with a message): load the model and its index dir, start the model
where it runs (MODEL_PLACES), find the data dir and decide whether its gallery must first be
carried to this model (`Opening`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from embedding.errors import ArtifactError
from embedding.index import IndexDir, open_index_dir
from embedding.rundir import RunDir
from embedding.world import WORLD_FILE, WorldFit, unfitted
from embedding.world import load as load_world_fit
from service.config import Settings
from service.metrics import Metrics
from service.model.runtime import ModelRuntime, Runtime
from service.startup.which_gallery import Beside, gallery_beside
from service.store.datadir import STORE_FILE, DataDir
from service.store.migration import Plan, Target, exclusive, plan, settle
from service.store.postgres import redact
from service.store.registry import locate_gallery

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
        data, where = locate(settings, data, model.fingerprint, ix.manifest.index_id)
        target = Target(model.fingerprint, ix.manifest.index_id, space, ix.dim)
        p = None
        beside = gallery_beside(settings, where, model.fingerprint, ix)
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


def locate(settings: Settings, data: DataDir, fingerprint: str, index_id: str):
    """(data dir, store target) of this model's gallery (store/registry.locate_gallery): the
    home store's, or a sibling's that `snca-gallery upgrade` built."""
    home = settings.home_store
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
        data, where = locate(settings, data, o["fingerprint"], ix.manifest.index_id)
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


def _batch_metrics(metrics: Metrics) -> Callable[[int, float, dict], None]:
    def on_batch(size: int, waited: float, phases: dict) -> None:
        metrics.batch_size.observe(size)
        metrics.queue_wait.observe(waited)
        for phase, seconds in phases.items():
            metrics.model_seconds.labels(phase).inc(seconds)

    return on_batch


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
