"""Corrections over HTTP (issue 43): relabel one item or many, rename and merge labels, on a
tiny real model and index through FastAPI's TestClient: durable (a restart finds them, the
index holds each item once), the calibration of every touched label what a gallery loaded
afresh computes, Idempotency-Key retries answered once, clear problems for what cannot be
done. (Both backends and an upgrade carrying them: tests/service/store/test_corrections_carry.py;
kill -9 and replicas: the history checker, tests/service/test_history.py.)"""

import numpy as np

from ..helpers import img, make_client, of_class, png

TPR = 0.95


def thresholds(client) -> dict[str, float]:
    g = client.app.state.snca.state.gallery
    t = g.thresholds_at(TPR)
    return {name: float(t[c]) for name, c in g.stats.ids.items() if g.stats.counts[c] > 0}


def labels(client) -> dict[str, int]:
    return {x["label"]: x["count"] for x in client.get("/gallery/labels").json()["labels"]}


def test_corrections_are_durable_writes_with_calibration_recomputed(
    base_run, tmp_path, fmnist_train, fmnist_test
):
    data = tmp_path / "serve"
    shots = of_class(fmnist_train, 0, 6)
    files = [("images", (f"{i}.png", png(fmnist_train, i), "image/png")) for i in shots]
    with make_client(base_run, data) as c:
        ids = c.post("/gallery/add", data={"label": "top"}, files=files).json()["ids"]
        before = labels(c)
        # one item
        r = c.patch(f"/gallery/items/{ids[0]}", json={"label": "shirt"})
        assert r.status_code == 200, r.text
        v1 = r.json()["gallery_version"]
        assert r.json()["relabelled"] == [{"id": ids[0], "previous_label": "top"}]
        assert c.get(f"/gallery/items/{ids[0]}").json()["label"] == "shirt"
        assert c.patch(f"/gallery/items/{ids[0]}", json={"label": "shirt"}).json() == {
            "relabelled": [],
            "label": "shirt",
            "gallery_version": v1,
        }  # already there: nothing written
        # many, with a trained item among them and an id that is not live
        trouser = c.get("/gallery/items", params={"label": "Trouser", "limit": 1}).json()
        tid = trouser["items"][0]["id"]
        r = c.post("/gallery/relabel", json={"ids": [ids[1], tid, 10**12], "label": "shirt"})
        assert r.status_code == 200 and r.json()["gallery_version"] == v1 + 1
        assert sorted(m["id"] for m in r.json()["relabelled"]) == sorted([ids[1], tid])
        # a rename onto a label with items is refused (a merge is asked for), and vice versa
        assert c.post("/gallery/rename", json={"label": "top", "to": "shirt"}).status_code == 409
        r = c.post("/gallery/merge", json={"label": "top", "into": "nobody"})
        assert r.status_code == 404 and r.json()["code"] == "label_unknown"
        assert c.post("/gallery/rename", json={"label": "none", "to": "x"}).status_code == 404
        # nothing to rename, whatever the new name has (issue 51: was 409 label_exists)
        r = c.post("/gallery/rename", json={"label": "none", "to": "shirt"})
        assert r.status_code == 404 and r.json()["code"] == "label_unknown", r.text
        r = c.post("/gallery/rename", json={"label": "top", "to": "top"})
        assert r.status_code == 409 and r.json()["code"] == "label_same"
        # rename a trained label, merge an added one into another (label names with '/')
        r = c.post("/gallery/rename", json={"label": "Trouser", "to": "Pants/long"})
        assert r.status_code == 200 and r.json()["count"] == before["Trouser"] - 1
        r = c.post("/gallery/merge", json={"label": "top", "into": "shirt"})
        assert r.status_code == 200 and r.json()["count"] == 4
        after = labels(c)
        assert "Trouser" not in after and "top" not in after
        assert after["shirt"] == 7 and after["Pants/long"] == before["Trouser"] - 1
        assert sum(after.values()) == sum(before.values())
        q = of_class(fmnist_test, 1, 1)[0]
        assert c.post("/classify", files=img(fmnist_test, q)).json()["label"] == "Pants/long"
        hits = c.post("/search", files=img(fmnist_train, shots[2]), params={"k": 3}).json()
        assert hits["items"][0]["id"] == ids[2] and hits["items"][0]["label"] == "shirt"
        live = thresholds(c)
        g = c.app.state.snca.state.gallery
        ntotal, version = g.vectors.index.ntotal, g.version
    # a restart: the store replayed over the snapshot or the built index, every item once, the
    # calibration of every label as a gallery loaded afresh computes it
    with make_client(base_run, data) as c:
        g = c.app.state.snca.state.gallery
        assert g.version == version and labels(c) == after
        assert g.vectors.index.ntotal == ntotal
        hits = c.post("/search", files=img(fmnist_train, shots[2]), params={"k": 20}).json()
        found = [h["id"] for h in hits["items"]]
        assert len(found) == len(set(found))  # (a moved item replayed into the index twice)
        fresh = thresholds(c)
        assert fresh.keys() == live.keys()
        assert np.allclose([fresh[k] for k in live], [live[k] for k in live], atol=1e-5)


def test_a_retried_correction_is_answered_once(base_run, tmp_path, fmnist_train):
    with make_client(base_run, tmp_path / "serve") as c:
        f = [("images", ("a.png", png(fmnist_train, 0), "image/png"))]
        (item,) = c.post("/gallery/add", data={"label": "a"}, files=f).json()["ids"]
        h = {"Idempotency-Key": "fix-1"}
        r1 = c.patch(f"/gallery/items/{item}", json={"label": "b"}, headers=h)
        c.patch(f"/gallery/items/{item}", json={"label": "c"})  # (moved on meanwhile)
        r2 = c.patch(f"/gallery/items/{item}", json={"label": "b"}, headers=h)
        assert r2.json() == r1.json() and r2.headers["Idempotent-Replayed"] == "true"
        assert c.get(f"/gallery/items/{item}").json()["label"] == "c"  # not made again
        r3 = c.patch(f"/gallery/items/{item}", json={"label": "d"}, headers=h)
        assert r3.status_code == 422 and r3.json()["code"] == "idempotency_key_reused"
        h = {"Idempotency-Key": "ren-1"}
        r1 = c.post("/gallery/rename", json={"label": "c", "to": "e"}, headers=h)
        r2 = c.post("/gallery/rename", json={"label": "c", "to": "e"}, headers=h)
        assert r1.status_code == r2.status_code == 200 and r1.json() == r2.json()
        assert labels(c).get("e") == 1


def test_bad_corrections_are_problems(base_run, tmp_path):
    with make_client(base_run, tmp_path / "serve") as c:
        bad = [
            ("patch", "/gallery/items/1", {"label": ""}),
            ("patch", "/gallery/items/1", {"label": "a\nb"}),
            ("patch", "/gallery/items/1", {"name": "x"}),
            ("patch", "/gallery/items/-1", {"label": "x"}),
            ("post", "/gallery/relabel", {"ids": [], "label": "x"}),
            ("post", "/gallery/relabel", {"ids": list(range(1001)), "label": "x"}),
            ("post", "/gallery/relabel", {"ids": ["a"], "label": "x"}),
            ("post", "/gallery/rename", {"label": "Trouser", "to": "x" * 2000}),
            ("post", "/gallery/rename", {"label": "Trouser", "to": "x" * 101}),
            ("post", "/gallery/relabel", {"ids": [False], "label": "x"}),
            ("post", "/gallery/merge", {"label": "Trouser"}),
            ("post", "/review/dismiss", {"ids": [True]}),
        ]
        for method, path, body in bad:
            r = getattr(c, method)(path, json=body)
            assert r.status_code == 422, (path, body, r.status_code)
            assert r.headers["content-type"] == "application/problem+json", path
        r = c.post(
            "/gallery/relabel", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert r.status_code == 422
        assert c.patch("/gallery/items/123456789", json={"label": "x"}).status_code == 404
        assert "Trouser" in labels(c)  # nothing changed


def test_every_keyed_outcome_is_replayed_and_binds_its_key(base_run, tmp_path, fmnist_train):
    """Issue 51: an Idempotency-Key records its write's outcome whatever it was (a no-op, a
    404, a 409), so a retry never does later what the first attempt did not (it undid another
    client's correction), and the key with another request is 422 on every write route."""
    f = [("images", ("a.png", png(fmnist_train, 0), "image/png"))]

    def key(k):
        return {"Idempotency-Key": k}

    with make_client(base_run, tmp_path / "serve") as c:
        (item,) = c.post("/gallery/add", data={"label": "a"}, files=f).json()["ids"]
        c.post("/gallery/add", data={"label": "b"}, files=f)
        # client A asks for the label the item has: nothing to do, recorded as such
        r1 = c.patch(f"/gallery/items/{item}", json={"label": "a"}, headers=key("A"))
        assert r1.status_code == 200 and r1.json()["relabelled"] == []
        c.patch(f"/gallery/items/{item}", json={"label": "z"})  # client B's correction
        r2 = c.patch(f"/gallery/items/{item}", json={"label": "a"}, headers=key("A"))
        assert (r2.status_code, r2.json()) == (200, r1.json())
        assert r2.headers["Idempotent-Replayed"] == "true"
        assert c.get(f"/gallery/items/{item}").json()["label"] == "z"  # B's stays
        # 404s and 409s are outcomes too: replayed as they were, though the gallery changed
        first = {
            "del": ("delete", "/gallery/labels/c", None),
            "none": ("post", "/gallery/rename", {"label": "c", "to": "d"}),
            "gone": ("post", "/gallery/relabel", {"ids": [10**12], "label": "c"}),
            "busy": ("post", "/gallery/rename", {"label": "z", "to": "b"}),
            "named": ("post", "/review/name", {"ids": [10**12], "label": "c"}),
        }
        answers = {}
        for k, (method, path, body) in first.items():
            kw = {} if body is None else {"json": body}
            answers[k] = getattr(c, method)(path, headers=key(k), **kw)
        assert {k: r.status_code for k, r in answers.items()} == {
            "del": 404, "none": 404, "gone": 404, "busy": 409, "named": 404
        }  # fmt: skip
        c.post("/gallery/add", data={"label": "c"}, files=f)  # (now there is a "c")
        c.delete("/gallery/labels/b")  # (and "b" is free)
        for k, (method, path, body) in first.items():
            kw = {} if body is None else {"json": body}
            r = getattr(c, method)(path, headers=key(k), **kw)
            assert (r.status_code, r.json()["code"]) == (
                answers[k].status_code,
                answers[k].json()["code"],
            ), k
            assert r.headers["Idempotent-Replayed"] == "true", k
        assert labels(c).get("c") == 1 and "d" not in labels(c)  # nothing made late
        # the same key with another request: 422 on every write route, whatever it answered
        other = [
            ("post", "/gallery/add", {"data": {"label": "q"}, "files": f}),
            ("delete", f"/gallery/items/{item}", {}),
            ("delete", "/gallery/labels/q", {}),
            ("patch", f"/gallery/items/{item}", {"json": {"label": "q"}}),
            ("post", "/gallery/relabel", {"json": {"ids": [item], "label": "q"}}),
            ("post", "/gallery/rename", {"json": {"label": "z", "to": "q"}}),
            ("post", "/gallery/merge", {"json": {"label": "z", "into": "c"}}),
            ("post", "/review/name", {"json": {"ids": [1], "label": "q"}}),
        ]
        for k in ("A", *first):
            for method, path, kw in other:
                r = getattr(c, method)(path, headers=key(k), **kw)
                assert (r.status_code, r.json()["code"]) == (422, "idempotency_key_reused"), (
                    k, path, r.text,
                )  # fmt: skip
        assert c.get(f"/gallery/items/{item}").json()["label"] == "z"
