"""A user's gallery outlives every model: on a store made under another model the service
carries every added item over before it serves (service/store/migration.py)."""

import json
import os
import sqlite3
import threading
import time

import httpx
import numpy as np
import pytest

from embedding.rundir import RunDir
from index_builder.build import BuildConfig, build
from service.config import Settings
from service.metrics import Metrics
from service.startup import open_service
from service.store import migration
from service.store.datadir import DataDir
from service.store.migration import Migration

from ..helpers import make_client as _make_client
from ..helpers import of_class, png, replaced_model


def make_client(run, data_dir, **kw):
    """The service on `run` with a quicker start (no fused copies, warm-up up to batch 8):
    what these tests check does not depend on the model's speed."""
    return _make_client(run, data_dir, fused_batches=0, max_batch=8, **kw)


@pytest.fixture(scope="module")
def new_model(base_run, tmp_path_factory):
    return replaced_model(base_run, tmp_path_factory.mktemp("new") / "run")


def wait_ready(client, timeout: float = 600) -> dict:
    """Poll /readyz until 200 (a migration runs in the background meanwhile)."""
    deadline = time.time() + timeout
    seen = set()
    while time.time() < deadline:
        r = client.get("/readyz")
        if r.status_code == 200:
            body = r.json()
            body["phases_seen"] = seen
            return body
        seen.add(r.json()["status"])
        time.sleep(0.05)
    raise AssertionError(f"not ready after {timeout}s: {r.json()}")


def _add(c, label, raw, idxs, **data):
    files = [("images", (f"{i}.png", png(raw, i), "image/png")) for i in idxs]
    r = c.post("/gallery/add", data={"label": label, **data}, files=files)
    assert r.status_code == 201, r.text
    return r.json()["ids"]


def _search(c, raw, i, label, k=5):
    files = {"image": ("q.png", png(raw, i), "image/png")}
    return c.post("/search", params={"k": k, "label": label}, files=files).json()["items"]


def _meta(path):
    conn = sqlite3.connect(path)
    try:
        return dict(conn.execute("SELECT key, value FROM meta"))
    finally:
        conn.close()


def test_a_new_model_carries_every_added_item(base_run, new_model, tmp_path, fmnist_train):
    data = tmp_path / "data"
    tees = of_class(fmnist_train, 0, 5)
    with make_client(base_run, data) as c:
        md = json.dumps([{"n": int(i)} for i in range(5)])
        tee_ids = _add(c, "my-tee", fmnist_train, tees, metadata=md)
        one = _add(c, "one-off", fmnist_train, of_class(fmnist_train, 2, 1))
        assert c.delete(f"/gallery/items/{tee_ids[0]}").status_code == 200  # an added delete
        trouser = _search(c, fmnist_train, of_class(fmnist_train, 1, 1)[0], "Trouser", 1)[0]
        assert c.delete(f"/gallery/items/{trouser['id']}").status_code == 200  # a trained one
        before = {x["label"]: x["count"] for x in c.get("/gallery/labels").json()["labels"]}
    with make_client(base_run, data, store_images=False) as c:  # an item without its image
        lost = _add(c, "no-image", fmnist_train, of_class(fmnist_train, 3, 1))

    new_fp = RunDir(new_model).load_model_card()[1]
    with make_client(new_model, data) as c:
        body = wait_ready(c)
        assert "migrating" in body["phases_seen"]  # /readyz said so meanwhile
        assert body["model_fingerprint"] == new_fp
        m = body["migration"]
        assert m["carried"] == 5 and m["deleted_trained"] == 1 and not m["renumbered"]
        assert [u["id"] for u in m["uncarried"]] == lost and "no stored image" in str(m)
        after = {x["label"]: x["count"] for x in c.get("/gallery/labels").json()["labels"]}
        assert after == {k: v for k, v in before.items()}  # every label, every count
        # re-embedded by the new model: an added image finds itself, ids and metadata kept
        hits = _search(c, fmnist_train, tees[2], "my-tee")
        assert hits[0]["id"] == tee_ids[2] and hits[0]["similarity"] > 0.999
        assert hits[0]["metadata"] == {"n": 2}
        assert (
            _search(c, fmnist_train, of_class(fmnist_train, 2, 1)[0], "one-off")[0]["id"] == one[0]
        )
        files = {"image": ("q.png", png(fmnist_train, tees[3]), "image/png")}
        assert c.post("/classify", files=files).json()["label"] == "my-tee"
        gone = _search(c, fmnist_train, of_class(fmnist_train, 1, 1)[0], "Trouser", 50)
        assert trouser["metadata"]["dataset_index"] not in {
            h["metadata"]["dataset_index"] for h in gone
        }  # the trained item the user deleted stays deleted

    store = data / "gallery.sqlite"
    assert _meta(store)["model_fingerprint"] == new_fp
    assert json.loads(_meta(store)["migrated_from"])["carried"] == 5
    (archive,) = (data / "previous").iterdir()  # the old store, kept whole
    assert archive.name == m["archive"].split("/")[-1]
    old = sqlite3.connect(archive)
    assert old.execute("SELECT label FROM items WHERE id = ?", (lost[0],)).fetchone() == (
        "no-image",
    )
    old.close()
    assert not (data / "gallery.sqlite.migrating").exists()
    with make_client(new_model, data) as c:  # started again: nothing more to carry
        body = wait_ready(c)
        assert "migration" not in body and "migrating" not in body["phases_seen"]


def test_a_rebuilt_index_keeps_stored_embeddings(base_run, tmp_path, fmnist_train):
    """Same model, another index build: the stored embeddings stay valid, so items carry even
    without their images, and nothing is re-embedded."""
    data = tmp_path / "data"
    with make_client(base_run, data, store_images=False) as c:
        ids = _add(c, "x", fmnist_train, of_class(fmnist_train, 0, 2))
    ix2 = tmp_path / "hnsw"
    build(BuildConfig(base_run, ix2, factory="HNSW32", progress=False), log=lambda m: None)
    with make_client(base_run, data, index=ix2) as c:
        m = wait_ready(c)["migration"]
        assert m["carried"] == 2 and m["uncarried"] == [] and not m["reembedded"]
        hits = _search(c, fmnist_train, of_class(fmnist_train, 0, 1)[0], "x")
        assert hits[0]["id"] == ids[0] and hits[0]["similarity"] > 0.999


class Crash(Exception):
    pass


def test_migration_resumes_after_a_crash_and_loses_nothing(
    base_run, new_model, tmp_path, fmnist_train, monkeypatch
):
    data = tmp_path / "data"
    with make_client(base_run, data) as c:
        ids = []
        for s in range(0, 40, 10):
            ids += _add(c, f"l{s}", fmnist_train, range(s, s + 10))
    store = data / "gallery.sqlite"
    old_fp = _meta(store)["model_fingerprint"]
    opening = open_service(Settings(model=new_model, data_dir=data), Metrics())
    try:
        p = opening.plan
        assert p is not None and p.total == 40 and not p.reuse
        calls = []

        def embed(items, crash_at=None):
            calls.append(len(items))
            if len(calls) == crash_at:
                raise Crash
            return opening.runtime.embed_stored([it.image for it in items])

        def run(crash_at=None):
            return Migration(
                p, DataDir(data), opening.index.store, lambda it: embed(it, crash_at), 8
            ).run()

        with pytest.raises(Crash):  # dies in its third batch
            run(crash_at=3)
        assert _meta(store)["model_fingerprint"] == old_fp  # the old store is still the store
        half = sqlite3.connect(data / "gallery.sqlite.migrating")
        added = "SELECT COUNT(*) FROM items WHERE source = 'added'"
        assert half.execute(added).fetchone()[0] == 16
        half.close()

        real = migration.os.replace

        def failing(src, dst):  # dies between archiving the old store and the swap
            if str(dst) == str(store):
                raise OSError("killed")
            return real(src, dst)

        monkeypatch.setattr(migration.os, "replace", failing)
        calls.clear()
        with pytest.raises(OSError):
            run()
        assert calls == [8, 8, 8]  # resumed after the 16 carried items, not from the start
        assert _meta(store)["model_fingerprint"] == old_fp and (data / "previous").is_dir()
        monkeypatch.undo()
        calls.clear()
        report = run()
        assert calls == [] and report.carried == 40 and report.uncarried == []
    finally:
        opening.runtime.close()
    conn = sqlite3.connect(store)
    rows = conn.execute("SELECT id FROM items WHERE source = 'added' ORDER BY id").fetchall()
    assert [r[0] for r in rows] == ids  # each item once, with its id
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    conn.close()
    assert len(list((data / "previous").iterdir())) == 1
    emb = np.frombuffer(
        sqlite3.connect(store)
        .execute("SELECT embedding FROM items WHERE id = ?", (ids[0],))
        .fetchone()[0],
        "<f4",
    )
    assert abs(float(np.linalg.norm(emb)) - 1) < 1e-3


def test_a_store_at_the_old_default_place_is_carried_into_the_data_dir(
    base_run, tmp_path, fmnist_train
):
    """Before the data dir, the store lived in MODEL/serve/ (replaced by every retrain): the
    first start with the new default copies it (WAL included) and leaves the old file."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(base_run, run)
    with make_client(run, run / "serve") as c:  # what the old default was
        ids = _add(c, "from-before", fmnist_train, of_class(fmnist_train, 0, 3))
    legacy = run / "serve" / "gallery.sqlite"
    before = legacy.read_bytes()
    with make_client(run, tmp_path / "data") as c:
        labels = {x["label"]: x["count"] for x in c.get("/gallery/labels").json()["labels"]}
        assert labels["from-before"] == 3
        hit = _search(c, fmnist_train, of_class(fmnist_train, 0, 1)[0], "from-before", 1)[0]
        assert hit["id"] == ids[0]
    assert (tmp_path / "data" / "gallery.sqlite").is_file() and legacy.read_bytes() == before
    with make_client(run, tmp_path / "other", store=tmp_path / "named.sqlite") as c:
        labels = {x["label"] for x in c.get("/gallery/labels").json()["labels"]}
        assert "from-before" not in labels  # a store named explicitly is not replaced by it


def _live_added(store) -> dict[int, str]:
    conn = sqlite3.connect(store)
    try:
        rows = conn.execute(
            "SELECT id, label FROM items WHERE source = 'added' AND deleted_seq IS NULL"
        ).fetchall()
    finally:
        conn.close()
    return dict(rows)


def test_a_copy_the_store_moved_past_is_caught_up_not_swapped_in(
    base_run, new_model, tmp_path, fmnist_train, monkeypatch
):
    """The copy is complete (migrated_from written) but the process dies before the old store
    is sealed; a server with the old model then keeps writing. The next run must carry those
    writes (it swapped the stale copy in: 26 of 157 acknowledged adds vanished)."""
    data = tmp_path / "data"
    with make_client(base_run, data) as c:
        first = _add(c, "before", fmnist_train, range(0, 8))
    opening = open_service(Settings(model=new_model, data_dir=data), Metrics())
    try:

        def run():
            return Migration(
                opening.plan,
                DataDir(data),
                opening.index.store,
                lambda it: opening.runtime.embed_stored([x.image for x in it]),
                4,
            ).run()

        real = migration.set_meta

        def dies_at_the_seal(conn, key, value):
            if key == migration.CARRIED_TO:
                raise Crash
            return real(conn, key, value)

        monkeypatch.setattr(migration, "set_meta", dies_at_the_seal)
        with pytest.raises(Crash):
            run()
        monkeypatch.undo()
        half = _meta(data / "gallery.sqlite.migrating")
        assert half.get("migrated_from") is not None  # the copy was complete...
        # ...and the old model's server goes on: adds, a delete of a carried item, a delete
        # of a trained one
        with make_client(base_run, data) as c:
            later = _add(c, "after", fmnist_train, range(8, 13))
            assert c.delete(f"/gallery/items/{first[0]}").status_code == 200
            trouser = _search(c, fmnist_train, of_class(fmnist_train, 1, 1)[0], "Trouser", 1)[0]
            assert c.delete(f"/gallery/items/{trouser['id']}").status_code == 200
        report = run()
    finally:
        opening.runtime.close()
    assert report.caught_up == 3 and report.deleted_trained == 1  # 1 add + 2 deletes
    live = _live_added(data / "gallery.sqlite")
    assert sorted(live) == sorted(first[1:] + later)  # every acknowledged add, no deleted one
    meta = _meta(data / "gallery.sqlite")
    assert meta["model_fingerprint"] == RunDir(new_model).load_model_card()[1]
    (archive,) = (data / "previous").iterdir()
    assert migration.CARRIED_TO in _meta(archive)  # the old store, sealed: no write can land


@pytest.mark.slow
def test_a_rolling_upgrade_loses_no_acknowledged_add(base_run, new_model, tmp_path, fmnist_train):
    """Server A (old model) keeps taking adds while B (new model) starts on the same data dir:
    B carries the gallery, follows A's writes, seals the old store (A's later adds answer 503,
    A reports not ready and lets go of the file), then swaps. Every add A acknowledged is in
    B's gallery. (B used to fail its swap with "database is locked" and exit; restarted, it
    swapped in its stale copy.)"""
    from ..helpers import Server

    data = tmp_path / "data"
    a = Server(base_run, data, {"SNCA_FUSED_BATCHES": "0"})
    acked: dict[int, str] = {}
    refused: list[int] = []
    stop = threading.Event()

    def writer():
        n = 0
        with httpx.Client(base_url=a.url, timeout=30) as c:
            while not stop.is_set():
                files = [("images", ("x.png", png(fmnist_train, n % 500), "image/png"))]
                r = c.post("/gallery/add", data={"label": f"w{n % 7}"}, files=files)
                if r.status_code == 201:
                    acked.update({i: f"w{n % 7}" for i in r.json()["ids"]})
                else:
                    refused.append(r.status_code)
                n += 1

    with httpx.Client(base_url=a.url, timeout=30) as c:
        for s in range(0, 96, 32):  # something to carry while A writes
            _add(c, f"seed{s}", fmnist_train, range(1000 + s, 1032 + s))
    t = threading.Thread(target=writer, daemon=True)
    t.start()
    time.sleep(1.0)
    b = None
    try:
        b = Server(new_model, data, {"SNCA_FUSED_BATCHES": "0"})
        stop.set()
        t.join(timeout=60)
        ready = httpx.get(b.url + "/readyz").json()
        assert ready["migration"]["caught_up"] >= 1, ready  # A's writes during the copy
        ra = httpx.get(a.url + "/readyz")
        assert ra.status_code == 503 and "carried" in ra.json()["store_error"], ra.text
        r = httpx.post(
            a.url + "/gallery/add",
            data={"label": "late"},
            files=[("images", ("x.png", png(fmnist_train, 1), "image/png"))],
        )
        assert r.status_code == 503 and r.json()["code"] == "store_unavailable", r.text
        assert set(refused) <= {503}
        live = _live_added(data / "gallery.sqlite")
        missing = {i: lab for i, lab in acked.items() if live.get(i) != lab}
        assert not missing, f"{len(missing)} of {len(acked)} acknowledged adds lost"
        assert len(acked) >= 5
        print(
            f"rolling upgrade: {len(acked)} adds acknowledged by A, all in B's gallery; "
            f"{len(refused)} refused (503) after the seal; {ready['migration']['caught_up']} "
            "writes caught up"
        )
        with httpx.Client(base_url=b.url, timeout=30) as cb:
            labels = {x["label"]: x["count"] for x in cb.get("/gallery/labels").json()["labels"]}
        assert labels["seed0"] == 32 and sum(labels.get(f"w{i}", 0) for i in range(7)) == len(
            {i for i, lab in acked.items() if lab.startswith("w")}
        )
    finally:
        stop.set()
        a.kill(15)
        if b is not None:
            b.kill(15)


@pytest.mark.slow
def test_two_new_models_starting_together_carry_the_gallery_once(
    base_run, new_model, tmp_path, fmnist_train
):
    """Two processes of the new model on one data dir: the second used to delete the first's
    half-written store, and the first died. Now one carries, the other waits for it."""
    import subprocess
    import sys

    from ..helpers import free_port

    data = tmp_path / "data"
    with make_client(base_run, data) as c:
        ids = _add(c, "shared", fmnist_train, range(0, 40))
    procs, urls = [], []
    for i in range(2):
        port = free_port()
        log = open(tmp_path / f"b{i}.log", "w")  # noqa: SIM115 (closed below)
        procs.append(
            (
                subprocess.Popen(
                    [sys.executable, "-m", "service", "--model", str(new_model), "--data-dir",
                     str(data), "--port", str(port)],
                    stdout=log, stderr=subprocess.STDOUT,
                    env={**os.environ, "SNCA_FUSED_BATCHES": "0", "OMP_NUM_THREADS": "1"},
                ),
                log,
            )
        )  # fmt: skip
        urls.append(f"http://127.0.0.1:{port}")
    try:
        for i, ((p, _), url) in enumerate(zip(procs, urls, strict=True)):
            deadline = time.time() + 600
            while True:
                assert p.poll() is None, (tmp_path / f"b{i}.log").read_text()
                try:
                    if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.time() < deadline, "not ready"
                time.sleep(0.2)
        states = [httpx.get(u + "/readyz").json() for u in urls]
        assert len({s["gallery_checksum"] for s in states}) == 1
        assert len([s for s in states if "migration" in s]) == 1  # one carried, once
        assert len(list((data / "previous").iterdir())) == 1
        assert sorted(_live_added(data / "gallery.sqlite")) == ids
    finally:
        for p, log in procs:
            p.terminate()
            p.wait(timeout=30)
            log.close()
