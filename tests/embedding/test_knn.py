import math

import torch
import torch.nn.functional as F

from embedding.knn import knn_evaluate, knn_search, weighted_knn_vote


def test_vote_is_the_weighted_sum_of_exp_similarity():
    sims = torch.tensor([[0.9, 0.8, 0.7, 0.1]])
    labels = torch.tensor([[2, 0, 2, 1]])
    sigma = 0.1
    probs = weighted_knn_vote(sims, labels, 3, sigma)
    w = [math.exp(s / sigma) for s in (0.9, 0.8, 0.7, 0.1)]
    scores = torch.tensor([w[1], w[3], w[0] + w[2]])
    torch.testing.assert_close(probs[0], (scores / scores.sum()).float())
    # k truncates to the first (most similar) neighbours
    p1 = weighted_knn_vote(sims, labels, 3, sigma, k=1)
    assert p1.tolist() == [[0.0, 0.0, 1.0]]


def test_vote_is_stable_for_small_sigma_and_ignores_padding():
    sims = torch.tensor([[0.99, 0.98, -0.5], [0.2, 0.1, 0.0]])
    labels = torch.tensor([[0, 1, -1], [-1, -1, -1]])
    probs = weighted_knn_vote(sims, labels, 2, 0.001)  # exp(990) would overflow unshifted
    assert torch.isfinite(probs).all()
    assert abs(probs[0].sum().item() - 1.0) < 1e-6
    assert probs[0, 0] > probs[0, 1]
    assert probs[1].sum() == 0  # no valid neighbour: no vote


def test_search_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    q = F.normalize(torch.randn(37, 8, generator=g), dim=1)
    x = F.normalize(torch.randn(500, 8, generator=g), dim=1)
    sims, idx = knn_search(q, x, 10, chunk_size=16)
    full = q @ x.T
    ref = full.topk(10, dim=1)
    torch.testing.assert_close(sims, ref.values)
    assert torch.equal(idx, ref.indices)


def test_evaluate_on_separable_clusters():
    g = torch.Generator().manual_seed(0)
    centers = F.normalize(torch.randn(4, 16, generator=g), dim=1)
    y = torch.randint(0, 4, (400,), generator=g)
    x = F.normalize(centers[y] + 0.05 * torch.randn(400, 16, generator=g), dim=1)
    res = knn_evaluate(x[:100], y[:100], x[100:], y[100:], 4, 0.05, ks=(1, 30))
    assert res["knn_top1@1"] == 100.0 and res["knn_top1@30"] == 100.0
    # wrong labels in the gallery -> low accuracy: the metric can fail
    bad = knn_evaluate(x[:100], y[:100], x[100:], (y[100:] + 1) % 4, 4, 0.05, ks=(1,))
    assert bad["knn_top1@1"] == 0.0


def test_evaluate_leave_one_out():
    x = F.normalize(torch.tensor([[1.0, 0.0], [0.99, 0.1], [0.0, 1.0], [0.1, 0.99]]), dim=1)
    y = torch.tensor([0, 0, 1, 1])
    res = knn_evaluate(x, y, x, y, 2, 0.05, ks=(1,), exclude_self=True)
    assert res["knn_top1@1"] == 100.0
    swapped = torch.tensor([0, 1, 0, 1])  # each item's nearest other is the other class
    res = knn_evaluate(x, swapped, x, swapped, 2, 0.05, ks=(1,), exclude_self=True)
    assert res["knn_top1@1"] == 0.0
