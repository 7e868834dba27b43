"""`snca-gallery classify FOLDER` (issue 53): the API's answers for every image of a folder,
read recursively, as CSV or JSON lines, with a progress line; an unreadable file is a row of
its own that says why, and the exit status says some failed. Checked against a real server's
/classify on the same gallery, answer by answer."""

from __future__ import annotations

import csv
import json

import httpx
import pytest

from tests.helpers import run_cli

from ..helpers import Server, of_class, png


@pytest.fixture(scope="module")
def folder(tmp_path_factory, fmnist_test):
    root = tmp_path_factory.mktemp("classify") / "photos"
    picks = {}
    for cls in (0, 7, 9):
        d = root / f"class-{cls}" / "deeper"
        d.mkdir(parents=True)
        for i in of_class(fmnist_test, cls, 3, 40):
            (d / f"{i}.png").write_bytes(png(fmnist_test, i))
            picks[f"class-{cls}/deeper/{i}.png"] = int(i)
    (root / "broken.png").write_bytes(b"\x89PNG not an image")
    (root / "notes.txt").write_text("not an image: left out")
    return root, picks


def test_classify_a_folder_gives_the_apis_answers(base_run, folder, tmp_path, fmnist_test):
    root, picks = folder
    data = tmp_path / "data"
    srv = Server(base_run, data)
    try:  # (a registered label too: the answers cover a user's label)
        files = [("images", (f"{i}.png", png(fmnist_test, i))) for i in of_class(fmnist_test, 9, 5)]
        r = httpx.post(srv.url + "/gallery/add", data={"label": "boots"}, files=files, timeout=60)
        assert r.status_code == 201, r.text
        api = {}
        for shown, i in picks.items():
            r = httpx.post(srv.url + "/classify", files={"image": ("q.png", png(fmnist_test, i))})
            api[shown] = r.json()
        bad = httpx.post(srv.url + "/classify", files={"image": ("b.png", b"\x89PNG not an image")})
        assert bad.status_code == 415  # (the API refuses it: the tool reports it)
    finally:
        srv.kill()
    out = tmp_path / "answers.csv"
    p = run_cli("service.tools.gallery_tool", "classify", root, "--model", base_run,
                "--data-dir", data, "--out", out, env={"SNCA_PROGRESS_SECONDS": "0"})  # fmt: skip
    assert p.returncode == 1, p.stderr  # one image could not be read
    assert f"classified {len(picks)} images" in p.stderr and "1 could not be read" in p.stderr
    assert "classifying: " in p.stderr  # the progress line, also when not a terminal
    rows = {r["path"]: r for r in csv.DictReader(out.open())}
    assert set(rows) == set(picks) | {"broken.png"}  # recursive; notes.txt left out
    assert rows["broken.png"]["error"] and not rows["broken.png"]["label"]
    for shown, want in api.items():
        got = rows[shown]
        assert got["label"] == (want["label"] or ""), (shown, got, want)
        assert got["nearest_label"] == want["nearest_label"]
        assert got["unknown"] == str(want["unknown"])
        assert got["explanation"] == want["explanation"]
        assert float(got["nearest_probability"]) == pytest.approx(
            want["nearest_probability"], abs=1e-5
        )
    # JSON lines: the whole ClassifyResult of the API, per image
    j = run_cli("service.tools.gallery_tool", "classify", root / "class-9", "--model", base_run,
                "--data-dir", data, "--format", "jsonl", "--no-progress")  # fmt: skip
    assert j.returncode == 0, j.stderr
    lines = [json.loads(x) for x in j.stdout.splitlines()]
    assert len(lines) == 3
    for x in lines:
        want = api["class-9/" + x.pop("path")]
        assert x.keys() == want.keys()
        assert {k: v for k, v in x.items() if not isinstance(v, float | list)} == {
            k: v for k, v in want.items() if not isinstance(v, float | list)
        }
