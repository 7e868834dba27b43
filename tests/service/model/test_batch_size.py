"""The batch the model process forms (Embedder.batch_cap) and the sizes start-up warms: a size
that buys no speed is not formed (its working memory grows with it: a Lite0 model process held
1.75 GB after batches of up to 64, 1.15 GB capped at 8), a cheap batch always is, and an engine
that keeps only its last few shapes compiled is warmed up to that many."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from embedding.config import ModelConfig
from embedding.model import EmbeddingNet
from service.model.embedder import CHEAP_BATCH_MS, Embedder
from service.model.engines.base import Engine


class Timed(Engine):
    """An engine whose batch of b images takes `fixed_ms + b * per_image_ms` (a sleep, so the
    timings are what they say whatever the machine) and keeps `kept` shapes."""

    name = "timed"

    def __init__(self, fixed_ms: float, per_image_ms: float, dim: int, kept: int | None = None):
        self.fixed, self.per_image, self.dim, self.shapes_kept = fixed_ms, per_image_ms, dim, kept
        self.sizes: list[int] = []

    def run(self, pixels: np.ndarray) -> np.ndarray:
        self.sizes.append(len(pixels))
        time.sleep((self.fixed + len(pixels) * self.per_image) / 1000)
        return np.zeros((len(pixels), self.dim), np.float32)


def embedder(engine: Engine) -> Embedder:
    cfg = ModelConfig(arch="conv4", in_channels=1, image_size=28, mean=[0.5], std=[0.25])
    e = Embedder(EmbeddingNet(cfg).eval(), torch.device("cpu"))
    engine.dim = e.dim
    e.engine = engine
    return e


def test_a_size_that_buys_no_speed_is_not_formed():
    # 3 ms an image whatever the batch (a photo model): 8, then 16 (48 ms, no faster): 8
    cap, timed = embedder(Timed(0.0, 3.0, 0)).batch_cap(64, 0.05)
    assert cap == 8 and sorted(timed) == [8, 16], timed
    # a fixed cost a call that larger batches share: each doubling pays, up to max_batch
    cap, timed = embedder(Timed(40.0, 1.0, 0)).batch_cap(64, 0.05)
    assert cap == 64 and sorted(timed) == [8, 16, 32, 64], timed
    # the gain asked for decides: 24.8 ms at 16 is 1.55 ms an image against 1.8 at 8 (14 %)
    assert embedder(Timed(4.0, 1.3, 0)).batch_cap(64, 0.05)[0] > 8
    assert embedder(Timed(4.0, 1.3, 0)).batch_cap(64, 0.5)[0] == 8
    # off, or no room to grow: max_batch as set
    assert embedder(Timed(0.0, 3.0, 0)).batch_cap(64, 0.0) == (64, {})
    assert embedder(Timed(0.0, 3.0, 0)).batch_cap(8, 0.05) == (8, {})
    assert embedder(Timed(0.0, 3.0, 0)).batch_cap(5, 0.05) == (5, {})


def test_a_cheap_batch_is_always_formed():
    # no faster per image, but 64 images run within CHEAP_BATCH_MS (conv4's case)
    per_image = CHEAP_BATCH_MS / 64 * 0.25
    cap, _ = embedder(Timed(0.0, per_image, 0)).batch_cap(64, 0.05)
    assert cap == 64


@pytest.mark.parametrize(("kept", "warmed"), [(3, 3), (None, 10)])
def test_warm_up_stops_at_the_shapes_an_engine_keeps(kept, warmed):
    eng = Timed(0.0, 0.0, 0, kept)
    _, largest = embedder(eng).warmup_every_size(10)
    assert largest == warmed and eng.sizes == list(range(1, warmed + 1))
