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


def home_of(settings) -> str:
    return settings.store_url or str(settings.store_path)


def _shown(target: str) -> str:
    from service.store.postgres import redact

    return redact(str(target))


def _open_home(settings):
    from service.store.registry import backend_class, open_as_found

    home = home_of(settings)
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
    from embedding.progress import Progress
    from embedding.rundir import RunDir
    from service.store.galleries import gen_of, live_gen, register, registry
    from service.store.records import STANDBY
    from service.store.registry import open_as_found
    from service.store.upgrade import Carry, Side

    settings = settings_of(args)
    to = Path(args["to"]).resolve()
    to_index = Path(args.get("to_index") or to / "index").resolve()
    cls, home, h = _open_home(settings)
    stores = [h]
    runtime = None
    try:
        reg = registry(h)
        live = live_gen(h)
        src_target = _gallery_target(cls, home, h, live)
        source = open_as_found(src_target)
        stores.append(source)
        sm = source.meta()
        if live not in reg:  # the home gallery, first upgrade: record what serves it
            model_dir = None  # (--model, when it is that gallery's model: rollback needs it)
            with contextlib.suppress(SNCAError, OSError, ValueError):
                if RunDir(settings.model).load_model_card()[1] == sm["model_fingerprint"]:
                    model_dir = str(Path(settings.model).resolve())
            register(
                h,
                live,
                {
                    "model_fingerprint": sm["model_fingerprint"],
                    "index_id": sm["index_id"],
                    "model_dir": model_dir,
                    "index_dir": str(Path(settings.index).resolve()) if model_dir else None,
                },
            )
        from embedding.index import open_index_dir
        from service.model.runtime import ModelRuntime
        from service.startup import load_world

        model = RunDir(to).load_model()
        ix = open_index_dir(to_index, expected_fingerprint=model.fingerprint)
        gen = gen_of(model.fingerprint, ix.manifest.index_id)
        if gen == live:
            say(f"the gallery of {to} ({gen}) is the live one already: nothing to do")
            return 0
        target = _gallery_target(cls, home, h, gen)
        info = {
            "model_fingerprint": model.fingerprint,
            "index_id": ix.manifest.index_id,
            "model_dir": str(to),
            "index_dir": str(to_index),
        }
        fresh = not cls.exists(target)
        if fresh and settings.store_url is None:
            Path(target).parent.mkdir(parents=True, exist_ok=True)
        tstore = cls(target, ix.store, model.fingerprint, ix.manifest.index_id)
        stores.append(tstore)
        if STANDBY not in tstore.meta():  # on standby before any server can find it (registered
            # below; also when a first run died between creating and flagging it)
            flag = json.dumps({"gen": live, "model_fingerprint": sm["model_fingerprint"]})
            tstore.plain(lambda c: tstore.set_meta(c, STANDBY, flag))
        register(h, gen, info)
        # (no warm-up of every batch size, no fused copies: serving latency, not bulk work)
        tsettings = settings_of(
            args, model=to, index=to_index, model_process=False, warmup_seconds=0.0, fused_batches=0
        )
        world = load_world(tsettings, ix, model.fingerprint)
        runtime = ModelRuntime.load(tsettings, model, ix.manifest.space, world=world is not None)

        def embed(items):
            errors: list[str | None] = [None] * len(items)
            with_image = [i for i, it in enumerate(items) if it.image is not None]
            emb, stats, errs = runtime.embed_stored([items[i].image for i in with_image])
            for i, e in zip(with_image, errs, strict=True):
                errors[i] = None if e is None else f"the stored image cannot be read: {e}"
            for i, it in enumerate(items):
                if it.image is None:
                    errors[i] = "no stored image (added with SNCA_STORE_IMAGES off, or too large)"
            return emb, stats, errors

        bar = Progress(None, "re-embedding", "item", enabled=args.get("progress", True))
        last = {"done": 0}

        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - last["done"])
            last["done"] = done

        carry = Carry(
            Side(source, live, reg.get(live, {})),
            Side(tstore, gen, info),
            embed,
            int(args.get("batch_size") or 64),
            say,
            progress,
        )
        with bar:
            st = carry.begin()
            carry.backfill(st)
        carry.catch_up(st)
        say(
            f"{gen}: {carry.carried} items carried, {carry.deleted} deleted, up to write "
            f"{st['source_seq']} of {live}"
            + (
                f"; {st.get('uncarried_count', len(st['uncarried']))} could not be carried "
                "(they stay in the old gallery)"
                if st["uncarried"]
                else ""
            )
        )
        for item_id, label, why in st["uncarried"][:20]:
            say(f"  not carried: item {item_id} ({label}): {why}")
        if args.get("switch"):
            a = carry.switch(st, h)
            say(
                f"switched: {gen} ({to}) is live; {live} is on standby (snca-gallery rollback "
                f"switches back) at {a['switched_at']}"
            )
        else:
            say(
                f"servers started with --model {to} serve {gen} (read-only until the switch); "
                "run again with --switch to make it the live gallery"
            )
        return 0
    finally:
        if runtime is not None:
            runtime.close()
        for s in reversed(stores):
            s.close()


def rollback(args: dict, say=print) -> int:
    """Switch back to the gallery the alias names as previous (carrying the writes made
    since the switch back into it first)."""
    from service.store.galleries import alias, registry

    settings = settings_of(args)
    _, _, h = _open_home(settings)
    try:
        a = alias(h)
        if a is None or not a.get("previous"):
            raise SNCAError("nothing to roll back: this store was never switched")
        info = registry(h).get(a["previous"], {})
    finally:
        h.close()
    if not info.get("model_dir"):
        raise SNCAError(
            f"the previous gallery {a['previous']} does not record its model: run "
            "snca-gallery upgrade --to ITS_RUN_DIR --switch"
        )
    return upgrade(
        {**args, "to": info["model_dir"], "to_index": info.get("index_dir"), "switch": True}, say
    )


# ---------------------------------------------------------------------------- backups
def _gallery_for(args: dict, settings) -> tuple[str, str]:
    """(store target, gen) of the gallery a command works on: --gallery GEN, else the live one."""
    from service.store.galleries import live_gen

    cls, home, h = _open_home(settings)
    try:
        gen = args.get("gallery") or live_gen(h)
        return _gallery_target(cls, home, h, gen), gen
    finally:
        h.close()


def backup(args: dict, say=print) -> int:
    from service.store import backup as b
    from service.store.registry import backend_class

    settings = settings_of(args)
    target, gen = _gallery_for(args, settings)
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
    from service.store import backup as b
    from service.store.registry import backend_class

    settings = settings_of(args)
    target = home_of(settings)
    m = b.restore(backend_class(target), Path(args["backup"]), target, _shown(target), say)
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
    target, gen = _gallery_for(args, settings)
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
