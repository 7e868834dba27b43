"""Each worker is a front process and a model process (service/model/remote.py,
service/model_process.py): real snca-serve processes, the model process found by /readyz's
model_pid and killed for real."""

import io
import os
import shutil
import signal
import threading
import time

import httpx
import pytest
from PIL import Image

from service.model.engines import ENGINES
from tests.service.helpers import Server, model_seconds, of_class, png
from tests.service.hostile_images import corpus


def corpus_truncated(data: bytes) -> bytes:
    """`data` (a PNG) cut short: its header reads, its pixels do not."""
    return data[: len(data) // 2]


H = "X-Min-Gallery-Version"


def add(c: httpx.Client, label: str, images: list[bytes]) -> httpx.Response:
    return c.post(
        "/gallery/add",
        data={"label": label},
        files=[("images", (f"{i}.png", b, "image/png")) for i, b in enumerate(images)],
    )


def neighbour_ids(c: httpx.Client, image: bytes, headers=None) -> tuple[set[int], int]:
    """The ids of the query's 10 nearest items through /classify (the model process's
    replica votes and finds them), and the gallery version it answered at."""
    r = c.post(
        "/classify",
        params={"neighbors": "true", "k": 10},
        files={"image": ("q.png", image, "image/png")},
        headers=headers or {},
    )
    assert r.status_code == 200, r.text
    return {n["id"] for n in r.json()["neighbors"]}, r.json()["gallery_version"]


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def until(what, timeout: float = 120.0, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"not within {timeout} s")


def readyz(url: str) -> httpx.Response:
    return httpx.get(url + "/readyz", timeout=30)


@pytest.mark.slow
def test_read_your_writes_through_the_model_process(base_run, tmp_path, fmnist_train):
    """An add is acknowledged once the model process votes with it: on the same worker at once
    (no header), on another with X-Min-Gallery-Version; the same for a delete."""
    data = tmp_path / "data"
    a = Server(base_run, data, model_process=True)
    b = Server(base_run, data, model_process=True)
    try:
        ra = readyz(a.url).json()
        assert ra["model_pid"] != ra["pid"] and alive(ra["model_pid"])
        ca, cb = httpx.Client(base_url=a.url, timeout=30), httpx.Client(base_url=b.url, timeout=30)
        shots = [png(fmnist_train, i) for i in of_class(fmnist_train, 0, 3)]
        for round_ in range(3):  # each time: the model process must have applied this write
            r = add(ca, f"new-{round_}", shots)
            assert r.status_code == 201, r.text
            ids, v = set(r.json()["ids"]), r.json()["gallery_version"]
            first = r.json()["ids"][0]  # shots[0]'s own item: its nearest neighbour
            got, seen = neighbour_ids(ca, shots[0])
            assert first in got and seen >= v
            got, seen = neighbour_ids(cb, shots[0], {H: str(v)})
            assert first in got and seen >= v
            r = ca.delete(f"/gallery/labels/new-{round_}")
            assert r.status_code == 200, r.text
            v2 = r.json()["gallery_version"]
            got, seen = neighbour_ids(ca, shots[0])
            assert not ids & got and seen >= v2
            got, _ = neighbour_ids(cb, shots[0], {H: str(v2)})
            assert not ids & got
        # where the model process's time went reaches the front's /metrics, by phase
        spent = model_seconds(ca.get("/metrics").text)
        assert set(spent) == {"decode", "forward", "vote", "other"}, spent
        assert spent["forward"] > 0 and spent["vote"] > 0 and spent["decode"] > 0, spent
    finally:
        a.kill(signal.SIGTERM)
        b.kill(signal.SIGTERM)


@pytest.mark.slow
def test_model_process_killed_under_load(base_run, tmp_path, fmnist_train, fmnist_test):
    """SIGKILL of the model process while adds and classifications stream: every request
    answers (200, or 503 model_unavailable with Retry-After; none hangs), a new model process
    takes over, and every acknowledged add is in the gallery it votes over."""
    s = Server(base_run, tmp_path / "data", model_process=True)
    try:
        first = readyz(s.url).json()["model_pid"]
        shots = [png(fmnist_train, i) for i in of_class(fmnist_train, 0, 40)]
        query = png(fmnist_test, 0)
        acked: list[int] = []
        statuses: list[int] = []
        problems: list[dict] = []
        stop = threading.Event()

        failures: list[str] = []

        def never_hangs(fn):
            def run():
                try:
                    fn()
                except Exception as e:  # a timeout: a request hung
                    failures.append(repr(e))

            return run

        @never_hangs
        def writer():
            with httpx.Client(base_url=s.url, timeout=20) as c:
                i = 0
                while not stop.is_set():
                    r = add(c, "streamed", [shots[i % len(shots)]])
                    statuses.append(r.status_code)
                    if r.status_code == 201:
                        acked.extend(r.json()["ids"])
                    elif r.status_code == 503:
                        problems.append({**r.json(), "retry": r.headers.get("retry-after")})
                    i += 1

        @never_hangs
        def reader():
            with httpx.Client(base_url=s.url, timeout=20) as c:
                while not stop.is_set():
                    r = c.post("/classify", files={"image": ("q.png", query, "image/png")})
                    statuses.append(r.status_code)
                    if r.status_code == 503:
                        problems.append({**r.json(), "retry": r.headers.get("retry-after")})

        threads = [threading.Thread(target=f) for f in (writer, reader, reader)]
        for t in threads:
            t.start()
        until(lambda: len(acked) >= 5)
        os.kill(first, signal.SIGKILL)
        # /readyz says so while the new one starts (seconds: it imports torch, loads the
        # model and the gallery), then a new process serves
        down = until(
            lambda: (r := readyz(s.url)).status_code == 503 and r.json().get("model_error"),
            timeout=10,
            every=0.02,
        )
        second = until(
            lambda: readyz(s.url).status_code == 200 and readyz(s.url).json()["model_pid"] != first
        )
        assert second
        n_before = len(acked)
        until(lambda: len(acked) >= n_before + 5)  # writes go on through the new process
        stop.set()
        for t in threads:
            t.join(timeout=120)
            assert not t.is_alive(), "a request hung"
        assert not failures, failures
        assert "the model process" in down, down
        assert set(statuses) <= {200, 201, 503}, statuses
        assert problems, "nothing was in flight or sent while the model process was down"
        assert all(p["code"] == "model_unavailable" and p["retry"] for p in problems), problems
        r = readyz(s.url).json()
        assert r["model_pid"] != first and not alive(first)
        # every acknowledged add is live, in the store and in the new model process's replica
        items = httpx.get(s.url + "/gallery/labels").json()
        assert {x["label"]: x["count"] for x in items["labels"]}["streamed"] == len(acked)
        got, _ = neighbour_ids(httpx.Client(base_url=s.url, timeout=30), shots[0])
        assert got & set(acked)
        r = httpx.post(
            s.url + "/search",
            params={"k": 1000, "label": "streamed"},
            files={"image": ("q.png", shots[0], "image/png")},
        )
        assert {it["id"] for it in r.json()["items"]} == set(acked)
    finally:
        s.kill(signal.SIGTERM)


@pytest.mark.slow
def test_a_stopped_model_process_is_bounded_and_replaced_and_a_killed_front_takes_it(
    base_run, tmp_path, fmnist_test
):
    """A model process that stops answering (SIGSTOP: a hung forward, swap, a debugger) held
    /classify, /search and /gallery/add forever while /readyz said ready (issue 39, finding
    5). Now every wait is bounded by SNCA_MODEL_TIMEOUT_S: 503 model_unavailable (a write says
    it was not committed), /readyz 503, the process killed and replaced. Its environment holds
    no API key (a low finding: SNCA_API_KEYS was passed on). Then a killed front takes its
    model process with it."""
    key = "fence-key-0001"
    env = {"SNCA_MODEL_TIMEOUT_S": "3", "SNCA_API_KEYS": f"write:{key}"}
    s = Server(base_run, tmp_path / "data", env, model_process=True)
    model = readyz(s.url).json()["model_pid"]
    assert alive(model)
    with open(f"/proc/{model}/environ", "rb") as f:
        assert b"SNCA_API_KEY" not in f.read().upper()
    img = png(fmnist_test, 0)
    os.kill(model, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with httpx.Client(base_url=s.url, timeout=30, headers={"X-API-Key": key}) as c:
            r = c.post("/classify", files={"image": ("q.png", img, "image/png")})
            took = time.monotonic() - t0
            assert r.status_code == 503 and r.json()["code"] == "model_unavailable", r.text
            assert r.headers["Retry-After"] and took < 3 + 3, took  # (the bound, + a watch)
            r = c.post("/gallery/add", data={"label": "x"}, files={"images": ("a.png", img)})
            assert r.status_code == 503, r.text
            assert r.json()["code"] == "model_unavailable" and r.json()["committed"] is False
        until(lambda: readyz(s.url).status_code == 503, timeout=10)
        until(lambda: not alive(model), timeout=10)  # killed (SIGKILL works while stopped)
    finally:
        if alive(model):
            os.kill(model, signal.SIGCONT)
    s.wait("/readyz", timeout=120)  # a new model process
    model = readyz(s.url).json()["model_pid"]
    r = httpx.post(s.url + "/search", files={"image": ("q.png", img, "image/png")}, timeout=30)
    assert r.status_code == 200, r.text
    s.kill(signal.SIGKILL)
    until(lambda: not alive(model), timeout=10)


def test_a_busy_model_process_is_not_killed_and_its_queue_is_bounded(
    base_run, tmp_path, fmnist_test
):
    """Issue 51: under a flood the watchdog killed a model process that was busy, not hung (it
    judged the oldest queued job's age, which measures the queue), again and again, and
    nothing bounded the work queued to it. Now a process is hung only when it answers nothing
    for SNCA_MODEL_TIMEOUT_S while jobs wait, and the queue is held to SNCA_MODEL_QUEUE_S of
    work: past it requests are answered 503 model_busy with Retry-After at once. The flood is
    sized from the process's measured time per image: 4 timeouts of work offered at once."""
    timeout = 1.0
    env = {
        "SNCA_MODEL_TIMEOUT_S": str(timeout),
        "SNCA_MODEL_QUEUE_S": str(2 * timeout),
        "SNCA_MAX_BATCH": "1",
    }  # fmt: skip (one image per forward: the slowest honest pace)
    s = Server(base_run, tmp_path / "data", env, model_process=True)
    try:
        _flood(s, timeout, fmnist_test)
    finally:
        s.kill()


def _flood(s, timeout: float, fmnist_test) -> None:
    model = readyz(s.url).json()["model_pid"]
    images = [png(fmnist_test, i) for i in range(64)]
    files = [("images", (f"{i}.png", b, "image/png")) for i, b in enumerate(images)]
    with httpx.Client(base_url=s.url, timeout=120) as c:
        t0 = time.monotonic()
        assert c.post("/classify/batch", files=files).status_code == 200  # (its pace, measured)
        per_image = (time.monotonic() - t0) / len(images)
    n = max(4, int(4 * timeout / per_image / len(images)) + 1)  # batches of 64: 4 timeouts' work
    answers: list[httpx.Response] = []
    ready: list[int] = []
    go = threading.Barrier(n + 1)

    def flood():
        with httpx.Client(base_url=s.url, timeout=120) as c:
            go.wait()
            answers.append(c.post("/classify/batch", files=files))

    threads = [threading.Thread(target=flood) for _ in range(n)]
    for t in threads:
        t.start()
    go.wait()
    while any(t.is_alive() for t in threads):
        ready.append(readyz(s.url).status_code)
        time.sleep(0.1)
    codes = [r.status_code for r in answers]
    busy = [r for r in answers if r.status_code == 503]
    after = readyz(s.url).json()
    assert after["model_pid"] == model, "the busy model process was killed"
    assert after["model_process"]["killed_hung"] == after["model_process"]["restarts"] == 0
    assert after["model_process"]["busy"] == len(busy)
    assert codes.count(200) >= 1 and busy, (per_image, n, codes)
    assert all(r.json()["code"] == "model_busy" for r in busy), [r.json() for r in busy]
    assert all(int(r.headers["Retry-After"]) >= 1 for r in busy)
    assert set(ready) == {200}, ready  # (busy is not unready)


REQUESTS = [
    ("post", "/classify", {}),
    ("post", "/classify", {"vote": "knn", "k": 10, "neighbors": "true"}),
    ("post", "/classify", {"vote": "kde", "unknown_tpr": 0.5}),
    ("post", "/classify", {"labels": ["Trouser", "Bag"], "neighbors": "true"}),
    ("post", "/classify", {"unknown": "off", "vote": "prototype"}),
    ("post", "/classify/batch", {}),
    ("post", "/search", {"k": 5}),
    ("post", "/search", {"k": 5, "label": "Sandal"}),
    ("get", "/gallery/labels", {}),
]


def _answers(url: str, images: list[bytes]) -> list:
    out = []
    with httpx.Client(base_url=url, timeout=60) as c:
        for method, path, params in REQUESTS:
            for img in images[:2]:
                if path.endswith("batch"):
                    files = [("images", (f"{i}.png", b, "image/png")) for i, b in enumerate(images)]
                elif method == "post":
                    files = {"image": ("q.png", img, "image/png")}
                else:
                    files = None
                r = c.request(method, path, params=params, files=files)
                out.append((path, params, r.status_code, r.json()))
        r = add(c, "T-shirt/top", images[2:5])
        body = r.json()
        assert r.status_code == 201, r.text
        out.append(("add", r.status_code, body))
        for img in images[:2]:
            r = c.post("/classify", params={"neighbors": "true"}, files={"image": ("q", img)})
            out.append(("after add", r.json()))
        r = c.delete(f"/gallery/items/{body['ids'][0]}")
        out.append(("delete", r.status_code, r.json()))
        r = c.post("/classify", params={"labels": "Nope"}, files={"image": ("q", images[0])})
        out.append(("unknown label", r.status_code, r.json()["code"]))
        r = c.post("/classify", files={"image": ("q.png", b"not an image")})
        out.append(("not an image", r.status_code, r.json()["code"]))
        # every file of the hostile corpus: the same status and problem whichever process
        # decodes it (a model process decodes small queries itself: the front reads the header)
        for name, data, _ in corpus(Image.open(io.BytesIO(images[0]))):
            r = c.post("/classify", files={"image": (name, data)})
            body = r.json()
            out.append(
                (name, r.status_code, body.get("code"), body.get("detail"), body.get("label"))
            )
        bad = corpus_truncated(images[0])
        r = c.post("/classify/batch", files=[("images", ("i", b)) for b in (images[0], bad, bad)])
        out.append(("a batch with two truncated", r.status_code, r.json()["detail"]))
        ready = c.get("/readyz").json()
        out.append(
            ("readyz", {k: ready[k] for k in ("items", "gallery_version", "gallery_checksum")})
        )
    return out


@pytest.mark.slow
def test_every_route_answers_as_in_one_process(base_run, tmp_path, fmnist_test, fmnist_train):
    """The same requests, on copies of one gallery: a worker with a model process and one with
    the model on a thread (--no-model-process) give the same answers."""
    images = [png(fmnist_test, i) for i in range(3)] + [
        png(fmnist_train, i) for i in of_class(fmnist_train, 0, 2)
    ]
    seeded = Server(base_run, tmp_path / "one", None, "--no-model-process")
    seeded.kill(signal.SIGTERM)
    shutil.copytree(tmp_path / "one", tmp_path / "two")
    got = {}
    for name, extra in (("thread", ("--no-model-process",)), ("process", ())):
        s = Server(
            base_run,
            tmp_path / ("one" if name == "thread" else "two"),
            None,
            *extra,
            model_process=name == "process",
        )
        try:
            ready = readyz(s.url).json()
            assert (ready["model_pid"] == ready["pid"]) == (name == "thread")
            # the engine as the process that runs the model chose it (the same on both)
            assert ready["engine"] in ENGINES and ready["engine_note"], ready
            got[name] = _answers(s.url, images)
        finally:
            s.kill(signal.SIGTERM)
    for a, b in zip(got["thread"], got["process"], strict=True):
        assert same(a, b), (a, b)


def same(a, b) -> bool:
    """Equal, floats within 1e-5: the images of one /classify/batch may share a forward pass
    or not (whichever the batcher finds queued, in either mode), and a batch's size changes
    the last bits of its floats."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-5
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b
