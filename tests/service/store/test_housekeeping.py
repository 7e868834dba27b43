"""`snca-gallery prune`: previous/ keeps the newest N stores, never fewer than one, and never a
store that is the only copy of an item (an added item with no stored image could not be
carried to the next model). `snca-gallery compact` is run against live servers in
test_replicas.py (a replica behind the new floor rebuilds from the store)."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys

from embedding.gallery import utc_now


def prune(data, run, *args):
    tool = [sys.executable, "-m", "service.tools.gallery_tool", "prune"]
    return subprocess.run(
        [*tool, "--model", str(run), "--data-dir", str(data), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def archive(prev, base_run, n: int, only_copy: bool = False):
    p = prev / f"gallery-2026010{n}T000000Z-m{n}.sqlite"
    shutil.copyfile(base_run / "index" / "gallery.sqlite", p)
    if only_copy:  # an added item without its image: it exists nowhere else
        conn = sqlite3.connect(p)
        conn.execute(
            "INSERT INTO items (id, label, source, created_at, embedding, add_seq) "
            "VALUES (999999, 'mine', 'added', ?, x'00000000', 1)",
            (utc_now(),),
        )
        conn.commit()
        conn.close()
    os.utime(p, (1_700_000_000 + n, 1_700_000_000 + n))
    return p


def test_prune_keeps_the_newest_and_every_only_copy(base_run, tmp_path):
    data = tmp_path / "data"
    prev = data / "previous"
    prev.mkdir(parents=True)
    stores = [archive(prev, base_run, n, only_copy=(n == 1)) for n in range(5)]
    dry = prune(data, base_run, "--keep", "2", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.count("would remove") == 2
    assert all(p.exists() for p in stores)  # nothing removed by a dry run
    p = prune(data, base_run, "--keep", "2")
    assert p.returncode == 0, p.stderr
    left = sorted(x.name for x in prev.iterdir())
    assert left == sorted(s.name for s in (stores[1], stores[3], stores[4])), left
    assert "the only copy of 1 items" in p.stdout
    assert prune(data, base_run, "--keep", "0").returncode == 2  # at least one is kept
    for s in (stores[3], stores[4]):
        s.unlink()
    p = prune(data, base_run, "--keep", "1")
    assert [x.name for x in prev.iterdir()] == [stores[1].name]  # the newest, and an only copy
    empty = tmp_path / "empty"
    assert "no previous stores" in prune(empty, base_run).stdout
