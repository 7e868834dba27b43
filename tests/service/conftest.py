"""A tiny real model + index (Fashion-MNIST, five base classes) shared by the service tests."""

import io
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from embedding.datasets import load_raw


@pytest.fixture(scope="session")
def fmnist_test():
    return load_raw("fashion-mnist", "test")


@pytest.fixture(scope="session")
def fmnist_train():
    return load_raw("fashion-mnist", "train")


def png(raw, i: int, fmt: str = "PNG") -> bytes:
    b = io.BytesIO()
    Image.fromarray(raw.source.get(int(i))[0].numpy()).save(b, fmt)
    return b.getvalue()


def of_class(raw, cls: int, n: int, start: int = 0) -> np.ndarray:
    return np.nonzero(raw.targets == cls)[0][start : start + n]


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
            # start-up work that only buys speed later (~1.5 s of CPU a start): the fused
            # copies and the warm-up batches; tests/service/model/ test them, and a test whose
            # subject they are sets them in `env`
            SNCA_FUSED_BATCHES="0",
            SNCA_WARMUP_SECONDS="0",
        )
        full_env.update(env or {})
        where = [] if data_dir is None else ["--data-dir", str(data_dir)]
        self.proc = subprocess.Popen(
            [
                *prefix,
                sys.executable,
                "-m",
                "service",
                "--model",
                str(run),
                *where,
                "--port",
                str(self.port),
                *extra,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=full_env,
            cwd=cwd,
        )
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


@pytest.fixture(scope="session")
def postgres():
    """A real PostgreSQL server (tests/service/pg.py), started once per test process."""
    from .pg import PostgresServer

    server = PostgresServer()
    yield server
    server.close()
