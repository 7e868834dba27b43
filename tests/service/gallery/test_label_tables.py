"""The label tables a dense vote reads, kept write by write (service.gallery.label_tables), equal
exactly what kde_prepare and label_groups make anew from the rows' labels, after every step of
random histories of appends (new and known labels), deletes, moves and compactions; and the
gallery's answers with them are the step-by-step vote's."""

import faiss
import numpy as np
import pytest
import torch

from embedding.openset import label_groups
from embedding.votes.kde import kde_prepare
from service.gallery.gallery import Gallery
from service.gallery.label_tables import LabelTables
from service.gallery.rows import Rows
from service.gallery.vectors import VectorIndex

DIM = 4


def _assert_equal(t: LabelTables, rows: Rows, c: int, temperature: float, limit: int) -> None:
    labels = torch.from_numpy(rows.labels.copy())
    lab, counts, onehot = kde_prepare(labels, c, temperature, limit)
    klab, kcounts, konehot = t.prepared()
    assert torch.equal(klab, lab)
    assert kcounts.dtype == counts.dtype and torch.equal(kcounts, counts)
    assert (konehot is None) == (onehot is None)
    if onehot is not None:
        assert konehot.dtype == onehot.dtype and torch.equal(konehot, onehot)
    order, starts = label_groups(labels, c)
    korder, kstarts = t.groups()
    assert torch.equal(korder, order) and torch.equal(kstarts, starts)


@pytest.mark.parametrize(
    "seed, temperature, limit",
    [(0, 0.05, 1 << 25), (1, 0.02, 1 << 25), (2, 0.05, 3000), (3, 0.05, 1 << 25)],
)
def test_kept_tables_equal_tables_made_anew_after_every_write(seed, temperature, limit):
    rng = np.random.default_rng(seed)
    rows, t = Rows(DIM), LabelTables(temperature, onehot_limit=limit)
    labels, next_id = 1, 0
    steps = 400
    for _ in range(steps):
        live = rows.ids[rows.labels >= 0]
        op = rng.choice(["add", "add", "kill", "move", "batch", "compact", "new"])
        if op in ("add", "new") or len(live) == 0:
            if op == "new" or rng.random() < 0.05:
                labels += 1  # a new label: column C moves, the tables are made anew
            n = int(rng.integers(1, 20))
            rows.append(np.arange(next_id, next_id + n), int(rng.integers(labels)),
                        rng.standard_normal((n, DIM)).astype(np.float32))  # fmt: skip
            next_id += n
        elif op == "kill":
            rows.kill(int(rng.choice(live)))
        elif op == "move":  # (at times to the label it has: no change)
            rows.relabel(int(rng.choice(live)), int(rng.integers(labels)))
        elif op == "batch":  # several changes between two votes, some rows touched twice
            for x in rng.choice(live, size=min(len(live), 8)):
                rows.relabel(int(x), int(rng.integers(labels)))
                if rng.random() < 0.3:
                    rows.kill(int(x))
        else:
            for x in rng.choice(live, size=len(live) // 3, replace=False):
                rows.kill(int(x))
            rows.compact()
        if rng.random() < 0.8:  # at times two writes between votes
            t.sync(rows, labels)
            _assert_equal(t, rows, labels, temperature, limit)
    t.sync(rows, labels)
    _assert_equal(t, rows, labels, temperature, limit)
    # the histories took the kept path most of the time (else this tested only the remake)
    assert t.rebuilds < steps // 3, t.rebuilds


def test_a_journal_past_its_bound_makes_the_tables_anew():
    rows, t = Rows(DIM), LabelTables(0.05)
    rows.append(np.arange(100), 0, np.ones((100, DIM), dtype=np.float32))
    t.sync(rows, 1)
    made = t.rebuilds
    for i in range(70):  # more touched ranges than Rows journals
        rows.kill(i)
    t.sync(rows, 1)
    assert t.rebuilds == made + 1
    _assert_equal(t, rows, 1, 0.05, 1 << 25)


def test_a_gallery_answers_with_kept_tables_as_the_step_by_step_vote():
    """Writes between votes keep the tables (no remake); the compiled vote on them gives the
    plain Kde rule's answers (the path test_gallery_vote.py compares on fresh tables)."""
    rng = np.random.default_rng(5)
    g = Gallery(VectorIndex(faiss.IndexIDMap2(faiss.IndexFlatIP(DIM)), {}), DIM, 0.05)
    emb = rng.standard_normal((600, DIM)).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    for i, label in enumerate("abc"):
        g.apply_add(list(range(200 * i, 200 * i + 200)), label, emb[200 * i : 200 * i + 200], i)
    q = emb[:5] + 0.1
    g.classify(q, "kde", 30)
    made = g._tables.rebuilds
    for step in range(12):
        g.apply_add([1000 + step], "abc"[step % 3], emb[step : step + 1], 10 + step)
        if step % 4 == 0:
            g.apply_delete([(step, "a", emb[step], "added")], 100 + step)
        fast = g.classify(q, "kde", 30)
        slow = g.classify(q, "kde", 30, neighbors=True)  # the step-by-step path
        for f, s in zip(fast, slow, strict=True):
            assert f.label == s.label
            for (lf, pf), (ls, ps) in zip(f.probabilities, s.probabilities, strict=True):
                assert lf == ls and pf == pytest.approx(ps, abs=1e-6)
    assert g._tables.rebuilds == made
