"""snca-gallery import/export against a real server on the same store: the server sees the
imported items, a rerun skips them, bad files are named and skipped, an imported image embeds
exactly as /gallery/add embeds it, and an export gives every item and image back."""

import csv
import json
import sqlite3
import time

import httpx
import numpy as np

from tests.helpers import run_cli

from ..helpers import Server, label_counts, of_class, png


def gallery(run, data, command, *args):
    """snca-gallery COMMAND ARGS on the served model's data dir, without progress lines."""
    return run_cli(
        "service.tools.gallery_tool", command, *args, "--model", run, "--data-dir", data,
        "--no-progress",
    )  # fmt: skip


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
            p = gallery(base_run, data, "import", src)
            assert p.returncode == 1, p.stderr  # one unreadable image
            assert "kicks/broken.png" in p.stderr and "imported 10" in p.stdout, p.stdout
            deadline = time.time() + 600  # the server follows the store's log
            while label_counts(c).get("kicks") != 4 and time.time() < deadline:
                time.sleep(0.1)
            counts = label_counts(c)
            assert counts["handbag"] == 6 and counts["kicks"] == 4
            assert sum(counts.values()) == sum(before.values()) + 10

            # a rerun (e.g. after an interruption) adds nothing twice
            p = gallery(base_run, data, "import", src)
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
    p = gallery(base_run, data, "import", tmp_path / "list.csv")
    assert p.returncode == 0 and "imported 0, skipped 10" in p.stdout, p.stdout + p.stderr

    out = tmp_path / "out"
    p = gallery(base_run, data, "export", out)
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
    p = run_cli(
        "service.tools.gallery_tool", "export", out, "--model", base_run, "--data-dir", data
    )
    assert p.returncode == 2 and "not an empty folder" in p.stderr


def _gallery_with_images(base_run, data, raw, labels: dict[str, int]) -> dict[str, list[int]]:
    """A data dir whose gallery holds `labels` (name -> n images, each added with its image)."""
    from ..helpers import make_client

    out = {}
    with make_client(base_run, data) as c:
        start = 0
        for label, n in labels.items():
            files = [
                ("images", (f"{i}.png", png(raw, i), "image/png")) for i in range(start, start + n)
            ]
            r = c.post("/gallery/add", data={"label": label}, files=files)
            assert r.status_code == 201, r.text
            out[label] = r.json()["ids"]
            start += n
    return out


def test_export_refuses_links_planted_in_its_folder(base_run, tmp_path, fmnist_test, monkeypatch):
    """Links planted in OUT after its emptiness check (while the gallery opens) used to be
    followed: a file outside OUT was overwritten and the images written outside it."""
    from embedding.errors import SNCAError
    from service.tools import gallery_tool

    data = tmp_path / "data"
    _gallery_with_images(base_run, data, fmnist_test, {"bag": 3})
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.txt").write_text("keep me")
    out = tmp_path / "out"
    out.mkdir()  # new and empty: the check passes
    real = gallery_tool.tool_settings

    def plant_then_open(args, **kw):  # the attacker's move, in the window
        (out / "images").symlink_to(outside)
        (out / "items.jsonl").symlink_to(outside / "victim.txt")
        return real(args, **kw)

    monkeypatch.setattr(gallery_tool, "tool_settings", plant_then_open)
    args = {"out": out, "model": base_run, "data_dir": data, "progress": False}
    try:
        gallery_tool.export_items(args, log=lambda *a, **k: None)
        raise AssertionError("the export wrote through planted links")
    except SNCAError as e:
        assert "wrote into it meanwhile" in str(e)
    assert (outside / "victim.txt").read_text() == "keep me"
    assert sorted(p.name for p in outside.iterdir()) == ["victim.txt"]


def test_export_is_one_point_in_time_and_takes_any_label(
    base_run, tmp_path, fmnist_test, monkeypatch
):
    """Labels of 86 CJK characters or 64 emoji (<= 100 characters, > 255 bytes) made every
    export abort (file name too long); items added while an export ran were written with
    "image": null. Now an export reads one transaction: a write meanwhile is not in it."""
    from embedding.progress import Progress
    from service.store.sqlite import SqliteStore
    from service.tools import gallery_tool

    data = tmp_path / "data"
    cjk, emoji = "漢" * 86, "🙂" * 64
    ids = _gallery_with_images(base_run, data, fmnist_test, {cjk: 2, emoji: 2, "plain": 2})
    conn = sqlite3.connect(data / "gallery.sqlite")
    meta = dict(conn.execute("SELECT key, value FROM meta"))
    conn.close()
    written = {}
    real = Progress.__enter__

    def write_meanwhile(self):  # a writer commits after the images were read
        if not written:
            s = SqliteStore(
                data / "gallery.sqlite", None, meta["model_fingerprint"], meta["index_id"]
            )
            emb = np.eye(1, int(meta["dim"]), dtype="float32")
            written["seq"], written["ids"] = s.add("late", emb, [None], [(b"x", "image/png")])
            s.close()
        return real(self)

    monkeypatch.setattr(Progress, "__enter__", write_meanwhile)
    out = tmp_path / "out"
    args = {"out": out, "model": base_run, "data_dir": data, "progress": False}
    assert gallery_tool.export_items(args, log=lambda *a, **k: None) == 0
    rows = [json.loads(x) for x in (out / "items.jsonl").read_text().splitlines()]
    added = [r for r in rows if r["source"] == "added"]
    assert sorted(r["id"] for r in added) == sorted(i for v in ids.values() for i in v)
    assert all(r["image"] is not None and (out / r["image"]).is_file() for r in added)
    assert written["ids"][0] not in {r["id"] for r in rows}  # after the export's point in time
    summary = json.loads((out / "export.json").read_text())
    assert summary["gallery_version"] == written["seq"] - 1 and summary["items"] == len(rows)
    folders = json.loads((out / "labels.json").read_text())
    assert folders["plain"] == "plain" and len(folders[cjk].encode()) <= 100
    assert {r["label"] for r in added} == {cjk, emoji, "plain"}


def test_import_is_bounded_and_forgiving_per_row(base_run, tmp_path, fmnist_test):
    """A 2 GB sparse .png was read whole (+2.3 GB RSS); one bad CSV row aborted the import; a
    field over 131 KB was a traceback; a BOM header was read as data; absolute and ../ paths
    were imported without saying so. Now each is named and skipped, the rest imported."""
    root = tmp_path / "csvdir"
    (root / "img").mkdir(parents=True)
    for j, i in enumerate(of_class(fmnist_test, 8, 3)):
        (root / "img" / f"{j}.png").write_bytes(png(fmnist_test, i))
    with open(root / "img" / "huge.png", "wb") as f:  # sparse: 2 GB that take no disk
        f.truncate(2 * 1024**3)
    outside = tmp_path / "outside.png"
    outside.write_bytes(png(fmnist_test, int(of_class(fmnist_test, 8, 4)[3])))
    (root / "img" / "solo.png").write_bytes(png(fmnist_test, int(of_class(fmnist_test, 8, 6)[5])))
    lines = [
        "\ufeffpath,label",  # a BOM before the header
        "img/0.png,bags",
        "img/huge.png,bags",
        "only-one-field",
        '"' + "x" * 200_000 + '",bags',
        "img/1.png,bags",
        f"{outside},bags",
        "../outside.png,bags",
        "img/2.png,bags",
        "img/solo.png,solo",  # one image of a trained class: the import says so (issue 53)
    ]
    (root / "list.csv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    data = tmp_path / "data"
    args = ["import", root / "list.csv", "--model", base_run, "--data-dir", data, "--no-progress"]
    p = run_cli("service.tools.gallery_tool", *args)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "imported 4," in p.stdout, p.stdout + p.stderr
    solo = [ln for ln in p.stdout.splitlines() if ln.startswith("snca-gallery: label 'solo': ")]
    assert solo and "already classifies" in solo[0], p.stdout  # /gallery/add's diagnostics
    err = p.stderr
    assert "huge.png" in err and "limit" in err
    assert "line 4" in err and "line 5" in err and "field larger" in err
    assert err.count("outside the CSV's folder") == 2 and "Traceback" not in err
    assert "path" not in {x for x in label_counts_of(data, base_run)}  # the header is no row
    p = run_cli("service.tools.gallery_tool", *args, "--allow-outside")
    assert "imported 1," in p.stdout, p.stdout + p.stderr  # the two outside rows: one image


def label_counts_of(data, run) -> dict[str, int]:
    conn = sqlite3.connect(data / "gallery.sqlite")
    try:
        return dict(
            conn.execute(
                "SELECT label, COUNT(*) FROM items WHERE deleted_seq IS NULL GROUP BY label"
            ).fetchall()
        )
    finally:
        conn.close()


def test_store_commands_load_no_torch(base_run, tmp_path, fmnist_test):
    """The commands that only read or write the store (galleries, backup, verify, compact,
    prune, relabel, rename, merge, review-export) run on the standard library, pydantic and the
    store: no torch import (~1.5 s of CPU each; a history run calls them while servers load)."""
    import subprocess
    import sys

    data = tmp_path / "serve"
    ids = _gallery_with_images(base_run, data, fmnist_test, {"handbag": 2, "kicks": 1})
    code = """if True:
        import sys
        from service.tools.gallery_tool import main

        run, data, out, moved = sys.argv[1:]
        given = ["--model", run, "--data-dir", data]
        commands = (["galleries"], ["backup", out + "/bk"], ["verify", out + "/bk"],
                    ["compact", "--keep", "1"], ["prune", "--keep", "1"],
                    ["relabel", moved, "--label", "kicks"], ["rename", "kicks", "shoes"],
                    ["merge", "handbag", "shoes"], ["review-export", out + "/rv"])
        print([main([*c, *given]) for c in commands], "torch" in sys.modules)
    """
    p = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            str(base_run),
            str(data),
            str(tmp_path),
            str(ids["handbag"][0]),
        ],
        capture_output=True,
        text=True,
    )
    assert p.stdout.strip().endswith("[0, 0, 0, 0, 0, 0, 0, 0, 0] False"), p.stdout + p.stderr
    counts = label_counts_of(data, base_run)  # the writes were made
    assert counts["shoes"] == 3 and "handbag" not in counts and "kicks" not in counts, counts


def test_export_of_a_served_gallery_loads_no_model_and_is_the_same(
    base_run, tmp_path, fmnist_test, monkeypatch
):
    """An export of a gallery that has served (learn exports the live one on every run) opens
    its store as found without loading the model (5-6 s for a photo model): the same export as
    through the service state; a data dir never served still gets what a start seeds (the
    index's trained items), through the service state."""
    from service.tools import gallery_tool

    data = tmp_path / "data"
    added = _gallery_with_images(base_run, data, fmnist_test, {"bag": 2, "coat": 1})
    hosts = []
    real = gallery_tool.open_host
    monkeypatch.setattr(gallery_tool, "open_host", lambda s: hosts.append(s) or real(s))

    def export(name, data_dir):
        args = {"out": tmp_path / name, "model": base_run, "data_dir": data_dir, "progress": False}
        assert gallery_tool.export_items(args, log=lambda *a, **k: None) == 0
        rows = (tmp_path / name / "items.jsonl").read_text().splitlines()
        return [json.loads(x) for x in rows], json.loads(
            (tmp_path / name / "export.json").read_text()
        )

    fast = export("fast", data)
    assert hosts == []  # (no model loaded)
    monkeypatch.setattr(gallery_tool, "open_served_store", lambda s: None)
    assert export("state", data) == fast and len(hosts) == 1
    assert sorted(r["id"] for r in fast[0] if r["source"] == "added") == sorted(
        i for ids in added.values() for i in ids
    )
    monkeypatch.undo()
    monkeypatch.setattr(gallery_tool, "open_host", lambda s: hosts.append(s) or real(s))
    seeded = export("fresh", tmp_path / "fresh")
    assert len(hosts) == 2  # never served: the service state seeds it

    def trained(rows):
        return [(r["id"], r["label"]) for r in rows if r["source"] == "trained"]

    assert len(trained(fast[0])) > 0 and trained(seeded[0]) == trained(fast[0])
