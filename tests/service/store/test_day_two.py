"""Day two on a live gallery, on SQLite and on a real PostgreSQL, with real server processes
and the real `snca-gallery` commands: a backup taken while a server writes restores to the same
gallery; a model upgrade while writers write to an old replica, SIGKILLed half-way and resumed,
then switched and rolled back, loses no acknowledged write and writes nothing twice
(service/store/backup.py, service/store/upgrade.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from embedding.errors import ArtifactError
from service.store import sql
from service.store.backup import gallery_checksum, restore, verify
from service.store.registry import backend_class

from ..helpers import Backend, png, replaced_model

FAST = {"SNCA_FUSED_BATCHES": "0", "SNCA_MAX_BATCH": "8"}
FAST_ENV = {**FAST, "SNCA_WARMUP_SECONDS": "0"}


@pytest.fixture(scope="module")
def new_model(base_run, tmp_path_factory):
    return replaced_model(base_run, tmp_path_factory.mktemp("upgrade") / "run")


@pytest.fixture(params=["sqlite", "postgresql"])
def backend(request, tmp_path):
    pg = request.getfixturevalue("postgres") if request.param == "postgresql" else None
    return Backend(request.param, tmp_path, pg)


def tool(backend: Backend, run: Path, *args, check=True) -> subprocess.CompletedProcess:
    return backend.tool(run, *args, check=check, env=FAST_ENV)


def start_tool(backend: Backend, run: Path, *args) -> subprocess.Popen:
    return subprocess.Popen(
        backend.tool_command(run, *args),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=dict(os.environ, OMP_NUM_THREADS="1", **FAST_ENV),
    )


class Writer(threading.Thread):
    """Adds (one image each, labels w0..w4) and deletes (every 4th write: an item it added
    before) on one server until stopped; records what was acknowledged."""

    def __init__(self, url: str, raw, start_at: int = 0):
        super().__init__(daemon=True)
        self.url, self.raw, self.n = url, raw, start_at
        self.added: dict[int, str] = {}  # id -> label, acknowledged (201)
        self.deleted: set[int] = set()  # acknowledged deletes (200)
        self.acked_seq = 0  # the highest gallery_version an acknowledged write returned
        self.refused: list[int] = []
        self.deleting: int | None = None
        self.lock = threading.RLock()
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as c:
            while not self.stop.is_set():
                self.n += 1
                live = sorted(self.live())
                if self.n % 4 == 0 and live:
                    victim = live[self.n % len(live)]
                    with self.lock:  # (in flight: maybe deleted, maybe not, until answered)
                        self.deleting = victim
                    r = c.delete(f"/gallery/items/{victim}")
                    with self.lock:
                        self.deleting = None
                        if r.status_code == 200:
                            self.deleted.add(victim)
                            self.acked_seq = max(self.acked_seq, r.json()["gallery_version"])
                        else:
                            self.refused.append(r.status_code)
                    continue
                label = f"w{self.n % 5}"
                files = [("images", ("x.png", png(self.raw, self.n % 700), "image/png"))]
                r = c.post("/gallery/add", data={"label": label}, files=files)
                with self.lock:
                    if r.status_code == 201:
                        body = r.json()
                        self.added.update({i: label for i in body["ids"]})
                        self.acked_seq = max(self.acked_seq, body["gallery_version"])
                    else:
                        self.refused.append(r.status_code)
                if r.status_code != 201:
                    time.sleep(0.05)

    def live(self) -> dict[int, str]:
        """Acknowledged adds not deleted (nor being deleted right now)."""
        with self.lock:
            gone = self.deleted | {self.deleting}
            return {i: lab for i, lab in self.added.items() if i not in gone}

    def snapshot(self) -> tuple[int, dict[int, str]]:
        """(the highest version acknowledged, the live items) at one moment."""
        with self.lock:
            return self.acked_seq, self.live()


def added_items(url: str) -> dict[int, str]:
    """Every live added item (id -> label) a server's store lists, page by page."""
    out, token = {}, None
    with httpx.Client(base_url=url, timeout=30) as c:
        while True:
            params = {"limit": 1000, **({"page_token": token} if token else {})}
            page = c.get("/gallery/items", params=params).json()
            out |= {it["id"]: it["label"] for it in page["items"] if it["source"] == "added"}
            token = page["next_page_token"]
            if token is None:
                return out


def ready(url: str) -> dict:
    return httpx.get(url + "/readyz", timeout=10).json()


def until(what, timeout: float = 60.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = what()
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def seed(url: str, raw, n: int) -> None:
    with httpx.Client(base_url=url, timeout=60) as c:
        for s in range(0, n, 16):
            files = [
                ("images", (f"{i}.png", png(raw, 1000 + i), "image/png")) for i in range(s, s + 16)
            ]
            r = c.post("/gallery/add", data={"label": f"seed{s // 16 % 3}"}, files=files)
            assert r.status_code == 201, r.text


def target_carried(backend: Backend) -> int:
    """Added items in the gallery an upgrade is building (read straight from its store)."""
    q = "SELECT COUNT(*) FROM items WHERE source = 'added'"
    if backend.kind == "sqlite":
        found = list((backend.tmp / "data" / "galleries").glob("*/gallery.sqlite"))
        if not found:
            return 0
        conn = sqlite3.connect(f"file:{found[0]}?mode=ro", uri=True)
        try:
            return conn.execute(q).fetchone()[0]
        except sqlite3.Error:
            return 0
        finally:
            conn.close()
    import psycopg

    with psycopg.connect(backend.url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT schema_name FROM information_schema.schemata WHERE schema_name LIKE 'snca_%'"
        ).fetchall()
        if not rows:
            return 0
        try:
            return conn.execute(q.replace("items", f"{rows[0][0]}.items")).fetchone()[0]
        except psycopg.Error:
            return 0


def follows(backend: Backend, run: Path) -> Path:
    """The model `snca-serve --model RUN --follow-alias` serves on the backend's store."""
    from service.config import Settings
    from service.startup import follow_alias

    where = {"store": backend.url} if backend.url else {}
    s = Settings(model=run, data_dir=backend.tmp / "data", follow_alias=True, **where)
    follow_alias(s)
    return Path(s.model).resolve()


def store_conn(backend: Backend):
    """(connection, dialect) on the home store (for the checksum at a past write)."""
    if backend.kind == "sqlite":
        return sqlite3.connect(backend.tmp / "data" / "gallery.sqlite"), sql.SQLITE
    import psycopg

    return psycopg.connect(backend.url, autocommit=True), sql.POSTGRES


def test_backup_under_writes_restores_the_same_gallery(backend, base_run, tmp_path, fmnist_train):
    """A backup taken while a server writes holds every write acknowledged before it started,
    its checksum equals the live source's at the backup's log position (computed later, after
    more writes), and it restores into an empty store to a gallery with that checksum, which a
    server then serves. A damaged backup, or a non-empty target, is refused."""
    a = backend.start(base_run, env=FAST, model_process=False)  # (the writers' server)
    w = Writer(a.url, fmnist_train)
    try:
        seed(a.url, fmnist_train, 48)
        w.start()
        until(lambda: len(w.added) >= 10)
        before, before_live = w.snapshot()  # acknowledged before the backup starts
        out = tmp_path / "backup"
        p = tool(backend, base_run, "backup", str(out))
        until(lambda: w.acked_seq > before + 5)  # the writes go on after it
    finally:
        w.stop.set()
        w.join(timeout=60)
    m = json.loads((out / "backup.json").read_text())
    print(
        f"backup[{backend.kind}]: at write {m['last_seq']} (writes acknowledged before it "
        f"started: up to {before}; after: {w.acked_seq}), {m['items']} items"
    )
    assert m["last_seq"] >= before, (m["last_seq"], before)
    assert str(m["last_seq"]) in p.stdout
    conn, d = store_conn(backend)
    try:
        assert gallery_checksum(conn, d, m["last_seq"])[0] == m["checksum"]
        assert gallery_checksum(conn, d, w.acked_seq)[0] != m["checksum"]  # (it moved on)
    finally:
        conn.close()
    assert verify(out)["checksum"] == m["checksum"]
    a.kill()
    # restore into an empty data dir / database
    fresh = Backend(backend.kind, tmp_path / "restored", backend.pg)
    (tmp_path / "restored").mkdir()
    r = tool(fresh, base_run, "restore", str(out))
    assert m["checksum"][:16] in r.stdout
    target = fresh.url or str(fresh.tmp / "data" / "gallery.sqlite")
    conn, d = store_conn(fresh)  # the restored store's own checksum at that position
    try:
        assert gallery_checksum(conn, d, m["last_seq"])[0] == m["checksum"]
    finally:
        conn.close()
    b = fresh.start(base_run, env=FAST, model_process=False)
    try:
        body = ready(b.url)
        assert body["gallery_version"] == m["last_seq"]
        # every add acknowledged before the backup started is in it (its row, added by a write
        # the backup holds; the writer may have deleted it since, by a write the backup holds
        # too), and the restored server serves exactly the backup's live items
        conn = sqlite3.connect(f"file:{out / 'gallery.sqlite'}?mode=ro", uri=True)
        rows = {
            r[0]: r[1:]
            for r in conn.execute(
                "SELECT id, label, add_seq, deleted_seq FROM items WHERE source = 'added'"
            )
        }
        conn.close()
        for i, label in before_live.items():
            assert i in rows and rows[i][0] == label and rows[i][1] <= m["last_seq"], i
            assert rows[i][2] is None or rows[i][2] <= m["last_seq"], i
        have = added_items(b.url)
        assert have == {i: r[0] for i, r in rows.items() if r[2] is None}
        assert len(have) == m["added"]
        # a restore never overwrites: the target holds a gallery now
        with pytest.raises(ArtifactError, match="exists|already holds"):
            restore(backend_class(target), out, target, target, say=lambda _: None)
        assert ready(b.url)["gallery_version"] == m["last_seq"]
    finally:
        b.kill()
    # a damaged backup is refused before anything is written
    blob = bytearray((out / "gallery.sqlite").read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    (out / "gallery.sqlite").write_bytes(bytes(blob))
    bad = tool(fresh, base_run, "verify", str(out), check=False)  # (the command's exit status)
    assert bad.returncode == 2 and "sha256" in bad.stderr


def writing(backend, run, dataset, seeded: int):
    """Server A of model `run` (the writers' server), `seeded` items added, and a Writer
    adding to it from now on."""
    a = backend.start(run, env=FAST, model_process=False)
    seed(a.url, dataset, seeded)
    w = Writer(a.url, dataset)
    w.start()
    return a, w


def test_upgrade_under_writes_killed_resumed_switched_and_rolled_back(
    base_run, new_model, tmp_path, fmnist_train
):
    """(SQLite; PostgreSQL's upgrades run in the history checker, tests/service/test_history.py,
    and its start-up carry below.) Old-model server A takes adds and deletes throughout. `snca-gallery upgrade --to NEW`
    is SIGKILLed half-way through its copy and run again (resumes); a new-model server B serves
    the new gallery read-only meanwhile (/readyz standby, writes 503); `upgrade --switch` makes
    it live while A still writes: every write A acknowledged is in B's gallery, nothing twice
    (the same ids and labels as A's gallery, the same checksum), A is on standby. Writes on B,
    then `snca-gallery rollback`: A takes writes again and holds B's writes."""
    backend = Backend("sqlite", tmp_path)
    a, w = writing(backend, base_run, fmnist_train, 160)
    b = None
    try:
        until(lambda: len(w.added) >= 5)
        up = start_tool(backend, base_run, "upgrade", "--to", str(new_model), "--batch-size", "2")
        until(lambda: target_carried(backend) >= 20, timeout=120)
        up.send_signal(signal.SIGKILL)
        up.wait(timeout=30)
        half = target_carried(backend)
        assert 20 <= half < 160, half  # killed half-way through the copy
        # a new-model server on the half-built gallery: it serves it, read-only
        b = backend.start(new_model, env=FAST, wait_for="/healthz")
        until(lambda: ready(b.url).get("status") == "standby")
        r = httpx.delete(b.url + "/gallery/items/1", timeout=30)
        assert r.status_code == 503 and "standby" in r.json()["detail"]
        assert httpx.get(b.url + "/gallery/labels", timeout=30).status_code == 200
        # before the switch --follow-alias keeps each model on its own gallery: the new one on
        # the copy being built (not the home store's model, which it follows with no upgrade)
        assert follows(backend, new_model) == new_model.resolve()
        assert follows(backend, base_run) == base_run.resolve()
        n = w.n
        until(lambda: w.n > n + 10)  # A keeps writing while B serves the copy
        # run again: resumes the copy after its last batch, follows A's log, switches
        p = tool(backend, base_run, "upgrade", "--to", str(new_model), "--switch", "--no-progress")
        assert "switched" in p.stdout and "carrying" not in p.stdout, p.stdout  # (resumed)
        carried = int(re.search(r": (\d+) items carried", p.stdout).group(1))
        assert carried + half <= 160 + len(w.added), (carried, half)  # none of `half` again
        # `make run` and compose start with --follow-alias: the old model's command line now
        # serves the new model (the alias), on the same store
        assert follows(backend, base_run) == new_model.resolve()
        until(lambda: ready(a.url).get("status") == "standby")
        until(lambda: len(w.refused) >= 2)  # A refuses writes after the switch
    finally:
        w.stop.set()
        w.join(timeout=60)
    try:
        assert all(code == 503 for code in w.refused), w.refused
        until(lambda: ready(b.url).get("status") == "ready")
        want = w.live()
        on_a, on_b = added_items(a.url), added_items(b.url)
        for i, label in want.items():
            assert on_b.get(i) == label, (i, label)
        for i in w.deleted:
            assert i not in on_b, i
        assert on_b == on_a  # nothing lost, nothing written twice
        print(
            f"upgrade[{backend.kind}]: {len(w.added)} adds and {len(w.deleted)} deletes "
            f"acknowledged by A, {half} items carried at the kill, {len(on_b)} added items live"
        )
        until(lambda: ready(b.url)["gallery_checksum"] == ready(a.url)["gallery_checksum"])
        # writes on the new live gallery, then roll back
        w2 = Writer(b.url, fmnist_train, start_at=10_000)
        w2.start()
        until(lambda: len(w2.added) >= 6 and w2.deleted)
        w2.stop.set()
        w2.join(timeout=60)
        p = tool(backend, base_run, "rollback", "--no-progress")
        assert "switched" in p.stdout
        until(lambda: ready(a.url).get("status") == "ready")
        until(lambda: ready(b.url).get("status") == "standby")
        assert follows(backend, new_model) == base_run.resolve()
        on_a = added_items(a.url)
        for i, label in w2.live().items():
            assert on_a.get(i) == label, (i, label)
        for i in w2.deleted:
            assert i not in on_a, i
        assert on_a == added_items(b.url)
        files = [("images", ("y.png", png(fmnist_train, 5), "image/png"))]
        r = httpx.post(a.url + "/gallery/add", data={"label": "after"}, files=files, timeout=30)
        assert r.status_code == 201, r.text
        g = json.loads(tool(backend, base_run, "galleries").stdout)  # (the command's output)
        live = [x for x in g["galleries"] if x["live"]]
        assert len(live) == 1 and not live[0]["standby"]
        assert g["alias"]["previous"] is not None
    finally:
        for s in (b, a):
            if s is not None:
                s.kill()


def test_a_new_model_started_on_postgresql_builds_its_gallery_beside_and_switches(
    postgres,
    base_run,
    new_model,
    tmp_path,
    fmnist_train,
):
    """PostgreSQL has the start-up carry too (the one carry engine, its alias ending): a
    replica started with a model that has no gallery in the database builds it beside the live
    one while old-model server A keeps writing, switches, and serves; A turns standby; every
    write A acknowledged is on the new gallery. Then `snca-gallery rollback` switches back."""
    backend = Backend("postgresql", tmp_path, postgres)
    a, w = writing(backend, base_run, fmnist_train, 48)
    b = None
    try:
        until(lambda: len(w.added) >= 5)
        b = backend.start(new_model, env=FAST, wait_for="/healthz")  # (a front + model process)
        until(lambda: ready(b.url).get("status") == "ready", timeout=300)
        until(lambda: ready(a.url).get("status") == "standby")
        until(lambda: len(w.refused) >= 2)
    finally:
        w.stop.set()
        w.join(timeout=60)
    try:
        assert all(code == 503 for code in w.refused), w.refused
        on_b = added_items(b.url)
        for i, label in w.live().items():
            assert on_b.get(i) == label, (i, label)
        for i in w.deleted:
            assert i not in on_b, i
        assert ready(b.url)["migration"]["carried"] >= 48
        assert follows(backend, base_run) == new_model.resolve()
        p = tool(backend, base_run, "rollback", "--no-progress")
        assert "switched" in p.stdout
        until(lambda: ready(a.url).get("status") == "ready")
        assert added_items(a.url) == on_b
    finally:
        for s in (b, a):
            if s is not None:
                s.kill()
