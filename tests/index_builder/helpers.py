"""Synthetic run dirs and clustered vectors for index tests."""

from pathlib import Path

import numpy as np
import torch

from embedding import EmbeddingNet, ModelConfig, save_memory_bank, save_model
from embedding.files import atomic_write_json


def clustered(n, d=128, clusters=50, spread=0.5, seed=0):
    """Unit vectors around `clusters` random unit centres; `spread` = norm of the noise."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((clusters, d)).astype(np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    y = rng.integers(0, clusters, n)
    x = centres[y] + spread * rng.standard_normal((n, d)).astype(np.float32) / np.sqrt(d)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x.astype(np.float32), y.astype(np.int64)


def make_run_dir(
    path: Path,
    emb: np.ndarray,
    labels: np.ndarray,
    num_classes: int,
    dim: int | None = None,
    dataset: str = "fashion-mnist",
    world: bool = True,
) -> str:
    """A run dir with a (random) conv4 model of embedding dim `dim` and the given memory bank;
    with its world statistics (as snca-train writes them) unless `world` is False: without
    them every build fits them on 20,000 Fashion-MNIST images (18 s a build), which these
    tests of the index do not need (tests/service/gallery/test_world.py tests that path)."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = ModelConfig(
        embedding_dim=dim or emb.shape[1], class_names=[f"class{i}" for i in range(num_classes)]
    )
    torch.manual_seed(0)
    model = EmbeddingNet(cfg)
    fp = save_model(model, path)
    if world:
        write_world(model, path, fp, num_classes)
    save_memory_bank(
        path / "memory.safetensors",
        torch.from_numpy(emb),
        torch.from_numpy(labels),
        torch.arange(len(emb)),
        fp,
    )
    atomic_write_json(path / "config.json", {"dataset": dataset})
    return fp


def brute_force(base: np.ndarray, queries: np.ndarray, k: int):
    sims = queries @ base.T  # (Q, N)
    ids = np.argsort(-sims, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(sims, ids, axis=1), ids


def recall_at(found: np.ndarray, truth: np.ndarray) -> float:
    k = truth.shape[1]
    return float(np.mean([len(set(f) & set(t)) / k for f, t in zip(found, truth, strict=True)]))


def write_world(model, path: Path, fp: str, num_classes: int) -> None:
    """World statistics of the model fitted on noise images (what the builder reads; the world
    check's quality is not what these tests are about)."""
    from embedding import world

    x = torch.randn(600, 1, 28, 28, generator=torch.Generator().manual_seed(1))
    _, s = world.collect(model, [x[:300], x[300:]])
    w = world.fit(s[:400], s[400:], np.arange(200) % num_classes)
    world.save(w, path, fp)
