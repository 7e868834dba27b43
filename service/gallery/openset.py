"""The gallery's open-set calibration (embedding.openset): a deterministic sample of each
label's items and their leave-one-out scores, recalibrated per label as writes touch it.

The sample of a label is its SAMPLE items with the smallest hash of their id (a bottom-k
sketch): the same items on every replica whatever the order of writes, so replicas at the same
version answer with the same thresholds. A deleted sampled item leaves the sample; a label
whose sample shrank under half of what it could hold is resampled from the dense rows where
the gallery keeps them (beyond SNCA_EXACT_VOTE_MAX it keeps the smaller sample).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from embedding import openset
from embedding.openset import Calibration, label_kth, leave_one_out


def _priority(ids: np.ndarray) -> np.ndarray:
    """splitmix64 of each id: a fixed pseudo-random order of items."""
    with np.errstate(over="ignore"):
        z = ids.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


# A label bigger than its sample is recalibrated when its size moved by this share since (the
# scores of 200 sampled items among thousands barely move with a few more items).
REFRESH = 0.05


class LabelSample:
    """Up to `size` items of one label: ids, priorities, embeddings (m, d)."""

    def __init__(self, dim: int, size: int):
        self.size = size
        self.ids = np.zeros(0, dtype=np.int64)
        self.prio = np.zeros(0, dtype=np.uint64)
        self.emb = np.zeros((0, dim), dtype=np.float32)

    def add(self, ids: np.ndarray, emb: np.ndarray) -> None:
        ids = np.concatenate([self.ids, ids.astype(np.int64)])
        prio = np.concatenate([self.prio, _priority(ids[len(self.ids) :])])
        emb = np.concatenate([self.emb, emb.astype(np.float32)])
        keep = np.argsort(prio, kind="stable")[: self.size]
        self.ids, self.prio, self.emb = ids[keep], prio[keep], emb[keep]

    def remove(self, item_id: int) -> bool:
        hit = self.ids == item_id
        if not hit.any():
            return False
        keep = ~hit
        self.ids, self.prio, self.emb = self.ids[keep], self.prio[keep], self.emb[keep]
        return True


class OpenSet:
    """Samples and calibration of every label. `search(q (S, d), k) -> (sims, ids)` is the
    gallery's index; `labels_of(ids) -> label ids`; `members(c) -> (ids, emb) | None` the
    label's rows when the gallery keeps them densely."""

    def __init__(self, dim: int, k: int = openset.K, sample: int = openset.SAMPLE):
        self.dim = dim
        self.k = k
        self.sample_size = sample
        self.samples: dict[int, LabelSample] = {}
        self.calibration = Calibration(k=k)
        self.epoch = 0  # bumped on every recalibration (caches of thresholds key on it)

    def sample_of(self, c: int) -> LabelSample:
        s = self.samples.get(c)
        if s is None:
            s = self.samples[c] = LabelSample(self.dim, self.sample_size)
        return s

    def added(self, c: int, ids: np.ndarray, emb: np.ndarray) -> None:
        self.sample_of(c).add(ids, emb)

    def removed(self, c: int, item_id: int) -> None:
        s = self.samples.get(c)
        if s is not None:
            s.remove(item_id)

    def recalibrate(
        self,
        labels,
        counts: np.ndarray,
        search: Callable,
        labels_of: Callable,
        members: Callable,
        candidates: int,
    ) -> None:
        """Leave-one-out scores of each label in `labels` from its sample: exactly among the
        label's items when the sample holds all of them, else from the index's top
        `candidates` neighbours of each sampled item (its own id excluded)."""
        for c in labels:
            n = int(counts[c]) if c < len(counts) else 0
            s = self.samples.get(c)
            if n <= 0 or s is None:
                self.calibration.set(c, np.zeros(0), 0)
                self.samples.pop(c, None)
                continue
            if len(s.ids) < min(n, self.sample_size) // 2:  # deletes thinned it out
                rows = members(c)
                if rows is not None:
                    fresh = LabelSample(self.dim, self.sample_size)
                    fresh.add(*rows)
                    s = self.samples[c] = fresh
            if n <= len(s.ids):  # the sample is the whole label
                scores = leave_one_out(s.emb, s.emb, self.k, self_in=True)
            else:
                last = self.calibration.sizes.get(c, 0)
                if last > self.sample_size and abs(n - last) < REFRESH * last:
                    continue  # a big label that moved by less than REFRESH: scores still hold
                # a sampled item's k nearest of its own label are among its first few dozen
                # neighbours (an outlier's are not: it gets the farthest one found, an upper
                # bound, or -1; both err toward accepting)
                kk = min(candidates, max(8 * self.k, 64), int(counts.sum()))
                sims, ids = search(s.emb, kk)  # (m, kk) descending
                lab = labels_of(ids)
                lab = np.where(ids == s.ids[:, None], -1, lab)  # leave the item itself out
                kc = torch.full((len(s.ids),), min(self.k, n - 1), dtype=torch.long)
                scores = label_kth(
                    torch.from_numpy(sims),
                    torch.from_numpy(lab),
                    torch.full((len(s.ids),), c, dtype=torch.long),
                    kc,
                ).numpy()
                # -1: none of the label's items among the candidates, a placeholder, not a
                # similarity (at a high rate the quantile would land on it: threshold -1, which
                # silently accepts everything)
                scores = scores[scores > -1.0]
            self.calibration.set(c, scores, n)
        self.epoch += 1
