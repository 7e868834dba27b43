"""The tables every unfiltered dense vote derives from the rows' labels, kept write by write
instead of made anew after each write (issue 55, point 4): embedding.votes.kde_prepare's labels
(deleted rows at column C), live counts and one-hot (N, C + 1), and embedding.openset's
label_groups (row indices sorted by label, deleted rows first). A write changes a few rows;
made anew, the one-hot and the sort cost ~1.5 ms at 55,000 rows and allocate megabytes, kept
they cost the changed rows and two passes over the order (docs/PERFORMANCE.md).

Rows records which rows it touched since the tables last took them (Rows.take_touched); the
tables compare each touched row's label with the one they hold and move only the rows whose
label changed. They are made anew when the journal overflowed or the rows were compacted,
when the gallery's number of labels changed (column C is the deleted rows'), for another Rows
object, and when many rows changed at once. Equal to kde_prepare and label_groups exactly
(tests/service/gallery/test_label_tables.py, after random adds, deletes, moves, compactions).

Not thread-safe by itself: the gallery syncs them under its snapshot lock, at a rows epoch no
reader still votes on (a write takes the write lock, so every reader of the old epoch is done).
"""

from __future__ import annotations

import numpy as np
import torch

from embedding.openset import label_groups
from embedding.votes.kde import ONEHOT_LIMIT, kde_dtype, kde_prepare

# More changed rows than this in one sync: made anew (each kept change is a Python step).
MOST_KEPT = 256


class LabelTables:
    def __init__(self, temperature: float, onehot_limit: int = ONEHOT_LIMIT):
        self.temperature = temperature  # σ: kde_prepare's dtype follows it
        self.dtype = kde_dtype(temperature)
        self.onehot_limit = onehot_limit
        self._rows = None  # the Rows object they describe
        self._epoch = -1  # its epoch when they were last synced
        self.num_classes = -1  # C
        self.n = 0  # rows described
        self._lab = np.zeros(0, dtype=np.int64)  # (capacity,) label id, C: deleted
        self._counts = np.zeros(0, dtype=np.int64)  # (C,) live rows per label
        self._onehot: torch.Tensor | None = None  # (capacity, C + 1) in dtype, or None
        self._order = np.zeros(0, dtype=np.int64)  # (n,) rows by (group, row); group 0: deleted
        self._sizes = np.zeros(1, dtype=np.int64)  # (C + 1,) rows per group: deleted, 0..C-1
        self.rebuilds = 0  # times made anew (tests and the benchmark read it)

    def sync(self, rows, num_classes: int) -> None:
        """Bring the tables to `rows` (service.gallery.rows.Rows) and C = `num_classes`."""
        if rows is self._rows and rows.epoch == self._epoch and num_classes == self.num_classes:
            return
        touched = rows.take_touched()  # always taken: the journal restarts from here
        anew = rows is not self._rows or touched is None or num_classes != self.num_classes
        if anew or not self._kept(rows, touched):
            self._rebuild(rows, num_classes)
        self._rows, self._epoch = rows, rows.epoch

    def prepared(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """kde_prepare(rows' labels, C, σ): (lab (n,), counts (C,) in dtype, one-hot or None);
        lab and the one-hot are views that the next sync writes over."""
        n = self.n
        onehot = None if self._onehot is None else self._onehot[:n]
        lab = torch.from_numpy(self._lab[:n])
        return lab, torch.from_numpy(self._counts).to(self.dtype), onehot

    def groups(self) -> tuple[torch.Tensor, torch.Tensor]:
        """label_groups(rows' labels, C): (order (n,), starts (C + 1,))."""
        starts = np.cumsum(self._sizes)  # starts[c] = where label c's rows begin
        # no copy: a sync replaces the order (np.delete / np.insert), never writes it
        return torch.from_numpy(self._order), torch.from_numpy(starts)

    # ------------------------------------------------------------------ made anew
    def _rebuild(self, rows, num_classes: int) -> None:
        self.rebuilds += 1
        self.num_classes = c = num_classes
        labels = torch.from_numpy(np.ascontiguousarray(rows.labels))  # (n,) -1: deleted
        lab, _, onehot = kde_prepare(labels, c, self.temperature, self.onehot_limit)
        self.n = n = len(labels)
        self._lab = lab.numpy()
        self._counts = torch.bincount(lab, minlength=c + 1)[:c].numpy().copy()
        self._onehot = onehot
        order, _ = label_groups(labels, c)
        self._order = order.numpy().copy()
        self._sizes = np.concatenate([[n - int(self._counts.sum())], self._counts])

    # ------------------------------------------------------------------ kept
    def _kept(self, rows, touched: list[tuple[int, int]]) -> bool:
        """Apply the touched rows' label changes; False when they are better made anew."""
        c, n_was, n = self.num_classes, self.n, rows.n
        if n < n_was:
            return False
        parts = [np.arange(a, min(b, n_was)) for a, b in touched if a < n_was]
        idx = np.unique(np.concatenate([*parts, np.arange(n_was, n)]).astype(np.int64))
        new = np.asarray(rows.labels)[idx]
        new = np.where(new >= 0, new, c)  # (m,) deleted -> C, as kde_prepare
        old = np.full(len(idx), -1, dtype=np.int64)  # rows appended since: from nowhere (-1)
        there = idx < n_was
        old[there] = self._lab[idx[there]]
        moved = old != new
        idx, old, new = idx[moved], old[moved], new[moved]
        if len(idx) > MOST_KEPT:
            return False
        if self._onehot is not None and n * (c + 1) > self.onehot_limit:
            return False  # past kde_prepare's limit: it would have no one-hot
        self._grow(n)
        was = old >= 0
        if self._onehot is not None:
            self._onehot[torch.from_numpy(idx[was]), torch.from_numpy(old[was])] = 0.0
            self._onehot[torch.from_numpy(idx), torch.from_numpy(new)] = 1.0
        self._lab[idx] = new
        np.subtract.at(self._counts, old[was & (old < c)], 1)
        np.add.at(self._counts, new[new < c], 1)
        self._move(idx, np.where(old == c, 0, old + 1), np.where(new == c, 0, new + 1), was)
        self.n = n
        return True

    def _grow(self, n: int) -> None:
        """Room for n rows (capacity doubles)."""
        cap = len(self._lab)
        if n <= cap:
            return
        size = max(n, 2 * cap, 1024)
        lab = np.full(size, self.num_classes, dtype=np.int64)
        lab[:cap] = self._lab
        self._lab = lab
        if self._onehot is not None:
            onehot = torch.zeros(size, self.num_classes + 1, dtype=self.dtype)
            onehot[: self._onehot.shape[0]] = self._onehot
            self._onehot = onehot

    def _move(self, idx: np.ndarray, g_old: np.ndarray, g_new: np.ndarray, was: np.ndarray):
        """Rows idx leave groups g_old (where `was`: rows that were described) and join g_new,
        each kept in row order within its group (label_groups' stable sort)."""
        bounds = np.concatenate([[0], np.cumsum(self._sizes)])  # group g: bounds[g]:bounds[g+1]
        gone = [
            int(bounds[g]) + int(np.searchsorted(self._order[bounds[g] : bounds[g + 1]], r))
            for r, g in zip(idx[was], g_old[was], strict=True)
        ]
        order = np.delete(self._order, gone)
        np.subtract.at(self._sizes, g_old[was], 1)
        bounds = np.concatenate([[0], np.cumsum(self._sizes)])
        joins = sorted(zip(g_new.tolist(), idx.tolist(), strict=True))  # by (group, row)
        at = [
            int(bounds[g]) + int(np.searchsorted(order[bounds[g] : bounds[g + 1]], r))
            for g, r in joins
        ]
        self._order = np.insert(order, at, [r for _, r in joins])
        np.add.at(self._sizes, g_new, 1)
