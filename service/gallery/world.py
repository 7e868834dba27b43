"""The gallery's world check (embedding/world.py): is a query the kind of image the label the
vote chose holds?

- A label of trained items: the training world's Gaussian, |z|^2/r against the threshold that
  accepts SNCA_WORLD_TPR of held-out known images.
- A label users registered: its own images. A sample of its added items' z (the same
  bottom-k-by-hash sample as the label check's, so replicas agree) and a radius from their
  spread (WorldFit.radius); a query is of the label's world when its nearest sampled image is
  within the radius. Recomputed for the labels a write touches. A user's photos on a
  Fashion-MNIST model are outside the training world, and are recognised as theirs all the same.
- A label with both: either world will do.
- A label whose added items have no statistics (added before schema 5) and no trained items,
  or a gallery without a fit (an index built before the world check): no world check.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from embedding import openset
from embedding.world import WorldFit
from service.gallery.openset import LabelSample


@dataclass(frozen=True)
class WorldVerdict:
    score: float | None  # the distance the query was judged by (None: no world check)
    threshold: float | None
    ok: bool
    basis: str | None  # "training" (the trained world) | "label" (the label's own images)


NO_CHECK = WorldVerdict(None, None, True, None)


class Worlds:
    def __init__(self, fit: WorldFit | None, tpr: float, sample: int = openset.SAMPLE):
        self.fit = fit
        self.tpr = tpr
        self.threshold = fit.threshold(tpr) if fit is not None and tpr > 0 else None
        self.sample_size = sample
        self.own: dict[int, LabelSample] = {}  # label id -> its added items' z (sampled)
        self.radius: dict[int, float] = {}

    @property
    def enabled(self) -> bool:
        return self.fit is not None and self.threshold is not None

    def z(self, stats: np.ndarray | None) -> np.ndarray | None:
        """(B, D) statistics -> (B, r) whitened (None without a fit or statistics)."""
        if stats is None or self.fit is None or stats.shape[1] != len(self.fit.mean):
            return None
        return self.fit.z(stats)

    def added(self, c: int, ids: np.ndarray, stats: list | np.ndarray | None) -> None:
        """Items `ids` added to label `c` with their statistics (rows may be None)."""
        if stats is None or self.fit is None:
            return
        keep = [i for i, s in enumerate(stats) if s is not None and len(s) == len(self.fit.mean)]
        if not keep:
            return
        z = self.fit.z(np.stack([np.asarray(stats[i], np.float32) for i in keep]))
        s = self.own.get(c)
        if s is None:
            s = self.own[c] = LabelSample(self.fit.rank, self.sample_size)
        s.add(np.asarray(ids, dtype=np.int64)[keep], z)

    def removed(self, c: int, item_id: int) -> None:
        s = self.own.get(c)
        if s is not None:
            s.remove(item_id)

    def recalibrate(self, labels) -> None:
        """The radius of each of `labels` anew from its sample."""
        if self.fit is None:
            return
        for c in labels:
            s = self.own.get(c)
            if s is None or not len(s.ids):
                self.own.pop(c, None)
                self.radius.pop(c, None)
                continue
            self.radius[c] = self.fit.radius(s.emb)

    def check(self, label_ids: list[int], z: np.ndarray | None, trained: np.ndarray) -> list:
        """A WorldVerdict per query: label_ids (B,) the labels the vote chose (-1: none),
        z (B, r) the queries' whitened statistics, trained (C,) trained items per label."""
        if z is None or self.fit is None:
            return [NO_CHECK] * len(label_ids)
        out = []
        scores = self.fit.score(z) if self.threshold is not None else None
        for b, c in enumerate(label_ids):
            own = self.own.get(c) if c >= 0 else None
            has_trained = c >= 0 and c < len(trained) and trained[c] > 0
            glob = None
            if has_trained and scores is not None:
                glob = WorldVerdict(
                    float(scores[b]), self.threshold, bool(scores[b] <= self.threshold), "training"
                )
            if own is not None and len(own.ids):
                d = float(self.fit.distances(z[b : b + 1], own.emb).min())
                r = self.radius.get(c, self.fit.same_radius)
                mine = WorldVerdict(d, r, d <= r, "label")
                out.append(glob if (glob is not None and glob.ok and not mine.ok) else mine)
            else:
                out.append(glob if glob is not None else NO_CHECK)
        return out
