"""The vote at gallery scale (Gallery past exact_vote_max: the index's top-K' candidates plus
exact label statistics, no dense copy) against the dense exact vote, on every index kind the
builder makes, with deletes and the label filter."""

import faiss
import numpy as np
import pytest
import torch

from embedding.index import apply_search_params
from embedding.votes import GalleryView, get_rule
from service.gallery.gallery import Gallery
from service.gallery.vectors import VectorIndex

DIM = 16
SIZES = (("a", 600), ("b", 400), ("c", 5), ("d", 80))


def _unit(rng, n):
    x = rng.standard_normal((n, DIM)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _clusters(seed=0):
    """(label, (n, d) embeddings) per label: clustered like real embeddings."""
    rng = np.random.default_rng(seed)
    out = []
    for label, n in SIZES:
        emb = _unit(rng, 1) + 0.7 * _unit(rng, n)
        out.append((label, (emb / np.linalg.norm(emb, axis=1, keepdims=True)).astype(np.float32)))
    return out


def _index(factory: str):
    base = faiss.index_factory(DIM, factory, faiss.METRIC_INNER_PRODUCT)
    if not base.is_trained:
        base.train(np.concatenate([e for _, e in _clusters()]))
    params = {}
    if factory.startswith("IVF"):
        params["nprobe"] = 8  # every list: the candidates are exact
    if factory.startswith("HNSW"):
        params["efSearch"] = 2048
    index = faiss.IndexIDMap2(base)
    apply_search_params(index, params)  # as the service loads a built index
    return VectorIndex(index, params)


def _gallery(factory="Flat", exact_max=0, candidates=1024) -> Gallery:
    g = Gallery(_index(factory), DIM, 0.05, candidates=candidates, exact_max=exact_max)
    nid = 0
    for seq, (label, emb) in enumerate(_clusters(), start=1):
        g.apply_add(list(range(nid, nid + len(emb))), label, emb, seq)
        nid += len(emb)
    return g


def _same(a, b, tol=1e-5):
    assert [r.label for r in a] == [r.label for r in b]
    for x, y in zip(a, b, strict=True):
        assert x.best_similarity == pytest.approx(y.best_similarity, abs=tol)
        assert [lab for lab, _ in x.probabilities] == [lab for lab, _ in y.probabilities]
        for (_, p), (_, r) in zip(x.probabilities, y.probabilities, strict=True):
            assert p == pytest.approx(r, abs=tol)


@pytest.mark.parametrize("factory", ["Flat", "IVF8,Flat", "HNSW16"])
def test_with_every_item_a_candidate_every_rule_is_the_exact_vote(factory):
    dense, cand = _gallery(exact_max=10**9), _gallery(factory, exact_max=0, candidates=2000)
    assert dense.rows.dense and not cand.rows.dense
    with pytest.raises(RuntimeError):
        _ = cand.rows.embeddings  # no dense copy on the candidate path
    q = _unit(np.random.default_rng(5), 40)
    for vote in ("kde", "knn", "prototype"):
        _same(cand.classify(q, vote, 30), dense.classify(q, vote, 30))
    # the neighbours that voted: the same items
    a = cand.classify(q[:3], "knn", 10, neighbors=True)
    b = dense.classify(q[:3], "knn", 10, neighbors=True)
    assert [[i for i, _, _ in r.neighbors] for r in a] == [
        [i for i, _, _ in r.neighbors] for r in b
    ]


def test_few_candidates_keep_knn_and_prototype_exact_and_kde_close():
    dense, cand = _gallery(exact_max=10**9), _gallery(exact_max=0, candidates=64)
    q = np.concatenate([_unit(np.random.default_rng(6), 300), *(e[:20] for _, e in _clusters(1))])
    for vote in ("knn", "prototype"):  # knn reads k <= K' neighbours; prototype only statistics
        _same(cand.classify(q, vote, 30), dense.classify(q, vote, 30))
    a, b = cand.classify(q, "kde", 30), dense.classify(q, "kde", 30)
    same = np.mean([x.label == y.label for x, y in zip(a, b, strict=True)])
    assert same >= 0.97, same


def test_kde_tail_correction_gives_a_label_without_candidates_its_density():
    """A query whose K' candidates are all of label a: b, c and d still get f_c from the items
    outside the candidates (r_c·exp(μ_c/σ), μ_c from the label sums), as the exact vote does;
    truncated without the tail they would get probability 0."""
    view = GalleryView.of(
        torch.from_numpy(np.concatenate([e for _, e in _clusters()])),
        torch.from_numpy(np.repeat(np.arange(len(SIZES)), [n for _, n in SIZES])),
        len(SIZES),
        0.5,  # a wide kernel: the other labels have real mass
    )
    q = torch.from_numpy(_clusters()[0][1][:4])  # items of label a
    x = view.candidates(q, 30, 8)
    assert bool((x.labels == 0).all())
    kde = get_rule("kde")
    approx, exact = kde.vote_candidates(x), kde.probs(q, view, 30)
    assert bool((approx[:, 1:] > 0).all())
    # the tail estimate keeps every label near its exact probability
    assert torch.allclose(approx, exact, atol=0.05), (approx, exact)


@pytest.mark.parametrize("factory", ["Flat", "IVF8,Flat", "HNSW16"])
def test_deletes_and_the_label_filter_on_the_candidate_path(factory):
    g = _gallery(factory, exact_max=0, candidates=256)
    emb = dict(_clusters())
    gone = list(range(0, 600, 2))  # half of label a; HNSW keeps them as tombstones
    g.apply_delete([(i, "a", emb["a"][i], "trained") for i in gone], seq=10)
    assert g.count_of("a") == 300
    q = np.concatenate([emb["a"][:10], _unit(np.random.default_rng(7), 10)])
    for r in g.classify(q, "knn", 30, neighbors=True):
        assert not {i for i, _, _ in r.neighbors} & set(gone)
    assert g.classify(emb["a"][:1], "kde", 30)[0].best_similarity < 0.999  # its own item is gone
    res = g.classify(q, "kde", 30, labels=["c", "d"], neighbors=True)
    assert {r.label for r in res} <= {"c", "d"}
    assert all({lab for _, lab, _ in r.neighbors} <= {"c", "d"} for r in res)
    assert all({lab for lab, _ in r.probabilities} <= {"c", "d"} for r in res)
    # every item of a label deleted: no label can take the query, no error
    g.apply_delete([(1000 + i, "c", emb["c"][i], "added") for i in range(5)], seq=11)
    for vote in ("knn", "prototype", "kde"):
        assert [r.label for r in g.classify(q[:2], vote, 30, labels=["c"])] == [None, None]


def test_a_dense_gallery_that_outgrows_exact_max_drops_its_matrix_and_votes_the_same_labels():
    g = _gallery(exact_max=1100, candidates=2000)
    assert g.rows.dense and g.size() == 1085
    q = _unit(np.random.default_rng(8), 50)
    before = [r.label for r in g.classify(q, "kde", 30)]
    extra = _clusters(2)[3][1][:20]
    g.apply_add(list(range(5000, 5020)), "d", extra, seq=20)
    assert not g.rows.dense and g.size() == 1105
    ref = _gallery(exact_max=10**9)
    ref.apply_add(list(range(5000, 5020)), "d", extra, seq=20)
    _same(g.classify(q, "kde", 30), ref.classify(q, "kde", 30))
    assert len(before) == 50


@pytest.mark.parametrize("factory", ["Flat", "IVF8,Flat", "HNSW16", "PQ4"])
def test_after_deletes_every_index_kind_returns_each_items_own_id(factory):
    """Regression: IndexIDMap2.remove_ids under an IVF index compacted the id map while the
    lists kept their old positions, so search answered other items' ids (and -1s), and a
    second delete aborted the process in a FAISS assertion."""
    vi = _index(factory)
    x = np.concatenate([e for _, e in _clusters()])
    ids = np.arange(len(x)) + 100
    vi.add(ids, x)
    vi.remove(ids[:600:2])
    vi.remove(ids[601:700:2])  # a second delete
    keep = np.array([1, 3, 5, 700, 1000, 1084])
    k = 1 if factory != "PQ4" else 50  # PQ codes are lossy: the item is among the first few
    _, got = vi.search(x[keep], k)
    assert all(ids[j] in row for j, row in zip(keep, got, strict=True)), got[:, :3]
    _, got = vi.search(x[:600:2], 5)
    assert not set(got.ravel().tolist()) & set(ids[:600:2].tolist())


@pytest.mark.parametrize("factory", ["Flat", "IVF8,Flat", "HNSW16"])
def test_corrections_and_suggestions_on_every_index_kind(factory):
    """Issue 43 past the dense path: a correction moves items between labels (statistics, the
    vote), and a label's suggestions read its items' vectors back from the index (an IVF index
    makes its direct map for that)."""
    from service.gallery.suggest import suggest
    from service.store.records import Relabelled

    g = _gallery(factory, exact_max=0)
    a = g.rows.ids_with(np.array([g.stats.ids["a"]]))[:40]
    moved = [Relabelled(int(i), "a", g.vectors.vector(int(i)), "added", None) for i in a]
    g.apply_relabel(moved, "c", seq=99)
    assert g.count_of("a") == 560 and g.count_of("c") == 45 and g.version == 99
    got = suggest(g, "knn", "c", k=30, limit=20)
    c_ids = set(g.rows.ids_with(np.array([g.stats.ids["c"]])).tolist())
    assert got and all(s.near_id in c_ids and s.id not in c_ids for s in got)
    assert [s.score for s in got] == sorted((s.score for s in got), reverse=True)
    # the moved items vote for their new label
    q = np.stack([m.embedding for m in moved[:5]])
    assert all(r.label == "c" for r in g.classify(q, "knn", 10))
