"""The lean hot path (service/http/lean.py): POST /classify and /classify/batch are called from
the outer middleware without FastAPI's router, with the same guards, problems and metrics."""

import re

from service.http.lean import lean_routes
from service.http.routes import classify, gallery, search

from ..helpers import img, make_client, png


def _count(metrics: str, route: str, status: str) -> float:
    m = re.search(
        rf'snca_requests_total{{[^}}]*method="POST",route="{re.escape(route)}",status="{status}"}} '
        r"([0-9.e+]+)",
        metrics,
    )
    return float(m.group(1)) if m else 0.0


def test_the_classify_routes_answer_without_the_router(
    base_run, tmp_path, fmnist_test, monkeypatch
):
    assert set(lean_routes([classify.router, search.router, gallery.router])) == {
        ("POST", "/classify"),
        ("POST", "/classify/batch"),
    }
    with make_client(base_run, tmp_path / "s", api_key="k", protect_reads=True) as c:
        want = c.post("/classify", files=img(fmnist_test, 2), headers={"X-API-Key": "k"}).json()

        async def no_router(self, scope, receive, send):
            raise AssertionError(f"the router was called for {scope['path']}")

        router_class = type(c.app.router)
        monkeypatch.setattr(router_class, "__call__", no_router)
        key = {"X-API-Key": "k"}
        got = c.post("/classify", files=img(fmnist_test, 2), headers=key)
        assert got.status_code == 200 and got.json() == want
        r = c.post(
            "/classify/batch", files=[("images", ("a.png", png(fmnist_test, 2)))] * 2, headers=key
        )
        assert r.status_code == 200
        assert [x["label"] for x in r.json()["results"]] == [want["label"]] * 2
        # the guards and the problems of the route, not of a layer that was skipped
        assert c.post("/classify", files=img(fmnist_test, 2)).json()["code"] == "unauthorized"
        r = c.post("/classify?kk=3", files=img(fmnist_test, 2), headers=key)
        assert r.json()["code"] == "unknown_parameter", r.text
        r = c.post("/classify?k=0", files=img(fmnist_test, 2), headers=key)
        assert r.status_code == 422 and r.json()["code"] == "validation_error", r.text
        r = c.post("/classify", files={"image": ("a.png", b"nope" * 50)}, headers=key)
        assert r.status_code == 415 and r.headers["x-request-id"], r.text
        r = c.post("/classify", headers={**key, "X-Min-Gallery-Version": "10000"})
        assert r.status_code == 422 and r.json()["code"] == "version_unknown", r.text
        # anything else still goes through the router (FastAPI's stack inside the context: its
        # bug is the same 500 problem, not the framework's plain-text one)
        r = c.get("/gallery/labels", headers=key)
        assert r.status_code == 500 and r.json()["code"] == "internal_error", r.text
        assert r.headers["content-type"] == "application/problem+json"
        assert r.headers["x-request-id"] in r.json()["detail"]
        monkeypatch.undo()
        metrics = c.get("/metrics", headers=key).text
        assert _count(metrics, "/classify", "200") == 2
        assert _count(metrics, "/classify", "401") == 1
        assert _count(metrics, "/classify/batch", "200") == 1
