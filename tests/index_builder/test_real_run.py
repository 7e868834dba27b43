"""snca-build-index on a tiny real Fashion-MNIST run, through the CLI."""

import numpy as np
import pytest
import torch

from embedding import load_memory_bank, load_model
from embedding.datasets import load_raw
from embedding.gallery import label_counts, open_store
from embedding.index import STORE_FILE, open_index_dir
from embedding.transforms import eval_transform
from tests.helpers import run_cli


@pytest.fixture(scope="module")
def tiny_run(models):
    run, _ = models.run(subset=700, val_size=100, epochs=1, batch_size=64)
    return run


@pytest.mark.parametrize("source", ["memory", "recompute"])
def test_both_sources_build_a_working_index(tiny_run, tmp_path, source):
    out = tmp_path / source
    p = run_cli("index_builder", tiny_run, "--out", out, "--source", source, "--no-progress")
    assert p.returncode == 0, p.stderr
    assert f"index: {out}" in p.stdout
    model = load_model(tiny_run)
    ix = open_index_dir(out, model.fingerprint)
    bank, _ = load_memory_bank(tiny_run / "memory.safetensors")
    n = bank["embeddings"].shape[0]
    assert ix.index.ntotal == n == 600
    assert ix.manifest.source == source
    conn = open_store(out / STORE_FILE)
    names = model.config.class_names
    expect = {names[c]: int(k) for c, k in enumerate(np.bincount(bank["labels"].numpy())) if k}
    assert label_counts(conn) == expect == ix.manifest.labels
    conn.close()
    rows = [0, 17, 599]
    if source == "memory":
        queries = bank["embeddings"][rows].numpy()
    else:  # the image itself, embedded as the service will embed it
        raw = load_raw("fashion-mnist", "train")
        tf = eval_transform(model.config)
        x = torch.stack([tf(raw.source.get(int(bank["indices"][r]))) for r in rows])
        with torch.no_grad():
            queries = model(x).numpy()
    sims, ids = ix.search(queries, 3)
    assert ids[:, 0].tolist() == rows
    assert (sims[:, 0] > 0.999).all()


def test_console_script_is_installed(tiny_run, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    exe = Path(sys.executable).parent / "snca-build-index"
    p = subprocess.run(
        [str(exe), str(tiny_run), "--out", str(tmp_path / "ix"), "--no-progress"],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "ix" / "manifest.json").is_file()


def test_cli_bad_input(tiny_run, tmp_path):
    def fails(*args, needle):
        p = run_cli("index_builder", *args)
        assert p.returncode == 2, p.stdout + p.stderr
        assert "Traceback" not in p.stderr and needle in p.stderr, p.stderr

    fails(tmp_path / "nope", needle="does not exist")
    fails(tiny_run, "--out", tmp_path / "x", "--factory", "PQ", needle="FAISS rejects")
    fails(tiny_run, "--out", tmp_path / "x", "--factory", "IVF1024,Flat", needle="IVF lists")
    fails(tiny_run, "--out", tmp_path / "x", "--nprobe", "0", needle="positive integer")
    assert run_cli("index_builder", tiny_run, "--out", tmp_path / "ok").returncode == 0
    fails(tiny_run, "--out", tmp_path / "ok", needle="--overwrite")
