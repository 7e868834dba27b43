import fcntl
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

# Test processes share the cores (pytest-xdist workers, servers, trainings): OpenMP threads that
# spin while they wait burn CPU another process needs (two trainings side by side on 2 cores:
# 31 s with the default policy, 23 s passive; alone 13.0 s either way). Set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

# Keep test processes from oversubscribing each other: one thread per xdist worker.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // WORKERS)))


@pytest.fixture(scope="session")
def fashion_train():
    """The real Fashion-MNIST training split (installed by `make test` via apt, or downloaded)."""
    from embedding.datasets import load_raw

    return load_raw("fashion-mnist", "train")


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


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> Models:
    base = tmp_path_factory.getbasetemp()
    # under pytest-xdist each worker has its own basetemp below one shared by the session
    return Models(base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base)


@pytest.fixture(scope="session")
def short_run(models):
    """(run dir, stdout) of `python -m training` with SHORT."""
    return models.run(**SHORT)


BASE = "1,5,7,8,9"  # Trouser, Sandal, Sneaker, Bag, Ankle boot; T-shirt (0) is added at run time

# ~25 s: a tiny model of five base classes with its index (most service tests serve it, and
# the benchmark tools' tests)
BASE_RUN = dict(classes=BASE, subset=2000, val_size=200, epochs=2, batch_size=64)


@pytest.fixture(scope="session")
def base_run(models):
    """The base model's run dir, its index dir at run/index."""
    run, _ = models.run(index=True, **BASE_RUN)
    return run


def run_cli(module: str, *args, env=None, timeout=3600):
    """Run `python -m <module> args` as users do; return the CompletedProcess."""
    import subprocess
    import sys

    full_env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONUNBUFFERED="1")
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", module, *map(str, args)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
    )


# The longest files first, longest first (make test's durations: the first two take minutes
# alone, the rest 1.5-8 min of one worker in all), so that `--dist loadfile` hands the short files
# out last and both workers end together, instead of one worker running a long file at the end
# with nothing left to overlap it (test_replicas, the longest service file, used to be collected
# near the end by its name, and the suite's last minutes ran on one of two cores).
LONG_FILES = (
    "tests/training/test_train_e2e.py",
    "tests/experiments/test_reproduce.py",
    "tests/service/test_replicas.py",
    "tests/service/test_history.py",
    "tests/service/test_faults.py",
    "tests/service/store/test_day_two.py",
    "tests/service/test_integration.py",
    "tests/service/store/test_gallery_lifetime.py",
    "tests/service/http/test_fuzz.py",
    "tests/service/model/test_model_process.py",
    "tests/service/store/test_migration.py",
    "tests/service/http/test_hardening.py",
    "tests/service/test_colour_photos.py",
    "tests/service/tools/test_gallery_tool.py",
    "tests/service/tools/test_learn.py",
    "tests/service/http/test_browser.py",
)


def pytest_collection_modifyitems(session, config, items):
    root = Path(__file__).resolve().parent.parent
    rank = {name: i for i, name in enumerate(LONG_FILES)}

    def key(item) -> int:
        try:
            rel = Path(str(item.fspath)).resolve().relative_to(root).as_posix()
        except ValueError:
            return len(rank)
        return rank.get(rel, len(rank))

    items.sort(key=key)  # stable: everything else keeps its order


# Debian's Chromium (installed by `make test`), driven by Playwright: the web page's tests.
CHROMIUM = "/usr/bin/chromium"
# Flags for a sandboxed machine with no outside network (the background services of Chromium
# would try to reach Google's hosts; as root it needs --no-sandbox).
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    assert os.access(CHROMIUM, os.X_OK), f"{CHROMIUM} missing: `make test` installs it (apt)"
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        yield b
        b.close()


@pytest.fixture
def artifacts(request) -> Path:
    """A folder kept after the run for what a test shows (the page's screenshots):
    test-artifacts/<test id>/ under the checkout (SNCA_TEST_ARTIFACTS: elsewhere)."""
    import re

    root = Path(
        os.environ.get(
            "SNCA_TEST_ARTIFACTS", Path(__file__).resolve().parents[1] / "test-artifacts"
        )
    )
    d = root / re.sub(r"[^\w.-]+", "_", request.node.nodeid)
    d.mkdir(parents=True, exist_ok=True)
    return d
