"""python -m service.tools.label_copy: added labels move from an old store to a running service."""

import json

import httpx

from tests.helpers import run_cli

from ..helpers import Server, make_client, of_class, png


def test_migrate_added_labels_to_a_running_service(base_run, tmp_path, fmnist_test):
    old = tmp_path / "old"
    tees = of_class(fmnist_test, 0, 3)
    with make_client(base_run, old) as c:
        files = [("images", (f"{i}.png", png(fmnist_test, i), "image/png")) for i in tees]
        md = json.dumps([{"n": 0}, {"n": 1}, {"n": 2}])
        assert (
            c.post("/gallery/add", data={"label": "tee", "metadata": md}, files=files).status_code
            == 201
        )
        files = [("images", ("b.png", png(fmnist_test, 5), "image/png"))]
        c.post("/gallery/add", data={"label": "other"}, files=files)
    with make_client(base_run, old, store_images=False) as c:  # an item without its image
        files = [("images", ("c.png", png(fmnist_test, 6), "image/png"))]
        c.post("/gallery/add", data={"label": "noimage"}, files=files)
    store = old / "gallery.sqlite"
    before = store.read_bytes()
    target = Server(base_run, tmp_path / "new", {"SNCA_API_KEY": "k"})
    try:
        p = run_cli("service.tools.label_copy", store, target.url, "--api-key", "wrong")
        assert p.returncode == 1 and "401" in p.stderr
        p = run_cli(
            "service.tools.label_copy",
            store,
            target.url,
            "--labels",
            "tee,noimage",
            "--chunk",
            "2",
            "--api-key",
            "k",
        )
        assert p.returncode == 0, p.stderr
        assert "3 images migrated" in p.stdout and "no stored image" in p.stderr
        labels = {
            x["label"]: x["count"]
            for x in httpx.get(target.url + "/gallery/labels").json()["labels"]
        }
        assert labels["tee"] == 3 and "other" not in labels and "noimage" not in labels
        hits = httpx.post(
            target.url + "/search",
            files={"image": ("q.png", png(fmnist_test, tees[1]))},
            params={"label": "tee", "k": 3},
        ).json()["items"]
        assert hits[0]["similarity"] > 0.999 and hits[0]["metadata"]["n"] == 1
        assert "migrated_from" in hits[0]["metadata"]
        p = run_cli(
            "service.tools.label_copy", store, target.url, "--api-key", "k"
        )  # again: tee is there
        assert p.returncode == 0 and "'tee': the target has it already" in p.stdout
        labels = {
            x["label"]: x["count"]
            for x in httpx.get(target.url + "/gallery/labels").json()["labels"]
        }
        assert labels["tee"] == 3 and labels["other"] == 1
    finally:
        target.kill(15)
    assert store.read_bytes() == before  # the old store is only read
    assert run_cli("service.tools.label_copy", tmp_path / "nope.sqlite", target.url).returncode == 2
