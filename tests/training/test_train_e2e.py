"""Real training runs on Fashion-MNIST subsets through the CLI."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from embedding import EmbeddingNet, load_memory_bank, load_model
from embedding.knn import knn_evaluate
from embedding.rundir import RunDir
from tests.helpers import SHORT, run_cli
from training.config import TrainConfig
from training.datasets import build_data, embed_split


def _pixels(split):
    x = split.raw.source.images[torch.from_numpy(split.positions)].float().flatten(1)  # (n, 784)
    return F.normalize(x - x.mean(dim=1, keepdim=True), dim=1)


@pytest.mark.slow
def test_short_run_beats_untrained_net_and_raw_pixels(short_run):
    out, stdout = short_run
    assert "validation kNN top-1" in stdout
    summary = json.loads((out / "summary.json").read_text())
    trained_mem = summary["final"]["val_knn_top1@30"]
    trained_rec = summary["final"]["val_recompute_knn_top1@30"]

    data = build_data(TrainConfig(**SHORT))
    cfg = data.model_cfg
    val_y = torch.from_numpy(data.val.labels)
    tr_y = torch.from_numpy(data.train.labels)
    torch.manual_seed(123)
    untrained = EmbeddingNet(cfg)
    ve = embed_split(untrained, data.val, cfg)
    te = embed_split(untrained, data.train, cfg)
    base = knn_evaluate(ve, val_y, te, tr_y, 10, cfg.temperature, (30,))["knn_top1@30"]
    pix = knn_evaluate(
        _pixels(data.val), val_y, _pixels(data.train), tr_y, 10, cfg.temperature, (1, 30)
    )
    pixel_best = max(pix["knn_top1@1"], pix["knn_top1@30"])
    print(
        f"untrained {base:.2f}  raw pixels {pixel_best:.2f}  trained memory {trained_mem:.2f} "
        f"re-embedded {trained_rec:.2f}"
    )
    assert trained_rec > base + 5
    assert trained_mem > base
    assert trained_rec > pixel_best + 2


@pytest.mark.slow
def test_run_dir_is_complete_and_round_trips(short_run):
    out, _ = short_run
    names = {p.name for p in out.iterdir()}
    assert {
        "model.json",
        "model.safetensors",
        "memory.safetensors",
        "config.json",
        "metrics.jsonl",
        "curves.png",
        "summary.json",
        "checkpoint.safetensors",
        "dataset.json",
    } <= names
    assert not out.with_name(out.name + ".partial").exists()
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in metrics] == list(range(1, SHORT["epochs"] + 1))
    assert metrics[0]["memory_momentum"] == 0.5 and metrics[-1]["memory_momentum"] == 0.9
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    config = json.loads((out / "config.json").read_text())
    want = SHORT["subset"] - SHORT["val_size"]
    assert config["train_images"] == want and config["val_images"] == SHORT["val_size"]
    # where the images came from, enough for the index builder to read the same ones again
    prov = RunDir(out).read_provenance()
    assert prov.dataset == "fashion-mnist" and prov.train_items == 60000
    assert prov.root and (prov.load_train().root.resolve() == Path(prov.root))

    # Load model card + weights + memory bank, embed the validation images again:
    # the same kNN accuracy as the run reported.
    model = load_model(out)
    bank, meta = load_memory_bank(out / "memory.safetensors")
    assert meta["model_fingerprint"] == model.fingerprint
    assert bank["embeddings"].shape == (want, 128)
    torch.testing.assert_close(bank["embeddings"].norm(dim=1), torch.ones(want))
    data = build_data(TrainConfig(**SHORT))
    assert np.array_equal(bank["indices"].numpy(), data.train.positions)
    ve = embed_split(model, data.val, model.config, batch_size=256)
    res = knn_evaluate(
        ve,
        torch.from_numpy(data.val.labels),
        bank["embeddings"],
        bank["labels"],
        model.config.num_classes,
        model.config.temperature,
        (30,),
    )
    summary = json.loads((out / "summary.json").read_text())
    assert res["knn_top1@30"] == pytest.approx(summary["final"]["val_knn_top1@30"], abs=1e-6)


RESUME = [
    "--subset",
    "1500",
    "--val-size",
    "300",
    "--epochs",
    "3",
    "--batch-size",
    "64",
    "--no-progress",
    "--seed",
    "3",
]


@pytest.mark.slow
def test_kill_then_resume_equals_uninterrupted_run(tmp_path):
    ref = tmp_path / "ref"
    assert run_cli("training", *RESUME, "--out", ref).returncode == 0

    out = tmp_path / "killed"
    stage = tmp_path / "killed.partial"
    env = dict(os.environ, OMP_NUM_THREADS="2")
    proc = subprocess.Popen(
        [sys.executable, "-m", "training", *RESUME, "--out", str(out)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if (stage / "checkpoint.safetensors").exists():  # epoch 1 is done
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists(), "a killed run must not leave a run dir that looks complete"
    assert (stage / "checkpoint.safetensors").exists()

    p = run_cli("training", *RESUME, "--out", out, "--resume")
    assert p.returncode == 0, p.stderr
    assert not stage.exists()
    assert load_model(out).fingerprint == load_model(ref).fingerprint
    m_ref = (ref / "metrics.jsonl").read_text().splitlines()
    m_res = (out / "metrics.jsonl").read_text().splitlines()
    assert len(m_res) == 3
    for a, b in zip(m_ref, m_res, strict=True):
        a, b = json.loads(a), json.loads(b)
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-9)
        assert a["val_knn_top1@30"] == b["val_knn_top1@30"]

    # Extending the finished run with more epochs; a clashing option is refused.
    p = run_cli("training", *RESUME, "--out", out, "--resume", "--lr", "0.5")
    assert p.returncode != 0 and "differ" in p.stderr
    (out / "index").mkdir()  # an index built for the 3-epoch model...
    (out / "index" / "manifest.json").write_text("{}")
    p = run_cli("training", *RESUME, "--epochs", "4", "--out", out, "--resume")
    assert p.returncode == 0, p.stderr
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 4
    assert not (out / "index").exists()  # ...does not follow the extended run
    p = run_cli("training", *RESUME, "--epochs", "4", "--out", out, "--resume")
    assert p.returncode != 0 and "already has 4 epochs" in p.stderr
    assert not stage.exists() and (out / "model.json").exists()


@pytest.mark.slow
def test_softmax_baseline_run(tmp_path):
    out = tmp_path / "softmax"
    args = "--loss softmax --subset 2000 --val-size 400 --epochs 2 --no-progress"
    p = run_cli("training", *args.split(" "), "--out", out)
    assert p.returncode == 0, p.stderr
    assert "validation softmax top-1" in p.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final"]["val_softmax_top1"] > 50  # 10 classes: chance is 10%
    assert summary["final"]["val_recompute_knn_top1@30"] > 50
    assert (out / "classifier.safetensors").is_file()

    # The evaluation module reproduces the training-time validation numbers from the run dir
    # alone (same split, same kNN), and adds the +PCA row.
    from training.evaluate import closed_set

    r = closed_set(out, "val", (1, 30))
    fin = summary["final"]
    one_query = 100 / r["queries"] + 1e-6
    assert r["queries"] == 400
    assert abs(r["memory"]["knn_top1@30"] - fin["val_knn_top1@30"]) <= one_query
    assert abs(r["recompute"]["knn_top1@30"] - fin["val_recompute_knn_top1@30"]) <= one_query
    assert abs(r["parametric_top1"] - fin["val_softmax_top1"]) <= one_query
    assert r["pca_dim"] == 64 and r["pca_features"]["knn_top1@30"] > 50
    bad = run_cli("training.evaluate", tmp_path / "nope")
    assert bad.returncode == 2 and bad.stderr.startswith("evaluate: error:")


@pytest.mark.slow
def test_coarse_run_keeps_fine_labels(tmp_path):
    out = tmp_path / "coarse"
    args = "--coarse --classes 0,1,5,8 --subset 800 --val-size 100 --epochs 1 --batch-size 64"
    p = run_cli("training", *args.split(" "), "--no-progress", "--out", out)
    assert p.returncode == 0, p.stderr
    model = load_model(out)
    assert model.config.class_names == ["tops", "trousers_dresses", "footwear", "bags"]
    bank, _ = load_memory_bank(out / "memory.safetensors")
    assert set(bank["labels"].tolist()) == {0, 1, 2, 3}
    assert set(bank["fine_labels"].tolist()) == {0, 1, 2, 3}  # T-shirt, Trouser, Sandal, Bag
