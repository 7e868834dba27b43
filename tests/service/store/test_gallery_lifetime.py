"""Through the real CLIs and real servers: a user's gallery outlives the model. Retraining the
run dir in place and rebuilding its index keeps every label added before; killing the service
while it carries the gallery to the new model loses nothing."""

import hashlib
import os
import shutil
import signal
import sqlite3
import time
from pathlib import Path

import httpx
import pytest

from embedding.rundir import RunDir
from tests.helpers import BASE, run_cli

from ..helpers import Server, of_class, png, replaced_model


def _labels(url: str) -> dict[str, int]:
    return {x["label"]: x["count"] for x in httpx.get(url + "/gallery/labels").json()["labels"]}


def _add(url: str, label: str, raw, idxs) -> list[int]:
    files = [("images", (f"{i}.png", png(raw, i), "image/png")) for i in idxs]
    r = httpx.post(url + "/gallery/add", data={"label": label}, files=files, timeout=60)
    assert r.status_code == 201, r.text
    return r.json()["ids"]


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
def test_retraining_in_place_keeps_every_added_label(base_run, tmp_path, fmnist_train):
    run = tmp_path / "runs" / "shop"  # a run dir (and its index) made by the real CLIs
    shutil.copytree(base_run, run)
    srv = Server(run, None, cwd=tmp_path)  # the default data dir: data/shop
    try:
        tees = of_class(fmnist_train, 0, 5)  # T-shirt/top: not among the trained classes
        ids = _add(srv.url, "my-tee", fmnist_train, tees)
        before = _labels(srv.url)
        srv.log.flush()
        log = Path(srv.log.name).read_text()
        assert f"gallery data dir {tmp_path / 'data' / 'shop'}" in log
    finally:
        srv.kill(signal.SIGTERM)
    store = tmp_path / "data" / "shop" / "gallery.sqlite"
    digest = _sha(store)

    args = ("--classes", BASE, "--subset", "2000", "--val-size", "200", "--epochs", "1")
    p = run_cli(
        "training", *args, "--batch-size", "64", "--no-progress", "--out", run, "--overwrite"
    )
    assert p.returncode == 0, p.stderr
    assert not (run / "index").exists()  # the run dir was replaced whole, index included
    p = run_cli("index_builder", run, "--out", run / "index", "--no-progress")
    assert p.returncode == 0, p.stderr
    assert _sha(store) == digest  # neither command touched the gallery

    # three stores archived by earlier migrations: with SNCA_KEEP_PREVIOUS=2 this migration
    # keeps its own archive and the newest earlier one (pruning, service/store/datadir.py)
    prev = tmp_path / "data" / "shop" / "previous"
    prev.mkdir()
    for n in range(3):
        old = prev / f"gallery-2026010{n}T000000Z-old{n}.sqlite"
        shutil.copyfile(base_run / "index" / "gallery.sqlite", old)
        os.utime(old, (1_700_000_000 + n, 1_700_000_000 + n))
    new_fp = RunDir(run).load_model_card()[1]
    srv = Server(run, None, {"SNCA_KEEP_PREVIOUS": "2"}, cwd=tmp_path)
    try:
        ready = httpx.get(srv.url + "/readyz").json()
        assert ready["model_fingerprint"] == new_fp and ready["migration"]["carried"] == 5
        kept = {p.name for p in prev.iterdir()}
        archive = Path(ready["migration"]["archive"]).name
        assert kept == {archive, "gallery-20260102T000000Z-old2.sqlite"}, kept
        assert _labels(srv.url) == before  # the label with all its items, trained ones too
        files = {"image": ("q.png", png(fmnist_train, tees[1]), "image/png")}
        hits = httpx.post(
            srv.url + "/search", params={"label": "my-tee", "k": 1}, files=files
        ).json()["items"]
        assert hits[0]["id"] == ids[1] and hits[0]["similarity"] > 0.999  # re-embedded
        r = httpx.post(srv.url + "/classify", files=files).json()
        assert r["label"] == "my-tee" and r["model_fingerprint"] == new_fp
    finally:
        srv.kill(signal.SIGTERM)
    conn = sqlite3.connect(store)
    meta = dict(conn.execute("SELECT key, value FROM meta"))
    conn.close()
    assert meta["model_fingerprint"] == new_fp


@pytest.mark.slow
def test_sigkill_in_the_middle_of_a_migration_loses_nothing(base_run, tmp_path, fmnist_train):
    new = replaced_model(base_run, tmp_path / "new")
    data = tmp_path / "data"
    srv = Server(base_run, data)
    ids = {}
    try:
        for n in range(32):
            ids[f"l{n}"] = _add(srv.url, f"l{n}", fmnist_train, range(64 * n, 64 * n + 64))
        before = _labels(srv.url)
    finally:
        srv.kill(signal.SIGTERM)

    # 2,048 items, one per transaction (~4 s): killed once /readyz reports it part-way
    srv = Server(new, data, {"SNCA_MIGRATION_BATCH": "1"}, wait_for=None, poll=0.01)
    seen = None
    try:
        deadline = time.time() + 600
        while time.time() < deadline:
            body = httpx.get(srv.url + "/readyz", timeout=5).json()
            if body["status"] == "migrating" and 0 < body["migrated"] < body["total"]:
                seen = (body["migrated"], body["total"], body["detail"])
                break
            assert body["status"] != "ready", "the migration ended before it could be killed"
            time.sleep(0.02)
    finally:
        srv.kill(signal.SIGKILL)
    assert seen is not None and seen[1] == 2048 and "of 2048" in seen[2], seen
    print(f"killed with {seen[0]} of {seen[1]} items carried")

    srv = Server(new, data)  # resumes where the killed one stopped
    try:
        srv.log.flush()
        assert "resuming the migration" in Path(srv.log.name).read_text()
        ready = httpx.get(srv.url + "/readyz").json()
        assert ready["migration"]["carried"] == 2048 and ready["migration"]["uncarried"] == []
        print(f"resumed and finished in {ready['migration']['seconds']} s")
        assert _labels(srv.url) == before
        for n in (0, 7, 31):
            files = {"image": ("q.png", png(fmnist_train, 64 * n + 5), "image/png")}
            hit = httpx.post(
                srv.url + "/search", params={"label": f"l{n}", "k": 1}, files=files
            ).json()["items"][0]
            assert hit["id"] == ids[f"l{n}"][5] and hit["similarity"] > 0.999
    finally:
        srv.kill(signal.SIGTERM)
    conn = sqlite3.connect(data / "gallery.sqlite")
    got = [r[0] for r in conn.execute("SELECT id FROM items WHERE source = 'added' ORDER BY id")]
    assert got == sorted(i for v in ids.values() for i in v)  # every item, once, same id
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    conn.close()
    assert len(list((data / "previous").iterdir())) == 1  # the old store, archived once
