"""snca-gallery import/export against a real server on the same store: the server sees the
imported items, a rerun skips them, bad files are named and skipped, an imported image embeds
exactly as /gallery/add embeds it, and an export gives every item and image back."""

import csv
import json
import time

import httpx

from tests.conftest import run_cli

from .conftest import Server, label_counts, of_class, png


def _folder(root, raw):
    """root/<label>/<png> of real Fashion-MNIST test images: 6 bags, 4 sneakers, 1 broken."""
    files = {}
    for label, cls, n in (("handbag", 8, 6), ("kicks", 7, 4)):
        (root / label).mkdir(parents=True)
        for j, i in enumerate(of_class(raw, cls, n)):
            data = png(raw, i)
            (root / label / f"{j}.png").write_bytes(data)
            files[f"{label}/{j}.png"] = data
    (root / "kicks" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    return files


def test_import_while_serving_resume_and_export(base_run, tmp_path, fmnist_test):
    src = tmp_path / "src"
    files = _folder(src, fmnist_test)
    data = tmp_path / "serve"
    srv = Server(base_run, data)
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            before = label_counts(c)
            p = run_cli(
                "service.gallery_tool",
                "import",
                src,
                "--model",
                base_run,
                "--data-dir",
                data,
                "--no-progress",
            )
            assert p.returncode == 1, p.stderr  # one unreadable image
            assert "kicks/broken.png" in p.stderr and "imported 10" in p.stdout, p.stdout
            deadline = time.time() + 10  # the server follows the store's log
            while label_counts(c).get("kicks") != 4 and time.time() < deadline:
                time.sleep(0.1)
            counts = label_counts(c)
            assert counts["handbag"] == 6 and counts["kicks"] == 4
            assert sum(counts.values()) == sum(before.values()) + 10

            # a rerun (e.g. after an interruption) adds nothing twice
            p = run_cli(
                "service.gallery_tool",
                "import",
                src,
                "--model",
                base_run,
                "--data-dir",
                data,
                "--no-progress",
            )
            assert "imported 0, skipped 10" in p.stdout, p.stdout + p.stderr
            # the same image through HTTP embeds the same: its own nearest items are both
            r = c.post(
                "/gallery/add",
                data={"label": "http"},
                files={"images": ("x.png", files["handbag/0.png"], "image/png")},
            )
            assert r.status_code == 201, r.text
            v = r.json()["gallery_version"]
            hits = c.post(
                "/search",
                params={"k": 2},
                headers={"X-Min-Gallery-Version": str(v)},
                files={"image": ("x.png", files["handbag/0.png"], "image/png")},
            )
            got = hits.json()["items"]
            assert {h["label"] for h in got} == {"http", "handbag"}, got
            assert all(h["similarity"] > 0.9999 for h in got), got
            total = sum(label_counts(c).values())
    finally:
        srv.kill()

    # a CSV of path,label imports the same way (here: nothing new)
    with open(tmp_path / "list.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["path", "label"])
        w.writerows([[f"src/{k}", k.split("/")[0]] for k in files])
    p = run_cli(
        "service.gallery_tool",
        "import",
        tmp_path / "list.csv",
        "--model",
        base_run,
        "--data-dir",
        data,
        "--no-progress",
    )
    assert p.returncode == 0 and "imported 0, skipped 10" in p.stdout, p.stdout + p.stderr

    out = tmp_path / "out"
    p = run_cli(
        "service.gallery_tool",
        "export",
        out,
        "--model",
        base_run,
        "--data-dir",
        data,
        "--no-progress",
    )
    assert p.returncode == 0, p.stderr
    rows = [json.loads(x) for x in (out / "items.jsonl").read_text().splitlines()]
    assert len(rows) == total and [r["id"] for r in rows] == sorted(r["id"] for r in rows)
    imported = {
        r["metadata"]["import"]["path"]: r
        for r in rows
        if r["source"] == "added" and r["metadata"] and "import" in r["metadata"]
    }
    assert set(imported) == set(files)
    for key, r in imported.items():
        assert r["label"] == key.split("/")[0]
        assert (out / r["image"]).read_bytes() == files[key]
    p = run_cli("service.gallery_tool", "export", out, "--model", base_run, "--data-dir", data)
    assert p.returncode == 2 and "not an empty folder" in p.stderr
