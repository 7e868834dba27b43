"""A real PostgreSQL server for the tests: Debian's `postgresql` package (the README's test
command installs it), `initdb` into a temporary dir, `pg_ctl` on a free loopback port, removed
afterwards. initdb refuses to run as root: then it runs as the `postgres` user."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest

from .helpers import free_port


def pg_bin() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    if not found:
        pytest.fail(
            "PostgreSQL is not installed (apt-get install postgresql; `make test` does it)",
            pytrace=False,
        )
    return Path(found[-1]).parent


class PostgresServer:
    def __init__(self):
        self.bin = pg_bin()
        self.root = Path(tempfile.mkdtemp(prefix="snca-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self.as_root = os.geteuid() == 0
        if self.as_root:
            shutil.chown(self.root, "postgres", "postgres")
        os.chmod(self.root, 0o755)
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")
        with open(self.data / "postgresql.conf", "a") as f:
            f.write(
                f"listen_addresses = '127.0.0.1'\nport = {self.port}\n"
                f"unix_socket_directories = '{self.root}'\nfsync = on\n"
                "max_connections = 200\n"
            )
        self.start()

    def _run(self, tool: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        cmd = [str(self.bin / tool), *args]
        if self.as_root:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if check and p.returncode != 0:
            raise RuntimeError(f"{tool} failed: {p.stdout}\n{p.stderr}")
        return p

    def start(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.root / "log"), "-w", "start")

    def start_if_stopped(self) -> None:
        if self._run("pg_ctl", "-D", str(self.data), "status", check=False).returncode != 0:
            self.start()

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop", check=False)

    def url(self, db: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{db}"

    def new_database(self) -> str:
        """A fresh empty database; its URL."""
        import psycopg

        name = "snca_" + uuid.uuid4().hex[:12]
        with psycopg.connect(self.url(), autocommit=True) as c:
            c.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def close(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)
