import os

import pytest
import torch

# Two cores: keep test processes from oversubscribing each other.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def fashion_train():
    """The real Fashion-MNIST training split (installed by `make test` via apt, or downloaded)."""
    from embedding.datasets import load_raw

    return load_raw("fashion-mnist", "train")


# ~60 s on 2 cores: 9,000 training images of all 10 classes, 8 epochs, cosine lr: the smallest
# model on which the classes separate well (the training tests and the example test share it).
SHORT = dict(subset=10000, val_size=1000, epochs=8, seed=0, lr_schedule="cosine")


@pytest.fixture(scope="session")
def short_run(tmp_path_factory):
    """(run dir, stdout) of `python -m training` with SHORT."""
    out = tmp_path_factory.mktemp("runs") / "nca"
    args = [a for k, v in SHORT.items() for a in (f"--{k.replace('_', '-')}", v)]
    p = run_cli("training", *args, "--out", out, "--no-progress")
    assert p.returncode == 0, p.stderr
    return out, p.stdout


def run_cli(module: str, *args, env=None, timeout=600):
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
