"""Thumbnails (index builder --thumbnails, SNCA_THUMBNAILS for added images, GET
/gallery/items/{id}/thumbnail, URLs in neighbours and search results), the store's schema
upgrade that adds them, and the web page's static files."""

import io
import json
import sqlite3

import numpy as np
import pytest
from PIL import Image

from embedding.gallery import STORE_SCHEMA_VERSION
from embedding.index import STORE_FILE
from tests.helpers import run_cli

from ..helpers import img, make_client, of_class, png


@pytest.fixture(scope="module")
def thumb_index(base_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("thumbs") / "index"
    p = run_cli("index_builder", base_run, "--out", out, "--thumbnails", "--no-progress")
    assert p.returncode == 0, p.stderr
    return out


def _decode(data: bytes) -> Image.Image:
    im = Image.open(io.BytesIO(data))
    im.load()
    return im


def test_dataset_and_added_thumbnails(base_run, thumb_index, tmp_path, fmnist_test, fmnist_train):
    with make_client(base_run, tmp_path / "serve", index=thumb_index, thumbnails=True) as c:
        r = c.post("/classify", files=img(fmnist_test, 0), params={"neighbors": "true", "k": 5})
        nb = r.json()["neighbors"]
        assert len(nb) == 5 and all(n["thumbnail_url"] for n in nb)
        t = c.get(nb[0]["thumbnail_url"])
        assert t.status_code == 200 and t.headers["content-type"] == "image/png"
        assert t.headers["cache-control"] == "private, no-cache" and t.headers["etag"]
        # a 28x28 item is kept at its own size, pixel for pixel (never enlarged)
        item = c.post("/search", files=img(fmnist_test, 0), params={"k": 1}).json()["items"][0]
        assert item["thumbnail_url"] == f"/gallery/items/{item['id']}/thumbnail"
        shown = np.asarray(_decode(c.get(item["thumbnail_url"]).content))
        source = fmnist_train.source.get(item["metadata"]["dataset_index"])[0].numpy()
        assert np.array_equal(shown, source)
        # added: a grey PNG and a large colour JPEG
        big = io.BytesIO()
        Image.fromarray(np.random.default_rng(0).integers(0, 255, (300, 500, 3), np.uint8)).save(
            big, "JPEG"
        )
        files = [
            ("images", ("a.png", png(fmnist_train, of_class(fmnist_train, 0, 1)[0]), "image/png")),
            ("images", ("b.jpg", big.getvalue(), "image/jpeg")),
        ]
        ids = c.post("/gallery/add", data={"label": "mine"}, files=files).json()["ids"]
        grey, colour = (_decode(c.get(f"/gallery/items/{i}/thumbnail").content) for i in ids)
        assert grey.size == (28, 28) and grey.mode == "L"
        assert (
            colour.format == "JPEG" and max(colour.size) == 96 and colour.size[0] > colour.size[1]
        )
        hits = c.post(
            "/search",
            files={"image": ("b.jpg", big.getvalue(), "image/jpeg")},
            params={"label": "mine"},
        ).json()["items"]
        assert {h["id"] for h in hits} == set(ids) and all(h["thumbnail_url"] for h in hits)
        assert c.delete(f"/gallery/items/{ids[0]}").status_code == 200
        assert c.get(f"/gallery/items/{ids[0]}/thumbnail").status_code == 404  # deleted
        assert c.get("/gallery/items/99999999/thumbnail").status_code == 404
        assert c.get("/gallery/items/abc/thumbnail").status_code == 422


def test_no_thumbnails_unless_asked(base_run, tmp_path, fmnist_test):
    with make_client(base_run, tmp_path / "serve") as c:  # index built without --thumbnails
        ids = c.post(
            "/gallery/add",
            data={"label": "x"},
            files={"images": ("a.png", png(fmnist_test, 1), "image/png")},
        ).json()["ids"]
        r = c.post("/classify", files=img(fmnist_test, 1), params={"neighbors": "true", "k": 3})
        assert all(n["thumbnail_url"] is None for n in r.json()["neighbors"])
        assert c.get(f"/gallery/items/{ids[0]}/thumbnail").status_code == 404
        assert c.get("/gallery/items/0/thumbnail").status_code == 404


def test_version_1_store_is_upgraded_in_place(base_run, tmp_path, fmnist_test):
    serve = tmp_path / "serve"
    with make_client(base_run, serve) as c:
        c.post(
            "/gallery/add",
            data={"label": "old"},
            files={"images": ("a.png", png(fmnist_test, 2), "image/png")},
        )
    # turn the service's store back into what the previous release wrote (schema 1)
    conn = sqlite3.connect(serve / "gallery.sqlite")
    conn.execute("ALTER TABLE items DROP COLUMN thumbnail")
    conn.execute("DROP TABLE log")
    conn.execute("DELETE FROM meta WHERE key = 'log_floor'")
    conn.execute("UPDATE meta SET value = '1' WHERE key = 'schema_version'")
    conn.commit()
    conn.close()
    with make_client(base_run, serve, thumbnails=True) as c:
        labels = {x["label"]: x["count"] for x in c.get("/gallery/labels").json()["labels"]}
        assert labels["old"] == 1  # nothing lost
        ids = c.post(
            "/gallery/add",
            data={"label": "new"},
            files={"images": ("a.png", png(fmnist_test, 3), "image/png")},
        ).json()["ids"]
        assert c.get(f"/gallery/items/{ids[0]}/thumbnail").status_code == 200
    conn = sqlite3.connect(serve / "gallery.sqlite")
    version = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0]
    # the change log came with schema 3: empty, its floor the writes made before it
    assert conn.execute("SELECT value FROM meta WHERE key = 'log_floor'").fetchone()[0] == "1"
    assert conn.execute("SELECT COUNT(*) FROM log").fetchone()[0] == 1  # the add after
    assert (
        version == str(STORE_SCHEMA_VERSION)
        and conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    )
    conn.close()
    assert (base_run / "index" / STORE_FILE).is_file()  # the built index dir is never modified


def test_thumbnail_needs_the_key_when_reads_are_protected(base_run, thumb_index, tmp_path):
    with make_client(
        base_run, tmp_path / "serve", index=thumb_index, api_key="k", protect_reads=True
    ) as c:
        assert c.get("/gallery/items/0/thumbnail").status_code == 401
        assert c.get("/gallery/items/0/thumbnail", headers={"X-API-Key": "k"}).status_code == 200


def test_page_and_static_files(base_run, tmp_path):
    with make_client(base_run, tmp_path / "serve") as client:
        _check_page(client)


def _check_page(client):
    r = client.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert '<script src="/static/app.js"' in r.text and 'name="viewport"' in r.text
    for f, kind in (("app.js", "javascript"), ("style.css", "text/css")):
        s = client.get(f"/static/{f}")
        assert s.status_code == 200 and kind in s.headers["content-type"], f
    assert client.get("/static/../config.py").status_code == 404
    assert "/" not in json.loads(client.get("/openapi.json").text)["paths"]
