"""Is this something new? The calibrated unknown and a registration's diagnostics, on the shared
real model (five Fashion-MNIST classes: Trouser, Sandal, Sneaker, Bag, Ankle boot) served by a
real snca-serve process; real test images, real noise."""

import io

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from embedding import openset
from service.config import Settings
from service.startup import ServiceHost

from ..helpers import Server, of_class, png

BASE = (1, 5, 7, 8, 9)
TSHIRT = 0  # not trained on: the new kind of image


def png_array(a: np.ndarray) -> bytes:
    b = io.BytesIO()
    Image.fromarray(a.astype(np.uint8)).save(b, "PNG")
    return b.getvalue()


@pytest.fixture(scope="module")
def state(base_run, tmp_path_factory):
    host = ServiceHost(Settings(model=base_run, data_dir=tmp_path_factory.mktemp("openset")))
    st = host.finish()
    yield st
    host.stop()


@pytest.fixture(scope="module")
def server(base_run, tmp_path_factory):
    s = Server(base_run, tmp_path_factory.mktemp("openset") / "serve", None)
    yield s
    s.kill(15)


def _classify(st, images: np.ndarray, tpr: float = openset.TPR):
    """(accepted (n,) bool, labels) of uint8 images (n, 28, 28) through the service's embedder
    and gallery, at acceptance `tpr`."""
    emb = st.runtime.embedder.embed(torch.from_numpy(np.ascontiguousarray(images[:, None])))
    res = st.gallery.classify(emb, st.settings.vote, st.settings.k)
    th = st.gallery.thresholds(tpr)
    acc = np.array([c.unknown_score >= th[c.label_id] for c in res])
    return acc, [c.label for c in res]


def test_calibration_accepts_the_target_share_of_held_out_known_images(state, fmnist_test):
    """Leave-one-out calibration on the gallery, checked on images it never saw: the base
    classes' test images are accepted at about the target rate, and a stricter target rejects
    more of them."""
    x = fmnist_test.source.images
    pos = np.concatenate([of_class(fmnist_test, c, 200) for c in BASE])
    imgs = np.asarray(x[pos]).reshape(len(pos), 28, 28)
    acc95, _ = _classify(state, imgs, 0.95)
    acc80, _ = _classify(state, imgs, 0.80)
    assert 0.90 <= acc95.mean() <= 0.99, acc95.mean()
    assert acc80.mean() < acc95.mean() - 0.05
    assert 0.70 <= acc80.mean() <= 0.90, acc80.mean()


def test_noise_ranks_below_known_images_and_the_request_can_set_the_rate(server, fmnist_test):
    """Uniform noise scores below the known images of the label it lands in; at a request's
    stricter unknown_tpr it is flagged unknown (its label null, the best guess given as nearest_label), unknown=off
    turns the flag off, an out-of-range rate is a 422. (At the default 0.95 this small model
    flags only a few noise images: noise lands among the Bags, the most spread-out label,
    whose threshold is the lowest; docs/RESULTS.md measures it.)"""
    rng = np.random.default_rng(0)
    noise = [
        ("images", (f"n{i}.png", png_array(rng.integers(0, 256, (28, 28))))) for i in range(20)
    ]
    known = [("images", (f"{i}.png", png(fmnist_test, i))) for i in of_class(fmnist_test, 8, 40)]

    def ask(files, query=""):
        r = httpx.post(server.url + "/classify/batch" + query, files=files, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["results"]

    bags = ask(known)
    median_bag = np.median([x["unknown_score"] for x in bags if x["label"] == "Bag"])
    res = ask(noise)
    assert all(x["nearest_label"] and x["unknown_threshold"] is not None for x in res)
    assert np.mean([x["unknown_score"] < median_bag for x in res]) >= 0.9
    strict = ask(noise, "?unknown_tpr=0.5")
    assert all(x["unknown_tpr"] == 0.5 for x in strict)
    assert np.mean([x["unknown"] for x in strict]) >= 0.8
    assert all(x["unknown"] == (x["unknown_score"] < x["unknown_threshold"]) for x in strict)
    # an unknown answer names no label (a client reading `label` first is never confidently
    # wrong); the guess stays under its own name
    for x in strict + bags:
        if x["unknown"]:
            assert x["label"] is None and x["confidence"] is None, x
            assert x["nearest_label"] and 0 < x["nearest_probability"] <= 1, x
        else:
            assert x["label"] == x["nearest_label"] is not None, x
            # how likely right: the share between the two best labels, never under p1
            p = [q["probability"] for q in x["probabilities"]]
            want = p[0] / (p[0] + p[1]) if len(p) > 1 else 1.0
            assert x["confidence"] == pytest.approx(want, abs=1e-6), x
            assert x["confidence"] >= x["nearest_probability"] - 1e-6, x
    assert np.mean([x["unknown"] for x in ask(known, "?unknown_tpr=0.5")]) <= 0.7
    off = ask(noise, "?unknown=off")
    assert not any(x["unknown"] for x in off) and all(x["unknown_tpr"] is None for x in off)
    assert all(x["label"] == x["nearest_label"] is not None for x in off)
    bad = httpx.post(server.url + "/classify?unknown_tpr=1.5", files={"image": noise[0][1]})
    assert bad.status_code == 422


def test_a_registered_kind_stops_being_unknown(server, fmnist_test, fmnist_train):
    """T-shirts (never trained on) are often unknown; five registered, they are classified
    as the new label and at most half as many are unknown; known images stay accepted."""
    tees = of_class(fmnist_test, TSHIRT, 40)
    known = np.concatenate([of_class(fmnist_test, c, 8) for c in BASE])

    def ask(positions):
        files = [("images", (f"{i}.png", png(fmnist_test, i))) for i in positions]
        r = httpx.post(server.url + "/classify/batch", files=files, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["results"]

    before = ask(tees)
    known_before = np.mean([not r["unknown"] for r in ask(known)])
    shots = [("images", (f"s{i}.png", png(fmnist_train, i))) for i in of_class(fmnist_train, 0, 5)]
    r = httpx.post(server.url + "/gallery/add", data={"label": "tee"}, files=shots, timeout=60)
    assert r.status_code == 201, r.text
    after = ask(tees)
    unknown_before = np.mean([x["unknown"] for x in before])
    unknown_after = np.mean([x["unknown"] for x in after])
    print(f"T-shirts unknown {unknown_before:.2f} -> {unknown_after:.2f}")
    assert unknown_before >= 0.3, unknown_before  # measured 0.45
    assert unknown_after <= unknown_before - 0.1, (unknown_before, unknown_after)  # 0.23
    assert np.mean([x["label"] == "tee" for x in after]) >= 0.6
    known_after = np.mean([not r["unknown"] for r in ask(known)])
    assert known_after >= known_before - 0.1
    httpx.delete(server.url + "/gallery/labels/tee")


def test_diagnostics_flag_a_planted_mislabelled_image(server, fmnist_train):
    """Five T-shirts and one sandal registered as "tee2": the sandal is named as an image that
    sits with another label (a trained footwear label); GET /gallery/diagnostics tells the same of the label."""
    tees = of_class(fmnist_train, TSHIRT, 5, 100)
    sandal = of_class(fmnist_train, 5, 1, 100)[0]
    files = [("images", (f"{i}.png", png(fmnist_train, i))) for i in [*tees, sandal]]
    r = httpx.post(server.url + "/gallery/add", data={"label": "tee2"}, files=files, timeout=60)
    assert r.status_code == 201, r.text
    body = r.json()
    d = body["diagnostics"]
    sandal_id = body["ids"][-1]
    assert d["checked"] == 6 and d["count"] == 6
    out = {o["id"]: o["sits_with"] for o in d["outliers"]}
    assert out.get(sandal_id) in {"Sandal", "Sneaker"}, d  # footwear: where it belongs
    assert len(out) <= 2  # the sandal, and at most one T-shirt this small model puts elsewhere
    assert any("mislabelled" in w and f"#{sandal_id}" in w for w in d["warnings"]), d["warnings"]
    # every outlier disagrees; an image that disagrees but is unknown at the label it chose is
    # new there, not mislabelled, so no outlier (this small model has one such T-shirt at times)
    assert 0.5 <= d["agreement"] <= 1 - len(out) / 6 + 1e-6, d
    assert d["nearest_label"] in {"Trouser", "Sandal", "Sneaker", "Bag", "Ankle boot"}
    got = httpx.get(server.url + "/gallery/diagnostics", params={"label": "tee2"}).json()
    assert sandal_id in [o["id"] for o in got["outliers"]]
    missing = httpx.get(server.url + "/gallery/diagnostics", params={"label": "nope"})
    assert missing.status_code == 404 and missing.json()["code"] == "label_unknown"
    httpx.delete(server.url + "/gallery/labels/tee2")


def test_one_image_of_a_trained_class_warns_and_does_not_take_it_over(server, fmnist_test):
    """The user's mistake of issue 21: one sandal registered as "my-shoe". The answer warns
    that the gallery already calls it Sandal, and the default vote (kde_shrunk) lets the new
    label take fewer of the sandals than kde's equal priors do (on the default 55,000-item
    gallery: docs/RESULTS.md)."""
    sandals = of_class(fmnist_test, 5, 61)
    r = httpx.post(
        server.url + "/gallery/add",
        data={"label": "my-shoe"},
        files=[("images", ("s.png", png(fmnist_test, sandals[0])))],
    )
    assert r.status_code == 201, r.text
    d = r.json()["diagnostics"]
    assert d["agreement"] is None and d["outliers"][0]["sits_with"] == "Sandal"
    assert any("already classifies this image as 'Sandal'" in w for w in d["warnings"])
    files = [("images", (f"{i}.png", png(fmnist_test, i))) for i in sandals[1:]]

    def taken(vote):
        r = httpx.post(server.url + f"/classify/batch?vote={vote}", files=files, timeout=60)
        return np.mean([x["nearest_label"] == "my-shoe" for x in r.json()["results"]])

    shrunk, flat = taken("kde_shrunk"), taken("kde")
    print(f"my-shoe takes {shrunk:.2f} of the sandals (kde: {flat:.2f})")
    assert shrunk <= flat - 0.1, (shrunk, flat)
    assert shrunk <= 0.4, shrunk
    httpx.delete(server.url + "/gallery/labels/my-shoe")
