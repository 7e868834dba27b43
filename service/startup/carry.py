"""The start-up carry: a gallery kept for another model carried to this one before it serves
(a gallery beside this model's: `carry_beside`; a store migration: `migrate`), with progress
lines and /readyz's "migrating N of M" meanwhile (service/store/migration.py does the work)."""

from __future__ import annotations

import logging
import time

from embedding.progress import Progress
from service.config import Settings
from service.startup.opening import Opening
from service.store.carry import CarryState
from service.store.migration import Migration, Report

log = logging.getLogger("snca.service")


def carry_beside(o: Opening, settings: Settings, progress, status=None) -> Report:
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
    st = out.state or CarryState(source_seq=0)
    carried = out.carry.carried if out.carry is not None else 0
    r = Report(
        carried=carried,
        uncarried=[tuple(u) for u in st.uncarried],
        reembedded=True,
        archive="",
        seconds=time.perf_counter() - t0,
        caught_up=st.caught_up,
    )
    log.info("gallery carried beside the live one and switched", extra={"fields": r.to_dict()})
    return r


def migrate(o: Opening, settings: Settings, progress, status=None) -> Report | None:
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
