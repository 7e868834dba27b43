import os
from pathlib import Path

import pytest

from tests.helpers import BASE_RUN, SHORT, Models

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


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> Models:
    base = tmp_path_factory.getbasetemp()
    # under pytest-xdist each worker has its own basetemp below one shared by the session
    return Models(base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base)


@pytest.fixture(scope="session")
def short_run(models):
    """(run dir, stdout) of `python -m training` with SHORT."""
    return models.run(**SHORT)


@pytest.fixture(scope="session")
def base_run(models):
    """The base model's run dir, its index dir at run/index."""
    run, _ = models.run(index=True, **BASE_RUN)
    return run


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
