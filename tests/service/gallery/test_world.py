"""The world check (embedding/world.py, service/gallery/world.py): an image that is not the
kind a label holds is unknown, says why, and a label users register from their own photos is
recognised by its own images while photos unrelated to it stay unknown."""

from __future__ import annotations

import io
import json
import shutil

import numpy as np
import pytest
from PIL import Image

from tests.helpers import run_cli

from ..helpers import make_client, of_class, png
from ..photos import CUP_BOX, crops, photo, png_bytes, unrelated


def _png(a: np.ndarray) -> bytes:
    b = io.BytesIO()
    Image.fromarray(a).save(b, "PNG")
    return b.getvalue()


def _classify(c, data: bytes, **params) -> dict:
    r = c.post("/classify", params=params, files={"image": ("q.png", data, "image/png")})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def client(base_run, tmp_path_factory):
    with make_client(base_run, tmp_path_factory.mktemp("world") / "data", fused_batches=0) as c:
        yield c


def test_noise_flat_and_inverted_images_are_outside_the_world(client, fmnist_test):
    """The model was trained on Fashion-MNIST: uniform noise, flat greys and inverted images
    land among its classes with high confidence (the label check let most of them through);
    the world check flags them, and the answer says so."""
    assert client.get("/readyz").json()["world_check"] is True
    rng = np.random.default_rng(0)
    known = of_class(fmnist_test, 7, 20)
    families = {
        "noise": [rng.integers(0, 256, (28, 28), dtype=np.uint8) for _ in range(10)],
        "flat": [np.full((28, 28), v, np.uint8) for v in np.linspace(0, 255, 10).astype(int)],
        "inverted": [255 - fmnist_test.source.get(int(i))[0].numpy() for i in known[:10]],
    }
    for name, images in families.items():
        answers = [_classify(client, _png(a)) for a in images]
        flagged = [a for a in answers if a["unknown"]]
        assert len(flagged) == len(images), (name, [a["world_score"] for a in answers])
        assert all(a["unknown_reason"] == "outside_world" for a in flagged), name
        assert all(a["world_basis"] == "training" for a in flagged), name
        assert all(a["world_score"] > a["world_threshold"] for a in flagged), name
    accepted = [not _classify(client, png(fmnist_test, i))["unknown"] for i in known]
    assert np.mean(accepted) >= 0.8, accepted  # known images stay known (calibrated at 99%)
    off = _classify(client, _png(families["noise"][0]), unknown="off")
    assert off["unknown"] is False and off["unknown_reason"] is None
    assert off["world_score"] is not None  # the measurement is still there


def test_a_label_of_photos_is_recognised_by_its_own_images(client):
    """Five crops of one photo of a cup registered as "coffee" on a Fashion-MNIST model: its
    other photos are "coffee" and known (the trained world would call every photo unknown),
    unrelated photos stay unknown (19 of 24 were answered "coffee", 11 of them accepted), and
    the registration says its images are outside the model's world."""
    cup = photo("coffee")
    shots = [png_bytes(c) for c in crops(cup, 5, 1, CUP_BOX)]
    files = [("images", (f"{i}.png", b, "image/png")) for i, b in enumerate(shots)]
    r = client.post("/gallery/add", data={"label": "coffee"}, files=files)
    assert r.status_code == 201, r.text
    d = r.json()["diagnostics"]
    assert d["outside_world"] == 1.0 and any("not like the images" in w for w in d["warnings"])
    try:
        others = [_classify(client, png_bytes(c)) for c in crops(cup, 30, 2, CUP_BOX, flip=True)]
        won = [a["label"] == "coffee" and not a["unknown"] for a in others]
        print(f"other cup photos won and known: {np.mean(won):.2f}")
        assert np.mean(won) >= 0.9, [(a["label"], a["world_score"]) for a in others]
        assert all(a["world_basis"] == "label" for a in others if a["label"] == "coffee")
        strangers = [_classify(client, b) for b in unrelated()]
        taken = [a for a in strangers if not a["unknown"]]
        assert not taken, [(a["label"], a["world_score"], a["world_threshold"]) for a in taken]
        assert {a["unknown_reason"] for a in strangers} == {"outside_world"}
    finally:
        client.delete("/gallery/labels/coffee")


def test_an_old_run_dir_gets_world_statistics_at_index_build(base_run, tmp_path, fmnist_test):
    """A run dir trained before the world check has no world.safetensors: snca-build-index
    fits them from the run's training images, and the service checks the world with them. An
    index dir without them (built before) is served with the label check alone."""
    old = tmp_path / "old-run"
    shutil.copytree(base_run, old, ignore=shutil.ignore_patterns("index"))
    (old / "world.safetensors").unlink()
    p = run_cli("index_builder", old, "--out", old / "index", "--no-progress")
    assert p.returncode == 0, p.stderr
    assert "fitting on" in p.stdout + p.stderr
    manifest = (old / "index" / "manifest.json").read_text()
    assert '"world": "fitted at build"' in manifest
    noise = _png(np.random.default_rng(1).integers(0, 256, (28, 28), dtype=np.uint8))
    with make_client(old, tmp_path / "data", fused_batches=0) as c:
        a = _classify(c, noise)
        assert a["unknown"] and a["unknown_reason"] == "outside_world", a
    # an index dir from before: no world file, none in its manifest
    (old / "index" / "world.safetensors").unlink()
    m = json.loads((old / "index" / "manifest.json").read_text())
    del m["files"]["world.safetensors"]
    (old / "index" / "manifest.json").write_text(json.dumps(m))
    with make_client(old, tmp_path / "data2", fused_batches=0) as c:
        assert c.get("/readyz").json()["world_check"] is False
        a = _classify(c, noise)
        assert a["world_score"] is None and a["world_basis"] is None
        assert a["unknown_reason"] in (None, "no_label_accepts")


def test_no_placeholder_threshold_at_a_high_rate(client, fmnist_test):
    """At unknown_tpr >= 0.985 the label check answered unknown_threshold -1.0 for Coat and
    Trouser: a leave-one-out score of -1 (the label's own items not among the candidates, a
    placeholder) became the threshold, which silently accepted everything."""
    for cls in (1, 5, 7, 8, 9):
        for i in of_class(fmnist_test, cls, 3):
            a = _classify(client, png(fmnist_test, i), unknown_tpr=0.999)
            assert a["unknown_threshold"] is None or a["unknown_threshold"] > -1.0, a


def test_leave_one_out_placeholders_never_become_a_threshold():
    """The same, deterministically: a sampled item none of whose candidates is of its label
    gets the placeholder -1 from label_kth; it is left out of the calibration."""
    from service.gallery.openset import OpenSet

    rng = np.random.default_rng(0)
    emb = rng.normal(size=(30, 4)).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    o = OpenSet(dim=4, k=2, sample=5)  # 30 items, a sample of 5: the candidate path
    o.added(0, np.arange(30), emb)

    def search(q, kk):  # every candidate is item 99, of another label
        return np.full((len(q), kk), 0.5, np.float32), np.full((len(q), kk), 99)

    def labels_of(ids):
        return np.where(ids == 99, 1, 0)

    o.recalibrate([0], np.array([30, 1]), search, labels_of, lambda c: None, 64)
    th = o.calibration.thresholds(2, 0.999)
    assert not np.any(th == -1.0), th


def _gallery_world(order, rows, labels):
    from embedding.world import unfitted
    from service.gallery.world import Worlds

    w = Worlds(unfitted(), 0.99)
    for i in order:
        w.added(int(labels[i]), np.array([i]), [rows[i]])
        w.recalibrate([int(labels[i])])
    return w


def test_a_world_fitted_on_the_registered_images_agrees_whatever_their_order():
    """No training world (nothing trained): the metric is fitted on the registered images. Two
    replicas that applied the same adds in other orders (or a restart that loaded them at
    once) judge a query alike; under two images there is no metric and so no check."""
    rng = np.random.default_rng(0)
    centres = rng.normal(0, 3, (3, 40))
    labels = np.repeat(np.arange(3), 25)  # (enough 6-image draws that unseeded ones differ)
    rows = (centres[labels] + rng.normal(0, 0.3, (75, 40))).astype(np.float32)
    one = _gallery_world([0], rows, labels)
    assert one.fit is None and one.enabled
    assert one.check([0], one.z(rows[:1]), np.zeros(3)) == [one.check([0], None, np.zeros(3))[0]]
    a = _gallery_world(range(75), rows, labels)
    b = _gallery_world(rng.permutation(75), rows, labels)
    q = np.concatenate([centres, rng.normal(0, 3, (3, 40))])  # each label's own centre; strangers
    q = q.astype(np.float32)
    va = a.check([0, 1, 2, 0, 1, 2], a.z(q), np.zeros(3))
    vb = b.check([0, 1, 2, 0, 1, 2], b.z(q), np.zeros(3))
    assert [v.basis for v in va] == ["label"] * 6
    assert [round(v.score, 6) for v in va] == [round(v.score, 6) for v in vb]
    # and on every label's radius (the fit's few-shot draws are seeded, not the order's)
    assert (a.fit.same_radius, a.fit.spread) == (b.fit.same_radius, b.fit.spread)
    assert a.radius == pytest.approx(b.radius, rel=1e-6)
    assert [v.ok for v in va] == [True, True, True, False, False, False]
    # a delete refits: the label's radius and the metric come from what is left
    a.removed(0, 0)
    a.recalibrate([0])
    assert 0 not in a.own[0].ids and a.fit.fitted_on == 74


def test_fewer_images_than_statistics_fit_a_diagonal_world_that_saves_and_loads(tmp_path):
    """A run of a few photos has fewer images than world statistics: a full covariance is the
    shrink floor in most directions (a 16-photo fit put 81 % of its objects' other crops
    outside), so the fit is diagonal; it saves, loads and scores the same."""
    import torch

    from embedding import world

    rng = np.random.default_rng(0)
    s = torch.from_numpy(rng.normal(0, 1, (30, 50)) * rng.uniform(0.1, 3, 50))
    w = world.fit(s[:20], s[20:], np.arange(10) % 2)
    assert w.whiten.shape == (50,)  # diagonal
    full = world.fit(torch.cat([s] * 3)[:60], s[20:])
    assert full.whiten.ndim == 2
    world.save(w, tmp_path, "fp")
    back = world.load(tmp_path / world.WORLD_FILE, "fp")
    q = rng.normal(0, 1, (4, 50))
    assert np.allclose(back.score(back.z(q)), w.score(w.z(q)))
    assert back.threshold(0.9) == w.threshold(0.9)
    # 10 held-out images place a threshold at 0.9 (the 10th of 10) but none at 0.99: nothing
    # is refused by it rather than everything over the largest of them
    assert w.threshold(0.99) is None and w.accepts(w.z(q * 100), 0.99).all()
