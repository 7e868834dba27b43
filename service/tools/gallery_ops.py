"""snca-gallery's day-two commands: upgrade / rollback / galleries (another model's gallery
beside the live one, switched by an alias: service/store/upgrade.py), backup / verify / restore
(service/store/backup.py), compact (the log's floor) and prune (previous/).

They work on the store the flags name (--store, --data-dir, --model as snca-serve finds it);
none needs a server to be stopped, and backup, compact, upgrade and rollback are meant to run
while servers write."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from embedding.errors import SNCAError


def settings_of(args: dict, **overrides):
    from pydantic import ValidationError

    from service.config import Settings

    keys = ("model", "index", "store", "data_dir", "device", "log_level")
    given = {k: v for k, v in args.items() if k in keys and v is not None}
    try:
        return Settings(**{**given, **overrides})
    except ValidationError as e:
        msgs = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise SNCAError(msgs) from None


def _shown(target: str) -> str:
    from service.store.postgres import redact

    return redact(str(target))


def _open_home(settings):
    from service.store.registry import backend_class, open_as_found

    home = settings.home_store
    cls = backend_class(home)
    if not cls.exists(home):
        raise SNCAError(
            f"no gallery at {_shown(home)}: start snca-serve once (or restore a backup) first"
        )
    return cls, home, open_as_found(home)


def _gallery_target(cls, home: str, home_store, gen: str) -> str:
    from service.store.galleries import gen_of

    m = home_store.meta()
    return home if gen_of(m["model_fingerprint"], m["index_id"]) == gen else cls.sibling(home, gen)


# ---------------------------------------------------------------------------- galleries
def galleries(args: dict, say=print) -> int:
    """List the galleries of the store: which is live, which are on standby, how far each is."""
    from service.store.galleries import alias, gen_of, live_gen, registry
    from service.store.registry import open_as_found

    settings = settings_of(args)
    cls, home, h = _open_home(settings)
    try:
        reg = registry(h)
        live = live_gen(h)
        m = h.meta()
        home_gen = gen_of(m["model_fingerprint"], m["index_id"])
        rows = []
        for gen in sorted({home_gen, *reg}):
            target = _gallery_target(cls, home, h, gen)
            info = reg.get(gen, {})
            if cls.exists(target):
                s = open_as_found(target)
                try:
                    sm = s.meta()
                    rows.append(
                        {
                            "gen": gen,
                            "live": gen == live,
                            "standby": "standby" in sm,
                            "store": _shown(target),
                            "last_seq": int(sm["last_seq"]),
                            "model_fingerprint": sm.get("model_fingerprint"),
                            "model_dir": info.get("model_dir"),
                        }
                    )
                finally:
                    s.close()
            else:
                rows.append(
                    {"gen": gen, "live": gen == live, "store": _shown(target), "missing": True}
                )
        say(json.dumps({"alias": alias(h), "galleries": rows}, indent=2))
    finally:
        h.close()
    return 0


# ---------------------------------------------------------------------------- upgrade
def upgrade(args: dict, say=print) -> int:
    """Carry the live gallery into --to's gallery (built beside it, resumable), and with
    --switch make it the live one."""
    to = Path(args["to"]).resolve()
    to_index = Path(args.get("to_index") or to / "index").resolve()
    return _carry(args, lambda g: (to, to_index), bool(args.get("switch")), say)


def rollback(args: dict, say=print) -> int:
    """Switch back to the gallery the alias names as previous (carrying the writes made
    since the switch into it first). Which one is read under the carry lock, so a rollback
    that waited for an upgrade rolls that upgrade back."""
    from service.store.galleries import alias, registry

    def previous(g) -> tuple[Path, Path]:
        a = alias(g.home)
        if a is None or not a.get("previous"):
            raise SNCAError("nothing to roll back: this store was never switched")
        info = registry(g.home).get(a["previous"], {})
        if not info.get("model_dir"):
            raise SNCAError(
                f"the previous gallery {a['previous']} does not record its model: run "
                "snca-gallery upgrade --to ITS_RUN_DIR --switch"
            )
        model = Path(info["model_dir"])
        return model, Path(info.get("index_dir") or model / "index")

    return _carry(args, previous, True, say)


def _carry(args: dict, resolve, switch: bool, say) -> int:
    """Under the home store's carry lock (service/store/upgrade.py `run`): finish a switch a
    killed run began, resolve the target (run dir, index dir), carry the live gallery into its
    gallery, and switch."""
    from embedding.index import open_index_dir
    from embedding.rundir import RunDir
    from service.store.galleries import gen_of, register, registry
    from service.store.registry import backend_class
    from service.store.upgrade import To, open_galleries, run

    settings = settings_of(args)
    cls, home, h = _open_home(settings)
    h.close()
    g = open_galleries(backend_class(home), home)
    runtimes = []
    bar, progress = _bar(args)
    shown = contextlib.ExitStack()  # the progress line, from when there is something to embed

    def target(g, live):
        if live not in registry(g.home):  # the home gallery, first upgrade: what serves it
            sm = g.home.meta()
            model_dir = None  # (--model, when it is that gallery's model: rollback needs it)
            with contextlib.suppress(SNCAError, OSError, ValueError):
                if RunDir(settings.model).load_model_card()[1] == sm["model_fingerprint"]:
                    model_dir = str(Path(settings.model).resolve())
            register(
                g.home,
                live,
                {
                    "model_fingerprint": sm["model_fingerprint"],
                    "index_id": sm["index_id"],
                    "model_dir": model_dir,
                    "index_dir": str(Path(settings.index).resolve()) if model_dir else None,
                },
            )
        to, to_index = resolve(g)
        model = RunDir(to).load_model()
        ix = open_index_dir(to_index, expected_fingerprint=model.fingerprint)
        gen = gen_of(model.fingerprint, ix.manifest.index_id)
        if gen == live:
            return None
        info = {
            "model_fingerprint": model.fingerprint,
            "index_id": ix.manifest.index_id,
            "model_dir": str(to),
            "index_dir": str(to_index),
        }

        def open_target(seed_meta):
            target = g.target_of(gen)
            return cls(target, ix.store, model.fingerprint, ix.manifest.index_id, seed_meta)

        runtimes.append(_runtime(args, to, to_index, ix, model))
        shown.enter_context(bar)
        return To(gen, info, open_target), _embedder(runtimes[-1])

    try:
        out = run(g, target, switch, int(args.get("batch_size") or 64), say, progress)
        shown.close()
        if out.gen is None:
            say(f"the gallery of that model ({out.live}) is the live one already: nothing to do")
            return 0
        st, gen, live = out.state, out.gen, out.live
        n_un = st.uncarried_count
        say(
            f"{gen}: {out.carry.carried} items carried, {out.carry.deleted} deleted, up to write "
            f"{st.source_seq} of {live}"
            + (f"; {n_un} could not be carried (they stay in the old gallery)" if n_un else "")
        )
        for item_id, label, why in st.uncarried[:20]:
            say(f"  not carried: item {item_id} ({label}): {why}")
        if out.alias is not None:
            say(
                f"switched: {gen} ({out.carry.target.info.get('model_dir')}) is live; {live} is "
                f"on standby (snca-gallery rollback switches back) at {out.alias['switched_at']}"
            )
        else:
            say(
                f"servers started with that model serve {gen} (read-only until the switch); "
                "run again with --switch to make it the live gallery"
            )
        return 0
    finally:
        shown.close()
        for r in runtimes:
            r.close()
        g.close()
        g.home.close()


def _runtime(args: dict, to: Path, to_index: Path, ix, model):
    """The target model, loaded to re-embed stored images (no warm-up of every batch size,
    no fused copies: bulk work, not serving latency)."""
    from service.model.runtime import ModelRuntime
    from service.startup import load_world

    tsettings = settings_of(
        args, model=to, index=to_index, model_process=False, warmup_seconds=0.0, fused_batches=0
    )
    world = load_world(tsettings, ix, model.fingerprint)
    return ModelRuntime.load(tsettings, model, ix.manifest.space, world=world is not None)


def _embedder(runtime):
    """The carry's Embed over the runtime: (embeddings, world statistics, per item an error)."""

    def embed(items):
        emb, stats, errs = runtime.embed_stored([it.image for it in items])
        return emb, stats, list(errs)

    return embed


def _bar(args: dict):
    from embedding.progress import Progress

    bar = Progress(None, "re-embedding", "item", enabled=args.get("progress", True))
    last = {"done": 0}

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - last["done"])
        last["done"] = done

    return bar, progress


# ---------------------------------------------------------------------------- backups
def gallery_for(args: dict, settings) -> tuple[str, str]:
    """(store target, gen) of the gallery a command works on: --gallery GEN, else the live one."""
    from service.store.galleries import live_gen

    cls, home, h = _open_home(settings)
    try:
        gen = args.get("gallery") or live_gen(h)
        return _gallery_target(cls, home, h, gen), gen
    finally:
        h.close()


def open_gallery(args: dict):
    """(store, gen) of the gallery a command names, opened as found (no carry, no alias)."""
    from service.store.registry import open_as_found

    target, gen = gallery_for(args, settings_of(args))
    return open_as_found(target), gen


MAX_IDS = 1000  # ids per write (as the HTTP routes take)


def write_by_label(args: dict, by_label: dict[str, list[int]], write) -> int:
    """Each label's ids (duplicates dropped, in order, MAX_IDS a write) through
    `write(store, gen, ids, label)` -> how many it changed, on the gallery `args` names; the
    sum."""
    store, gen = open_gallery(args)
    done = 0
    try:
        for label, ids in sorted(by_label.items()):
            ids = sorted(set(ids))
            for s in range(0, len(ids), MAX_IDS):
                done += write(store, gen, ids[s : s + MAX_IDS], label)
    finally:
        store.close()
    return done


def backup(args: dict, say=print) -> int:
    from service.store import backup as b
    from service.store.registry import backend_class

    settings = settings_of(args)
    target, gen = gallery_for(args, settings)
    m = b.backup(backend_class(target), target, _shown(target), Path(args["out"]), say)
    say(
        f"backup of {gen} in {args['out']}: {m['items']} items ({m['added']} added) at write "
        f"{m['last_seq']}, checksum {m['checksum'][:16]}"
    )
    return 0


def verify(args: dict, say=print) -> int:
    from service.store import backup as b

    m = b.verify(Path(args["backup"]))
    say(
        f"{args['backup']}: intact ({m['items']} items at write {m['last_seq']}, checksum "
        f"{m['checksum'][:16]}, model {str(m['model_fingerprint'])[:19]}...)"
    )
    return 0


def restore(args: dict, say=print) -> int:
    """Verify a backup and restore it into the home store's place, which must hold no gallery
    and nothing of an earlier history beside it: other models' galleries left by upgrades (or a
    half-done migration) are refused, or with --discard-galleries moved aside (kept: SQLite
    into DATA_DIR/previous/discarded-STAMP/, PostgreSQL schemas renamed discarded_STAMP_*),
    because their carry state belongs to a history the backup may not have."""
    from embedding.gallery import utc_now
    from service.store import backup as b
    from service.store.registry import backend_class

    settings = settings_of(args)
    target = settings.home_store
    cls = backend_class(target)
    b.verify(Path(args["backup"]))  # (a broken backup is refused before anything is moved)
    if cls.exists(target):
        raise SNCAError(
            f"{_shown(target)} holds a gallery: restore into an empty data dir or database"
        )
    found = cls.leftovers(target)
    if found and not args.get("discard_galleries"):
        raise SNCAError(
            f"{_shown(target)} has galleries of an earlier history beside it ("
            + ", ".join(found)
            + "): a restore into this place would mix histories; move them away first, or run "
            "again with --discard-galleries (they are kept, moved aside)"
        )
    if found:
        stamp = utc_now().replace(":", "").replace("+00:00", "Z").replace("-", "")
        for where in cls.discard(target, found, stamp):
            say(f"moved aside: {where}")
    m = b.restore(cls, Path(args["backup"]), target, _shown(target), say)
    say(
        f"restored into {_shown(target)}: {m['items']} items at write {m['last_seq']}, checksum "
        f"{m['checksum'][:16]} (verified on the restored store); serve it with the model "
        f"{str(m['model_fingerprint'])[:19]}... and index {m['index_id']}"
    )
    return 0


# ---------------------------------------------------------------------------- housekeeping
def compact(args: dict, say=print) -> int:
    from service.store.registry import open_as_found

    settings = settings_of(args)
    target, gen = gallery_for(args, settings)
    store = open_as_found(target)
    try:
        last = store.last_seq()
        floor = int(store.meta().get("log_floor", 0))
        upto = args.get("upto")
        upto = last - int(args.get("keep") or 0) if upto is None else int(upto)
        upto = min(upto, last)
        if upto <= floor:
            say(f"{gen}: the log starts after write {floor} already (head {last}): nothing to do")
            return 0
        removed = store.compact(upto)
    finally:
        store.close()
    say(
        f"{gen}: the log now starts after write {upto} (was {floor}, head {last}); {removed} "
        "rows of deleted items removed. A replica (or an upgrade's carry) that has not applied "
        f"write {upto} yet reloads the whole gallery from the store when it next follows "
        "(/readyz rebuilds); snapshots older than it are not used"
    )
    return 0


def prune(args: dict, say=print) -> int:
    from service.store.datadir import DataDir, prune_previous

    settings = settings_of(args)
    keep = int(args.get("keep") or settings.keep_previous)
    data = DataDir(settings.data_dir, settings.store_path)
    removed, kept = prune_previous(data, keep, dry_run=bool(args.get("dry_run")))
    verb = "would remove" if args.get("dry_run") else "removed"
    for p in removed:
        say(f"{verb} {p}")
    for p, why in kept:
        say(f"kept {p} ({why})")
    if not removed and not kept:
        say(f"{data.previous}: no previous stores")
    return 0


COMMANDS = {
    "upgrade": upgrade,
    "rollback": rollback,
    "galleries": galleries,
    "backup": backup,
    "verify": verify,
    "restore": restore,
    "compact": compact,
    "prune": prune,
}
