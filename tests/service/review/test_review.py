"""The review queue over HTTP (issue 43), on a tiny real model and real Fashion-MNIST images
through FastAPI's TestClient: two classes the gallery lost arrive as queries; what the service
could not name is queued (vector, thumbnail, never the upload unless asked), bounded; GET
/review groups it by similarity (groups pure on real images); naming a group is one add (the
queries become items, leave the queue, survive a restart); dismissing drops them. (Both
backends, bounds and retention: tests/service/store/test_store_contract.py; kill -9 and a
replica: the history checker, tests/service/test_history.py.)"""

from collections import Counter

from ..helpers import img, make_client, of_class, png

NOVEL = {5: "Sandal", 8: "Bag"}


def queue_of(c):
    review = c.app.state.review
    review.flush()
    return review


def test_queries_the_service_could_not_name_are_grouped_and_named(base_run, tmp_path, fmnist_test):
    data = tmp_path / "serve"
    with make_client(base_run, data, review_queue=True) as c:
        for name in NOVEL.values():  # the gallery forgets two classes
            assert c.delete(f"/gallery/labels/{name}").status_code == 200
        truth = {}
        for cls in NOVEL:
            for i in of_class(fmnist_test, cls, 40):
                assert c.post("/classify", files=img(fmnist_test, i)).status_code == 200
                truth[i] = cls
        for i in of_class(fmnist_test, 1, 20):  # trousers: known, answered surely
            c.post("/classify", files=img(fmnist_test, i))
        # a filtered vote is no verdict on the query: not queued
        c.post("/classify", files=img(fmnist_test, i), params={"labels": ["Trouser"]})
        review = queue_of(c)
        body = c.get("/review", params={"limit": 500}).json()
        assert body["enabled"] and body["queued"] == review.queued >= 60
        assert review.queued <= 80 + 20 and not review.error
        groups = body["groups"]
        # the queue's rows are queries of the two lost classes (a trouser is answered surely)
        q = c.app.state.snca.state.store.queued(500)
        assert len(q) == body["queued"] and all(x.has_thumbnail for x in q)
        # grouping on real images: the big groups are pure
        ids_of = {x.id: x for x in q}
        # the queue does not know which image a query was: match by vector
        import numpy as np

        state = c.app.state.snca.state  # (the test's own embedding of each query)
        rows = {
            i: state.runtime.embedder.split(
                state.runtime.embed_pixels(
                    [state.runtime.uploads.prepare(png(fmnist_test, i), "q").pixels]
                )
            )[0][0]
            for i in truth
        }
        cls_of = {}
        for qid, x in ids_of.items():
            best = max(rows, key=lambda i: float(np.dot(rows[i], x.embedding)))
            assert float(np.dot(rows[best], x.embedding)) > 0.999
            cls_of[qid] = truth[best]
        big = [g for g in groups if g["size"] >= 5]
        assert big and sum(g["size"] for g in big) >= 0.6 * len(q)
        for g in big:
            top = Counter(cls_of[i] for i in g["ids"]).most_common(1)[0][1]
            assert top / g["size"] >= 0.9, g
        assert len(groups[0]["sample"]) == min(6, groups[0]["size"])
        assert groups[0]["sample"][0]["thumbnail_url"].startswith("/review/items/")
        assert c.get(groups[0]["sample"][0]["thumbnail_url"]).status_code == 200
        # naming the biggest group: one add, the queries leave the queue
        g = groups[0]
        label = "new:" + NOVEL[Counter(cls_of[i] for i in g["ids"]).most_common(1)[0][0]]
        r = c.post("/review/name", json={"ids": g["ids"], "label": label})
        assert r.status_code == 201, r.text
        named = r.json()
        assert len(named["ids"]) == g["size"] and named["count"] == g["size"]
        assert sorted(named["queued_ids"]) == sorted(g["ids"])
        again = c.post("/review/name", json={"ids": g["ids"], "label": label})
        assert again.status_code == 404  # (named already)
        items = c.get("/gallery/items", params={"label": label, "limit": 1000}).json()["items"]
        assert sorted(x["id"] for x in items) == sorted(named["ids"])
        assert all(x["thumbnail_url"] and "review" in x["metadata"] for x in items)
        # the query as the model saw it (28 x 28 here: for this dataset, the upload's pixels),
        # which an upgrade re-embeds a named item from
        import io

        from PIL import Image

        for it in state.store.stored_items(named["ids"]):
            assert it.image_type == "image/png"
            assert Image.open(io.BytesIO(it.image)).size == (28, 28)
        left = c.get("/review").json()
        assert left["queued"] == body["queued"] - g["size"]
        # a dismissed group is gone
        other = left["groups"][0]
        assert c.post("/review/dismiss", json={"ids": other["ids"]}).json() == {
            "dismissed": other["size"]
        }
        version = c.app.state.snca.state.gallery.version
    with make_client(base_run, data, review_queue=True) as c:  # a restart keeps both
        assert c.app.state.snca.state.gallery.version == version
        assert c.get("/gallery/labels").json()["labels"]
        counts = {x["label"]: x["count"] for x in c.get("/gallery/labels").json()["labels"]}
        assert counts[label] == g["size"]
        assert c.get("/review").json()["queued"] == left["queued"] - other["size"]


def test_the_queue_is_off_by_default_bounded_and_keeps_uploads_only_when_asked(
    base_run, tmp_path, fmnist_test
):
    with make_client(base_run, tmp_path / "off") as c:
        c.delete("/gallery/labels/Bag")
        for i in of_class(fmnist_test, 8, 5):
            c.post("/classify", files=img(fmnist_test, i))
        assert c.app.state.review is None
        assert c.get("/review").json()["queued"] == 0
    kw = {"review_queue": True, "review_max_items": 7, "review_keep_images": True}
    with make_client(base_run, tmp_path / "on", **kw) as c:
        c.delete("/gallery/labels/Bag")
        for i in of_class(fmnist_test, 8, 20):
            c.post("/classify", files=img(fmnist_test, i))
        review = queue_of(c)
        store = c.app.state.snca.state.store
        assert store.queue_totals()[0] == 7 and review.queued >= 15 and review.pruned >= 8
        said = c.get("/readyz").json()["review"]
        assert said["queued"] == review.queued and said["pruned"] == review.pruned
        assert said["dropped"] == 0 and said["error"] is None
        q = store.queued_items([x.id for x in store.queued(10)])
        uploads = {png(fmnist_test, i) for i in of_class(fmnist_test, 8, 20)}
        assert all(x.image in uploads for x in q)  # (the uploads themselves: asked for)


def test_the_queued_queries_of_other_callers_need_a_key_whenever_keys_are_set(
    base_run, tmp_path, fmnist_test
):
    """Issue 51: with only a write key set (reads open), anyone read the queries other callers
    sent once the queue was on: GET /review, their thumbnails, the suggestions that list them.
    Those routes now need a key of either scope whenever any key is configured."""
    write, read = "w" * 20, "r" * 20
    kw = {"review_queue": True, "review_margin": 1.0, "api_keys": f"write:{write}"}
    with make_client(base_run, tmp_path / "data", **kw) as c:
        for i in of_class(fmnist_test, 0, 4):
            assert c.post("/classify", files=img(fmnist_test, i)).status_code == 200
        queue_of(c)
        private = ["/review", "/gallery/suggestions?label=Bag"]
        w = c.get("/review", headers={"X-API-Key": write}).json()
        queued = w["groups"][0]["sample"][0]
        private.append(f"/review/items/{queued['id']}/thumbnail")
        for path in private:
            r = c.get(path)
            assert r.status_code == 401 and r.json()["code"] == "unauthorized", (path, r.text)
            assert c.get(path, headers={"X-API-Key": write}).status_code == 200, path
        assert c.get("/gallery/labels").status_code == 200  # (the other reads stay open)
        doc = c.get("/openapi.json").json()["paths"]
        assert doc["/review"]["get"]["security"] and "401" in doc["/review"]["get"]["responses"]
        assert "security" not in doc["/gallery/labels"]["get"]
    kw["api_keys"] += f",read:{read}"
    with make_client(base_run, tmp_path / "data", **kw) as c:
        assert c.get("/review", headers={"X-API-Key": read}).status_code == 200
        assert c.get("/review").status_code == 401
