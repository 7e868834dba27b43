"""snca-gallery's corrections and review-queue commands (issue 43) against a real server on the
same store: each is one write of the store's log, which the server follows; the queue exports
grouped with its thumbnails, a filled label column names the rows, the others are dismissed."""

import csv
import time

import httpx

from tests.helpers import run_cli

from ..helpers import Server, label_counts, of_class, png


def gallery(run, data, command, *args):
    """snca-gallery COMMAND ARGS on the served model's data dir."""
    return run_cli("service.tools.gallery_tool", command, *args, "--model", run, "--data-dir", data)


def wait_for(c, want, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = label_counts(c)
        if all(got.get(k) == v for k, v in want.items()):
            return got
        time.sleep(0.1)
    raise AssertionError(f"the server did not follow: {label_counts(c)} (wanted {want})")


def test_corrections_and_the_review_queue_from_the_command_line(base_run, tmp_path, fmnist_test):
    data = tmp_path / "serve"
    srv = Server(base_run, data, {"SNCA_REVIEW_QUEUE": "1"}, "--thumbnails")
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            assert c.delete("/gallery/labels/Bag").status_code == 200
            for i in of_class(fmnist_test, 8, 20):
                c.post("/classify", files={"image": ("q.png", png(fmnist_test, i))})
            deadline = time.time() + 30
            while c.get("/review").json()["queued"] < 15 and time.time() < deadline:
                time.sleep(0.2)
            queued = c.get("/review").json()["queued"]
            # export, grouped, thumbnails written beside
            out = tmp_path / "queue"
            p = gallery(base_run, data, "review-export", out)
            assert p.returncode == 0, p.stderr
            with open(out / "review.csv", encoding="utf-8") as f:
                rows = list(csv.DictReader(f))
            assert len(rows) == queued and all((out / r["thumbnail"]).is_file() for r in rows)
            assert [int(r["group"]) for r in rows] == sorted(int(r["group"]) for r in rows)
            # a person names group 1, leaves the rest
            for r in rows:
                r["label"] = "handbag" if r["group"] == "1" else ""
            with open(out / "review.csv", "w", newline="", encoding="utf-8") as f:
                w = csv.DictWriter(f, fieldnames=list(rows[0]))
                w.writeheader()
                w.writerows(rows)
            n1 = sum(r["group"] == "1" for r in rows)
            p = gallery(base_run, data, "review-name", out / "review.csv")
            assert p.returncode == 0 and f"{n1} of {n1} named" in p.stdout, p.stdout + p.stderr
            wait_for(c, {"handbag": n1})
            p = gallery(base_run, data, "review-dismiss", out / "review.csv")
            assert p.returncode == 0 and f"{queued - n1} queued queries dismissed" in p.stdout
            assert c.get("/review").json()["queued"] == 0
            # corrections: relabel, rename, merge, a file of decisions
            before = label_counts(c)
            items = c.get("/gallery/items", params={"label": "Trouser", "limit": 3}).json()
            ids = [x["id"] for x in items["items"]]
            p = gallery(base_run, data, "relabel", *map(str, ids[:2]), "--label", "pants")
            assert p.returncode == 0, p.stderr
            p = gallery(base_run, data, "rename", "handbag", "bags")
            assert p.returncode == 0, p.stderr
            p = gallery(base_run, data, "rename", "bags", "Trouser")
            assert p.returncode == 2 and "merge" in p.stderr  # (Trouser has items)
            p = gallery(base_run, data, "merge", "pants", "Trouser")
            assert p.returncode == 0, p.stderr
            (tmp_path / "d.csv").write_text(f"id,label\n{ids[2]},bags\n{ids[0]},bags\n")
            p = gallery(base_run, data, "accept", tmp_path / "d.csv")
            assert p.returncode == 0 and "2 of 2 items moved" in p.stdout, p.stdout + p.stderr
            (tmp_path / "bad.csv").write_text("id,label\nx,bags\n3,\n")
            p = gallery(base_run, data, "accept", tmp_path / "bad.csv")
            assert p.returncode == 2 and "nothing applied" in p.stderr
            wait_for(c, {"bags": n1 + 2, "Trouser": before["Trouser"] - 2})
            assert "handbag" not in label_counts(c) and "pants" not in label_counts(c)
    finally:
        srv.kill(15)
