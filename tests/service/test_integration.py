"""A real snca-serve (uvicorn) process: classify, add, search, delete, restart (kill -9 under
concurrent writes: the history checker, tests/service/test_history.py)."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from .helpers import Server, of_class, png


def test_cli_refuses_bad_config_clearly(tmp_path):
    exe = Path(sys.executable).parent / "snca-serve"
    assert exe.is_file()
    p = subprocess.run(
        [str(exe), "--model", str(tmp_path / "nope"), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and "snca-serve: error:" in p.stderr and "Traceback" not in p.stderr
    p = subprocess.run([str(exe), "--vote", "majority"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "invalid choice" in p.stderr


@pytest.mark.slow
def test_real_server_end_to_end_and_restart(base_run, tmp_path, fmnist_test, fmnist_train):
    data_dir = tmp_path / "serve"
    srv = Server(base_run, data_dir)
    try:
        c = httpx.Client(base_url=srv.url, timeout=30)
        # classify Fashion-MNIST test images of the base classes
        ok = 0
        for cls, name in ((1, "Trouser"), (8, "Bag"), (9, "Ankle boot")):
            for i in of_class(fmnist_test, cls, 5):
                ok += (
                    c.post(
                        "/classify", files={"image": ("q.png", png(fmnist_test, i), "image/png")}
                    ).json()["nearest_label"]
                    == name
                )
        assert ok >= 12
        # a new label from five images, predicted by the next requests
        shots = of_class(fmnist_train, 0, 5)
        r = c.post(
            "/gallery/add",
            data={"label": "T-shirt/top"},
            files=[("images", (f"{i}.png", png(fmnist_train, i), "image/png")) for i in shots],
        )
        assert r.status_code == 201, r.text
        added = r.json()["ids"]
        hits = sum(
            c.post(
                "/classify", files={"image": ("q.png", png(fmnist_test, i), "image/png")}
            ).json()["nearest_label"]
            == "T-shirt/top"
            for i in of_class(fmnist_test, 0, 10)
        )
        assert hits >= 5
        r = c.post(
            "/search",
            params={"k": 5, "label": "T-shirt/top"},
            files={
                "image": ("q.png", png(fmnist_test, of_class(fmnist_test, 0, 1)[0]), "image/png")
            },
        )
        assert {it["id"] for it in r.json()["items"]} == set(added)
        assert c.delete(f"/gallery/items/{added[0]}").status_code == 200
        trouser_ids = c.post(
            "/search",
            params={"k": 2, "label": "Trouser"},
            files={
                "image": ("q.png", png(fmnist_test, of_class(fmnist_test, 1, 1)[0]), "image/png")
            },
        ).json()["items"]
        assert (
            c.delete(f"/gallery/items/{trouser_ids[0]['id']}").status_code == 200
        )  # a trained item
        before = c.get("/gallery/labels").json()
    finally:
        srv.kill(signal.SIGTERM)
    # restart: every acknowledged write is still there, deletes stay deleted
    srv = Server(base_run, data_dir)
    try:
        c = httpx.Client(base_url=srv.url, timeout=30)
        assert c.get("/gallery/labels").json() == before
        r = c.post(
            "/search",
            params={"k": 10, "label": "T-shirt/top"},
            files={
                "image": ("q.png", png(fmnist_test, of_class(fmnist_test, 0, 1)[0]), "image/png")
            },
        )
        assert {it["id"] for it in r.json()["items"]} == set(added[1:])
        r = c.post(
            "/search",
            params={"k": 50, "label": "Trouser"},
            files={
                "image": ("q.png", png(fmnist_test, of_class(fmnist_test, 1, 1)[0]), "image/png")
            },
        )
        assert trouser_ids[0]["id"] not in {it["id"] for it in r.json()["items"]}
        # a snapshot, then one more write: the next start loads the snapshot and replays one write
        assert c.post("/admin/snapshot").status_code == 200
        r = c.post(
            "/gallery/add",
            data={"label": "late"},
            files={"images": ("a.png", png(fmnist_train, 0), "image/png")},
        )
        assert r.status_code == 201
        late = r.json()["ids"][0]
    finally:
        srv.kill(signal.SIGTERM)
    srv = Server(base_run, data_dir)
    try:
        log = srv.read_log()
        ready = json.loads(next(ln for ln in log.splitlines() if '"msg": "ready"' in ln))
        assert ready["snapshot_seq"] > 0 and ready["replayed_adds"] == 1
        c = httpx.Client(base_url=srv.url, timeout=30)
        r = c.post(
            "/search",
            params={"k": 1, "label": "late"},
            files={"image": ("q.png", png(fmnist_train, 0), "image/png")},
        )
        assert r.json()["items"][0]["id"] == late
    finally:
        srv.kill(signal.SIGTERM)
