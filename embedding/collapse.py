"""Is an embedding collapsed? A model trained from scratch on a few dozen photos mapped every
image to nearly the same vector (every similarity 0.95-1.000): the vote then answers at random
with a confident face, and nothing said so. The index builder, the service's start-up and the
registration diagnostics measure it the same way and say it in the same words."""

from __future__ import annotations

import numpy as np

# Mean cosine of random pairs above which the vectors are nearly one direction. A trained
# Fashion-MNIST model's random pairs: ~0.1-0.3; raw pretrained features (all-positive, pooled
# ReLU6): ~0.4-0.7; the collapsed photo model: 0.95-1.0.
COLLAPSED = 0.95


def pair_similarity(emb: np.ndarray, pairs: int = 2000, seed: int = 0) -> float | None:
    """Mean cosine similarity of up to `pairs` random pairs of distinct rows of `emb` (n, d),
    unit-norm rows; None for fewer than two rows."""
    n = len(emb)
    if n < 2:
        return None
    rng = np.random.default_rng(seed)
    a = rng.integers(0, n, pairs)
    b = (a + rng.integers(1, n, pairs)) % n  # never the same row
    x, y = np.asarray(emb[a], dtype=np.float32), np.asarray(emb[b], dtype=np.float32)
    return float(np.mean(np.sum(x * y, axis=1)))


def warning(similarity: float | None, what: str) -> str | None:
    """The warning for `what` (e.g. "the index's vectors") at this mean pair similarity, or
    None when the vectors are spread out."""
    if similarity is None or similarity < COLLAPSED:
        return None
    return (
        f"{what} are nearly all alike (mean cosine of random pairs {similarity:.3f}): the model "
        "has collapsed and cannot tell images apart, so every answer is a guess; retrain it "
        "(more images, a pretrained start such as --init pypi:efficientnet-lite0, fewer epochs)"
    )
