"""Helpers the service tests share (test modules and fixtures import these, never each other;
conftest.py holds only fixtures): real test images (`png`, `of_class`), a real snca-serve process
(`Server`, `free_port`), a second model (`replaced_model`), the app in this process
(`make_client`), an upload (`img`), and where replicas keep a gallery (`Backend`)."""

from __future__ import annotations

import io
import os
import re
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
from fastapi.testclient import TestClient
from PIL import Image

from service.config import Settings
from service.http.app import create_app
from tests.process_template import run_module, start_module


def make_client(run, data_dir, **kw):
    """The app in this process. The model on a thread (a TestClient tests the routes); the
    same routes through a model process: tests/service/model/test_model_process.py, which holds
    every route's answers in both modes equal."""
    kw.setdefault("model_process", False)
    # start-up work that only buys speed later: off unless the test's subject (as for Server)
    kw.setdefault("fused_batches", 0)
    kw.setdefault("warmup_seconds", 0)
    app = create_app(Settings(model=run, data_dir=data_dir, **kw))
    return TestClient(app, base_url="http://localhost")  # a loopback Host, as the server wants


def img(raw, i):
    return {"image": ("q.png", png(raw, i), "image/png")}


class Backend:
    """Where replicas keep the gallery: one SQLite file (a shared data dir) or PostgreSQL."""

    def __init__(self, kind: str, tmp: Path, pg=None):
        self.kind, self.tmp = kind, tmp
        self.url = pg.new_database() if kind == "postgresql" else None
        self.pg = pg
        self.n = 0

    def start(self, run: Path, *extra, env=None, **kw) -> Server:
        kw.setdefault("model_process", "--no-model-process" not in extra)  # as deployed
        self.n += 1
        if self.kind == "sqlite":  # one data dir: the store file and its snapshots
            return Server(run, self.tmp / "data", env, *extra, **kw)
        d = self.tmp / f"replica-{self.n}"
        d.mkdir(exist_ok=True)
        return Server(run, d / "data", env, "--store", self.url, *extra, **kw)

    def tool_command(self, run: Path, *args) -> list[str]:
        """`python -m service.tools.gallery_tool ARGS` on this backend's store."""
        where = ["--data-dir", str(self.tmp / "data")]
        if self.url:
            where += ["--store", self.url]
        tool = [sys.executable, "-m", "service.tools.gallery_tool"]
        return [*tool, *args, "--model", str(run), *where]

    def tool(self, run: Path, *args, check=True, env=None) -> subprocess.CompletedProcess:
        """snca-gallery ARGS on this backend's store, as users run it; rc 0 unless not `check`."""
        cmd = self.tool_command(run, *args)
        p = run_module(cmd[2], cmd[3:], dict(os.environ, OMP_NUM_THREADS="1", **(env or {})), 600)
        if check:
            assert p.returncode == 0, p.stdout + p.stderr
        return p

    def log_rows(self) -> tuple[int, int, list[int]]:
        """(log floor, last seq, seqs in (floor, last] missing from the log)."""
        if self.kind == "sqlite":
            conn = sqlite3.connect(self.tmp / "data" / "gallery.sqlite")
            meta = dict(conn.execute("SELECT key, value FROM meta"))
            seqs = {r[0] for r in conn.execute("SELECT seq FROM log")}
            conn.close()
        else:
            import psycopg

            with psycopg.connect(self.url) as conn:
                meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
                seqs = {r[0] for r in conn.execute("SELECT seq FROM log").fetchall()}
        floor, last = int(meta["log_floor"]), int(meta["last_seq"])
        return floor, last, [s for s in range(floor + 1, last + 1) if s not in seqs]

    def query(self, sql: str) -> list[tuple]:
        if self.kind == "sqlite":
            conn = sqlite3.connect(self.tmp / "data" / "gallery.sqlite")
            try:
                return conn.execute(sql).fetchall()
            finally:
                conn.close()
        import psycopg

        with psycopg.connect(self.url) as conn:
            return conn.execute(sql).fetchall()


def png(raw, i: int, fmt: str = "PNG") -> bytes:
    b = io.BytesIO()
    Image.fromarray(raw.source.get(int(i))[0].numpy()).save(b, fmt)
    return b.getvalue()


def of_class(raw, cls: int, n: int, start: int = 0) -> np.ndarray:
    return np.nonzero(raw.targets == cls)[0][start : start + n]


def model_seconds(metrics: str) -> dict[str, float]:
    """snca_model_seconds_total by phase, from /metrics' text."""
    found = re.findall(r'^snca_model_seconds_total\{phase="(\w+)"\} (\S+)$', metrics, re.M)
    return {phase: float(v) for phase, v in found}


def label_counts(client: httpx.Client) -> dict[str, int]:
    """Every label's live count, page by page (GET /gallery/labels pages at 1,000 labels)."""
    out, token = {}, None
    while True:
        params = {"page_token": token} if token else {}
        page = client.get("/gallery/labels", params=params).json()
        out |= {x["label"]: x["count"] for x in page["labels"]}
        token = page["next_page_token"]
        if token is None:
            return out


def run_beside(work: list, beside: list, stop) -> None:
    """Start the threads `work` and `beside`; when every one of `work` has ended, set the event
    `stop` (what `beside` loop on) and wait for `beside` to end too."""
    for t in work + beside:
        t.start()
    for t in work:
        t.join()
    stop.set()
    for t in beside:
        t.join()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A real `python -m service` process on a free loopback port."""

    def __init__(
        self,
        run: Path,
        data_dir: Path | None,
        env: dict | None = None,
        *extra,
        prefix: tuple[str, ...] = (),
        wait_for: str | None = "/readyz",
        cwd: Path | None = None,
        timeout: float = 600,
        poll: float = 0.2,
        model_process: bool = False,
    ):
        """`data_dir` None: the default one (data/<model name> under `cwd`); `prefix`: a
        command the server runs under (it must exec it, keeping the pid); `wait_for`: the route
        that must answer 200 before the server counts as started (None: only listening).
        `model_process`: each worker a front + model process, as deployed; off, one process
        (half the start-up and memory): the tests whose subject is the routes, the store or the
        write path (the front's in both modes) run that way, and test_model_process.py,
        test_replicas.py and test_day_two.py's new-model replicas run the pair."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        logs = data_dir.parent if data_dir is not None else cwd
        self.log = open(logs / f"server-{self.port}.log", "w")  # noqa: SIM115 (closed in kill)
        full_env = dict(
            os.environ,
            OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
            SNCA_MODEL_PROCESS="1" if model_process else "0",
            # start-up work that only buys speed (or memory) later (~1.5 s of CPU a start): the
            # fused copies and the warm-up batches; tests/service/model/ test them, and a test
            # whose subject they are sets them in `env`
            SNCA_FUSED_BATCHES="0",
            SNCA_WARMUP_SECONDS="0",
            # the same for timing the largest batch worth forming (~0.1 s for conv4, ~1 s for
            # Lite0): tests/service/model/test_batch_size.py tests it, benchmarks/photo_memory.py
            # measures it on a real photo model process
            SNCA_BATCH_MIN_GAIN="0",
        )
        full_env.update(env or {})
        where = [] if data_dir is None else ["--data-dir", str(data_dir)]
        args = ["--model", str(run), *where, "--port", str(self.port), *map(str, extra)]
        if prefix:
            self.proc = subprocess.Popen(
                [*prefix, sys.executable, "-m", "service", *args],
                stdout=self.log,
                stderr=subprocess.STDOUT,
                env=full_env,
                cwd=cwd,
            )
        else:  # forked: no ~2 s of imports (tests/process_template.py)
            self.proc = start_module("service", args, full_env, cwd, Path(self.log.name))
        self.wait(wait_for or "/healthz", timeout, poll)

    def wait(self, route: str = "/readyz", timeout: float = 600, poll: float = 0.2) -> None:
        """Until `route` answers 200 (RuntimeError with the log if the server exits first)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.read_log()}")
            try:
                if httpx.get(self.url + route, timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(poll)
        raise RuntimeError("server did not become ready: " + self.read_log())

    def read_log(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-3000:]

    def kill(self, sig=9) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)
        self.log.close()


def replaced_model(run: Path, out: Path, seed: int = 1, other_images: int = 0) -> Path:
    """A copy of run dir `run` whose weights are perturbed (a new fingerprint: what a retrain
    gives the service, without the minutes of one), with its memory bank re-saved for them and
    a fresh index dir (out/index). `other_images` k > 0: every k-th training image of the memory
    bank (so of the index) replaced by another image of the same class that `run` lacks, so the
    two indexes hold different trained images (as a model retrained on another draw of the data
    does): a label's delete or rename reaches the other's images by label only."""
    import shutil

    import torch

    from embedding import save_memory_bank, save_model
    from embedding.rundir import RunDir
    from index_builder.build import BuildConfig, build

    src = RunDir(run)
    out.mkdir(parents=True)
    for name in (RunDir.CONFIG, RunDir.DATASET):
        shutil.copyfile(src.file(name), out / name)
    model = src.load_model()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * p.abs().mean() * torch.randn(p.shape, generator=g))
    fp = save_model(model, out)
    mem = src.load_memory()
    indices = mem.indices
    if other_images:
        from embedding.datasets import load_raw

        targets = np.asarray(load_raw("fashion-mnist", "train").targets)
        indices = mem.indices.clone()
        taken = set(indices.tolist())
        for k in range(0, len(indices), other_images):
            cls = targets[int(indices[k])]
            j = next(j for j in np.nonzero(targets == cls)[0].tolist() if j not in taken)
            taken.add(j)
            indices[k] = j
    save_memory_bank(RunDir(out).memory, mem.embeddings, mem.labels, indices, fp)
    build(BuildConfig(run_dir=out, out=out / "index", progress=False), log=lambda m: None)
    return out
