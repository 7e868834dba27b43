"""Regression tests of the day-two attack (issue 39), each a finding that lost or undid an
acknowledged write, on SQLite and a real PostgreSQL, in-process on fake models
(tests/service/galleries_fake.py: the same service/store/upgrade.py `run` that snca-gallery
upgrade and rollback call, without loading a model): two switches at once, a switch killed after
the new gallery went live, deletes resurrected by a carry into a gallery that held items, a
restore next to another history's galleries, a restore that kept a standby flag, a catch-up
killed then resumed, a deleted label or trained image brought back by another model's index,
and the backup manifest checked field by field."""

from __future__ import annotations

import json
import threading
import time

import pytest

from embedding.errors import ArtifactError
from service.store import backup
from service.store.galleries import alias
from service.store.records import STANDBY, Keyed, StoreUnavailable
from service.store.upgrade import settle

from ..galleries_fake import Place, add, closing, embedding, gen, image, live_added


def writable(place: Place) -> list[str]:
    with closing(place.galleries()) as g:
        from service.store.galleries import registry

        gens = {gen(0), *registry(g.home)}
        return sorted(x for x in gens if g.exists(x) and STANDBY not in g.open(x).meta())


def delete(place: Place, gen_: str, ids=None, label=None) -> int:
    with closing(place.galleries()) as g:
        return g.open(gen_).delete(ids, label)[0]


def killed_in(monkeypatch, cls, dying, run) -> None:
    """`run()` with the store class's transaction replaced by `dying` (which raises
    RuntimeError where the process would have been killed), then the real one back."""
    real = cls.transaction
    monkeypatch.setattr(cls, "transaction", dying)
    with pytest.raises(RuntimeError):
        run()
    monkeypatch.setattr(cls, "transaction", real)


def test_two_switches_at_once_leave_one_live_gallery_with_every_acknowledged_write(place):
    """Finding 1: `upgrade --to B --switch` and `upgrade --to C --switch` started together
    (then a rollback racing another upgrade) while writers write to every gallery that takes
    writes: both switched, two galleries took writes, 320 acknowledged adds were missing from
    the alias's gallery. Now one carry or switch at a time (the carry lock) and a switch only
    from the live gallery (its seal is refused on standby): one live gallery, every add there."""
    add(place, gen(0), "seed", 24, 0)
    acked: dict[int, str] = {}
    stop = threading.Event()

    def writer(k: int) -> None:
        n = 1000 * (k + 1)
        with closing(place.galleries()) as g:
            while not stop.is_set():
                for m in range(3):
                    if not g.exists(gen(m)):
                        continue
                    n += 1
                    b = image(n)
                    try:
                        _, ids = g.open(gen(m)).add(f"w{m}", [embedding(b)], [None], [(b, "x")])
                    except (StoreUnavailable, ArtifactError):  # (a gallery being created)
                        continue
                    acked.update({i: f"w{m}" for i in ids})
                time.sleep(0.02)

    errors: list[BaseException] = []

    def upgrade(m: int) -> None:
        try:
            place.upgrade(m, True, delay=0.01)
        except BaseException as e:  # (a traceback here: the two runs raced)
            errors.append(e)

    writers = [threading.Thread(target=writer, args=(k,)) for k in range(1)]
    for t in writers:
        t.start()
    try:
        # two upgrades; a rollback-like switch and another; the same upgrade twice at once (one
        # died with "UNIQUE constraint failed: items.id")
        for targets in ([1, 2], [0, 2], [1, 1]):
            ts = [threading.Thread(target=upgrade, args=(m,)) for m in targets]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            time.sleep(0.05)
    finally:
        stop.set()
        for t in writers:
            t.join()
    assert not errors, errors
    live = writable(place)
    with closing(place.galleries()) as g:
        a = alias(g.home)
    assert live == [a["gen"]] == [gen(1)], (live, a)
    have = live_added(place)
    missing = {i: lab for i, lab in acked.items() if have.get(i) != lab}
    assert not missing, f"{len(missing)} of {len(acked)} acknowledged adds missing"
    assert len(acked) > 10


def test_a_switch_killed_after_the_new_gallery_went_live_then_rerun_then_rolled_back(
    place, monkeypatch
):
    """Finding 2: kill -9 of `upgrade --switch` once the new gallery took writes (before the
    alias moved), the rerun, then a rollback: the adds the new gallery acknowledged in between
    were missing on the old one (the rerun recorded its own switch row as where the carry back
    starts). Now the seal records it, and a rerun (or any start) finishes the switch."""
    add(place, gen(0), "a", 5, 0)
    cls, real = place.cls, place.cls.transaction

    def dies_once_live(store, fn, op="migrate", count=lambda r: 0):
        was = STANDBY in store.meta()
        out = real(store, fn, op, count)
        if was and STANDBY not in store.meta():  # this write made the new gallery live
            raise RuntimeError("killed")
        return out

    killed_in(monkeypatch, cls, dies_once_live, lambda: place.upgrade(1, True))
    assert writable(place) == [gen(1)]  # live, the alias not moved yet
    between = add(place, gen(1), "between", 20, 100)  # acknowledged by the new gallery
    place.upgrade(1, True)  # the rerun docs/operations.md recommends
    assert writable(place) == [gen(1)]
    with closing(place.galleries()) as g:
        assert alias(g.home)["gen"] == gen(1)
    place.upgrade(0, True)  # rollback
    have = live_added(place, gen(0))
    assert all(have.get(i) == "between" for i in between), sorted(set(between) - set(have))
    assert writable(place) == [gen(0)]


def test_acknowledged_deletes_stay_deleted_through_a_gallery_built_earlier(place):
    """Finding 3: 20 adds; `upgrade --to C` (no switch); 10 deletes; `upgrade --to B
    --switch`; `upgrade --to C --switch`: C went live with the 10 deleted ids back (a carry
    into a target that already held items only added). Now a new carry into a gallery that
    holds items first deletes there what its source no longer holds."""
    ids = add(place, gen(0), "a", 20, 0)
    place.upgrade(2, False)
    for i in ids[:10]:
        assert delete(place, gen(0), [i])
    place.upgrade(1, True)
    place.upgrade(2, True)
    assert sorted(live_added(place, gen(2))) == ids[10:]


def test_a_label_or_trained_image_deleted_stays_deleted_in_another_models_index(place):
    """Finding 8: a deleted trained label came back with the new model's index (trained items
    were matched by dataset index, and its index held other images of the label); the same for
    a trained image deleted on a gallery whose index lacked it when passed on (found by the
    model check, tests/service/store/test_carry_model.py). Now deletes leave tombstones that travel."""
    assert delete(place, gen(0), label="T0")
    place.upgrade(2, True)  # model 2's index: T0 images model 0's never had
    with closing(place.galleries()) as g:
        s = g.open(gen(2))
        live = s.select("SELECT label FROM items WHERE deleted_seq IS NULL")
        assert "T0" not in {r[0] for r in live}
        trained = s.select("SELECT id, metadata FROM items WHERE source = 'trained'")
        (seven,) = [i for i, md in trained if json.loads(md)["dataset_index"] == 7]
    assert delete(place, gen(2), [seven])  # an image model 0's index lacks
    place.upgrade(0, True)  # through model 0 ...
    place.upgrade(1, True)  # ... into model 1, whose index has it
    with closing(place.galleries()) as g:
        rows = g.open(gen(1)).select(
            "SELECT label, metadata FROM items WHERE source = 'trained' AND deleted_seq IS NULL"
        )
    assert "T0" not in {r[0] for r in rows}
    assert 7 not in {json.loads(r[1])["dataset_index"] for r in rows}


def test_a_catch_up_killed_after_a_write_resumes(place, monkeypatch):
    """Finding 7: an upgrade killed during its catch-up could never be resumed ("carried from
    another history": the saved state moved to the write just applied but kept the previous
    write's token). Now each write saves that write's token."""
    add(place, gen(0), "a", 6, 0)
    place.upgrade(1, False)
    later = add(place, gen(0), "b", 3, 50)  # writes the next run catches up with
    cls = place.cls
    real = cls.transaction
    calls = []

    def dies_after_one_carry_write(store, fn, op="migrate", count=lambda r: 0):
        out = real(store, fn, op, count)
        if op == "carry":
            calls.append(op)
            raise RuntimeError("killed")
        return out

    killed_in(monkeypatch, cls, dies_after_one_carry_write, lambda: place.upgrade(1, False))
    assert calls
    place.upgrade(1, True)  # resumes
    assert sorted(i for i, lab in live_added(place, gen(1)).items() if lab == "b") == later


def test_a_restore_refuses_to_land_next_to_galleries_of_another_history(place, tmp_path):
    """Finding 4: backup, upgrade, rollback, the home store lost, `restore` into the same
    place (accepted), 5 adds, `upgrade --to B --switch` resumed the leftover carry "up to write
    22", a write the restored gallery never had: the 5 adds missing, 10 items not in the
    backup live again. Now the restore refuses while other galleries are there, or moves them
    aside (--discard-galleries); the next upgrade carries exactly the restored gallery."""
    from embedding.errors import SNCAError
    from service.tools import gallery_ops

    first = add(place, gen(0), "a", 10, 0)
    out = tmp_path / "backup"
    backup.backup(place.cls, place.home, place.home, out, say=lambda s: None)
    place.upgrade(1, True)
    extra = add(place, gen(1), "after-backup", 10, 100)
    place.upgrade(0, True)
    _lose_home(place)
    args = {"backup": str(out), "store": place.home, "data_dir": str(place.dir / "data")}
    with pytest.raises(SNCAError, match="discard-galleries"):
        gallery_ops.restore(args, say=lambda s: None)
    assert gallery_ops.restore({**args, "discard_galleries": True}, say=lambda s: None) == 0
    assert not place.cls.leftovers(place.home)
    fresh = add(place, gen(0), "restored", 5, 200)
    place.upgrade(1, True)
    have = live_added(place, gen(1))
    assert have == {**dict.fromkeys(first, "a"), **dict.fromkeys(fresh, "restored")}
    assert extra and "after-backup" not in have.values()  # (the lost history's ids are reused)


def _lose_home(place: Place) -> None:
    """The home store lost (the SQLite file moved away; the default schema's tables dropped)."""
    if place.kind == "sqlite":
        from pathlib import Path

        home = Path(place.home)
        for suffix in ("", "-wal", "-shm"):
            p = Path(str(home) + suffix)
            if p.exists():
                p.rename(place.dir / ("lost" + suffix))
        return
    import psycopg

    with psycopg.connect(place.home, autocommit=True) as c:
        for t in ("items", "log", "meta", "tombstones", "label_changes", "review", "requests"):
            c.execute(f"DROP TABLE {t}")


def test_a_restored_standby_gallery_stands_alone(place, tmp_path):
    """Finding 6: after a SQLite restore of a standby gallery every write answered 503
    standby, and the registry, alias and carry state came back (their removal ran in a
    transaction the close discarded). Both backends now drop the same meta and keep the rest."""
    add(place, gen(0), "a", 4, 0)
    place.upgrade(1, True)  # model 0's gallery (the home store) on standby, with an alias
    with closing(place.galleries()) as g:
        target = g.target_of(gen(0))
        assert STANDBY in g.open(gen(0)).meta()
    out = tmp_path / "backup"
    m = backup.backup(place.cls, target, target, out, say=lambda s: None)
    where = str(tmp_path / "restored" / "gallery.sqlite")
    from service.store.sqlite import SqliteStore

    backup.restore(SqliteStore, out, where, where, say=lambda s: None)
    meta = SqliteStore.meta_of(where)
    dropped = [k for k in meta if k.split(":")[0] in ("gallery", "alias", "carry")]
    assert not dropped and not {"standby", "live_epoch", "carried_to"} & set(meta)
    assert meta["model_fingerprint"] == m["model_fingerprint"]
    s = SqliteStore(where, None, meta["model_fingerprint"], meta["index_id"])
    try:
        assert s.add("b", [embedding(b"z")], [None], [(b"z", "x")])[0] > 0  # takes writes
    finally:
        s.close()


def test_a_rerun_or_a_start_finishes_a_switch_killed_after_the_seal(place, monkeypatch):
    """A switch killed between the seal and the promotion leaves no gallery taking writes;
    the next run (of any target) or a server start (startup.settle_galleries) finishes it."""
    from service.store import upgrade as up

    ids = add(place, gen(0), "a", 3, 0)
    monkeypatch.setattr(up, "promote", lambda *a: (_ for _ in ()).throw(RuntimeError("killed")))
    with pytest.raises(RuntimeError):
        place.upgrade(1, True)
    monkeypatch.undo()
    assert writable(place) == []  # sealed, not yet live: writes wait (503), none is lost
    with closing(place.galleries()) as g, g.lock(lambda s: None):
        settle(g, lambda s: None)
    assert writable(place) == [gen(1)]
    assert sorted(live_added(place, gen(1))) == ids


def test_the_backup_manifest_is_checked_field_by_field(place, tmp_path):
    """Low findings: a backup.json without last_seq was a traceback, and one that lied about
    `added`, the model, the index build, the token, the floor or the dimension was accepted
    (restore then named the lie as the model to serve); a killed backup's partial file made
    the folder unusable."""
    add(place, gen(0), "a", 3, 0)
    out = tmp_path / "b"
    out.mkdir()
    (out / backup.PARTIAL).write_bytes(b"half a copy")  # what a killed backup leaves
    backup.backup(place.cls, place.home, place.home, out, say=lambda s: None)
    good = json.loads((out / backup.MANIFEST).read_text())
    backup.verify(out)
    lies = {
        "added": good["added"] + 1,
        "model_fingerprint": "sha256:" + "0" * 64,
        "index_id": "other",
        "token": "0" * 16,
        "log_floor": good["log_floor"] + 1,
        "dim": good["dim"] + 1,
    }
    for field, value in [*lies.items(), ("last_seq", None)]:
        bad = dict(good)
        if value is None:
            del bad[field]
        else:
            bad[field] = value
        (out / backup.MANIFEST).write_text(json.dumps(bad))
        with pytest.raises(ArtifactError, match=field):
            backup.verify(out)
    (out / backup.MANIFEST).write_text(json.dumps(good))


def test_a_server_never_makes_a_gallery_beside_the_live_one(tmp_path):
    """The history checker's finding: a model's server had recorded its gallery (the home
    store) in the registry; a server of another model then carried the home store at start-up
    (the swap), copying the registry, own entry included; the first model's next server found
    its gallery "registered", made a fresh one beside the live one from its index (ids from
    the start again) and took writes there: two galleries live, ids given twice. Now the swap
    keeps only galleries built beside it, a registered gallery must exist to be served, and a
    server opens a sibling without a seed (it never makes one)."""
    from pathlib import Path

    from service.store.datadir import DataDir
    from service.store.galleries import register_served
    from service.store.migration import Migration, Target, plan
    from service.store.registry import locate_gallery

    from ..galleries_fake import DIM, embed, fingerprint, index_id

    place = Place("sqlite")
    try:
        add(place, gen(0), "a", 3, 0)
        with closing(place.galleries()) as g:  # (a server of model 0: startup.register_model)
            assert register_served(g.home, gen(0), {"model_dir": "runs/model0"})
        home = Path(place.home)
        p = plan(home, Target(fingerprint(1), index_id(1), "embedding", DIM))
        Migration(p, DataDir(home.parent, home), place.seeds[1], embed, 2).run()
        where, _ = locate_gallery(home, home.parent, fingerprint(0), index_id(0))
        assert where == str(home)  # (home is model 1's now: model 0's start carries it back)
        assert not list((home.parent / "galleries").glob("*/gallery.sqlite"))
    finally:
        place.close()


def test_a_keyed_write_carried_through_a_compacted_log_keeps_its_key(place):
    """The history checker (PostgreSQL seed 2726998346, 240 s): an add committed on the live
    gallery under an Idempotency-Key, the log compacted past the upgrade's position, the
    carry reconciled in full without the key's record: the client's retry on the new gallery
    was made again (a second item; the first one "never acknowledged to anyone"). Now the
    reconcile copies the records too, and the retry is answered by the first outcome."""
    add(place, gen(0), "a", 3, 0)
    place.upgrade(1, False)  # B built, following A from here
    with closing(place.galleries()) as g:
        s = g.open(gen(0))
        b = image(99)
        _, ids = s.add("k", [embedding(b)], [None], [(b, "image/png")], keyed=Keyed("K1", "d1"))
        s.compact(s.last_seq())  # the log no longer reaches back to B's position
    place.upgrade(1, True)  # reconciles, switches
    with closing(place.galleries()) as g:
        assert alias(g.home)["gen"] == gen(1)
        got = g.open(gen(1)).request("K1")
    assert got is not None, "the key's record was not carried: a retry would add again"
    digest, _, outcome = got
    assert digest == "d1" and outcome["ids"] == ids
    assert sorted(i for i, lab in live_added(place, gen(1)).items() if lab == "k") == ids


def test_a_delete_of_an_image_the_live_gallery_lacks_reaches_a_gallery_built_earlier(place):
    """A trained image only some models' indexes hold (dataset index 6: models 1 and 2, not 0)
    deleted on model 1's gallery, then model 0 live (its carry deleted nothing there, and kept
    the tombstone), then model 2's gallery, built before that delete, made live: its carry
    resumes by following model 0's log, where that write changed no item. It deleted nothing
    on model 2 (the carry model's finding, both backends): the image came back."""

    def live_index_6(gen_: str) -> list[int]:
        with closing(place.galleries()) as g:
            rows = g.open(gen_).select(
                "SELECT id, metadata FROM items WHERE source = 'trained' AND deleted_seq IS NULL"
            )
        return [i for i, md in rows if json.loads(md)["dataset_index"] == 6]

    place.upgrade(2, False)  # model 2's gallery beside model 0's (its carry state kept)
    place.upgrade(1, True)
    assert writable(place) == [gen(1)]
    assert delete(place, gen(1), ids=live_index_6(gen(1)))
    place.upgrade(0, True)  # carried into model 0: nothing there to delete; its tombstone kept
    assert writable(place) == [gen(0)]
    assert live_index_6(gen(2))  # (model 2's gallery still holds it, not live)
    place.upgrade(2, True)
    assert writable(place) == [gen(2)]
    assert live_index_6(gen(2)) == []
