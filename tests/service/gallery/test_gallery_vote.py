"""The compiled kde path (service.gallery.compiled.kde_top, one call per batch) gives what the
step-by-step path (embedding.votes.Kde) gives, in the gallery states the service meets: all
rows live, deleted rows not yet compacted, a label emptied by deletes, labels added later; with
few labels (a one-hot product) and many (a scatter-add), at a temperature float32 holds and at
one that needs float64."""

import faiss
import numpy as np
import pytest
import torch

import service.gallery.gallery as gallery_mod
from service.gallery.compiled import ONEHOT_MAX_LABELS
from service.gallery.gallery import Gallery
from service.gallery.vectors import VectorIndex

DIM = 16


def _unit(rng, n):
    x = rng.standard_normal((n, DIM)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


SIZES = (("a", 300), ("b", 200), ("c", 5), ("d", 40))


def _gallery(rng, sizes=SIZES, temperature=0.05) -> Gallery:
    index = VectorIndex(faiss.IndexIDMap2(faiss.IndexFlatIP(DIM)), {})
    g = Gallery(index, DIM, temperature=temperature)
    next_id = 0
    for seq, (label, n) in enumerate(sizes, start=1):
        centre = _unit(rng, 1)
        emb = centre + 0.6 * _unit(rng, n)
        emb /= np.linalg.norm(emb, axis=1, keepdims=True)
        g.apply_add(list(range(next_id, next_id + n)), label, emb.astype(np.float32), seq)
        next_id += n
    return g


def _compare(g: Gallery, q: np.ndarray) -> None:
    fast = g.classify(q, "kde", 30)  # the compiled path
    slow = g.classify(q, "kde", 30, neighbors=True)  # step by step (neighbours force it)
    assert len(fast) == len(slow) == len(q)
    for f, s in zip(fast, slow, strict=True):
        assert f.label == s.label
        assert f.best_similarity == pytest.approx(s.best_similarity, abs=1e-6)
        assert f.unknown_score == pytest.approx(s.unknown_score, abs=1e-6)
        assert [lab for lab, _ in f.probabilities] == [lab for lab, _ in s.probabilities]
        for (_, pf), (_, ps) in zip(f.probabilities, s.probabilities, strict=True):
            assert pf == pytest.approx(ps, abs=1e-6)


def test_compiled_kde_matches_the_step_by_step_rule(monkeypatch):
    calls = []
    compiled = gallery_mod.scripted_kde_top()
    # compiled for real (scripted_kde_top falls back to plain Python where TorchScript fails)
    assert isinstance(compiled.__wrapped__, torch.jit.ScriptFunction)

    def counting(*a):
        calls.append(a[0].shape[0])
        return compiled(*a)

    monkeypatch.setattr(gallery_mod, "scripted_kde_top", lambda: counting)
    rng = np.random.default_rng(0)
    g = _gallery(rng)
    for b in (1, 3, 17):
        _compare(g, _unit(rng, b))
    assert calls == [1, 3, 17]  # the fast path ran, once per batch

    # deleted rows (fewer than compaction needs: they stay in the matrix, masked) and a label
    # emptied by deletes, whose probability must be 0 and never in the top list
    vec = g.rows.vector
    rows = [(i, "a", vec(i), "trained") for i in range(0, 300, 3)]
    rows += [(i, "c", vec(i), "trained") for i in range(500, 505)]
    g.apply_delete(rows, seq=10)
    assert g.rows.n == 545 and not g.rows.labels.min() >= 0
    q = np.concatenate([_unit(rng, 4), vec(1)[None, :]])  # + a live gallery item
    _compare(g, q)
    assert all("c" not in [lab for lab, _ in r.probabilities] for r in g.classify(q, "kde", 30))
    # a deleted item's own vector: its best similarity is no longer 1
    assert vec(0) is None
    assert g.classify(rows[0][2][None, :], "kde", 30)[0].best_similarity < 0.999

    g.apply_add([900, 901], "e", _unit(rng, 2), seq=11)  # a label added at run time
    _compare(g, np.concatenate([_unit(rng, 2), vec(900)[None, :]]))
    assert g.classify(vec(901)[None, :], "kde", 30)[0].best_similarity > 0.999


@pytest.mark.parametrize("labels,temperature", [(40, 0.05), (4, 0.02), (40, 0.02)])
def test_compiled_kde_matches_with_many_labels_and_a_sharp_kernel(labels, temperature):
    """40 labels: per-label sums by a scatter-add (no one-hot product); σ = 0.02: the kernel in
    float64, shifted (unshifted, exp(1/σ) = e^50 would overflow float32)."""
    assert 4 <= ONEHOT_MAX_LABELS < 40  # both ways of summing are exercised
    rng = np.random.default_rng(labels)
    sizes = [(f"l{i}", int(n)) for i, n in enumerate(rng.integers(1, 60, labels))]
    g = _gallery(rng, sizes, temperature)
    _compare(g, _unit(rng, 9))
    vec = g.rows.vector
    g.apply_delete([(i, "l0", vec(i), "trained") for i in range(sizes[0][1])], seq=99)
    _compare(g, _unit(rng, 5))  # a label emptied: a zero-length segment
    assert all("l0" not in [lab for lab, _ in r.probabilities] for r in g.classify(
        _unit(rng, 5), "kde", 30))  # fmt: skip


def test_every_rule_answers_when_no_item_qualifies():
    """A label filter whose labels were emptied by deletes: no label, no error, every rule."""
    rng = np.random.default_rng(1)
    g = _gallery(rng)
    g.apply_delete([(i, "c", g.rows.vector(i), "added") for i in range(500, 505)], seq=10)
    q = _unit(rng, 3)
    for vote in ("knn", "prototype", "kde"):
        for neighbors in (False, True):
            res = g.classify(q, vote, 30, labels=["c"], neighbors=neighbors)
            assert [r.label for r in res] == [None] * 3, vote
            assert all(r.neighbors == [] for r in res)


def test_every_rule_that_claims_the_fused_path_takes_it_and_matches_its_own_vote(monkeypatch):
    """The fused call is chosen by the rule's own `fused_kde_prior`, not by its type: each rule
    that answers with a prior runs the compiled call once per batch and gives what its own step
    by step vote gives; the others never reach it."""
    from embedding.votes import RULES

    compiled = gallery_mod.scripted_kde_top()
    calls = []
    monkeypatch.setattr(
        gallery_mod, "scripted_kde_top", lambda: lambda *a: calls.append(1) or compiled(*a)
    )
    rng = np.random.default_rng(3)
    g = _gallery(rng)
    q = _unit(rng, 7)
    fused = [name for name, rule in RULES.items() if rule().fused_kde_prior() is not None]
    assert {"kde", "kde_shrunk"} <= set(fused)
    for name in RULES:
        calls.clear()
        fast = g.classify(q, name, 30)
        slow = g.classify(q, name, 30, neighbors=True)
        assert len(calls) == (1 if name in fused else 0), name
        for f, s in zip(fast, slow, strict=True):
            assert f.label == s.label, name
            for (_, pf), (_, ps) in zip(f.probabilities, s.probabilities, strict=True):
                assert pf == pytest.approx(ps, abs=1e-6), name


def test_the_snapshot_votes_on_a_view_of_the_rows_whose_rows_never_lie_4_kb_apart():
    """The vote reads the rows' transposed matrix through a view (no copy per write), whose
    rows lie capacity + PAD_T floats apart: never a multiple of 4 KB, at any capacity the
    matrix grows to (a power-of-two stride made the product ~1.5x slower:
    benchmarks/write_cost.py). The answers after growing and after writes are the
    step-by-step vote's."""
    rng = np.random.default_rng(7)
    g = _gallery(rng)  # 545 rows in a matrix of 1,024 columns: the view is strided
    q = _unit(rng, 6)
    for grow in range(3):
        _compare(g, q)
        view = g._snapshot.embeddings_t
        assert view.data_ptr() == g.rows._emb_t.ctypes.data  # a view, not a copy
        assert not view.is_contiguous()
        assert (view.stride(0) * 4) % 4096 != 0, view.stride(0)
        n = g.rows.n
        g.apply_add(list(range(10_000 + n, 10_000 + 2 * n)), "c", _unit(rng, n), 99 + grow)
    assert g.rows._emb_t.shape[1] > 4 * 1024  # it grew past capacities 1,024, 2,048, 4,096
