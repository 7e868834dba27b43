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
