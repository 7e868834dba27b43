"""Helpers the service tests share (test modules import these, never each other): the app in
this process (`make_client`), an upload (`img`), and where replicas keep a gallery (`Backend`)."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

from fastapi.testclient import TestClient

from service.config import Settings
from service.http.app import create_app

from .conftest import Server, png


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
        p = subprocess.run(
            self.tool_command(run, *args),
            capture_output=True,
            text=True,
            timeout=600,
            env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})),
        )
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
