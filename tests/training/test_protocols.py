"""Evaluation protocol code on synthetic data with known answers."""

import math

import numpy as np
import pytest
import torch

from training.protocols import (
    episode_accuracy,
    linear_probe,
    mean_ci95,
    novel_base_hm,
    pca_fit,
    pca_project,
    sample_episodes,
)


def test_mean_ci95_formula():
    m, h = mean_ci95([1.0, 2.0, 3.0, 4.0])
    assert m == 2.5
    assert h == pytest.approx(1.96 * math.sqrt(5 / 3) / 2)  # sample std of 1..4 is sqrt(5/3)
    assert mean_ci95([0.7]) == (0.7, 0.0)
    with pytest.raises(ValueError):
        mean_ci95([])


def test_novel_base_hm_hand_computed():
    n, b, hm = novel_base_hm([(0.5, 1.0), (0.0, 0.0), (1.0, 0.25)])
    assert n.tolist() == [0.5, 0.0, 1.0] and b.tolist() == [1.0, 0.0, 0.25]
    np.testing.assert_allclose(hm, [2 * 0.5 / 1.5, 0.0, 2 * 0.25 / 1.25])


def test_episodes_never_leak_support_into_queries_and_are_reproducible():
    labels = np.repeat(np.arange(10), 30)  # 10 classes x 30 items
    eps = list(sample_episodes(labels, range(5, 10), 5, 5, 15, 200, seed=1))
    assert len(eps) == 200
    for ep in eps:
        assert not set(ep.support) & set(ep.query)  # disjoint items
        assert len(set(ep.support)) == 25 and len(set(ep.query)) == 75
        assert set(labels[ep.support]) <= set(range(5, 10))  # held-out classes only
        for local in range(5):  # one original class per local label, shared by both sides
            cls = set(labels[ep.support[ep.support_y == local]])
            assert len(cls) == 1 and cls == set(labels[ep.query[ep.query_y == local]])
    again = list(sample_episodes(labels, range(5, 10), 5, 5, 15, 200, seed=1))
    assert all(np.array_equal(a.query, b.query) for a, b in zip(eps, again, strict=True))
    with pytest.raises(ValueError, match="fewer than"):
        next(sample_episodes(labels, range(10), 5, 20, 15, 1))
    with pytest.raises(ValueError, match="need 6 classes"):
        next(sample_episodes(labels, range(5), 6, 1, 1, 1))


def _clusters(n_classes, per, noise, seed=0):
    g = torch.Generator().manual_seed(seed)
    centres = torch.nn.functional.normalize(torch.randn(n_classes, 32, generator=g), dim=1)
    y = torch.arange(n_classes).repeat_interleave(per)
    x = centres[y] + noise * torch.randn(len(y), 32, generator=g)
    return torch.nn.functional.normalize(x, dim=1), y.numpy()


def test_episode_accuracy_known_answers():
    emb, y = _clusters(8, 40, noise=0.05)  # well separated: every episode is solved
    eps = list(sample_episodes(y, range(8), 5, 1, 15, 50))
    assert episode_accuracy(emb, eps, 0.05).min() == 1.0
    emb, y = _clusters(8, 40, noise=50.0)  # noise only: chance level, 1/5
    acc = episode_accuracy(emb, list(sample_episodes(y, range(8), 5, 5, 15, 300)), 0.05)
    m, h = mean_ci95(acc)
    assert abs(m - 0.2) < 0.03 and h < 0.02


def test_episode_vote_matches_a_hand_computed_case():
    # support: items 0,1 of class A (local 0), item 2 of class B (local 1); query: item 3
    emb = torch.nn.functional.normalize(
        torch.tensor([[1.0, 0.2], [1.0, -0.2], [0.6, 1.0], [0.7, 0.6]]), dim=1
    )
    from training.protocols import Episode

    ep = Episode(np.array([0, 1, 2]), np.array([0, 0, 1]), np.array([3]), np.array([1]))
    s = (emb[3] @ emb[:3].T).tolist()
    # k = 3, sigma = 0.1: A scores e^(s0/.1) + e^(s1/.1), B scores e^(s2/.1)
    expect_b = math.exp(s[2] / 0.1) > math.exp(s[0] / 0.1) + math.exp(s[1] / 0.1)
    acc = episode_accuracy(emb, [ep], 0.1, k=3)[0]
    assert acc == (1.0 if expect_b else 0.0)
    # k = 1: only the single most similar support item votes
    assert episode_accuracy(emb, [ep], 0.1, k=1)[0] == float(int(np.argmax(s)) == 2)


def test_pca_recovers_the_dominant_subspace():
    g = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(20, 3, generator=g))[0].T  # (3, 20) orthonormal
    x = (torch.randn(500, 3, generator=g) * torch.tensor([5.0, 3.0, 2.0])) @ basis
    x = x + 0.01 * torch.randn(500, 20, generator=g) + 7.0  # offset: the mean must be removed
    mean, comp = pca_fit(x, 3)
    assert comp.shape == (3, 20)
    # same subspace: projecting the true basis onto the components keeps its norm
    assert torch.allclose((basis @ comp.T).norm(dim=1), torch.ones(3), atol=1e-3)
    # ordered by variance: the first component is the 5x direction (up to sign)
    assert abs(float(comp[0] @ basis[0])) > 0.999
    z = pca_project(x, mean, comp)
    assert z.shape == (500, 3) and torch.allclose(z.norm(dim=1), torch.ones(500), atol=1e-5)
    with pytest.raises(ValueError):
        pca_fit(x, 0)


def test_generalized_fewshot_on_separable_clusters():
    from training.fewshot import Pools, evaluate

    emb, y = _clusters(7, 60, noise=0.05, seed=2)  # classes 0-4 base, 5-6 novel
    y = torch.as_tensor(y)
    base, novel = y < 5, y >= 5
    gal = base.clone()
    gal[torch.arange(len(y)) % 60 >= 40] = False  # 40 gallery items per base class, 20 queries
    pools = Pools(
        gallery=emb[gal],
        gallery_labels=y[gal],
        base_q=emb[base & ~gal],
        base_y=y[base & ~gal],
        shot_pool=emb[novel],
        shot_y=y[novel],
        novel_q=None,  # validation protocol: novel queries drawn from the pool, not the shots
        novel_y=None,
        num_base=5,
        num_classes=7,
        temperature=0.05,
    )
    out = evaluate(
        pools, shots=1, draws=3, rules=["knn", "prototype", "kde"], k=30, queries_per_class=20
    )
    for rule in ("prototype", "kde"):
        assert out[rule]["novel"]["mean"] == 1.0 and out[rule]["base"]["mean"] == 1.0
        assert out[rule]["hm"]["mean"] == pytest.approx(1.0)
    assert set(out["knn"]) == {"novel", "base", "hm"}


def test_linear_probe_separates_separable_classes_and_only_sees_training_labels():
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(4, 16, generator=g) * 4  # 4 well separated classes in 16-d
    y = torch.arange(4).repeat_interleave(50)
    x = centres[y] + torch.randn(200, 16, generator=g)
    yt = torch.arange(4).repeat_interleave(25)
    xt = centres[yt] + torch.randn(100, 16, generator=g)
    assert (linear_probe(x, y, xt, 4) == yt).float().mean() >= 0.97
    # labels carrying no information about x: the probe cannot beat chance by much on new data
    noise = torch.randint(0, 4, (200,), generator=g)
    assert (linear_probe(x, noise, xt, 4) == yt).float().mean() < 0.6
    with pytest.raises(ValueError):
        linear_probe(x, y[:10], xt, 4)


def test_per_class_top1_hand_computed():
    from training.evaluate import per_class_top1

    # gallery: two classes on the x and y axes; queries near them, one class-1 query on class 0
    g = torch.tensor([[1.0, 0.0], [0.99, 0.141], [0.0, 1.0], [0.141, 0.99]])
    gy = torch.tensor([0, 0, 1, 1])
    q = torch.nn.functional.normalize(torch.tensor([[1.0, 0.1], [0.1, 1.0], [1.0, 0.05]]), dim=1)
    qy = torch.tensor([0, 1, 1])
    acc = per_class_top1(q, qy, g, gy, 3, 0.05, 2)
    assert acc[0] == 100.0 and acc[1] == 50.0 and math.isnan(acc[2])  # class 2 has no query
