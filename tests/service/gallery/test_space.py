"""A gallery in the spatial space (index_builder --space spatial): the index holds the backbone's
unpooled, normalised feature map, and the service embeds queries and added images the same way."""

import json

import httpx
import pytest

from tests.helpers import run_cli

from ..helpers import Server, of_class, png


@pytest.fixture(scope="module")
def spatial_index(base_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("spatial") / "index"
    p = run_cli("index_builder", base_run, "--out", out, "--space", "spatial", "--no-progress")
    assert p.returncode == 0, p.stderr
    return out


def test_index_records_space_and_dimension(spatial_index):
    m = json.loads((spatial_index / "manifest.json").read_text())
    # conv4 on 28 x 28: block 4 before its max-pool is 64 x 3 x 3
    assert m["space"] == "spatial" and m["dim"] == 576 and m["source"] == "recompute"


def test_spatial_needs_recomputed_vectors(base_run, tmp_path):
    p = run_cli(
        "index_builder", base_run, "--out", tmp_path / "x", "--space", "spatial", "--source",
        "memory",
    )  # fmt: skip
    assert p.returncode == 2 and "--source recompute" in p.stderr
    assert not (tmp_path / "x").exists()


def test_service_classifies_and_learns_a_label_in_the_spatial_space(
    base_run, spatial_index, tmp_path, fmnist_train, fmnist_test
):
    server = Server(base_run, tmp_path / "serve", None, "--index", str(spatial_index))
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            trousers = of_class(fmnist_test, 1, 10)
            got = [
                c.post("/classify", files={"image": ("q.png", png(fmnist_test, i))}).json()
                for i in trousers
            ]
            assert sum(g["nearest_label"] == "Trouser" for g in got) >= 8, got
            # five shots of a class the model never saw (T-shirt), then its test images
            files = [
                ("images", (f"{i}.png", png(fmnist_train, i), "image/png"))
                for i in of_class(fmnist_train, 0, 5)
            ]
            r = c.post("/gallery/add", data={"label": "T-shirt"}, files=files)
            assert r.status_code == 201, r.text
            shirts = of_class(fmnist_test, 0, 20)
            labels = [
                c.post("/classify", files={"image": ("q.png", png(fmnist_test, i))}).json()[
                    "nearest_label"
                ]
                for i in shirts
            ]
            assert labels.count("T-shirt") >= 14, labels
            # an added image is its own nearest neighbour (similarity 1 in the same space)
            shot = png(fmnist_train, int(of_class(fmnist_train, 0, 1)[0]))
            hits = c.post("/search", files={"image": ("q.png", shot)}, params={"k": 1}).json()
            assert hits["items"][0]["label"] == "T-shirt"
            assert hits["items"][0]["similarity"] > 0.999
    finally:
        server.kill()


def test_fewshot_evaluates_the_space_the_service_serves(base_run, tmp_path):
    """training.fewshot --space spatial embeds exactly like the index builder and the service."""
    out = tmp_path / "fs.json"
    args = ["--shots", "1", "--draws", "2", "--queries-per-class", "20", "--rules", "kde"]
    args += ["--limit", "1000"]  # of the 30,000 novel-class training images the shots come from
    p = run_cli("training.fewshot", base_run, "--space", "spatial", "--gallery", "recompute",
                *args, "--json", out)  # fmt: skip
    assert p.returncode == 0, p.stderr
    res = json.loads(out.read_text())
    assert res["space"] == "spatial"
    assert res["limit"] == 1000 and 990 <= res["shot_pool"] <= 1000  # stratified: ~200 a class
    assert 0 < res["table"]["1"]["kde"]["base"]["mean"] <= 1
    p = run_cli("training.fewshot", base_run, "--space", "spatial", *args)
    assert p.returncode == 2 and "--gallery recompute" in p.stderr
