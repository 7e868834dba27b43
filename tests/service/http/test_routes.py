"""Routes on a tiny real model and index, through FastAPI's TestClient (lifespan run)."""

import json
import struct
import zlib

import numpy as np
import pytest

from service.config import Settings
from service.http.schemas import BatchResult, ClassifyResult

from ..helpers import img, make_client, model_seconds, of_class, png


@pytest.fixture()
def client(base_run, tmp_path):
    with make_client(base_run, tmp_path / "serve") as c:
        yield c


def test_start_up_warms_the_vote_caches(base_run, tmp_path):
    """The first request does not build the gallery's kde caches or compile the vote (looked
    at in the process that votes: the model on a thread here; a model process runs the same
    ServiceHost start-up, service/model_process.py)."""
    from service.gallery.compiled import scripted_kde_top

    with make_client(base_run, tmp_path / "serve") as client:
        g = client.app.state.snca.state.gallery
        snap = g._snapshot  # the unfiltered view, built at start-up and still current
        assert snap is not None
        assert (snap.epoch, snap.num_labels) == (g.rows.epoch, len(g.labels))
        assert scripted_kde_top.cache_info().currsize == 1


def test_classify_base_images(client, fmnist_test):
    names = {1: "Trouser", 5: "Sandal", 7: "Sneaker", 8: "Bag", 9: "Ankle boot"}
    ok = total = 0
    for cls, name in names.items():
        for i in of_class(fmnist_test, cls, 6):
            r = client.post("/classify", files=img(fmnist_test, i))
            assert r.status_code == 200, r.text
            body = r.json()
            ClassifyResult.model_validate(
                body
            )  # the route returns a plain dict: check the contract
            assert "neighbors" not in body  # omitted unless asked (as response_model_exclude_none)
            assert set(body) >= {
                "label",
                "confidence",
                "probabilities",
                "unknown",
                "gallery_version",
                "model_fingerprint",
                "best_similarity",
                "vote",
                "k",
            }
            assert body["vote"] == "kde_shrunk" and body["k"] == 30
            assert 0 < len(body["probabilities"]) <= 5
            assert abs(sum(p["probability"] for p in body["probabilities"]) - 1) < 0.05
            assert float(r.headers["x-process-time-ms"]) > 0 and r.headers["x-request-id"]
            ok += body["nearest_label"] == name
            total += 1
    assert ok / total >= 0.8, f"{ok}/{total}"


def test_votes_neighbors_and_batch(client, fmnist_test):
    i = of_class(fmnist_test, 8, 1)[0]
    for vote in ("knn", "prototype", "kde"):
        r = client.post(
            "/classify", files=img(fmnist_test, i), params={"vote": vote, "k": 7, "neighbors": True}
        )
        body = r.json()
        ClassifyResult.model_validate(body)
        assert r.status_code == 200 and body["vote"] == vote and body["k"] == 7
        assert len(body["neighbors"]) == 7
        sims = [n["similarity"] for n in body["neighbors"]]
        assert sims == sorted(sims, reverse=True) and abs(sims[0] - body["best_similarity"]) < 1e-4
    ids = [*of_class(fmnist_test, 1, 2), *of_class(fmnist_test, 9, 2)]
    r = client.post(
        "/classify/batch",
        files=[("images", (f"{i}.png", png(fmnist_test, i), "image/png")) for i in ids],
    )
    BatchResult.model_validate(r.json())
    labels = [x["nearest_label"] for x in r.json()["results"]]
    assert r.status_code == 200 and len(labels) == 4
    single = [
        client.post("/classify", files=img(fmnist_test, i)).json()["nearest_label"] for i in ids
    ]
    assert labels == single  # one result per image, in order


def test_add_new_label_then_classify_search_delete(client, fmnist_test, fmnist_train):
    shots = of_class(fmnist_train, 0, 5)
    files = [("images", (f"{i}.png", png(fmnist_train, i), "image/png")) for i in shots]
    md = json.dumps([{"shot": int(i)} for i in shots])
    r = client.post("/gallery/add", data={"label": "T-shirt/top", "metadata": md}, files=files)
    assert r.status_code == 201, r.text
    add = r.json()
    assert add["label"] == "T-shirt/top" and add["count"] == 5 and len(add["ids"]) == 5
    v1 = add["gallery_version"]
    # classifiable by the very next request
    queries = of_class(fmnist_test, 0, 20)
    hits = sum(
        client.post("/classify", files=img(fmnist_test, i)).json()["nearest_label"] == "T-shirt/top"
        for i in queries
    )
    assert hits >= 10, hits
    knn_hits = sum(
        client.post("/classify", files=img(fmnist_test, i), params={"vote": "knn"}).json()[
            "nearest_label"
        ]
        == "T-shirt/top"
        for i in queries
    )
    assert knn_hits < hits  # the paper's vote is what drowns five exemplars
    # labels filter restricts the candidates
    r = client.post(
        "/classify",
        files=img(fmnist_test, of_class(fmnist_test, 8, 1)[0]),
        params={"labels": ["T-shirt/top", "Trouser"]},
    )
    # (a bag among those two is unknown: the vote's choice is its nearest label)
    assert r.json()["nearest_label"] in ("T-shirt/top", "Trouser")
    assert (
        client.post("/classify", files=img(fmnist_test, 0), params={"labels": ["Nope"]}).status_code
        == 404
    )
    # search with a label filter returns the added items with their metadata
    r = client.post(
        "/search", files=img(fmnist_test, queries[0]), params={"k": 3, "label": "T-shirt/top"}
    )
    items = r.json()["items"]
    assert r.status_code == 200 and len(items) == 3
    assert all(
        it["label"] == "T-shirt/top" and it["source"] == "added" and "shot" in it["metadata"]
        for it in items
    )
    # extending a label
    r = client.post("/gallery/add", data={"label": "T-shirt/top"}, files=files[:2])
    assert r.json()["count"] == 7 and r.json()["gallery_version"] == v1 + 1
    labels = {x["label"]: x for x in client.get("/gallery/labels").json()["labels"]}
    assert labels["T-shirt/top"] == {"label": "T-shirt/top", "count": 7, "source": "added"}
    assert labels["Trouser"]["source"] == "trained"
    # delete one item, then the label (label names may contain '/')
    gone = add["ids"][0]
    r = client.delete(f"/gallery/items/{gone}")
    assert r.status_code == 200 and r.json()["deleted"] == [gone]
    assert client.delete(f"/gallery/items/{gone}").status_code == 404
    r = client.post(
        "/search", files=img(fmnist_test, queries[0]), params={"k": 50, "label": "T-shirt/top"}
    )
    assert gone not in [it["id"] for it in r.json()["items"]] and len(r.json()["items"]) == 6
    r = client.delete("/gallery/labels/T-shirt%2Ftop")
    assert r.status_code == 200 and len(r.json()["deleted"]) == 6
    assert "T-shirt/top" not in {x["label"] for x in client.get("/gallery/labels").json()["labels"]}
    assert client.delete("/gallery/labels/T-shirt%2Ftop").status_code == 404


def test_delete_trained_items_and_hnsw_tombstones(base_run, tmp_path, fmnist_test):
    """Flat removes ids from FAISS; HNSW cannot and filters them at search time."""
    from tests.helpers import run_cli

    p = run_cli(
        "index_builder",
        base_run,
        "--out",
        tmp_path / "hnsw",
        "--factory",
        "HNSW16",
        "--no-progress",
    )
    assert p.returncode == 0, p.stderr
    with make_client(base_run, tmp_path / "serve", index=tmp_path / "hnsw") as c:
        q = img(fmnist_test, of_class(fmnist_test, 1, 1)[0])
        first = c.post("/search", files=q, params={"k": 5}).json()["items"]
        for it in first[:3]:
            assert c.delete(f"/gallery/items/{it['id']}").status_code == 200
        after = [it["id"] for it in c.post("/search", files=q, params={"k": 5}).json()["items"]]
        assert not set(after) & {it["id"] for it in first[:3]}
        assert after[:2] == [it["id"] for it in first[3:5]]


def test_api_key_on_every_mutating_route(base_run, tmp_path, fmnist_test):
    with make_client(base_run, tmp_path / "serve", api_key="s3cret") as c:
        f = {"images": ("a.png", png(fmnist_test, 0), "image/png")}
        routes = [
            ("post", "/gallery/add", {"data": {"label": "x"}, "files": f}),
            ("delete", "/gallery/labels/Trouser", {}),
            ("delete", "/gallery/items/1", {}),
            ("post", "/admin/snapshot", {}),
        ]
        for method, path, kw in routes:
            assert getattr(c, method)(path, **kw).status_code == 401, path
            assert (
                getattr(c, method)(path, headers={"X-API-Key": "wrong"}, **kw).status_code == 401
            ), path
        assert (
            c.post(
                "/gallery/add", data={"label": "x"}, files=f, headers={"X-API-Key": "s3cret"}
            ).status_code
            == 201
        )
        assert c.post("/admin/snapshot", headers={"X-API-Key": "s3cret"}).status_code == 200
        assert c.post("/classify", files=img(fmnist_test, 0)).status_code == 200  # reads stay open
        assert c.get("/gallery/labels").status_code == 200
    with make_client(base_run, tmp_path / "serve2", api_key="s3cret", protect_reads=True) as c:
        assert c.post("/classify", files=img(fmnist_test, 0)).status_code == 401
        assert c.get("/gallery/labels").status_code == 401
        assert c.get("/gallery/labels", headers={"X-API-Key": "s3cret"}).status_code == 200
        assert c.get("/healthz").status_code == 200


def _png_header(w, h):
    def chunk(kind, data):
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0))
        + chunk(b"IEND", b"")
    )


def test_bad_input_table(client, fmnist_test):
    good = png(fmnist_test, 0)

    def image(data, field="image", name="a.png", ctype="image/png"):  # one file in the form
        return {"files": {field: (name, data, ctype)}}

    query = image(good)  # a good image to classify
    gif, jpeg = png(fmnist_test, 0, "GIF"), png(fmnist_test, 0, "JPEG")

    def add(**data):  # a good image added with these form fields
        return {"data": data, "files": {"images": ("a.png", good, "image/png")}}

    cases = [
        ("no image field", "post", "/classify", {}, 422),
        ("wrong field name", "post", "/classify", image(good, "file"), 422),
        ("0-byte file", "post", "/classify", image(b""), 400),
        ("truncated PNG", "post", "/classify", image(good[: len(good) // 2]), 400),
        ("text named .png", "post", "/classify", image(b"hello, world\n" * 20), 415),
        ("20000x20000 PNG", "post", "/classify", image(_png_header(20000, 20000)), 413),
        ("k = 0", "post", "/classify?k=0", query, 422),
        ("k = 10^6", "post", "/classify?k=1000000", query, 422),
        ("unknown vote", "post", "/classify?vote=majority", query, 422),
        ("huge label", "post", "/gallery/add", add(label="x" * 10000), 422),
        ("empty label", "post", "/gallery/add", add(label="   "), 422),
        ("control chars in label", "post", "/gallery/add", add(label="a\x00b"), 422),
        ("bad JSON metadata", "post", "/gallery/add", add(label="x", metadata="{nope"), 422),
        (
            "metadata list of wrong length",
            "post",
            "/gallery/add",
            add(label="x", metadata="[{}, {}]"),
            422,
        ),
        ("add without images", "post", "/gallery/add", {"data": {"label": "x"}}, 422),
        (
            "65 images",
            "post",
            "/gallery/add",
            {"data": {"label": "x"}, "files": [("images", ("a.png", good, "image/png"))] * 65},
            413,
        ),
        ("unknown label delete", "delete", "/gallery/labels/NoSuchLabel", {}, 404),
        ("unknown item delete", "delete", "/gallery/items/987654321", {}, 404),
        ("non-integer item id", "delete", "/gallery/items/abc", {}, 422),
        ("search k = 0", "post", "/search?k=0", query, 422),
        ("GIF is fine", "post", "/classify", image(gif, name="a.gif", ctype="image/gif"), 200),
        ("JPEG is fine", "post", "/classify", image(jpeg, name="a.jpg", ctype="image/jpeg"), 200),
    ]
    before = client.get("/gallery/labels").json()
    for name, method, path, kw, expect in cases:
        r = getattr(client, method)(path, **kw)
        assert r.status_code == expect, f"{name}: {r.status_code} {r.text}"
        assert "Traceback" not in r.text, name
        if expect >= 400:
            assert r.json()["detail"], name
        assert client.get("/healthz").status_code == 200
    assert client.get("/gallery/labels").json() == before  # nothing stored by any of them


def test_upload_limit(base_run, tmp_path, fmnist_test):
    with make_client(base_run, tmp_path / "serve", max_upload_bytes=2048) as c:
        big = np.random.default_rng(0).integers(0, 255, (64, 64), dtype=np.uint8)
        import io

        from PIL import Image

        b = io.BytesIO()
        Image.fromarray(big).save(b, "PNG")
        r = c.post("/classify", files={"image": ("a.png", b.getvalue(), "image/png")})
        assert r.status_code == 413 and "limit" in r.json()["detail"]
        assert c.post("/classify", files=img(fmnist_test, 0)).status_code == 200


def test_store_unavailable_answers_503_and_changes_nothing(client, fmnist_test, monkeypatch):
    from service.store import StoreUnavailable

    state = client.app.state.snca.state

    def full(*a, **k):
        raise StoreUnavailable("the gallery store cannot be written: database or disk is full")

    monkeypatch.setattr(state.store, "transaction", full)
    before = client.get("/gallery/labels").json()
    r = client.post(
        "/gallery/add",
        data={"label": "x"},
        files={"images": ("a.png", png(fmnist_test, 0), "image/png")},
    )
    assert r.status_code == 503 and "disk is full" in r.json()["detail"]
    assert client.get("/readyz").status_code == 503
    assert client.get("/gallery/labels").json() == before
    assert client.post("/classify", files=img(fmnist_test, 0)).status_code == 200  # reads go on


def test_a_write_committed_before_the_store_failed_says_it_was_committed(
    client, fmnist_test, monkeypatch
):
    """The history checker's finding (issue 39): on PostgreSQL stopped just after a write
    committed, the writer's catch-up of the log (another process had written meanwhile)
    failed and the write was answered 503 "nothing was changed" although it was made; a
    client that believed it lost an add, or kept an item it had deleted. Now: 503
    write_not_applied, committed: true, and the follower applies it once the store is back."""
    from service.store import StoreUnavailable

    state = client.app.state.snca.state
    files = {"images": ("a.png", png(fmnist_test, 0), "image/png")}
    r = client.post("/gallery/add", data={"label": "x"}, files=files)
    assert r.status_code == 201

    def down(*a, **k):
        raise StoreUnavailable("the gallery store failed: server closed the connection")

    state.gallery.version -= 1  # as if another process wrote: this one catches up after its write
    monkeypatch.setattr(state.store, "changes_after", down)
    r = client.post("/gallery/add", data={"label": "y"}, files=files)
    body = r.json()
    assert r.status_code == 503 and body["code"] == "write_not_applied", r.text
    assert body["committed"] is True and body["gallery_version"] > 0
    assert [row.label for row in state.store.item_rows(-1, 10, "y")] == ["y"]  # it was made
    monkeypatch.undo()
    state.catch_up()
    assert state.gallery.count_of("y") == 1


def test_metrics_and_openapi(client, fmnist_test):
    client.post("/classify", files=img(fmnist_test, 0))
    text = client.get("/metrics").text
    for name in (
        "snca_requests_total",
        "snca_request_seconds",
        "snca_batch_size",
        "snca_queue_wait_seconds",
        "snca_gallery_items",
        "snca_unknown_total",
    ):
        assert name in text, name
    # the model thread's forward and votes, timed by phase (the model process adds its decode)
    spent = model_seconds(text)
    assert spent.get("forward", 0) > 0 and spent.get("vote", 0) > 0, spent
    spec = client.get("/openapi.json").json()
    for path in (
        "/classify",
        "/classify/batch",
        "/gallery/add",
        "/search",
        "/gallery/labels",
        "/gallery/labels/{label}",
        "/gallery/items/{item_id}",
        "/healthz",
        "/readyz",
        "/metrics",
    ):
        assert path in spec["paths"], path
    assert client.get("/docs").status_code == 200


def test_api_key_from_a_file_and_empty_key_means_none(base_run, tmp_path, fmnist_test):
    from pydantic import ValidationError

    key = tmp_path / "key"
    key.write_text("from-a-secret\n")
    s = Settings(model=base_run, api_key_file=key)
    assert s.api_key.get_secret_value() == "from-a-secret"
    assert Settings(model=base_run, api_key="").api_key is None  # SNCA_API_KEY= (unset in compose)
    assert (
        Settings(model=base_run, api_key="given", api_key_file=key).api_key.get_secret_value()
        == "given"
    )
    for bad, msg in ((tmp_path / "missing", "cannot read"), (tmp_path / "empty", "is empty")):
        if "empty" in str(bad):
            bad.write_text("  \n")
        with pytest.raises(ValidationError, match=msg):
            Settings(model=base_run, api_key_file=bad)
    with make_client(base_run, tmp_path / "serve", api_key_file=key) as c:
        f = {"images": ("a.png", png(fmnist_test, 0), "image/png")}
        assert c.post("/gallery/add", data={"label": "x"}, files=f).status_code == 401
        h = {"X-API-Key": "from-a-secret"}
        assert c.post("/gallery/add", data={"label": "x"}, files=f, headers=h).status_code == 201


def test_a_retried_write_with_its_idempotency_key_is_answered_once(base_run, tmp_path, fmnist_test):
    """Writes take an Idempotency-Key (issue 39): a retry with the same key and request is
    answered with the first outcome and writes nothing again, also after a restart (the record
    is in the store, so every replica has it); the same key for another request is 422."""
    files = [("images", ("a.png", png(fmnist_test, 1), "image/png"))]
    k = {"Idempotency-Key": "9b1deb4d-3b7d-4bad-9bdd-2b0d7b3dcb6d"}
    with make_client(base_run, tmp_path / "serve") as c:
        first = c.post("/gallery/add", data={"label": "once"}, files=files, headers=k)
        assert first.status_code == 201 and "Idempotent-Replayed" not in first.headers
        again = c.post("/gallery/add", data={"label": "once"}, files=files, headers=k)
        assert again.status_code == 201 and again.headers["Idempotent-Replayed"] == "true"
        assert again.json()["ids"] == first.json()["ids"] and again.json()["count"] == 1
        other = c.post("/gallery/add", data={"label": "other"}, files=files, headers=k)
        assert other.status_code == 422 and other.json()["code"] == "idempotency_key_reused"
        bad = c.post(
            "/gallery/add", data={"label": "x"}, files=files, headers={k_: "a b" for k_ in k}
        )
        assert bad.status_code == 422 and bad.json()["code"] == "header_invalid"
        d = {"Idempotency-Key": "delete-once-1"}
        item = first.json()["ids"][0]
        gone = c.delete(f"/gallery/items/{item}", headers=d)
        assert gone.status_code == 200, gone.text
        assert c.delete(f"/gallery/items/{item}").status_code == 404  # (without the key)
        doc = c.get("/openapi.json").json()
        params = doc["paths"]["/gallery/add"]["post"]["parameters"]
        assert "Idempotency-Key" in {p["name"] for p in params}
    with make_client(base_run, tmp_path / "serve") as c:  # restarted: the records are kept
        r = c.delete(f"/gallery/items/{item}", headers=d)
        assert r.status_code == 200 and r.json() == gone.json(), r.text
        r = c.post("/gallery/add", data={"label": "once"}, files=files, headers=k)
        assert r.status_code == 201 and r.json()["ids"] == first.json()["ids"]
        assert "once" not in {x["label"] for x in c.get("/gallery/labels").json()["labels"]}


def test_an_image_sent_as_the_body_is_answered_as_the_same_image_in_a_form(client, fmnist_test):
    """`Content-Type: image/*` with the image as the whole body (no multipart form) on /classify
    and /search: the same answers, and the same problem for each kind of bad input."""
    good = png(fmnist_test, 3)
    jpeg = png(fmnist_test, 4, "JPEG")
    for data, ctype in ((good, "image/png"), (jpeg, "image/jpeg"), (good, "image/jpeg")):
        for path in ("/classify?neighbors=true", "/search?k=5"):
            form = client.post(path, files={"image": ("q", data, ctype)})
            raw = client.post(path, content=data, headers={"Content-Type": ctype})
            assert form.status_code == raw.status_code == 200, raw.text
            a, b = form.json(), raw.json()
            assert a == b, (path, ctype)
    bad = {
        "0 bytes": b"",
        "truncated PNG": good[: len(good) // 2],
        "text": b"hello, world\n" * 20,
        "20000x20000 PNG": _png_header(20000, 20000),
    }
    for name, data in bad.items():
        for path in ("/classify", "/search"):
            form = client.post(path, files={"image": ("q.png", data, "image/png")})
            raw = client.post(path, content=data, headers={"Content-Type": "image/png"})
            assert raw.status_code in (400, 413, 415), (name, path, raw.text)
            assert raw.headers["content-type"] == "application/problem+json"
            assert (raw.status_code, raw.json()["code"]) == (form.status_code, form.json()["code"])
            assert raw.json()["detail"] == form.json()["detail"], name
    # another body type is still a missing form field; the batch route takes a form only
    r = client.post("/classify", content=good, headers={"Content-Type": "application/octet-stream"})
    assert r.status_code == 422 and "image" in r.text
    r = client.post("/classify/batch", content=good, headers={"Content-Type": "image/png"})
    assert r.status_code == 422 and "images" in r.text
    # documented: both routes take the form or image/*; the batch the form only
    paths = client.get("/openapi.json").json()["paths"]
    for path in ("/classify", "/search"):
        assert set(paths[path]["post"]["requestBody"]["content"]) == {
            "multipart/form-data",
            "image/*",
        }
    assert set(paths["/classify/batch"]["post"]["requestBody"]["content"]) == {
        "multipart/form-data"
    }


def test_the_body_limit_and_read_keys_hold_for_an_image_body(base_run, tmp_path, fmnist_test):
    good = png(fmnist_test, 0)
    with make_client(base_run, tmp_path / "s", api_key="k", protect_reads=True) as c:
        raw = {"Content-Type": "image/png"}
        assert c.post("/classify", content=good, headers=raw).status_code == 401
        r = c.post("/classify", content=good, headers={**raw, "X-API-Key": "k"})
        assert r.status_code == 200, r.text
        big = good + b"\0" * (c.app.state.snca.settings.max_upload_bytes + 1)
        r = c.post("/search", content=big, headers={**raw, "X-API-Key": "k"})
        assert r.status_code == 413 and r.json()["code"] == "request_too_large", r.text
