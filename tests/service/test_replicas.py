"""One gallery, several serving processes: real snca-serve replicas on one SQLite store (what
`--workers N` runs) and on a real PostgreSQL server (tests/service/pg.py), and `--workers 2`
itself. Read-your-writes with X-Min-Gallery-Version, concurrent writers, kill -9, the store
going away, seeding once, a log compacted past a replica."""

from __future__ import annotations

import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from .helpers import Backend, Server, free_port, of_class, png

SECONDS = float(os.environ.get("SNCA_REPLICA_SECONDS", "6"))
H = "X-Min-Gallery-Version"


@pytest.fixture(params=["sqlite", "postgresql"])
def backend(request, tmp_path):
    pg = request.getfixturevalue("postgres") if request.param == "postgresql" else None
    return Backend(request.param, tmp_path, pg)


def add(c: httpx.Client, label: str, images: list[bytes]) -> httpx.Response:
    return c.post(
        "/gallery/add",
        data={"label": label},
        files=[("images", (f"{i}.png", b, "image/png")) for i, b in enumerate(images)],
    )


def state(url: str, version: int = 0, timeout: float = 600) -> dict:
    """/readyz once the replica has applied write `version` (/readyz ignores the header: a
    health check must never wait, so this asks again)."""
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.get(url + "/readyz", timeout=30)
        assert r.status_code == 200, r.text
        if r.json()["gallery_version"] >= version or time.monotonic() > deadline:
            return r.json()
        time.sleep(0.05)


def counts(url: str, version: int) -> dict[str, int]:
    r = httpx.get(url + "/gallery/labels", headers={H: str(version)}, timeout=30)
    assert r.status_code == 200, r.text
    return {x["label"]: x["count"] for x in r.json()["labels"]}


@pytest.mark.slow
def test_read_your_writes_and_deletes_across_replicas(backend, base_run, fmnist_train, fmnist_test):
    a = backend.start(base_run)
    b = backend.start(base_run)
    try:
        ca, cb = httpx.Client(base_url=a.url, timeout=30), httpx.Client(base_url=b.url, timeout=30)
        shots = [png(fmnist_train, i) for i in of_class(fmnist_train, 0, 5)]
        r = add(ca, "T-shirt/top", shots)
        assert r.status_code == 201, r.text
        v, ids = r.json()["gallery_version"], r.json()["ids"]
        # B, told the version A answered, sees the write in one try
        q = png(fmnist_test, of_class(fmnist_test, 0, 1)[0])
        r = cb.post("/classify", files={"image": ("q.png", q, "image/png")}, headers={H: str(v)})
        assert r.status_code == 200 and r.json()["gallery_version"] >= v
        r = cb.post(
            "/search",
            params={"k": 10, "label": "T-shirt/top"},
            files={"image": ("q.png", q, "image/png")},
            headers={H: str(v)},
        )
        assert {it["id"] for it in r.json()["items"]} == set(ids)
        assert counts(b.url, v)["T-shirt/top"] == 5
        # a version no write has reached: refused at once (it would wait the whole bound)
        r = cb.get("/gallery/labels", headers={H: str(v + 1000)})
        assert r.status_code == 422 and r.json()["code"] == "version_unknown", r.text
        assert cb.get("/gallery/labels", headers={H: "x1"}).json()["code"] == "header_invalid"
        # delete on B; A stops returning the item
        r = cb.delete(f"/gallery/items/{ids[0]}")
        assert r.status_code == 200, r.text
        v2 = r.json()["gallery_version"]
        r = ca.post(
            "/search",
            params={"k": 10, "label": "T-shirt/top"},
            files={"image": ("q.png", q, "image/png")},
            headers={H: str(v2)},
        )
        assert {it["id"] for it in r.json()["items"]} == set(ids[1:])
        # without the header a replica answers at once, and gallery_version says what it saw
        assert ca.get("/gallery/labels").json()["gallery_version"] >= v2
    finally:
        a.kill(signal.SIGTERM)
        b.kill(signal.SIGTERM)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)  # (SQLite: test_history.py)
def test_concurrent_writers_leave_identical_replicas_and_a_gap_free_log(
    backend, base_run, fmnist_train
):
    a = backend.start(base_run)
    b = backend.start(base_run)
    images = [png(fmnist_train, i) for i in of_class(fmnist_train, 0, 40)]
    acked: dict[str, list[int]] = {"a": [], "b": []}
    errors: list[str] = []
    stop = time.monotonic() + SECONDS

    def writer(name: str, url: str) -> None:
        c = httpx.Client(base_url=url, timeout=60)
        n = 0
        while time.monotonic() < stop:
            n += 1
            r = add(c, f"w-{name}-{n % 7}", images[n % 20 : n % 20 + 2])
            if r.status_code != 201:
                errors.append(r.text)
                continue
            acked[name] += r.json()["ids"]
            if n % 5 == 0:  # and delete one of the writes of the other replica
                other = acked["b" if name == "a" else "a"]
                if other:
                    r = c.delete(f"/gallery/items/{other[len(other) // 2]}")
                    if r.status_code not in (200, 404):
                        errors.append(r.text)

    try:
        ts = [threading.Thread(target=writer, args=x) for x in (("a", a.url), ("b", b.url))]
        [t.start() for t in ts]
        [t.join() for t in ts]
        assert not errors, errors[:3]
        assert len(acked["a"]) > 10 and len(acked["b"]) > 10
        floor, last, gaps = backend.log_rows()
        assert gaps == [] and last > floor
        sa, sb = state(a.url, last), state(b.url, last)
        assert sa["gallery_version"] == sb["gallery_version"] == last
        assert sa["gallery_checksum"] == sb["gallery_checksum"]
        assert sa["items"] == sb["items"]
        live = backend.query("SELECT COUNT(*) FROM items WHERE deleted_seq IS NULL")[0][0]
        assert sa["items"] == live
    finally:
        a.kill(signal.SIGTERM)
        b.kill(signal.SIGTERM)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)  # (SQLite: test_history.py)
def test_kill_9_during_a_stream_of_adds_loses_nothing_acknowledged(backend, base_run, fmnist_train):
    b = backend.start(base_run)  # a front + model process that follows A's writes
    # A, killed and restarted 3 times: one process (its write path is the front's in both
    # modes; a second start-up per round would only lengthen the test)
    a = backend.start(base_run, "--no-model-process")
    images = [png(fmnist_train, i) for i in of_class(fmnist_train, 5, 4)]
    acked: list[int] = []
    try:
        for rnd in range(3):
            done = threading.Event()

            def stream(url=a.url, rnd=rnd, done=done):
                c = httpx.Client(base_url=url, timeout=30)
                while not done.is_set():
                    try:
                        r = add(c, f"kill-{rnd}", images[:2])
                    except httpx.HTTPError:
                        return  # the process died mid-request: not acknowledged
                    if r.status_code == 201:
                        acked.extend(r.json()["ids"])

            t = threading.Thread(target=stream)
            t.start()
            time.sleep(1.5 + rnd * 0.7)
            a.kill(signal.SIGKILL)
            done.set()
            t.join()
            a = backend.start(base_run, "--no-model-process")
        assert len(acked) > 10
        last = backend.query("SELECT value FROM meta WHERE key = 'last_seq'")[0][0]
        sa, sb = state(a.url, int(last)), state(b.url, int(last))
        assert sa["gallery_checksum"] == sb["gallery_checksum"]
        cb = httpx.Client(base_url=b.url, timeout=30)
        for i in acked:
            assert cb.get(f"/gallery/items/{i}").status_code == 200, i
        # every add of two images is whole in the store: nothing half-written
        groups = backend.query(
            "SELECT add_seq, COUNT(*) FROM items WHERE label LIKE 'kill-%' GROUP BY add_seq"
        )
        assert groups and all(n == 2 for _, n in groups)
        stored = {r[0] for r in backend.query("SELECT id FROM items WHERE label LIKE 'kill-%'")}
        assert set(acked) <= stored
        assert sa["items"] == sb["items"]
    finally:
        a.kill(signal.SIGTERM)
        b.kill(signal.SIGTERM)


@pytest.mark.slow
def test_a_replica_behind_a_compacted_log_rebuilds_from_the_store(backend, base_run, fmnist_train):
    a = backend.start(base_run)
    b = backend.start(base_run)
    try:
        ca = httpx.Client(base_url=a.url, timeout=30)
        images = [png(fmnist_train, i) for i in of_class(fmnist_train, 7, 6)]
        v0 = add(ca, "kept", images[:1]).json()["gallery_version"]
        assert state(b.url, v0)["gallery_version"] == v0  # B holds an added item...
        os.kill(b.proc.pid, signal.SIGSTOP)  # ...and falls behind
        ids = []
        for n in range(3):
            ids += add(ca, f"gone-{n}", images[2 * n : 2 * n + 2]).json()["ids"]
        for i in ids[:4]:
            assert ca.delete(f"/gallery/items/{i}").status_code == 200
        last = state(a.url)["gallery_version"]
        # forget the history of the deleted items (snca-gallery compact, as an operator runs
        # it while the servers run): B's position is no longer in the log
        p = backend.tool(base_run, "compact", "--upto", str(last))
        assert f"after write {last}" in p.stdout and " 4 rows of deleted items removed" in p.stdout
        assert backend.log_rows() == (last, last, [])
        again = backend.tool(base_run, "compact", "--keep", "0")
        assert "nothing to do" in again.stdout
        os.kill(b.proc.pid, signal.SIGCONT)
        sb = state(b.url, last)
        assert sb.get("rebuilds") == 1
        assert sb["gallery_checksum"] == state(a.url, last)["gallery_checksum"]
        got = counts(b.url, last)
        assert got.get("gone-2") == 2 and got.get("kept") == 1 and "gone-0" not in got
        assert "rebuilt the gallery from the store" in b.read_log()
    finally:
        with_cont = getattr(b, "proc", None)
        if with_cont is not None and with_cont.poll() is None:
            os.kill(with_cont.pid, signal.SIGCONT)
        a.kill(signal.SIGTERM)
        b.kill(signal.SIGTERM)


@pytest.mark.slow
def test_postgres_stopped_while_serving_then_back(postgres, base_run, tmp_path, fmnist_test):
    backend = Backend("postgresql", tmp_path, postgres)
    a = backend.start(base_run)
    q = png(fmnist_test, 0)
    try:
        c = httpx.Client(base_url=a.url, timeout=30)
        assert add(c, "before", [q]).status_code == 201
        postgres.stop()
        try:
            r = add(c, "during", [q])
            assert r.status_code == 503 and r.json()["code"] == "store_unavailable", r.text
            assert r.headers["retry-after"]
            r = c.post("/classify", files={"image": ("q.png", q, "image/png")})
            assert r.status_code == 200 and r.json()["nearest_label"]
            deadline = time.monotonic() + 600
            while (r := c.get("/readyz")).status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert r.status_code == 503 and "store_error" in r.json(), r.text
        finally:
            postgres.start()
        deadline = time.monotonic() + 600
        while (r := add(c, "after", [q])).status_code != 201 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert r.status_code == 201, r.text
        deadline = time.monotonic() + 600
        while c.get("/readyz").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert c.get("/readyz").status_code == 200
        assert {"before", "after"} <= set(counts(a.url, r.json()["gallery_version"]))
    finally:
        a.kill(signal.SIGTERM)


@pytest.mark.slow
def test_replicas_started_together_seed_an_empty_database_once(postgres, base_run, tmp_path):
    backend = Backend("postgresql", tmp_path, postgres)

    procs, urls = [], []
    for n in range(3):
        d = tmp_path / f"r{n}"
        d.mkdir()
        port = free_port()
        log = open(d / "log", "w")  # noqa: SIM115
        procs.append(
            (
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "service",
                        "--model",
                        str(base_run),
                        "--data-dir",
                        str(d / "data"),
                        "--store",
                        backend.url,
                        "--port",
                        str(port),
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=dict(os.environ, OMP_NUM_THREADS="1"),
                ),
                d / "log",
            )
        )
        urls.append(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 600
        for url, (p, log) in zip(urls, procs, strict=True):
            while True:
                assert p.poll() is None, log.read_text()
                try:
                    if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.3)
        seeded = sum(
            len(re.findall("seeded the gallery store", log.read_text())) for _, log in procs
        )
        assert seeded == 1
        n_items = backend.query("SELECT COUNT(*) FROM items")[0][0]
        built = sqlite3.connect(base_run / "index" / "gallery.sqlite")
        assert n_items == built.execute("SELECT COUNT(*) FROM items").fetchone()[0]
        built.close()
        assert len({state(u)["gallery_checksum"] for u in urls}) == 1
    finally:
        for p, _ in procs:
            p.terminate()
            p.wait(timeout=60)


@pytest.mark.slow
def test_workers_2_share_one_gallery_and_survive_a_killed_worker(base_run, tmp_path, fmnist_train):
    srv = Server(base_run, tmp_path / "data", None, "--workers", "2", model_process=True)
    images = [png(fmnist_train, i) for i in of_class(fmnist_train, 9, 4)]
    try:
        c = httpx.Client(base_url=srv.url, timeout=30)

        def both(version: int) -> dict[int, dict]:
            """/readyz of each worker (new connections until both pids answered)."""
            seen: dict[int, dict] = {}
            deadline = time.monotonic() + 600
            while len(seen) < 2 and time.monotonic() < deadline:
                s = state(srv.url, version)
                seen[s["pid"]] = s
            assert len(seen) == 2, "only one worker answered"
            return seen

        pids = set(both(0))
        # read-your-writes through the one port, whichever worker answers
        for n in range(10):
            r = add(c, f"wk-{n}", images[:2])
            assert r.status_code == 201, r.text
            v = r.json()["gallery_version"]
            with httpx.Client(base_url=srv.url, timeout=30) as fresh:
                got = fresh.get("/gallery/labels", headers={H: str(v)}).json()
                assert f"wk-{n}" in {x["label"] for x in got["labels"]}
        assert len({s["gallery_checksum"] for s in both(v).values()}) == 1
        # kill -9 one worker mid-stream: the supervisor starts another, nothing acked is lost
        acked, done = [], threading.Event()

        def stream():
            while not done.is_set():
                try:
                    with httpx.Client(base_url=srv.url, timeout=30) as cc:
                        r = add(cc, "wk-stream", images[2:4])
                except httpx.HTTPError:
                    continue
                if r.status_code == 201:
                    acked.extend(r.json()["ids"])

        t = threading.Thread(target=stream)
        t.start()
        time.sleep(2)
        os.kill(min(pids), signal.SIGKILL)
        time.sleep(2)
        done.set()
        t.join()
        deadline = time.monotonic() + 600
        while "starting it again" not in srv.read_log() and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(1)
        last = int(
            sqlite3.connect(tmp_path / "data" / "gallery.sqlite")
            .execute("SELECT value FROM meta WHERE key = 'last_seq'")
            .fetchone()[0]
        )
        deadline = time.monotonic() + 600
        while True:  # until the new worker is up and both answer
            try:
                states = both(last)
                break
            except AssertionError:
                assert time.monotonic() < deadline, srv.read_log()
        assert min(pids) not in states
        assert len({s["gallery_checksum"] for s in states.values()}) == 1
        for i in acked:
            assert c.get(f"/gallery/items/{i}").status_code == 200
    finally:
        srv.kill(signal.SIGTERM)
    assert srv.proc.returncode == 0


@pytest.mark.slow
def test_deletes_on_a_lagging_replica_resolve_against_the_store(backend, base_run, fmnist_train):
    """A delete names what the store holds, not what the replica has applied: an item added on
    A a moment ago is deleted on B (it answered 404 and left the item live when B resolved
    ids from its own memory), and so is a whole label. B's follower here polls once a minute,
    so on SQLite it has applied none of A's adds when the deletes arrive."""
    a = backend.start(base_run)
    b = backend.start(base_run, env={"SNCA_FOLLOW_POLL_S": "60"})
    try:
        ca, cb = httpx.Client(base_url=a.url, timeout=30), httpx.Client(base_url=b.url, timeout=30)
        shots = [png(fmnist_train, i) for i in of_class(fmnist_train, 2, 6)]
        for i in range(4):  # one item at a time: add on A, delete at once on B
            r = add(ca, "lag-one", shots[i : i + 1])
            assert r.status_code == 201, r.text
            (item,) = r.json()["ids"]
            r = cb.delete(f"/gallery/items/{item}")
            assert r.status_code == 200, r.text
            assert r.json()["deleted"] == [item] and r.json()["label"] == "lag-one"
        r = add(ca, "lag-label", shots[4:6])
        ids = r.json()["ids"]
        r = cb.delete("/gallery/labels/lag-label")
        assert r.status_code == 200 and sorted(r.json()["deleted"]) == sorted(ids), r.text
        v = r.json()["gallery_version"]
        assert cb.delete("/gallery/labels/lag-label").status_code == 404  # nothing left
        assert cb.delete(f"/gallery/items/{ids[0]}").status_code == 404
        live = backend.query(
            "SELECT COUNT(*) FROM items WHERE label IN ('lag-one', 'lag-label') "
            "AND deleted_seq IS NULL"
        )
        assert live == [(0,)]
        for url in (a.url, b.url):  # both replicas agree (B applied A's adds, then its deletes)
            got = counts(url, v)
            assert "lag-one" not in got and "lag-label" not in got
        assert state(a.url, v)["gallery_checksum"] == state(b.url, v)["gallery_checksum"]
    finally:
        a.kill(signal.SIGTERM)
        b.kill(signal.SIGTERM)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _park(port: int, version: int) -> socket.socket:
    """A kept-alive connection whose GET /gallery/labels waits for `version`."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(f"GET /gallery/labels HTTP/1.1\r\nHost: 127.0.0.1\r\n{H}: {version}\r\n\r\n".encode())
    return s


def _parked(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return float(re.search(r"^snca_parked_requests (\S+)$", text, re.M).group(1))


def _until(what, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.mark.slow
def test_min_version_header_cannot_stall_the_server(base_run, tmp_path, fmnist_train):
    """X-Min-Gallery-Version was a lever for anyone: a parked request polled every 2 ms and
    kept polling after its client left, a version no store had reached waited the whole bound,
    and /healthz, /readyz and /metrics waited too. B's follower polls once a minute here, so
    A's write is committed but not applied on B until B writes itself."""
    data = tmp_path / "data"
    a = Server(base_run, data, model_process=True)
    env = {
        "SNCA_FOLLOW_POLL_S": "60",
        "SNCA_MIN_VERSION_WAIT_S": "60",
        "SNCA_MAX_PARKED_PER_CLIENT": "100",
    }
    b = Server(base_run, data, env, model_process=True)
    socks: list[socket.socket] = []
    try:
        ca, cb = httpx.Client(base_url=a.url, timeout=30), httpx.Client(base_url=b.url, timeout=30)
        shots = [png(fmnist_train, i) for i in of_class(fmnist_train, 2, 2)]
        v = add(ca, "parked", shots[:1]).json()["gallery_version"]
        assert cb.get("/readyz").json()["gallery_version"] < v  # B has not applied it
        # health, readiness and metrics never wait, whatever the header says
        for route in ("/healthz", "/readyz", "/metrics"):
            r = cb.get(route, headers={H: str(v)}, timeout=5)
            assert r.status_code == 200, (route, r.text)
            assert "problem" not in r.headers["content-type"]
        # a version no write has reached is refused at once
        r = cb.get("/gallery/labels", headers={H: "999999999999999998"}, timeout=5)
        assert r.status_code == 422 and r.json()["code"] == "version_unknown", r.text
        # 100 parked requests from one client: the 101st is refused, and they cost no CPU
        socks = [_park(b.port, v) for _ in range(100)]
        _until(lambda: _parked(b.url) == 100)
        r = cb.get("/gallery/labels", headers={H: str(v)}, timeout=5)
        assert r.status_code == 429 and r.json()["code"] == "too_many_waiting", r.text
        t0 = _cpu_seconds(b.proc.pid)
        time.sleep(2.0)
        spent = _cpu_seconds(b.proc.pid) - t0
        assert spent < 0.5, f"100 parked requests took {spent:.2f} s of CPU in 2 s"
        print(f"100 parked requests: {spent:.3f} s of the server's CPU in 2 s")
        # a client that goes away ends its request: its slot is free again
        for s in socks[:50]:
            s.close()
        _until(lambda: _parked(b.url) == 50)
        socks = socks[50:] + [_park(b.port, v) for _ in range(50)]
        _until(lambda: _parked(b.url) == 100)
        # B's own write applies A's first (the log in order): every parked request answers
        assert add(cb, "parked", shots[1:]).status_code == 201
        for s in socks:
            head = s.recv(65536).split(b"\r\n", 1)[0]
            assert head == b"HTTP/1.1 200 OK", head
        assert _parked(b.url) == 0
        assert "Traceback" not in b.read_log()
    finally:
        for s in socks:
            s.close()
        a.kill(signal.SIGTERM)
        b.kill(signal.SIGTERM)
