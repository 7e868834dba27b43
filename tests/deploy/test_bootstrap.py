"""docker/bootstrap.sh itself (no engine needed), as the compose `bootstrap` job runs it: the
service's SNCA_DATA_DIR set for every command, the dataset in SNCA_DATASETS, thumbnails on,
downloads impossible, and Debian's /usr/share/datasets hidden (a mount namespace), so the
images can only be found where training recorded them (dataset.json). It once died at the index
step looking for Fashion-MNIST in the service's volume and trying to download it there."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from embedding.datasets import SYSTEM_FASHION_DIR
from embedding.index import read_manifest
from embedding.rundir import RunDir

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "docker" / "bootstrap.sh"
TRAIN = "--dataset fashion-mnist --arch conv4 --loss nca --epochs 1 --subset 1000 --val-size 100"


def _bootstrap(tmp: Path, **env) -> subprocess.CompletedProcess:
    """bootstrap.sh in its own mount namespace with SYSTEM_FASHION_DIR hidden under a tmpfs."""
    full = {
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "HOME": str(tmp / "home"),  # no download cache from earlier runs
        "SNCA_MODEL": str(tmp / "models" / "default"),
        "SNCA_DATA_DIR": str(tmp / "serve" / "default"),  # what compose sets for every service
        "SNCA_DATASETS": str(tmp / "datasets"),
        "SNCA_BOOTSTRAP_ARGS": TRAIN + " --batch-size 50",
        "SNCA_INDEX_ARGS": "--thumbnails",
        "SNCA_DEVICE": "cpu",
        "OMP_NUM_THREADS": "2",
        # any download fails at once: nothing listens on port 9
        "http_proxy": "http://127.0.0.1:9",
        "https_proxy": "http://127.0.0.1:9",
        "HTTP_PROXY": "http://127.0.0.1:9",
        "HTTPS_PROXY": "http://127.0.0.1:9",
        **env,
    }
    hide = f"mount -t tmpfs tmpfs {SYSTEM_FASHION_DIR.parent} && exec sh {SCRIPT}"
    return subprocess.run(
        ["unshare", "--map-root-user", "--mount", "sh", "-c", hide],
        capture_output=True,
        text=True,
        env=full,
        cwd=tmp,
        timeout=900,
    )


@pytest.mark.slow
def test_bootstrap_trains_and_indexes_offline_from_the_recorded_dataset(tmp_path):
    probe = subprocess.run(
        ["unshare", "--map-root-user", "--mount", "true"], capture_output=True, text=True
    )
    assert probe.returncode == 0, f"this test needs `unshare` (util-linux): {probe.stderr}"
    src = SYSTEM_FASHION_DIR  # installed by `make test` (apt: dataset-fashion-mnist)
    ds = tmp_path / "datasets" / "fashion-mnist"
    ds.mkdir(parents=True)
    for f in src.glob("*-ubyte*"):
        shutil.copyfile(f, ds / f.name)
    (tmp_path / "home").mkdir()

    p = _bootstrap(tmp_path)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "bootstrap: done" in p.stdout
    run = RunDir(tmp_path / "models" / "default")
    assert run.read_provenance().root == str(ds.resolve())
    m = read_manifest(run.path / "index")
    assert m.thumbnails and m.count == 900 and m.model_fingerprint == run.load_model_card()[1]
    serve = tmp_path / "serve" / "default"
    assert not serve.exists() or not any(serve.iterdir())  # nothing written to the gallery volume

    p = _bootstrap(tmp_path)  # the second `up`: nothing to do
    assert p.returncode == 0 and "nothing to do" in p.stdout, p.stderr
    p = _bootstrap(tmp_path, SNCA_RETRAIN="1")  # retrain in place, index rebuilt for it
    assert p.returncode == 0, p.stderr[-3000:]
    assert read_manifest(run.path / "index").model_fingerprint == run.load_model_card()[1]
