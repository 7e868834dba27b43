"""The gallery's rows and per-label statistics, kept exact under adds and deletes.

The rows map every live item to its label id; on the dense path (small galleries) they also
hold every embedding in one (n, d) matrix, which the exact votes read. The statistics (live
count, added count, embedding sum per label) are what the label table, the prototype vote and
the candidate vote's tail (embedding.votes.kde) read.
"""

from __future__ import annotations

import numpy as np

# Touched row ranges a Rows journals for its reader (LabelTables) before it gives up on them
# (the reader then makes its tables anew): bounds the journal of a process that never votes.
TOUCHED_MAX = 64

# Spare columns of the transposed matrix (d, capacity + PAD_T): its rows lie capacity + 64
# floats apart, never a multiple of 4 KB. At a power-of-two capacity (it doubles from 1,024)
# every row of a panel the product reads fell in the same cache sets: a batch of 8 against a
# (128, 55,000) view of (128, 65,536) took 10.4 ms, of (128, 65,600) 7.0, as a contiguous
# copy (one thread, AMD EPYC; benchmarks/write_cost.py, docs/PERFORMANCE.md).
PAD_T = 64


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
    """Every live item's id and label id, appended to, and (on the dense path, `dense=True`)
    its embedding in one (n, d) matrix. A deleted row keeps its place with label -1 until
    deleted rows are a quarter of the matrix; then they are compacted away. Ids map to rows
    through an array indexed by id (8 bytes per id, lookups vectorised: a candidate vote looks
    up Q·K' ids per batch). `epoch` changes whenever rows or their labels change: what a reader
    derived from them (GalleryView) is stale when its epoch differs.

    The dense path also keeps the matrix transposed, (d, capacity + PAD_T): a batch's
    similarities are queries (B, d) @ (d, n), a view of it, which multiplies 1.1-3.6x faster
    than against (n, d).T at the batch sizes a server runs (55,000 rows, one thread: 0.68 vs
    2.48 ms for one query, 3.4 vs 4.6 for 8, 12.8 vs 14.3 for 64; docs/PERFORMANCE.md), and as
    fast as a contiguous copy of it (PAD_T), so a write costs no copy.

    Bytes per item: 24 (id, label, row of id) + 8·d with the dense matrices."""

    def __init__(self, dim: int, capacity: int = 1024, dense: bool = True):
        self.dim = dim
        self.dense = dense
        self._emb = np.zeros((capacity if dense else 0, dim), dtype=np.float32)
        width = capacity + PAD_T if dense else 0
        self._emb_t = np.zeros((dim, width), dtype=np.float32)  # (d, capacity + PAD_T)
        self._label = np.full(capacity, -1, dtype=np.int64)  # -1: deleted row
        self._id = np.full(capacity, -1, dtype=np.int64)
        self._row_of = np.full(capacity, -1, dtype=np.int64)  # item id -> row, -1: none
        self.n = 0
        self.epoch = 0
        # row ranges [a, b) whose labels changed since take_touched (appends included); None:
        # too many, or rows moved (compaction): a reader makes what it derived anew
        self._touched: list[tuple[int, int]] | None = []

    def _touch(self, a: int, b: int) -> None:
        t = self._touched
        if t is not None:
            if len(t) >= TOUCHED_MAX:
                self._touched = None
            else:
                t.append((a, b))

    def take_touched(self) -> list[tuple[int, int]] | None:
        """The row ranges touched since the last call (None: too many or moved); the journal
        restarts empty."""
        t, self._touched = self._touched, []
        return t

    @property
    def embeddings(self) -> np.ndarray:
        """(n, d) float32, a view (deleted rows included); replaced when the matrix grows.
        Only on the dense path."""
        if not self.dense:
            raise RuntimeError("this gallery keeps no dense embedding matrix")
        return self._emb[: self.n]

    @property
    def embeddings_t(self) -> np.ndarray:
        """(d, n) float32: `embeddings` transposed, a view (rows capacity + PAD_T apart)."""
        if not self.dense:
            raise RuntimeError("this gallery keeps no dense embedding matrix")
        return self._emb_t[:, : self.n]

    @property
    def labels(self) -> np.ndarray:
        """(n,) int64 label id per row, -1 for deleted rows (a view)."""
        return self._label[: self.n]

    @property
    def ids(self) -> np.ndarray:
        """(n,) int64 item id per row (a view)."""
        return self._id[: self.n]

    def drop_embeddings(self) -> None:
        """Leave the dense path for good (the gallery outgrew it): free the matrix."""
        self.dense = False
        self._emb = np.zeros((0, self.dim), dtype=np.float32)
        self._emb_t = np.zeros((self.dim, 0), dtype=np.float32)
        self._touched = None
        self.epoch += 1

    def append(self, ids: np.ndarray, label: int, emb: np.ndarray) -> None:
        n = len(ids)
        while self.n + n > len(self._id):
            grow = len(self._id)
            if self.dense:
                self._emb = np.vstack([self._emb, np.zeros((grow, self.dim), dtype=np.float32)])
                zeros = np.zeros((self.dim, grow), dtype=np.float32)
                self._emb_t = np.hstack([self._emb_t, zeros])
            self._label = np.concatenate([self._label, np.full(grow, -1)])
            self._id = np.concatenate([self._id, np.full(grow, -1)])
        top = int(ids.max()) + 1 if n else 0
        if top > len(self._row_of):
            size = max(top, 2 * len(self._row_of))
            self._row_of = np.concatenate(
                [self._row_of, np.full(size - len(self._row_of), -1, dtype=np.int64)]
            )
        r = self.n
        if self.dense:
            self._emb[r : r + n] = emb
            self._emb_t[:, r : r + n] = np.asarray(emb).T
        self._label[r : r + n] = label
        self._id[r : r + n] = ids
        self._row_of[ids] = np.arange(r, r + n)
        self.n += n
        self._touch(r, r + n)
        self.epoch += 1

    def _row(self, item_id: int) -> int:
        i = int(item_id)
        return int(self._row_of[i]) if 0 <= i < len(self._row_of) else -1

    def kill(self, item_id: int) -> int | None:
        """Mark the row of `item_id` deleted; its label id, or None if it has no row."""
        row = self._row(item_id)
        if row < 0:
            return None
        self._row_of[int(item_id)] = -1
        c = int(self._label[row])
        self._label[row] = -1
        self._touch(row, row + 1)
        self.epoch += 1
        return c

    def relabel(self, item_id: int, label: int) -> int | None:
        """Move the live row of `item_id` to label id `label`; its label id before, or None if
        it has no row."""
        row = self._row(item_id)
        if row < 0:
            return None
        c = int(self._label[row])
        self._label[row] = label
        self._touch(row, row + 1)
        self.epoch += 1
        return c

    def has(self, item_id: int) -> bool:
        return self._row(item_id) >= 0

    def vector(self, item_id: int) -> np.ndarray | None:
        """(d,) the embedding of a live item (a copy), None if it has no row (or no matrix)."""
        r = self._row(item_id)
        return None if r < 0 or not self.dense else self._emb[r].copy()

    def labels_of(self, ids: np.ndarray) -> np.ndarray:
        """Label ids of item ids of any shape (-1: no such live item, or a -1 id), vectorised."""
        ids = np.asarray(ids, dtype=np.int64)
        ok = (ids >= 0) & (ids < len(self._row_of))
        rows = np.where(ok, self._row_of[np.where(ok, ids, 0)], -1)
        return np.where(rows >= 0, self._label[np.maximum(rows, 0)], -1)

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
        if self.dense:
            self._emb[:m] = self._emb[keep]
            self._emb_t[:, :m] = self._emb_t[:, keep]
        self._label[:m] = self._label[keep]
        self._id[:m] = self._id[keep]
        self._label[m:n] = -1
        self._id[m:n] = -1
        self.n = m
        self._row_of[:] = -1
        self._row_of[self._id[:m]] = np.arange(m)
        self._touched = None  # every row may have moved
        self.epoch += 1
