"""Helpers every test folder shares (test modules and fixtures import these; conftest files
hold only fixtures and hooks): the test models (`Models`: each distinct training run once per
session), `run_cli` (a CLI as users run it)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from pathlib import Path

from tests.process_template import run_module

# ~60 s on 2 cores: 9,000 training images of all 10 classes, 8 epochs, cosine lr: the smallest
# model on which the classes separate well (the training tests and the example test share it).
SHORT = dict(subset=10000, val_size=1000, epochs=8, seed=0, lr_schedule="cosine")


def cli_args(options: dict) -> list[str]:
    """{"val_size": 1000, "no_progress": True} -> ["--val-size", "1000", "--no-progress"]."""
    out = []
    for k, v in options.items():
        flag = "--" + k.replace("_", "-")
        out += [flag] if v is True else [flag, str(v)]
    return out


class Models:
    """The test models: each distinct training run once per test session, shared by every test
    (and every pytest-xdist worker) that asks for the same options. A run is trained into the
    session's shared temp dir under a name made of its options, behind a file lock: the first
    asker trains, the others wait for it and then reuse it."""

    def __init__(self, root: Path):
        self.root = root / "models"
        self.root.mkdir(parents=True, exist_ok=True)

    def run(self, index: bool = False, **options) -> tuple[Path, str]:
        """(run dir, training's stdout) of `python -m training` with `options` (+ its index
        dir, run/index, built by `python -m index_builder` when `index`)."""
        key = hashlib.sha256(json.dumps([options, index], sort_keys=True).encode()).hexdigest()
        where = self.root / key[:16]
        where.mkdir(exist_ok=True)
        with open(where / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # held while the first asker trains
            done = where / "stdout.txt"
            if not done.exists():
                out = where / "run"
                shutil.rmtree(out, ignore_errors=True)
                p = run_cli("training", *cli_args(options), "--no-progress", "--out", out)
                assert p.returncode == 0, p.stderr
                if index:
                    q = run_cli("index_builder", out, "--out", out / "index", "--no-progress")
                    assert q.returncode == 0, q.stderr
                done.write_text(p.stdout)
        return where / "run", done.read_text()


BASE = "1,5,7,8,9"  # Trouser, Sandal, Sneaker, Bag, Ankle boot; T-shirt (0) is added at run time


# ~25 s: a tiny model of five base classes with its index (most service tests serve it, and
# the benchmark tools' tests)
BASE_RUN = dict(classes=BASE, subset=2000, val_size=200, epochs=2, batch_size=64)


def run_cli(module: str, *args, env=None, timeout=3600):
    """Run `python -m <module> args` as users do; return the CompletedProcess."""
    full_env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONUNBUFFERED="1")
    full_env.update(env or {})
    return run_module(module, args, full_env, timeout)  # (forked: tests/process_template.py)
