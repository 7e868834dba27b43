"""`snca-build-index --factory auto` past its exact limit makes an IVF index tuned to a recall
target, and `snca-serve` past SNCA_EXACT_VOTE_MAX classifies from its candidates end to end:
trained labels, a label added at run time (and deleted again), the label filter; the same
labels as the dense exact vote on the same index."""

import json

import httpx
import numpy as np

from tests.helpers import run_cli

from ..helpers import Server, of_class, png


def _classify(c, img, **params):
    r = c.post("/classify", params=params, files={"image": ("x.png", img, "image/png")})
    assert r.status_code == 200, r.text
    return r.json()


def test_auto_ivf_index_served_by_the_candidate_vote(base_run, tmp_path, fmnist_test):
    ix = tmp_path / "ivf"
    p = run_cli(
        "index_builder",
        base_run,
        "--out",
        ix,
        "--factory",
        "auto",
        "--auto-exact-max",
        "500",
        "--recall-target",
        "0.9",
        "--no-progress",
    )
    assert p.returncode == 0, p.stderr
    m = json.loads((ix / "manifest.json").read_text())
    assert m["factory"].startswith("IVF") and m["build"]["factory_requested"] == "auto"
    auto = m["build"]["auto"]
    assert auto["recall_at_10"] >= 0.9 and m["search_params"]["nprobe"] >= 1, auto
    # the same images, the candidate vote (limit 100 items) and the dense vote (the default)
    queries = [png(fmnist_test, i) for i in range(40)]
    labels = {}
    for name, limit in (("candidates", "100"), ("dense", "1000000")):
        env = {"SNCA_EXACT_VOTE_MAX": limit, "SNCA_CANDIDATES": "256"}
        srv = Server(base_run, tmp_path / f"data-{name}", env, "--index", str(ix))
        try:
            with httpx.Client(base_url=srv.url, timeout=30) as c:
                assert c.get("/readyz").json()["vote_path"] == (
                    "dense" if name == "dense" else "candidates"
                )
                labels[name] = [_classify(c, q)["nearest_label"] for q in queries]
                if name != "candidates":
                    continue
                tee = [png(fmnist_test, i) for i in of_class(fmnist_test, 0, 6)]
                r = c.post(
                    "/gallery/add",
                    data={"label": "tee"},
                    files=[("images", (f"{i}.png", b, "image/png")) for i, b in enumerate(tee[:5])],
                )
                assert r.status_code == 201, r.text
                got = _classify(c, tee[0], neighbors="true")
                assert got["nearest_label"] == "tee", got
                assert got["neighbors"][0]["label"] == "tee"
                assert got["neighbors"][0]["similarity"] > 0.999
                only = _classify(c, tee[0], labels=["Trouser", "Bag"])
                assert only["nearest_label"] in {"Trouser", "Bag"}
                assert {x["label"] for x in only["probabilities"]} <= {"Trouser", "Bag"}
                assert c.delete("/gallery/labels/tee").status_code == 200
                after = _classify(c, tee[0], neighbors="true")
                assert after["nearest_label"] != "tee" and "tee" not in {
                    x["label"] for x in after["neighbors"]
                }
        finally:
            srv.kill()
    same = np.mean([a == b for a, b in zip(labels["candidates"], labels["dense"], strict=True)])
    assert same >= 0.95, labels
