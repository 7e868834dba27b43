"""The in-memory gallery: the FAISS index (VectorIndex: search, kNN neighbours), the rows and
per-label statistics (Rows, LabelStats), and the vote rules (embedding.votes) over them.

Two paths to the same votes. Up to `exact_max` items the rows keep a dense copy of every
embedding and a vote reads the similarity to every row (exact; the fastest there). Beyond it
there is no dense copy: a vote reads the index's top-K' candidates (K' = `candidates`) and the
exact label statistics (VoteRule.vote_candidates), so its cost does not grow with the gallery
and the memory per item is the index's bytes plus 24 (docs/PERFORMANCE.md, "gallery scale").

A write is applied here only after the store committed it; readers share a lock that a write
takes exclusively, so no reader ever sees a half-applied write.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import numpy as np
import torch

from embedding import openset
from embedding.openset import label_groups, label_kth, label_kth_grouped
from embedding.votes import RULES, Candidates, GalleryView, Kde, Neighbors, VoteRule
from embedding.world import DEFAULT_TPR as WORLD_TPR
from embedding.world import WorldFit
from service.gallery.compiled import ONEHOT_MAX_LABELS, scripted_kde_top
from service.gallery.diagnostics import Diagnostics, diagnose, world_warning
from service.gallery.label_tables import LabelTables
from service.gallery.lock import RWLock
from service.gallery.openset import OpenSet
from service.gallery.query import VoteQuery
from service.gallery.rows import LabelStats, Rows
from service.gallery.vectors import VectorIndex
from service.gallery.world import NO_CHECK, Worlds, WorldVerdict
from service.store.records import Change, Item, Relabelled

log = logging.getLogger("snca.service")

# The rules are stateless: one instance each.
RULES_BY_NAME: dict[str, VoteRule] = {name: cls() for name, cls in RULES.items()}


@dataclass
class Classification:
    label: str | None
    confidence: float
    probabilities: list[tuple[str, float]]  # top 5
    best_similarity: float
    neighbors: list[tuple[int, str, float]]
    # embedding.openset's score: similarity to the k_c-th nearest item of `label`; None when
    # there is no label
    unknown_score: float | None = None
    label_id: int = -1
    world: WorldVerdict = NO_CHECK  # is the query of the chosen label's world (world.py)
    # the query's row [vector | world statistics], float32, when the review queue keeps queries
    # (service/review/); None otherwise
    row: np.ndarray | None = None


@dataclass
class Snapshot:
    """The rows as every unfiltered classify reads them, kept until they change."""

    epoch: int  # Rows.epoch it was made at
    num_labels: int
    view: GalleryView  # tensors over the rows (the embeddings are a view, not a copy)
    live: torch.Tensor | None  # (n,) bool, None when every row is live
    any_live: bool
    embeddings_t: torch.Tensor  # (d, n) the rows transposed: a view of Rows' padded matrix


# Defaults measured on the 55,000-item Fashion-MNIST gallery (benchmarks/gallery_scale.py):
# K' = 1,024 candidates keep >= 99.5% of kde's labels identical to the exact vote (512: 99.2%);
# galleries up to EXACT_MAX items vote densely, where that is no slower (kde, batch of 64, Flat:
# dense 22.0 vs candidates 24.7 ms at 55,000 items; 83.0 vs 39.1 ms at 100,000).
CANDIDATES = 1024
EXACT_MAX = 60_000
DIAGNOSE_CHUNK = 16  # images searched per hold of the read lock (diagnose)


class Gallery:
    def __init__(
        self,
        vectors: VectorIndex,
        dim: int,
        temperature: float,
        candidates: int = CANDIDATES,
        exact_max: int = EXACT_MAX,
        unknown_k: int = openset.K,
        world: WorldFit | None = None,
        world_tpr: float = WORLD_TPR,
    ):
        self.vectors = vectors
        self.dim = dim
        self.temperature = temperature
        self.candidates = candidates  # K': index candidates a vote reads beyond exact_max
        self.exact_max = exact_max  # galleries up to this many items vote densely
        self.lock = RWLock()
        self.on_version = None  # (version) -> None, told whenever the version moves
        self._version = 0  # last store write applied
        self.rows = Rows(dim)
        self.stats = LabelStats(dim)
        self._snapshot: Snapshot | None = None
        self._snapshot_lock = threading.Lock()
        self._tables = LabelTables(temperature)  # kept write by write (label_tables.py)
        self._checksum: tuple | None = None
        self.openset = OpenSet(dim, unknown_k)
        self.worlds = Worlds(world, world_tpr)
        self._thresholds: dict[float, tuple] = {}  # tpr -> (key, (C,) thresholds)

    @property
    def version(self) -> int:
        """The last store write applied."""
        return self._version

    @version.setter
    def version(self, v: int) -> None:
        self._version = v
        if self.on_version is not None:
            self.on_version(v)  # wakes the requests parked for it (service/http/waits.py)

    # ------------------------------------------------------------------ writes (store first)
    def load_items(self, items: list[Item]) -> None:
        """Rows and label statistics from every live item of the store (start-up); the index
        already holds them (built, or a snapshot brought up to date)."""
        by_label: dict[str, list[Item]] = {}
        for it in items:
            by_label.setdefault(it.label, []).append(it)
        with self.lock.write():
            if self.rows.n == 0:
                self.rows = Rows(self.dim, dense=self.rows.n + len(items) <= self.exact_max)
            for name in sorted(by_label):
                group = by_label[name]
                c = self.stats.id_of(name)
                emb = np.stack([it.embedding for it in group]).astype(np.float32)
                idarr = np.array([it.id for it in group], dtype=np.int64)
                self.rows.append(idarr, c, emb)
                self.stats.add(c, emb, sum(it.source == "added" for it in group))
                self.openset.added(c, idarr, emb)
                added = [i for i, it in enumerate(group) if it.source == "added"]
                if added:
                    self.worlds.added(c, idarr[added], [group[i].world for i in added])
            self._recalibrate([self.stats.ids[name] for name in by_label])

    def apply(self, c: Change) -> None:
        """A write of the store's log that another process made (the follower reads it), by its
        kind (store/records.py Change): an add's items added; a correction's moved, and those
        added after this replica's version and moved since added under their new label; a
        carry's (mixed) each by whether this replica holds it; a delete's removed."""
        if c.op == "delete":
            self.apply_delete(c.rows, c.seq)
            return
        if c.op == "add" and any(self.rows.has(x) for x in c.ids):
            log.error(
                "write %d adds items this replica holds already (ids %s): moved, not added again",
                c.seq,
                [x for x in c.ids if self.rows.has(x)][:10],
            )
        self.apply_add(c.ids, c.label, c.embeddings, c.seq, c.worlds, c.sources)

    def apply_add(
        self, ids: list[int], label: str, emb: np.ndarray, seq: int, stats=None, sources=None
    ) -> None:
        """Items the store committed as write `seq` under `label` (added through the service,
        unless `sources` says), with their world statistics (rows of (D,) or None) when
        known. An id this replica holds already was moved to `label` by a correction (the
        store's relabel, rename, merge): it is moved here, its vector stays. A vector the
        index holds already is never added again (_lacking)."""
        held = [i for i, x in enumerate(ids) if self.rows.has(x)]
        if held:
            worlds = [None] * len(ids) if stats is None else list(stats)
            src = ["added"] * len(ids) if sources is None else list(sources)
            moved = [Relabelled(int(ids[i]), "", emb[i], src[i], worlds[i]) for i in held]
            self.apply_relabel(moved, label, seq)
            rest = sorted(set(range(len(ids))) - set(held))
            if not rest:
                return
            ids = [ids[i] for i in rest]
            emb = np.asarray(emb)[rest]
            stats = None if stats is None else [stats[i] for i in rest]
        with self.lock.write():
            idarr = np.asarray(ids, dtype=np.int64)
            lacking = self._lacking(idarr)
            self.vectors.add(idarr[lacking], np.asarray(emb)[lacking])
            c = self.stats.id_of(label)
            self.rows.append(idarr, c, emb)
            self.stats.add(c, emb, len(ids))
            if self.rows.dense and self.size() > self.exact_max:
                self.rows.drop_embeddings()  # outgrew the dense path: candidates from now on
                self._snapshot = None
            self.openset.added(c, idarr, emb)
            self.worlds.added(c, idarr, stats)
            self._recalibrate([c])
            self.version = max(self.version, seq)

    def _lacking(self, ids: np.ndarray) -> np.ndarray:
        """(n,) bool: which of `ids` (that the rows lack) the index lacks too. While the index
        holds as many vectors as the rows hold live items (start-up checks they hold the same
        ids: service/startup/finishing.py), an id the rows lack is not in the index: no lookup; else
        each id is looked up (a vector held already is not added again)."""
        if self.vectors.live_count() == self.size():
            return np.ones(len(ids), dtype=bool)
        lacking = ~self.vectors.holds(ids)
        if not lacking.all():
            log.error(
                "the index holds vectors of items the gallery's rows lack (ids %s): kept once",
                ids[~lacking][:10].tolist(),
            )
        return lacking

    def replace(self, vectors: VectorIndex, items: list[Item], version: int) -> None:
        """Everything anew (a replica that rebuilt from the store): index, rows, statistics."""
        with self.lock.write():
            self.vectors = vectors
            self.rows = Rows(self.dim, dense=len(items) <= self.exact_max)
            self.stats = LabelStats(self.dim)
            self.openset = OpenSet(self.dim, self.openset.k, self.openset.sample_size)
            self.worlds = Worlds(self.worlds.given, self.worlds.tpr, self.worlds.sample_size)
            self._snapshot = None
        self.load_items(items)
        self.version = version

    def apply_delete(self, rows: list[tuple[int, str, np.ndarray, str]], seq: int) -> None:
        """rows: (id, label, embedding, source) of items the store marked deleted by `seq`."""
        with self.lock.write():
            self.vectors.remove(np.array([r[0] for r in rows], dtype=np.int64))
            touched = set()
            for item_id, _label, emb, source in rows:
                c = self.rows.kill(item_id)
                if c is not None:
                    self.stats.remove(c, emb, source == "added")
                    self.openset.removed(c, item_id)
                    self.worlds.removed(c, item_id)
                    touched.add(c)
            self.rows.compact()
            self._recalibrate(sorted(touched))
            self.version = max(self.version, seq)

    def apply_relabel(self, moved: list[Relabelled], label: str, seq: int) -> None:
        """Items a correction (write `seq`) moved to `label`: their rows, the label statistics
        and the open-set samples of both labels move; both labels are calibrated anew."""
        with self.lock.write():
            c = self.stats.id_of(label)
            touched = {c}
            for m in moved:
                was = self.rows.relabel(m.id, c)
                if was is None or was == c:
                    continue
                added = m.source == "added"
                e = np.asarray(m.embedding, dtype=np.float32)
                self.stats.remove(was, e, added)
                self.stats.add(c, e[None, :], int(added))
                self.openset.removed(was, m.id)
                self.openset.added(c, np.array([m.id], dtype=np.int64), e[None, :])
                if added:
                    self.worlds.removed(was, m.id)
                    self.worlds.added(c, np.array([m.id], dtype=np.int64), [m.world])
                touched.add(was)
            self._recalibrate(sorted(touched))
            self.version = max(self.version, seq)

    def _recalibrate(self, labels) -> None:
        """Leave-one-out scores of `labels` anew (under the write lock; embedding.openset)."""

        def members(c):
            if not self.rows.dense:
                return None
            rows = np.nonzero(self.rows.labels == c)[0]
            return self.rows.ids[rows], self.rows.embeddings[rows]

        self.openset.recalibrate(
            labels,
            self.stats.counts,
            lambda q, k: self.vectors.search(q, k),
            self.rows.labels_of,
            members,
            self.candidates,
        )
        self.worlds.recalibrate(labels)

    # ------------------------------------------------------------------ reads
    def thresholds(self, tpr: float) -> np.ndarray:
        """(C,) the unknown threshold of every label id at acceptance rate `tpr` (-inf: none)."""
        key = (self.openset.epoch, len(self.stats))
        hit = self._thresholds.get(tpr)
        if hit is not None and hit[0] == key:
            return hit[1]
        t = self.openset.calibration.thresholds(len(self.stats), tpr)
        if len(self._thresholds) > 16:
            self._thresholds.clear()
        self._thresholds[tpr] = (key, t)
        return t

    def cached_thresholds(self, tpr: float) -> np.ndarray | None:
        """thresholds(tpr) if cached for the current calibration, else None; takes no lock
        (the event loop calls it: a reader waiting behind a writer would stop the loop)."""
        hit = self._thresholds.get(tpr)
        key = (self.openset.epoch, len(self.stats))
        return hit[1] if hit is not None and hit[0] == key else None

    def thresholds_at(self, tpr: float) -> np.ndarray:
        """thresholds(tpr) under the read lock (cached per calibration and rate)."""
        with self.lock.read():
            return self.thresholds(tpr)

    def diagnose(
        self,
        label: str,
        vote: str,
        k: int,
        tpr: float,
        ids: list[int] | None = None,
        emb: np.ndarray | None = None,
        stats: np.ndarray | None = None,
    ) -> Diagnostics | None:
        """Diagnostics of `label` (service/gallery/diagnostics.py) from its items `ids` with
        embeddings `emb` (the images just added), or else from its open-set sample (up to
        embedding.openset.SAMPLE items); None when the label has no items.

        The read lock is taken for a moment at a time (a copy of the label statistics, then
        one search of DIAGNOSE_CHUNK images per hold), never for the whole call: a write
        waiting for the lock blocks new readers, so one long hold would stall every reader
        behind it (the event loop's too, before it stopped taking this lock)."""
        with self.lock.read():
            c = self.stats.ids.get(label)
            if c is None or self.stats.counts[c] <= 0:
                return None
            if emb is None:
                s = self.openset.samples.get(c)
                own = s.ids.copy() if s is not None else np.zeros(0, dtype=np.int64)
                emb = s.emb.copy() if s is not None else np.zeros((0, self.dim), np.float32)
            else:
                own = np.asarray(ids, dtype=np.int64)
            names = list(self.stats.names)
            sums, counts = self.stats.sums.copy(), self.stats.counts.copy()
            thresholds = self.thresholds(tpr) if tpr else np.full(len(self.stats), -np.inf)

        def search(q: np.ndarray, kk: int):
            out = []
            for s0 in range(0, len(q), DIAGNOSE_CHUNK):
                with self.lock.read():
                    sims, hit = self.vectors.search(q[s0 : s0 + DIAGNOSE_CHUNK], kk)
                    out.append((sims, hit, self.rows.labels_of(hit)))
            if not out:
                z = np.zeros((0, kk))
                return z, z.astype(np.int64), z.astype(np.int64)
            return tuple(np.concatenate(parts) for parts in zip(*out, strict=True))

        d = diagnose(
            label,
            c,
            np.ascontiguousarray(emb, dtype=np.float32),
            own,
            RULES_BY_NAME[vote],
            names,
            sums,
            counts,
            search,
            self.temperature,
            k,
            self.candidates,
            self.openset.k,
            thresholds,
        )
        z = self.worlds.z(None if stats is None else np.asarray(stats, np.float32))
        if z is not None and self.worlds.threshold is not None:
            world_warning(d, self.worlds.fit.score(z) > self.worlds.threshold)
        return d

    def size(self) -> int:
        return int(self.stats.counts.sum())

    def added_size(self) -> int:
        return int(self.stats.added.sum())

    @property
    def labels(self) -> list[str]:
        """Every label name seen, in label-id order (some may have no items left)."""
        return self.stats.names

    def cached_checksum(self) -> str | None:
        """checksum() if cached for the current rows, else None; takes no lock."""
        c = self._checksum
        key = (id(self.rows), self.rows.epoch, self.vectors.index.ntotal)
        return c[1] if c is not None and c[0] == key else None

    def checksum(self) -> str:
        """sha256 over the live (id, label) pairs in id order, and the index's size: two
        replicas at the same version hold the same gallery iff these match (cached per
        change)."""
        import hashlib

        with self.lock.read():
            key = (id(self.rows), self.rows.epoch, self.vectors.index.ntotal)
            if self._checksum is not None and self._checksum[0] == key:
                return self._checksum[1]
            labels = self.rows.labels
            live = labels >= 0
            ids, lab = self.rows.ids[live], labels[live]
            order = np.argsort(ids, kind="stable")
            names = np.array([*self.stats.names, ""], dtype=object)[lab[order]]
            h = hashlib.sha256(ids[order].astype("<i8").tobytes())
            h.update("\x00".join(names.tolist()).encode())
            h.update(str(self.vectors.index.ntotal - len(self.vectors.tombstones)).encode())
            digest = h.hexdigest()[:16]
            self._checksum = (key, digest)
            return digest

    def has_label(self, name: str) -> bool:
        return name in self.stats.ids

    def count_of(self, label: str) -> int:
        c = self.stats.ids.get(label)
        return 0 if c is None else int(self.stats.counts[c])

    def label_table(self) -> list[tuple[str, int, int]]:
        """(label, live count, added count) for labels with items, by label name."""
        with self.lock.read():
            return self.stats.table()

    def _name(self, label_id: int) -> str | None:
        return None if label_id < 0 else self.stats.names[label_id]

    def _allowed(self, labels: list[str] | None) -> tuple[np.ndarray | None, np.ndarray | None]:
        """(allowed ids, allowed label ids) for a label filter; (None, None) without one."""
        if labels is None:
            return None, None
        cs = np.array([self.stats.ids[n] for n in labels if n in self.stats.ids], dtype=np.int64)
        return self.rows.ids_with(cs), cs

    def search(self, q: np.ndarray, k: int, labels: list[str] | None = None):
        """q (B, d) -> sims (B, k'), ids (B, k'), label names per hit (k' <= k; -1 padded)."""
        with self.lock.read():
            allowed, _ = self._allowed(labels)
            kk = min(k, self.size() if allowed is None else len(allowed))
            if kk <= 0:
                return np.full((len(q), 0), -1.0), np.full((len(q), 0), -1), []
            sims, ids = self.vectors.search(q, kk, allowed)
            lab = self.rows.labels_of(ids)
            names = [[self._name(int(c)) for c in row] for row in lab]
            return sims, ids, names

    def _unfiltered(self) -> Snapshot:
        """The view every unfiltered classify needs, made anew only when the rows changed; the
        label tables it reads (kde's one-hot, the label groups) kept write by write."""
        s = self._snapshot
        if s is not None and s.epoch == self.rows.epoch and s.num_labels == len(self.stats):
            return s
        with self._snapshot_lock:  # readers of one epoch: one makes it, the others take it
            s = self._snapshot
            if s is not None and s.epoch == self.rows.epoch and s.num_labels == len(self.stats):
                return s
            self._tables.sync(self.rows, len(self.stats))
            labels = self.rows.labels
            live = labels >= 0
            view = GalleryView(
                torch.from_numpy(self.rows.embeddings),  # a view: the matrix is replaced to grow
                torch.from_numpy(labels.copy()),
                torch.from_numpy(self.stats.sums.copy()),
                torch.from_numpy(self.stats.counts.copy()),
                self.temperature,
            )
            # what Kde.prepared and _groups would derive from the view's labels, already kept
            view.cache["kde"] = self._tables.prepared()
            view.cache["groups"] = self._tables.groups()
            all_live = bool(live.all())
            s = Snapshot(
                self.rows.epoch,
                len(self.stats),
                view,
                None if all_live else torch.from_numpy(live),
                bool(live.any()),
                torch.from_numpy(self.rows.embeddings_t),  # a view: as fast as a copy (PAD_T)
            )
            self._snapshot = s
            return s

    def _filtered(self, allowed_labels: np.ndarray) -> tuple[GalleryView, torch.Tensor, bool]:
        """A view in which labels outside `allowed_labels` have no items."""
        labels = self.rows.labels
        labels = np.where(np.isin(labels, allowed_labels), labels, -1)
        counts = self.stats.counts.copy()
        counts[~np.isin(np.arange(len(counts)), allowed_labels)] = 0
        view = GalleryView(
            torch.from_numpy(self.rows.embeddings),
            torch.from_numpy(labels),
            torch.from_numpy(self.stats.sums.copy()),
            torch.from_numpy(counts),
            self.temperature,
        )
        live = labels >= 0
        return view, torch.from_numpy(live), bool(live.any())

    def classify(
        self,
        q: np.ndarray | torch.Tensor,
        vote: str,
        k: int,
        labels: list[str] | None = None,
        neighbors: bool = False,
        stats: np.ndarray | None = None,
    ) -> list[Classification]:
        """Label probabilities for each query (B, d) (numpy, or a float32 CPU tensor) under
        the rule `vote`, optionally restricted to `labels`; the k nearest items (the kNN
        voters) when asked; with the queries' world statistics `stats` (B, D), whether each
        is of its chosen label's world (Classification.world)."""
        labels_ = None if labels is None else tuple(labels)
        return self.answer(q, VoteQuery(vote, k, labels_, neighbors), stats)

    def answer(
        self, q: np.ndarray | torch.Tensor, query: VoteQuery, stats: np.ndarray | None = None
    ) -> list[Classification]:
        """classify with the request's vote parameters as one VoteQuery (what the service's
        batches carry)."""
        with self.lock.read():
            labels = None if query.labels is None else list(query.labels)
            out = self._classify(q, query.vote, query.k, labels, query.neighbors)
            if stats is not None and self.worlds.fit is not None:
                z = self.worlds.z(np.asarray(stats, dtype=np.float32))
                trained = self.stats.counts - self.stats.added
                verdicts = self.worlds.check([c.label_id for c in out], z, trained)
                for c, v in zip(out, verdicts, strict=True):
                    c.world = v
            return out

    def _classify(self, q, vote: str, k: int, labels, neighbors: bool) -> list[Classification]:
        """classify's vote, under the read lock."""
        rule = RULES_BY_NAME[vote]
        qt = (
            q
            if isinstance(q, torch.Tensor)
            else torch.from_numpy(np.ascontiguousarray(q, dtype=np.float32))
        )
        allowed, allowed_labels = self._allowed(labels)
        if not self.rows.dense:
            return self._classify_candidates(qt, rule, k, allowed, allowed_labels, neighbors)
        if allowed_labels is None:
            snap = self._unfiltered()
            view, live, any_live = snap.view, snap.live, snap.any_live
        else:
            snap = None
            view, live, any_live = self._filtered(allowed_labels)
        c = view.num_classes
        top = min(5, c)
        kcs = self._kcs(view.counts)
        alpha = rule.fused_kde_prior()
        if alpha is not None and not neighbors and snap is not None and any_live:
            # the common request (a kde rule, no filter, no neighbours): one compiled call
            lab, counts, onehot = Kde.prepared(view)
            if c > ONEHOT_MAX_LABELS:
                onehot = None  # a scatter-add: the product grows with the labels
            order, starts = self._groups(view)
            best, vals, idx, total, score = scripted_kde_top()(
                qt, snap.embeddings_t, lab, onehot, counts, self.temperature, top, live,
                order, starts, kcs, alpha,
            )  # fmt: skip
            return self._results(
                best.tolist(), vals.tolist(), idx.tolist(), total.tolist(), scores=score.tolist()
            )
        n = view.embeddings.shape[0]
        sims = qt @ view.embeddings.T if n else torch.zeros(len(qt), 0)  # (B, n)
        if not any_live:
            best = np.full(len(qt), -1.0)
        elif live is None:
            best = sims.max(dim=1).values.numpy()
        else:  # dead or filtered columns at -inf, no copy of the kept columns
            best = sims.masked_fill(~live, -torch.inf).max(dim=1).values.numpy()
        hits = None
        if rule.needs_neighbors or neighbors:
            hits = self._neighbors(qt, k, allowed, int(view.counts.sum()))
        nb = None if hits is None else Neighbors(hits[0], hits[2])
        probs = rule.probs(qt, view, k, neighbors=nb, similarities=sims)
        # Top labels for the whole batch at once; Python only walks the small lists.
        vals = idx = total = scores = None
        if c:
            v, i = probs.topk(top, dim=1)
            vals, idx, total = v.tolist(), i.tolist(), probs.sum(dim=1).tolist()
            pred = i[:, 0]
            order, starts = self._groups(view)
            scores = label_kth_grouped(sims, order, starts, pred, kcs[pred]).tolist()
        return self._results(best.tolist(), vals, idx, total, hits if neighbors else None, scores)

    @staticmethod
    def _groups(view: GalleryView) -> tuple[torch.Tensor, torch.Tensor]:
        """The view's rows grouped by label (embedding.openset.label_groups), kept with it."""
        return view.memo("groups", lambda: label_groups(view.labels, view.num_classes))

    def _kcs(self, counts) -> torch.Tensor:
        """(C,) k_c = min(k, n_c - 1) of the open-set score (embedding.openset), at least 1:
        the statistic the calibration takes of each item (its k_c-th nearest among the n_c - 1
        others), so that a query of the label's kind is accepted at the rate asked. (It was
        min(k, n_c): for a label of 5 images, the query's farthest of 5 against the items'
        farthest of 4, stricter than calibrated: a registered label rejected its own kind.)"""
        n = torch.as_tensor(np.asarray(counts), dtype=torch.long)
        return (n - 1).clamp(min=1, max=self.openset.k)

    def _classify_candidates(
        self,
        qt: torch.Tensor,
        rule: VoteRule,
        k: int,
        allowed: np.ndarray | None,
        allowed_labels: np.ndarray | None,
        neighbors: bool,
    ) -> list[Classification]:
        """The vote at gallery scale: the index's top-K' candidates (K' >= k) and the exact
        label statistics, no similarity to every row (see the module docstring)."""
        counts = self.stats.counts
        if allowed_labels is not None:  # a label filter: the other labels have no items
            counts = np.where(np.isin(np.arange(len(counts)), allowed_labels), counts, 0)
        live = int(counts.sum())
        # K' candidates for every rule: the open-set score reads the chosen label's k_c-th
        # nearest among them (knn's k or prototype's 1 would leave it a loose upper bound)
        kk = min(max(rule.candidates_needed(k, self.candidates), self.candidates), live)
        if neighbors:
            kk = min(max(kk, k), live)
        if kk <= 0:
            return self._results([-1.0] * len(qt), None, None, None)
        sims, ids = self.vectors.search(qt.numpy(), kk, allowed)  # (B, kk) descending
        lab = self.rows.labels_of(ids)  # (B, kk), -1 for padding
        x = Candidates(
            qt,
            torch.from_numpy(sims),
            torch.from_numpy(lab),
            torch.from_numpy(self.stats.sums),
            torch.from_numpy(counts),
            self.temperature,
            k,
        )
        probs = rule.vote_candidates(x)  # (B, C)
        best = np.where(lab[:, 0] >= 0, sims[:, 0], -1.0).tolist()
        top = min(5, probs.shape[1])
        v, i = probs.topk(top, dim=1)
        pred = i[:, 0]
        scores = label_kth(x.similarities, x.labels, pred, self._kcs(counts)[pred]).tolist()
        hits = None
        if neighbors:
            kn = min(k, kk)
            hits = (x.similarities[:, :kn], torch.from_numpy(ids[:, :kn]), x.labels[:, :kn])
        return self._results(best, v.tolist(), i.tolist(), probs.sum(dim=1).tolist(), hits, scores)

    def _neighbors(self, qt: torch.Tensor, k: int, allowed: np.ndarray | None, live: int):
        """(sims (B, k'), ids (B, k'), label ids (B, k')) of the k' = min(k, live) nearest
        items from the index, as tensors; -1 ids and labels pad."""
        kk = min(k, live)
        if kk <= 0:
            empty = torch.zeros(len(qt), 0)
            return empty, empty.long(), empty.long()
        s, ids = self.vectors.search(qt.numpy(), kk, allowed)
        lab = self.rows.labels_of(ids)
        return torch.from_numpy(s), torch.from_numpy(ids), torch.from_numpy(lab)

    def _results(self, best, vals, idx, total, hits=None, scores=None) -> list[Classification]:
        """Per query: top labels from (B, top) probability lists `vals` and label ids `idx`
        (None when there are no labels), `total` probability (0: no label could take it),
        best similarity, the neighbours from `hits` (similarities, ids, label ids) and the
        open-set score of the top label (`scores`)."""
        names = self.stats.names
        out = []
        for b in range(len(best)):
            if total is None or total[b] <= 0:
                out.append(Classification(None, 0.0, [], best[b], []))
                continue
            pr = [(names[i], v) for v, i in zip(vals[b], idx[b], strict=True) if v > 0]
            nb = []
            if hits is not None:
                nb = [
                    (i, names[li], s)
                    for s, i, li in zip(
                        hits[0][b].tolist(), hits[1][b].tolist(), hits[2][b].tolist(), strict=True
                    )
                    if i >= 0 and li >= 0
                ]
            sc = None if scores is None or scores[b] < -1.0 else scores[b]
            out.append(Classification(pr[0][0], pr[0][1], pr, best[b], nb, sc, idx[b][0]))
        return out
