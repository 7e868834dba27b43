"""What the few-shot benchmarks over HTTP share (fewshot_http, learn_loop, review_loop): their
common flags, the held-out ("novel") classes of a model trained on base classes, the
Fashion-MNIST splits, and an image as the PNG the service is sent."""

from __future__ import annotations

import argparse
import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from benchmarks import command_line
from embedding.datasets import load_raw
from embedding.rundir import RunDir


def parser(doc: str, shots: int, draws: int, queries: str) -> argparse.ArgumentParser:
    """The flags every few-shot benchmark takes: the run, the novel classes, shots, draws and
    queries (`queries`: what they are, for --help)."""
    ap = command_line.parser(doc)
    ap.add_argument("run", type=Path)
    ap.add_argument("--novel", default="2,6,9", help="held-out class ids")
    ap.add_argument("--shots", type=int, default=shots)
    ap.add_argument("--draws", type=int, default=draws)
    ap.add_argument("--queries", type=int, default=600, help=queries)
    ap.add_argument("--seed", type=int, default=0)
    return ap


@dataclass
class NovelSplit:
    novel: list[int]  # the held-out class ids
    names: list[str]  # the base classes: the model's
    train: object  # the Fashion-MNIST splits (embedding.datasets.load_raw)
    test: object

    rng: np.random.Generator  # the draws' (seeded by --seed)

    @classmethod
    def of(cls, a: argparse.Namespace) -> NovelSplit:
        return cls(
            [int(c) for c in a.novel.split(",")],
            RunDir(a.run).load_model_card()[0].class_names,
            load_raw("fashion-mnist", "train"),
            load_raw("fashion-mnist", "test"),
            np.random.default_rng(a.seed),
        )

    def is_base(self) -> np.ndarray:
        """(n_test,) bool: test images of a class the model was trained on."""
        return np.array([self.test.class_names[t] in self.names for t in self.test.targets])

    def queries(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """n novel and n base test images, each in a random order."""
        nq = self.rng.permutation(np.nonzero(np.isin(self.test.targets, self.novel))[0])[:n]
        return nq, self.rng.permutation(np.nonzero(self.is_base())[0])[:n]


def png(split, i: int) -> bytes:
    """Image i of a split as PNG bytes."""
    b = io.BytesIO()
    Image.fromarray(split.source.get(int(i))[0].numpy()).save(b, "PNG")
    return b.getvalue()
