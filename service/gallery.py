"""The in-memory gallery: FAISS index (search, kNN, neighbours), a dense matrix of every live
embedding (the kde and prototype rules), per-label statistics. A write is applied here only
after the store committed it; readers share a lock that a write takes exclusively, so no reader
ever sees a half-applied write.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass

import faiss
import numpy as np
import torch

from embedding.voting import (
    kde_log_density,
    kde_prepare,
    knn_probs,
    prototype_probs,
    scripted_kde_top,
)

from .store import Item


class RWLock:
    """Many readers or one writer; a waiting writer blocks new readers (no writer starvation)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._waiting = 0

    @contextmanager
    def read(self):
        with self._cond:
            while self._writer or self._waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextmanager
    def write(self):
        with self._cond:
            self._waiting += 1
            while self._writer or self._readers:
                self._cond.wait()
            self._waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


@dataclass
class Classification:
    label: str | None
    confidence: float
    probabilities: list[tuple[str, float]]  # top 5
    best_similarity: float
    neighbors: list[tuple[int, str, float]]


class Gallery:
    def __init__(self, index, search_params: dict, dim: int, temperature: float):
        self.index = index  # faiss IndexIDMap2, CPU
        self.search_params = dict(search_params)
        self.dim = dim
        self.temperature = temperature
        self.lock = RWLock()
        self.version = 0  # last store write applied
        self.tombstones: set[int] = set()  # deleted ids the index cannot remove (HNSW)
        self.labels: list[str] = []
        self.label_id: dict[str, int] = {}
        self.counts = np.zeros(0, dtype=np.int64)  # live items per label
        self.added = np.zeros(0, dtype=np.int64)  # of which added through the service
        self.sums = np.zeros((0, dim), dtype=np.float64)  # per-label sum of embeddings
        self._emb = np.zeros((1024, dim), dtype=np.float32)  # dense rows, appended
        self._row_label = np.full(1024, -1, dtype=np.int64)  # -1: deleted row
        self._row_id = np.full(1024, -1, dtype=np.int64)
        self._rows = 0
        self._row_of: dict[int, int] = {}
        self._epoch = 0  # bumped whenever rows or their labels change (invalidates _cache)
        self._cache: tuple | None = None

    # ------------------------------------------------------------------ building
    def _label(self, name: str) -> int:
        c = self.label_id.get(name)
        if c is None:
            c = len(self.labels)
            self.labels.append(name)
            self.label_id[name] = c
            self.counts = np.append(self.counts, 0)
            self.added = np.append(self.added, 0)
            self.sums = np.vstack([self.sums, np.zeros((1, self.dim))])
        return c

    def _append_rows(self, ids: np.ndarray, label: int, emb: np.ndarray) -> None:
        n = len(ids)
        while self._rows + n > len(self._row_id):
            grow = len(self._row_id)
            self._emb = np.vstack([self._emb, np.zeros((grow, self.dim), dtype=np.float32)])
            self._row_label = np.concatenate([self._row_label, np.full(grow, -1)])
            self._row_id = np.concatenate([self._row_id, np.full(grow, -1)])
        r = self._rows
        self._emb[r : r + n] = emb
        self._row_label[r : r + n] = label
        self._row_id[r : r + n] = ids
        for i, item_id in enumerate(ids):
            self._row_of[int(item_id)] = r + i
        self._rows += n
        self._epoch += 1

    def load_items(self, items: list[Item]) -> None:
        """Dense matrix and label statistics from every live item of the store (start-up)."""
        by_label: dict[str, list[Item]] = {}
        for it in items:
            by_label.setdefault(it.label, []).append(it)
        for name in sorted(by_label):
            group = by_label[name]
            c = self._label(name)
            emb = np.stack([it.embedding for it in group]).astype(np.float32)
            self._append_rows(np.array([it.id for it in group], dtype=np.int64), c, emb)
            self.counts[c] += len(group)
            self.added[c] += sum(it.source == "added" for it in group)
            self.sums[c] += emb.astype(np.float64).sum(axis=0)

    # ------------------------------------------------------------------ writes (store first)
    def _index_add(self, ids: np.ndarray, emb: np.ndarray) -> None:
        self.index.add_with_ids(np.ascontiguousarray(emb, dtype=np.float32), ids)

    def _index_remove(self, ids: np.ndarray) -> None:
        try:
            self.index.remove_ids(ids)
        except RuntimeError:  # HNSW and GPU indexes cannot remove: filter at search time
            self.tombstones.update(int(i) for i in ids)

    def apply_add(
        self,
        ids: list[int],
        label: str,
        emb: np.ndarray,
        seq: int,
        source: str = "added",
        index: bool = True,
    ) -> None:
        with self.lock.write():
            idarr = np.asarray(ids, dtype=np.int64)
            if index:
                self._index_add(idarr, emb)
            c = self._label(label)
            self._append_rows(idarr, c, emb)
            self.counts[c] += len(ids)
            if source == "added":
                self.added[c] += len(ids)
            self.sums[c] += emb.astype(np.float64).sum(axis=0)
            self.version = max(self.version, seq)

    def apply_delete(
        self, rows: list[tuple[int, str, np.ndarray, str]], seq: int, index: bool = True
    ) -> None:
        """rows: (id, label, embedding, source) of items the store marked deleted."""
        with self.lock.write():
            ids = np.array([r[0] for r in rows], dtype=np.int64)
            if index and len(ids):
                self._index_remove(ids)
            for item_id, _name, emb, source in rows:
                row = self._row_of.pop(int(item_id), None)
                if row is None:
                    continue
                c = int(self._row_label[row])
                self._row_label[row] = -1
                self.counts[c] -= 1
                if source == "added":
                    self.added[c] -= 1
                self.sums[c] -= emb.astype(np.float64)
            self._epoch += 1
            self.version = max(self.version, seq)
            self._maybe_compact()

    def _maybe_compact(self) -> None:
        """Drop deleted rows from the dense matrix once they are a quarter of it."""
        n = self._rows
        keep = np.nonzero(self._row_label[:n] >= 0)[0]
        if n - len(keep) < max(1024, n // 4):
            return
        m = len(keep)
        self._emb[:m] = self._emb[keep]
        self._row_label[:m] = self._row_label[keep]
        self._row_id[:m] = self._row_id[keep]
        self._row_label[m:n] = -1
        self._row_id[m:n] = -1
        self._rows = m
        self._row_of = {int(i): r for r, i in enumerate(self._row_id[:m])}
        self._epoch += 1

    def _unfiltered(self) -> tuple:
        """Per-gallery-state tensors every unfiltered classify needs, cached until the rows
        change: (row labels (n,), live mask, any live, all live, kde_prepare result, the live
        mask as a tensor or None when every row is live, the rows (n, d) as a tensor)."""
        c = self._cache
        if c is not None and c[0] == (self._epoch, len(self.labels)):
            return c[1]
        row_label = self._row_label[: self._rows]
        live = row_label >= 0
        lab_t = torch.from_numpy(row_label.copy())
        v = (
            row_label.copy(),
            live,
            bool(live.any()),
            bool(live.all()),
            kde_prepare(lab_t, len(self.labels), self.temperature),
            None if live.all() else torch.from_numpy(live),
            torch.from_numpy(self._emb[: self._rows]),  # a view: _emb is replaced when it grows
        )
        self._cache = ((self._epoch, len(self.labels)), v)
        return v

    # ------------------------------------------------------------------ reads
    def size(self) -> int:
        return int(self.counts.sum())

    def label_table(self) -> list[tuple[str, int, int]]:
        """(label, live count, added count) for labels with items, by label name."""
        with self.lock.read():
            return sorted(
                (n, int(self.counts[c]), int(self.added[c]))
                for c, n in enumerate(self.labels)
                if self.counts[c] > 0
            )

    def ids_of(self, label: str) -> list[int]:
        with self.lock.read():
            c = self.label_id.get(label)
            if c is None:
                return []
            rows = np.nonzero(self._row_label[: self._rows] == c)[0]
            return self._row_id[rows].tolist()

    def label_of_id(self, item_id: int) -> str | None:
        with self.lock.read():
            r = self._row_of.get(int(item_id))
            return None if r is None else self.labels[int(self._row_label[r])]

    def _params(self, allowed: np.ndarray | None):
        """FAISS search parameters: the manifest's nprobe/efSearch, plus an id selector that
        drops tombstones and keeps only `allowed` ids when a label filter is given."""
        sel = None
        if allowed is not None:
            sel = faiss.IDSelectorBatch(np.ascontiguousarray(allowed, dtype=np.int64))
        if self.tombstones:
            gone = faiss.IDSelectorNot(
                faiss.IDSelectorBatch(np.fromiter(self.tombstones, np.int64))
            )
            sel = gone if sel is None else faiss.IDSelectorAnd(sel, gone)
            sel._keep = gone  # keep the inner selectors alive as long as the outer one
        if sel is None:
            return None
        if "nprobe" in self.search_params:
            p = faiss.SearchParametersIVF(sel=sel, nprobe=int(self.search_params["nprobe"]))
        elif "efSearch" in self.search_params:
            p = faiss.SearchParametersHNSW(sel=sel, efSearch=int(self.search_params["efSearch"]))
        else:
            p = faiss.SearchParameters(sel=sel)
        p._sel = sel
        return p

    def _allowed(self, labels: list[str] | None) -> tuple[np.ndarray | None, np.ndarray | None]:
        """(allowed ids, allowed label ids) for a label filter; (None, None) without one."""
        if labels is None:
            return None, None
        cs = np.array([self.label_id[n] for n in labels if n in self.label_id], dtype=np.int64)
        rows = np.nonzero(np.isin(self._row_label[: self._rows], cs))[0]
        return self._row_id[rows], cs

    def search(self, q: np.ndarray, k: int, labels: list[str] | None = None):
        """q (B, d) -> sims (B, k'), ids (B, k'), label names per hit (k' <= k; -1 padded)."""
        with self.lock.read():
            allowed, _ = self._allowed(labels)
            if allowed is not None and len(allowed) == 0:
                return np.full((len(q), 0), -1.0), np.full((len(q), 0), -1), []
            kk = min(k, self.size() if allowed is None else len(allowed))
            if kk <= 0:
                return np.full((len(q), 0), -1.0), np.full((len(q), 0), -1), []
            sims, ids = self.index.search(
                np.ascontiguousarray(q, dtype=np.float32), kk, params=self._params(allowed)
            )
            names = [[self._name_of(i) for i in row] for row in ids]
            return sims, ids, names

    def _name_of(self, item_id: int) -> str | None:
        r = self._row_of.get(int(item_id))
        return None if r is None else self.labels[int(self._row_label[r])]

    def classify(
        self,
        q: np.ndarray,
        vote: str,
        k: int,
        labels: list[str] | None = None,
        neighbors: bool = False,
    ) -> list[Classification]:
        """Label probabilities for each query (B, d) (numpy, or a float32 CPU tensor) under
        `vote`, optionally restricted to `labels`; neighbours (the kNN voters) when asked or
        when the rule needs them."""
        with self.lock.read():
            c = len(self.labels)
            allowed, allowed_labels = self._allowed(labels)
            if isinstance(q, torch.Tensor):  # the model thread's own output: no conversion
                qt = q
            else:
                qt = torch.from_numpy(np.ascontiguousarray(q, dtype=np.float32))
            n = self._rows
            if allowed_labels is None:
                row_label, live, any_live, all_live, prepared, live_t, emb = self._unfiltered()
            else:
                row_label = self._row_label[:n]
                row_label = np.where(np.isin(row_label, allowed_labels), row_label, -1)
                live = row_label >= 0
                any_live, all_live, prepared = bool(live.any()), bool(live.all()), None
                emb = torch.from_numpy(self._emb[:n])
            top = min(5, c)
            if (
                vote == "kde"
                and not neighbors
                and prepared
                and prepared[2] is not None
                and any_live
            ):
                # the common request (kde, no label filter, no neighbours): one compiled call
                best, vals, idx, total = scripted_kde_top()(
                    qt, emb, prepared[2], prepared[1], self.temperature, top, live_t
                )
                return self._results(best.tolist(), vals.tolist(), idx.tolist(), total.tolist())
            sims_all = qt @ emb.T if n else torch.zeros(len(q), 0)  # (B, n)
            if not any_live:
                best = np.full(len(q), -1.0)
            elif all_live:
                best = sims_all.max(dim=1).values.numpy()
            else:  # (B, n) with dead/filtered columns at -inf, no copy of the kept columns
                best = sims_all.masked_fill(~torch.from_numpy(live), -torch.inf)
                best = best.max(dim=1).values.numpy()
            hits = None
            if vote == "knn" or neighbors:
                kk = min(k, int(live.sum()))
                if kk > 0:
                    s, ids = self.index.search(qt.numpy(), kk, params=self._params(allowed))
                    lab = np.array([[self._label_of_row_id(i) for i in row] for row in ids])
                    hits = (s, ids, lab)
            if vote == "knn":
                if hits is None:
                    probs = torch.zeros(len(q), c)
                else:
                    probs = knn_probs(
                        torch.from_numpy(hits[0]), torch.from_numpy(hits[2]), c, self.temperature
                    )
            elif vote == "prototype":
                counts = self.counts.copy()
                if allowed_labels is not None:
                    counts[~np.isin(np.arange(c), allowed_labels)] = 0
                probs = prototype_probs(
                    qt,
                    torch.from_numpy(self.sums.astype(np.float32)),
                    torch.from_numpy(counts),
                    self.temperature,
                )
            else:  # kde
                lab = torch.from_numpy(row_label)
                logd = kde_log_density(sims_all, lab, c, self.temperature, prepared)  # (B, c)
                probs = (
                    torch.softmax(logd.nan_to_num(neginf=-1e30), dim=1)
                    if any_live
                    else torch.zeros(len(q), c)
                )
            # Top labels for the whole batch at once; Python only walks the small lists.
            vals = idx = total = None
            if c:
                vals, idx = probs.topk(top, dim=1)
                vals, idx, total = vals.tolist(), idx.tolist(), probs.sum(dim=1).tolist()
            return self._results(best.tolist(), vals, idx, total, hits if neighbors else None)

    def _results(self, best, vals, idx, total, hits=None) -> list[Classification]:
        """Per query: top labels from (B, top) probability lists `vals` and label ids `idx`
        (None when there are no labels), `total` probability (0: no label could take it),
        best similarity, and the neighbours from `hits` (similarities, ids, label ids)."""
        out = []
        for b in range(len(best)):
            if total is None or total[b] <= 0:
                out.append(Classification(None, 0.0, [], best[b], []))
                continue
            pr = [(self.labels[i], v) for v, i in zip(vals[b], idx[b], strict=True) if v > 0]
            nb = []
            if hits is not None:
                nb = [
                    (i, self.labels[li], s)
                    for s, i, li in zip(
                        hits[0][b].tolist(), hits[1][b].tolist(), hits[2][b].tolist(), strict=True
                    )
                    if i >= 0 and li >= 0
                ]
            out.append(Classification(pr[0][0], pr[0][1], pr, best[b], nb))
        return out

    def _label_of_row_id(self, item_id: int) -> int:
        r = self._row_of.get(int(item_id))
        return -1 if r is None else int(self._row_label[r])
