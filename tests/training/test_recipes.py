"""The CIFAR-100 / ResNet-18 GPU recipe (training/recipes/), smoke-tested on the CPU.

CIFAR-100 cannot be downloaded here (no internet beyond package registries), so torchvision's
CIFAR100 reader is replaced by an in-memory stand-in with the same attributes (data (N,32,32,3)
uint8, targets, classes); everything after it is the real path: our CIFAR loader and its
superclass map, the recipe's hyper-parameters, ResNet-18 with the small stem, NCA or softmax."""

from pathlib import Path

import numpy as np
import pytest
import torchvision

from embedding.datasets import CIFAR100_COARSE_NAMES
from embedding.files import read_json
from training.cli import main as train_main
from training.config import load_yaml_config

RECIPE = Path(__file__).resolve().parents[2] / "training" / "recipes" / "cifar100-resnet18.yaml"


class FakeCIFAR100:
    def __init__(self, root, train=True, download=True):
        n = 400 if train else 100
        rng = np.random.default_rng(0 if train else 1)
        self.targets = [int(i % 100) for i in range(n)]
        self.data = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
        self.classes = [f"fine{i}" for i in range(100)]


def test_recipe_holds_the_paper_hyper_parameters():
    r = load_yaml_config(RECIPE)
    assert (r["dataset"], r["arch"], r["loss"], r["device"]) == (
        "cifar100",
        "resnet18",
        "nca",
        "cuda",
    )
    assert (r["embedding_dim"], r["temperature"], r["lr"], r["momentum"]) == (128, 0.05, 0.1, 0.9)
    assert r["weight_decay"] == 5e-4 and r["lr_gamma"] == 0.1 and r["epochs"] == 200


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--coarse", "--loss", "softmax"]])
def test_recipe_trains_on_cpu_on_a_tiny_subset(tmp_path, monkeypatch, extra):
    monkeypatch.setattr(torchvision.datasets, "CIFAR100", FakeCIFAR100)
    out = tmp_path / "run"
    args = ["--config", str(RECIPE), "--subset", "200", "--val-size", "0", "--epochs", "1"]
    args += ["--batch-size", "32", "--device", "cpu", "--num-workers", "0", "--no-progress"]
    assert train_main([*args, *extra, "--data-dir", str(tmp_path), "--out", str(out)]) == 0
    card, cfg = read_json(out / "model.json")["config"], read_json(out / "config.json")
    assert card["arch"] == "resnet18" and card["embedding_dim"] == 128
    assert cfg["lr_steps"] == [0.6, 0.8] and cfg["weight_decay"] == 5e-4
    if "--coarse" in extra:
        assert card["class_names"] == list(CIFAR100_COARSE_NAMES)
    else:
        assert len(card["class_names"]) == 100
    assert (out / "memory.safetensors").is_file()
    assert (out / "classifier.safetensors").is_file() == ("softmax" in extra)
