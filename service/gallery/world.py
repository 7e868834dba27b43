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
- No training world (a model served with nothing trained, `WorldFit.source == "gallery"`): the
  metric itself is fitted on the registered images (embedding.world.fit_gallery, on a
  bottom-k-by-hash sample of FIT_SAMPLE of them, so replicas agree), and each label is checked
  against its own images as above. Refitted when that sample changes (every write while the
  gallery is small, rarely once it is large), which re-derives every label's z and radius.
  Before two registered images exist there is no metric: no world check (before any label
  exists every answer is unknown anyway: there is nothing to vote for).
- A label whose added items have no statistics (added before schema 5) and no trained items,
  or a gallery without a fit (an index built before the world check): no world check.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from embedding import openset
from embedding.world import WorldFit, fit_gallery
from service.gallery.openset import LabelSample


@dataclass(frozen=True)
class WorldVerdict:
    score: float | None  # the distance the query was judged by (None: no world check)
    threshold: float | None
    ok: bool
    basis: str | None  # "training" (the trained world) | "label" (the label's own images)


NO_CHECK = WorldVerdict(None, None, True, None)
FIT_SAMPLE = 1024  # registered images a gallery-fitted world is fitted on (fit_gallery)


class Worlds:
    def __init__(self, fit: WorldFit | None, tpr: float, sample: int = openset.SAMPLE):
        self.given = fit  # what the index dir gave (a gallery-fitted world: before its fit)
        self.gallery_fitted = fit is not None and fit.source == "gallery"
        self.fit = fit if fit is not None and fit.fitted else None
        self.tpr = tpr
        # None also when too few held-out images place it (WorldFit.threshold): trained labels
        # are then not refused by the training world, their score still reported
        self.threshold = fit.threshold(tpr) if self.fit is not None and tpr > 0 else None
        self.sample_size = sample
        self.own: dict[int, LabelSample] = {}  # label id -> its added items' z (sampled)
        self.radius: dict[int, float] = {}
        self.raw: dict[int, LabelSample] = {}  # gallery-fitted: the same samples' statistics
        self._fitted_ids = b""  # the ids the fit was made on (bytes of their array)

    @property
    def enabled(self) -> bool:
        return self.gallery_fitted or self.fit is not None

    def z(self, stats: np.ndarray | None) -> np.ndarray | None:
        """(B, D) statistics -> (B, r) whitened (None without a fit or statistics)."""
        if stats is None or self.fit is None or stats.shape[1] != len(self.fit.mean):
            return None
        return self.fit.z(stats)

    def added(self, c: int, ids: np.ndarray, stats: list | np.ndarray | None) -> None:
        """Items `ids` added to label `c` with their statistics (rows may be None)."""
        if stats is None or (self.fit is None and not self.gallery_fitted):
            return
        width = len(self.fit.mean) if not self.gallery_fitted else self._width(stats)
        keep = [i for i, s in enumerate(stats) if s is not None and len(s) == width]
        if not keep:
            return
        raw = np.stack([np.asarray(stats[i], np.float32) for i in keep])
        ids = np.asarray(ids, dtype=np.int64)[keep]
        if self.gallery_fitted:  # z follows at recalibrate, from the fit of the new sample
            r = self.raw.get(c)
            if r is None:
                r = self.raw[c] = LabelSample(width, self.sample_size)
            r.add(ids, raw)
            return
        s = self.own.get(c)
        if s is None:
            s = self.own[c] = LabelSample(self.fit.rank, self.sample_size)
        s.add(ids, self.fit.z(raw))

    def _width(self, stats) -> int:
        """D of a gallery-fitted world: that of the samples held, else of these rows."""
        for r in self.raw.values():
            return r.emb.shape[1]
        return next((len(s) for s in stats if s is not None), -1)

    def removed(self, c: int, item_id: int) -> None:
        for samples in (self.own, self.raw):
            s = samples.get(c)
            if s is not None:
                s.remove(item_id)

    def recalibrate(self, labels) -> None:
        """The radius of each of `labels` anew from its sample (gallery-fitted: the fit first,
        and every label when it moved)."""
        if self.gallery_fitted and self._refit():
            labels = list(self.raw)
        if self.fit is None:
            return
        for c in labels:
            if self.gallery_fitted:
                r = self.raw.get(c)
                if r is None or not len(r.ids):
                    self.raw.pop(c, None)
                    self.own.pop(c, None)
                else:
                    s = self.own[c] = LabelSample(self.fit.rank, self.sample_size)
                    s.ids, s.prio, s.emb = r.ids, r.prio, self.fit.z(r.emb)
            s = self.own.get(c)
            if s is None or not len(s.ids):
                self.own.pop(c, None)
                self.radius.pop(c, None)
                continue
            self.radius[c] = self.fit.radius(s.emb)

    def _refit(self) -> bool:
        """Fit the gallery's world anew when the FIT_SAMPLE lowest-priority sampled images
        changed (whatever the order they came in: replicas agree); True when it moved. Arrays,
        not Python rows: it runs under the write lock on every write of a gallery-fitted world."""
        groups = [(c, r) for c, r in self.raw.items() if len(r.ids)]
        prio = np.concatenate([r.prio for _, r in groups]) if groups else np.zeros(0, np.uint64)
        ids = np.concatenate([r.ids for _, r in groups]) if groups else np.zeros(0, np.int64)
        pick = np.lexsort((ids, prio))[:FIT_SAMPLE]  # by priority, then id (ids are unique)
        key = ids[pick].tobytes()
        if key == self._fitted_ids:
            return False
        self._fitted_ids = key
        if len(pick) < 2:
            self.fit = None
        else:
            stats = np.concatenate([r.emb for _, r in groups])[pick]
            labels = np.concatenate([np.full(len(r.ids), c) for c, r in groups])[pick]
            self.fit = fit_gallery(stats, labels)
        if self.fit is None:
            self.own.clear()
            self.radius.clear()
        return True

    def check(self, label_ids: list[int], z: np.ndarray | None, trained: np.ndarray) -> list:
        """A WorldVerdict per query: label_ids (B,) the labels the vote chose (-1: none),
        z (B, r) the queries' whitened statistics, trained (C,) trained items per label."""
        if z is None or self.fit is None:
            return [NO_CHECK] * len(label_ids)
        out = []
        scores = self.fit.score(z) if len(self.fit.calibration) and self.tpr > 0 else None
        for b, c in enumerate(label_ids):
            own = self.own.get(c) if c >= 0 else None
            has_trained = c >= 0 and c < len(trained) and trained[c] > 0
            glob = None
            if has_trained and scores is not None:
                t = self.threshold
                ok = t is None or bool(scores[b] <= t)
                glob = WorldVerdict(float(scores[b]), t, ok, "training")
            if own is not None and len(own.ids):
                d = float(self.fit.distances(z[b : b + 1], own.emb).min())
                r = self.radius.get(c, self.fit.same_radius)
                mine = WorldVerdict(d, r, d <= r, "label")
                out.append(glob if (glob is not None and glob.ok and not mine.ok) else mine)
            else:
                out.append(glob if glob is not None else NO_CHECK)
        return out
