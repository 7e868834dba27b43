"""The gallery's dense rows and per-label statistics, kept exact under adds and deletes.

The dense (n, d) matrix of every live embedding is what the kde and prototype votes and the
best-similarity read; the statistics (live count, added count, embedding sum per label) are
what the label table and the prototype vote read.
"""

from __future__ import annotations

import numpy as np


class LabelStats:
    """Labels by name with a stable label id each (ids are never reused while the process
    lives), and per label: live items, of which added through the service, embedding sum."""

    def __init__(self, dim: int):
        self.dim = dim
        self.names: list[str] = []
        self.ids: dict[str, int] = {}
        self.counts = np.zeros(0, dtype=np.int64)
        self.added = np.zeros(0, dtype=np.int64)
        self.sums = np.zeros((0, dim), dtype=np.float64)

    def __len__(self) -> int:
        return len(self.names)

    def id_of(self, name: str) -> int:
        """The label id of `name`, created (with no items) if new."""
        c = self.ids.get(name)
        if c is None:
            c = len(self.names)
            self.names.append(name)
            self.ids[name] = c
            self.counts = np.append(self.counts, 0)
            self.added = np.append(self.added, 0)
            self.sums = np.vstack([self.sums, np.zeros((1, self.dim))])
        return c

    def add(self, c: int, emb: np.ndarray, added: int) -> None:
        """emb (n, d): n new items of label c, `added` of them through the service."""
        self.counts[c] += len(emb)
        self.added[c] += added
        self.sums[c] += emb.astype(np.float64).sum(axis=0)

    def remove(self, c: int, emb: np.ndarray, added: bool) -> None:
        """emb (d,): one item of label c is gone."""
        self.counts[c] -= 1
        self.added[c] -= int(added)
        self.sums[c] -= emb.astype(np.float64)

    def table(self) -> list[tuple[str, int, int]]:
        """(label, live count, added count) for labels with items, by label name."""
        return sorted(
            (n, int(self.counts[c]), int(self.added[c]))
            for c, n in enumerate(self.names)
            if self.counts[c] > 0
        )


class Rows:
    """Every live embedding in one dense matrix, appended to. A deleted row keeps its place
    with label -1 until deleted rows are a quarter of the matrix; then they are compacted away.
    `epoch` changes whenever rows or their labels change: what a reader derived from them
    (GalleryView) is stale when its epoch differs."""

    def __init__(self, dim: int, capacity: int = 1024):
        self.dim = dim
        self._emb = np.zeros((capacity, dim), dtype=np.float32)
        self._label = np.full(capacity, -1, dtype=np.int64)  # -1: deleted row
        self._id = np.full(capacity, -1, dtype=np.int64)
        self.n = 0
        self._row_of: dict[int, int] = {}
        self.epoch = 0

    @property
    def embeddings(self) -> np.ndarray:
        """(n, d) float32, a view (deleted rows included); replaced when the matrix grows."""
        return self._emb[: self.n]

    @property
    def labels(self) -> np.ndarray:
        """(n,) int64 label id per row, -1 for deleted rows (a view)."""
        return self._label[: self.n]

    @property
    def ids(self) -> np.ndarray:
        """(n,) int64 item id per row (a view)."""
        return self._id[: self.n]

    def append(self, ids: np.ndarray, label: int, emb: np.ndarray) -> None:
        n = len(ids)
        while self.n + n > len(self._id):
            grow = len(self._id)
            self._emb = np.vstack([self._emb, np.zeros((grow, self.dim), dtype=np.float32)])
            self._label = np.concatenate([self._label, np.full(grow, -1)])
            self._id = np.concatenate([self._id, np.full(grow, -1)])
        r = self.n
        self._emb[r : r + n] = emb
        self._label[r : r + n] = label
        self._id[r : r + n] = ids
        for i, item_id in enumerate(ids):
            self._row_of[int(item_id)] = r + i
        self.n += n
        self.epoch += 1

    def kill(self, item_id: int) -> int | None:
        """Mark the row of `item_id` deleted; its label id, or None if it has no row."""
        row = self._row_of.pop(int(item_id), None)
        if row is None:
            return None
        c = int(self._label[row])
        self._label[row] = -1
        self.epoch += 1
        return c

    def vector(self, item_id: int) -> np.ndarray | None:
        """(d,) the embedding of a live item (a copy), None if it has no row."""
        r = self._row_of.get(int(item_id))
        return None if r is None else self._emb[r].copy()

    def label_of(self, item_id: int) -> int:
        """The label id of a live item, -1 if there is none."""
        r = self._row_of.get(int(item_id))
        return -1 if r is None else int(self._label[r])

    def ids_with(self, label_ids: np.ndarray) -> np.ndarray:
        """Ids of the live items whose label is one of `label_ids`."""
        return self.ids[np.isin(self.labels, label_ids)]

    def compact(self) -> None:
        """Drop deleted rows from the matrix once they are a quarter of it (at least 1,024)."""
        n = self.n
        keep = np.nonzero(self._label[:n] >= 0)[0]
        if n - len(keep) < max(1024, n // 4):
            return
        m = len(keep)
        self._emb[:m] = self._emb[keep]
        self._label[:m] = self._label[keep]
        self._id[:m] = self._id[keep]
        self._label[m:n] = -1
        self._id[m:n] = -1
        self.n = m
        self._row_of = {int(i): r for r, i in enumerate(self._id[:m])}
        self.epoch += 1
