"""`snca-train --init SOURCE --epochs 0`: a servable run dir from pretrained weights with nothing
trained and an empty gallery, for users who start from a few photos and no training set (as
Immich, clip-retrieval or Qdrant + an encoder start: a pretrained encoder, an empty collection).

The backbone is the source's as it is; the embedding is its pooled features themselves (the
embedding layer is the identity, d = the backbone's width: 1,280 for EfficientNet-Lite0), L2-
normalised like every embedding here, so cosine similarity is the pretrained features'. The
memory bank is empty and the model names no trained label: labels come from /gallery/add,
`snca-gallery import` or the page. `snca-train --init RUN_DIR` later learns a smaller
embedding from what users labelled."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from embedding.artifacts import save_memory_bank, save_model
from embedding.config import ModelConfig
from embedding.errors import SNCAError
from embedding.files import atomic_write_json
from embedding.model import EmbeddingNet
from embedding.rundir import RunDir

from . import rundir
from .config import EPOCHS_0_NEEDS_INIT, TrainConfig
from .init import apply, resolve

DEFAULT_IMAGE_SIZE = 224  # a source that does not say (torchvision's ImageNet weights)


def model_config(cfg: TrainConfig, loaded) -> ModelConfig:
    """The served model's config: the source's architecture and preprocessing, no labels, an
    embedding as wide as the backbone's features."""
    pre = loaded.preprocessing or {}
    channels = cfg.in_channels or int(pre.get("in_channels", 3))
    size = cfg.image_size or int(pre.get("image_size", DEFAULT_IMAGE_SIZE))
    mean, std = pre.get("mean", (0.485, 0.456, 0.406)), pre.get("std", (0.229, 0.224, 0.225))
    base = ModelConfig(
        arch=cfg.arch,
        in_channels=channels,
        image_size=size,
        mean=tuple(mean)[:channels] if len(mean) >= channels else (0.5,) * channels,
        std=tuple(std)[:channels] if len(std) >= channels else (0.5,) * channels,
        embedding_dim=2,  # replaced below by the backbone's width
        temperature=cfg.temperature,
        class_names=[],
        small_stem=cfg.resolved_small_stem(size),
    )
    base = loaded.model_config(base)
    width = EmbeddingNet(base).feature_dim
    return dataclasses.replace(base, embedding_dim=int(width))


def export(cfg: TrainConfig, overwrite: bool, log=print) -> Path:
    """Write the run dir `cfg.out` from `cfg.init` (SNCAError saying why not)."""
    if not cfg.init:
        raise SNCAError(EPOCHS_0_NEEDS_INIT)
    loaded = resolve(cfg.init)
    cfg = loaded.train_config(cfg)
    mc = model_config(cfg, loaded)
    net = EmbeddingNet(mc).eval()
    record = apply(net, loaded)
    with torch.no_grad():  # the embedding is the pooled features themselves
        net.embed.weight.copy_(torch.eye(mc.embedding_dim))
        net.embed.bias.zero_()
    record["embedding_layer"] = "identity (the pooled features)"
    stage, _, created = rundir.prepare(Path(cfg.out), False, overwrite)
    try:
        run = RunDir(stage)
        fp = save_model(
            net, stage, {"loss": None, "epochs": 0, "init": record, "outlier_exposure": None}
        )
        empty = torch.empty(0, dtype=torch.long)
        save_memory_bank(run.memory, torch.empty(0, mc.embedding_dim), empty, empty, fp)
        atomic_write_json(run.config, cfg.to_dict())
        atomic_write_json(
            run.summary,
            {
                "epochs": 0,
                "pretrained": cfg.init,
                "model_fingerprint": fp,
                "final": {},
                "protocol": "nothing trained: the source's weights, an empty gallery",
            },
        )
        rundir.finalize(stage, Path(cfg.out))
    except BaseException:
        if created:
            rundir.discard(stage)
        raise
    log(
        f"{cfg.init}: {mc.arch}, {mc.image_size} px, {mc.embedding_dim}-d embedding (the "
        f"pooled features), no labels yet\nrun dir: {cfg.out}\nnext: snca-build-index "
        f"{cfg.out} && snca-serve --model {cfg.out}, then register labels (/gallery/add, "
        "snca-gallery import, or the page)"
    )
    return Path(cfg.out)
