"""Faults on a real server process: the disk fills up, SIGTERM arrives during batches, clients
interleave writes and reads. Nothing acknowledged is lost, nothing deleted comes back, and the
store stays intact.

(kill -9 at random points of concurrent adds and deletes: tests/service/test_history.py, the
history checker, which does it to servers, model processes and the snca-gallery commands.)"""

import os
import random
import resource
import signal
import sqlite3
import subprocess
import threading
import time

import httpx
import pytest

from .helpers import Server, of_class, png, run_beside


def _add(c, label, image, n=1):
    files = [("images", (f"{i}.png", image, "image/png")) for i in range(n)]
    return c.post("/gallery/add", data={"label": label}, files=files)


@pytest.mark.slow
def test_disk_full_answers_503_keeps_reads_and_recovers(base_run, tmp_path, fmnist_test):
    """RLIMIT_FSIZE = 0 on the running server: no file of the process may grow, which is what
    a full disk looks like to it (EFBIG instead of ENOSPC; Python ignores SIGXFSZ)."""
    img = png(fmnist_test, 0)
    server = Server(base_run, tmp_path / "serve")
    pid = server.proc.pid
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            assert _add(c, "before", img).status_code == 201
            for i in range(30):  # grow the WAL past its first pages
                assert _add(c, f"fill{i}", img, 4).status_code == 201
            before = c.get("/gallery/labels").json()
            _, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (0, hard))
            failed = 0
            for i in range(20):
                r = _add(c, f"during{i}", img, 4)
                assert r.status_code in (201, 503), r.text
                if r.status_code == 503:
                    failed += 1
                    assert "nothing was changed" in r.json()["detail"], r.text
            assert failed > 0  # the fault was real
            r = c.post("/classify", files={"image": ("q.png", img)})
            assert r.status_code == 200  # reads keep working
            assert c.post("/search", files={"image": ("q.png", img)}).status_code == 200
            assert c.get("/readyz").status_code == 503  # store not writable: out of rotation
            during = {x["label"]: x["count"] for x in c.get("/gallery/labels").json()["labels"]}
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (hard, hard))  # space is back
            r = _add(c, "after", img, 2)
            assert r.status_code == 201, r.text
            assert c.get("/readyz").status_code == 200
            acked = {x["label"]: x["count"] for x in before["labels"]}
            for lab, n in during.items():  # whatever was acknowledged during the fault
                acked.setdefault(lab, n)
            acked["after"] = 2
    finally:
        server.kill(signal.SIGTERM)
    conn = sqlite3.connect(tmp_path / "serve" / "gallery.sqlite")
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    conn.close()
    server = Server(base_run, tmp_path / "serve")
    try:
        got = {
            x["label"]: x["count"]
            for x in httpx.get(server.url + "/gallery/labels").json()["labels"]
        }
        assert got == acked
    finally:
        server.kill(signal.SIGTERM)


def _labels(c) -> dict[str, int]:
    return {x["label"]: x["count"] for x in c.get("/gallery/labels").json()["labels"]}


def _make_writable(server: Server, data) -> None:
    if os.geteuid() == 0:  # remount read-write in the server's own mount namespace
        cmd = ["nsenter", "-t", str(server.proc.pid), "-m", "mount", "-o", "remount,bind,rw"]
        p = subprocess.run([*cmd, str(data)], capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
    else:
        for f in [data, *data.iterdir()]:
            f.chmod(f.stat().st_mode | 0o200)


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["clean", "crashed"])
def test_read_only_store_serves_reads_refuses_writes_and_recovers(
    base_run, tmp_path, fmnist_test, stop
):
    """The data dir on a read-only filesystem (a `:ro` volume, a disk the kernel remounted
    read-only): a read-only bind mount in a private mount namespace, so even root gets EROFS.
    The server starts degraded, answers reads, refuses writes with 503, and takes writes again
    once the mount is read-write, with nothing lost or half-written. After a crash the last
    writes sit in the -wal file, which must be read too."""
    img = png(fmnist_test, 0)
    data = tmp_path / "serve"
    server = Server(base_run, data, model_process=True)  # (a crash takes both processes)
    with httpx.Client(base_url=server.url, timeout=30) as c:
        assert _add(c, "before", img, 3).status_code == 201
        before = _labels(c)
    if stop == signal.SIGKILL:  # a crash takes the model process too, before it can close
        model = httpx.get(server.url + "/readyz", timeout=30).json()["model_pid"]
        os.kill(model, signal.SIGSTOP)
        server.kill(stop)
        os.kill(model, signal.SIGKILL)
    else:
        server.kill(stop)
    wal = data / "gallery.sqlite-wal"
    assert (wal.exists() and wal.stat().st_size > 0) == (stop == signal.SIGKILL)

    if os.geteuid() == 0:  # root ignores permissions: a read-only mount, in its own namespace
        ro = f'mount --bind {data} {data} && mount -o remount,bind,ro {data} && exec "$@"'
        prefix = ("unshare", "-m", "sh", "-c", ro, "sh")
    else:  # anyone else: taking write permission away is the same fault to the server
        prefix = ()
        for f in [data, *data.iterdir()]:
            f.chmod(f.stat().st_mode & ~0o222)
    server = Server(base_run, data, None, prefix=prefix, wait_for="/healthz")
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            r = c.get("/readyz")
            assert r.status_code == 503 and r.json()["store_writable"] is False, r.text
            assert "read-only" in r.json()["store_error"], r.text
            assert _labels(c) == before  # reads keep working
            assert c.post("/classify", files={"image": ("q.png", img)}).status_code == 200
            assert c.post("/search", files={"image": ("q.png", img)}).status_code == 200
            r = _add(c, "during", img)
            assert r.status_code == 503, r.text
            assert "read-only" in r.json()["detail"] and "nothing was changed" in r.json()["detail"]
            assert c.delete("/gallery/labels/before").status_code == 503
            assert _labels(c) == before
            _make_writable(server, data)  # the disk comes back read-write
            r = _add(c, "after", img, 2)
            assert r.status_code == 201, r.text
            assert c.get("/readyz").status_code == 200
            assert _labels(c) == {**before, "after": 2}
    finally:
        server.kill(signal.SIGTERM)
    conn = sqlite3.connect(data / "gallery.sqlite")
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    conn.close()
    server = Server(base_run, data)
    try:
        assert _labels(httpx.Client(base_url=server.url)) == {**before, "after": 2}
    finally:
        server.kill(signal.SIGTERM)


@pytest.mark.slow
def test_sigterm_lets_in_flight_requests_finish(base_run, tmp_path, fmnist_test):
    batch = [("images", (f"{i}.png", png(fmnist_test, i), "image/png")) for i in range(32)]
    server = Server(base_run, tmp_path / "serve")
    outcomes, lock, stop = [], threading.Lock(), threading.Event()
    under_way: dict[int, float] = {}  # client thread -> when its request began

    def client():
        while not stop.is_set():
            began = under_way[threading.get_ident()] = time.monotonic()
            sent = []  # when the request's last byte was written (httpcore's trace)

            def trace(name, info, sent=sent):
                if name == "http11.send_request_body.complete":
                    sent.append(time.monotonic())

            try:  # a new connection per request: no idle keep-alive races
                with httpx.Client(base_url=server.url, timeout=30) as c:
                    r = c.post(
                        "/classify/batch",
                        files=batch,
                        headers={"Connection": "close"},
                        extensions={"trace": trace},
                    )
                    res = r.status_code if r.status_code != 200 else len(r.json()["results"])
            except httpx.ConnectError:
                res = "refused"  # after the listener closed: never accepted
            except httpx.HTTPError as e:
                res = f"dropped: {type(e).__name__}"
            with lock:
                under_way.pop(threading.get_ident(), None)
                outcomes.append((began, time.monotonic(), res, sent[0] if sent else None))

    threads = [threading.Thread(target=client) for _ in range(6)]
    for t in threads:
        t.start()
    time.sleep(2.0)
    # the signal while a request has been under way for a while: the clients finish together
    # (the server batches them) and begin again together, and a signal just after that found
    # every request begun within 0.25 s of it (none counted in flight; 7977e2f's CI, loaded)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with lock:
            if any(time.monotonic() - b > 0.4 for b in under_way.values()):
                break
        time.sleep(0.01)
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    code = server.proc.wait(timeout=60)
    took = time.monotonic() - t0
    stop.set()
    for t in threads:
        t.join()
    log = server.read_log()
    server.kill()
    # In flight = the whole request written well before the signal (0.25 s for the server to
    # read its headers). A request sent just before it may still sit in the listen backlog or
    # have its headers unread; uvicorn closes such connections on shutdown (the server never
    # started them), so those may be dropped, never the others. (It counted from when the
    # client began: on a loaded CI machine a request begun 0.25 s before the signal was still
    # being written by its starved client thread, and its drop failed the test.) A refusal is
    # a connection never accepted: fine once the signal closed the listener (a client begun
    # earlier may connect only then on a busy machine), never before it.
    in_flight = [(o, ended) for _, ended, o, sent in outcomes if sent and sent < t0 - 0.25]
    late = [o for _, _, o, sent in outcomes if not (sent and sent < t0 - 0.25)]
    done = [o for o, _ in in_flight if o == 32]
    bad = [
        (o, ended - t0)
        for o, ended in in_flight
        if o != 32 and not (o == "refused" and ended >= t0)
    ]
    bad += [o for o in late if o not in (32, "refused") and not str(o).startswith("dropped")]
    # uvicorn shuts down gracefully, then re-raises SIGTERM so the parent sees it: -15 (143)
    assert code in (0, -signal.SIGTERM) and took < 30
    assert "Finished server process" in log or "shutdown" in log.lower(), log[-2000:]
    assert len(done) > 6 and bad == [], outcomes
    # the signal did land mid-traffic: some request under way at that instant still completed
    assert any(b < t0 < e and o == 32 for b, e, o, _ in outcomes), outcomes


@pytest.mark.slow
def test_interleaved_writes_and_reads_stay_consistent(base_run, tmp_path, fmnist_test):
    """Each writer adds items under its own label, checks /search sees every acknowledged add,
    deletes one, and checks /search never returns it again, while readers classify."""
    server = Server(base_run, tmp_path / "serve")
    errors, stop = [], threading.Event()
    imgs = [png(fmnist_test, int(i)) for i in of_class(fmnist_test, 0, 40)]

    def writer(w):
        rng = random.Random(w)
        live: set[int] = set()
        with httpx.Client(base_url=server.url, timeout=30) as c:
            for step in range(12):
                r = _add(c, f"w{w}", imgs[rng.randrange(len(imgs))], 2)
                if r.status_code != 201:
                    errors.append(f"w{w} add {r.status_code}")
                    return
                live |= set(r.json()["ids"])
                hits = c.post(
                    "/search",
                    files={"image": ("q.png", imgs[0])},
                    params={"label": f"w{w}", "k": 1000},
                ).json()["items"]
                got = {h["id"] for h in hits}
                if got != live:
                    errors.append(f"w{w} step {step}: search {sorted(got)} != acked {sorted(live)}")
                gone = rng.choice(sorted(live))
                if c.delete(f"/gallery/items/{gone}").status_code != 200:
                    errors.append(f"w{w} delete {gone}")
                live.discard(gone)
                hits = c.post(
                    "/search",
                    files={"image": ("q.png", imgs[0])},
                    params={"label": f"w{w}", "k": 1000},
                ).json()["items"]
                if gone in {h["id"] for h in hits}:
                    errors.append(
                        f"w{w}: deleted id {gone} returned after the delete was acknowledged"
                    )

    def reader():
        with httpx.Client(base_url=server.url, timeout=30) as c:
            while not stop.is_set():
                r = c.post(
                    "/classify", files={"image": ("q.png", imgs[1])}, params={"neighbors": "true"}
                )
                if r.status_code != 200:
                    errors.append(f"classify {r.status_code}")

    writers = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    readers = [threading.Thread(target=reader) for _ in range(2)]
    try:
        run_beside(writers, readers, stop)
    finally:
        server.kill(signal.SIGTERM)
    assert errors == []


@pytest.mark.slow
def test_bad_index_refuses_to_start_and_bad_snapshot_is_replayed(base_run, tmp_path, fmnist_test):
    import shutil
    import subprocess
    import sys

    from embedding.index import INDEX_FILE

    exe = [sys.executable, "-m", "service", "--model", str(base_run), "--port", "0"]
    bad = tmp_path / "index"
    shutil.copytree(base_run / "index", bad)
    blob = bytearray((bad / INDEX_FILE).read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    (bad / INDEX_FILE).write_bytes(bytes(blob))
    for what in ("corrupt", "missing"):
        if what == "missing":
            (bad / INDEX_FILE).unlink()
        p = subprocess.run(
            [*exe, "--index", str(bad), "--data-dir", str(tmp_path / what)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert p.returncode == 2, (what, p.stderr)
        assert "snca-serve: error:" in p.stderr and INDEX_FILE in p.stderr, (what, p.stderr)
        assert "Traceback" not in p.stderr
    # a corrupt snapshot is not trusted: the service replays every write from the built index
    data_dir = tmp_path / "serve"
    srv = Server(base_run, data_dir)
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        assert _add(c, "a", png(fmnist_test, 0), 2).status_code == 201
        assert c.post("/admin/snapshot").status_code == 200
        assert _add(c, "b", png(fmnist_test, 1), 3).status_code == 201
    srv.kill(signal.SIGKILL)
    snaps = [
        p for p in data_dir.rglob("*") if p.is_file() and "snapshot" in str(p.relative_to(data_dir))
    ]
    assert snaps
    for p in snaps:
        p.write_bytes(b"garbage" + p.read_bytes()[7:])
    srv = Server(base_run, data_dir)
    try:
        labels = {
            x["label"]: x["count"] for x in httpx.get(srv.url + "/gallery/labels").json()["labels"]
        }
        assert labels["a"] == 2 and labels["b"] == 3
        assert "snapshot" in srv.read_log().lower()  # the warning says why it was ignored
    finally:
        srv.kill(signal.SIGTERM)
