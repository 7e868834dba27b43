import math

import pytest
import torch
import torch.nn.functional as F

from embedding.votes import kde_log_density, kde_probs, knn_probs, prototype_probs


def test_kde_log_density_matches_the_definition():
    g = torch.Generator().manual_seed(0)
    q = F.normalize(torch.randn(4, 8, generator=g, dtype=torch.float64), dim=1)
    x = F.normalize(torch.randn(30, 8, generator=g, dtype=torch.float64), dim=1)
    y = torch.randint(0, 3, (30,), generator=g)
    y[5] = -1  # a deleted item counts for nothing
    s = q @ x.T
    got = kde_log_density(s, y, 4, 0.1)
    for c in range(3):
        members = (y == c).nonzero().squeeze(1)
        want = torch.log(torch.exp(s[:, members] / 0.1).mean(dim=1))
        torch.testing.assert_close(got[:, c].double(), want, rtol=1e-5, atol=1e-4)
    assert torch.isinf(got[:, 3]).all() and (got[:, 3] < 0).all()  # label without items
    p = kde_probs(s, y, 4, 0.1)
    torch.testing.assert_close(p.sum(1), torch.ones(4))
    assert (p[:, 3] == 0).all()


def _imbalanced(n_big=20000, n_small=5, seed=0):
    """A big label spread around one centre and a 5-item label tight around another, with the
    query next to the small label's centre but also near many big-label items."""
    g = torch.Generator().manual_seed(seed)
    d = 16
    a, b = F.normalize(torch.randn(2, d, generator=g), dim=1)
    big = F.normalize(a + 1.2 * torch.randn(n_big, d, generator=g) / math.sqrt(d) + 0.9 * b, dim=1)
    small = F.normalize(b + 0.3 * torch.randn(n_small, d, generator=g) / math.sqrt(d), dim=1)
    x = torch.cat([big, small])
    y = torch.cat([torch.zeros(n_big, dtype=torch.long), torch.ones(n_small, dtype=torch.long)])
    q = F.normalize(b + 0.3 * torch.randn(20, d, generator=g) / math.sqrt(d), dim=1)
    return q, x, y


def test_density_rule_lets_five_exemplars_win_where_knn_cannot():
    q, x, y = _imbalanced()
    s = q @ x.T
    top = s.topk(30, dim=1)
    knn = knn_probs(top.values, y[top.indices], 2, 0.05).argmax(1)
    kde = kde_probs(s, y, 2, 0.05).argmax(1)
    assert (knn == 0).float().mean() > 0.5  # the crowd wins the paper's vote
    assert (kde == 1).all()


def test_prototype_probs_nearest_mean_and_empty_labels():
    x = F.normalize(torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0]]), dim=1)
    y = torch.tensor([0, 0, 1])
    sums = torch.zeros(3, 2).index_add_(0, y, x)
    counts = torch.bincount(y, minlength=3)
    p = prototype_probs(
        F.normalize(torch.tensor([[0.2, 1.0], [1.0, 0.05]]), dim=1), sums, counts, 0.1
    )
    assert p.argmax(1).tolist() == [1, 0]
    assert (p[:, 2] == 0).all()
    torch.testing.assert_close(p.sum(1), torch.ones(2))


@pytest.mark.parametrize("sigma", [0.05, 0.01])
def test_kde_is_stable_for_small_sigma(sigma):
    s = torch.tensor([[0.99, 0.98, -0.9, -0.95]])
    y = torch.tensor([0, 0, 1, 1])
    p = kde_probs(s, y, 2, sigma)
    assert torch.isfinite(p).all() and p[0, 0] > 0.99


def test_kde_prepared_labels_give_the_same_density():
    from embedding.votes import kde_prepare

    g = torch.Generator().manual_seed(3)
    s = torch.rand(4, 50, generator=g) * 2 - 1
    lab = torch.randint(-1, 5, (50,), generator=g)
    a = kde_log_density(s, lab, 6, 0.05)
    b = kde_log_density(s, lab, 6, 0.05, kde_prepare(lab, 6, 0.05))
    assert torch.equal(a, b) and torch.isinf(a[:, 5]).all()  # label 5 has no items


def test_kde_onehot_and_scatter_paths_agree():
    from embedding.votes import kde_prepare

    g = torch.Generator().manual_seed(4)
    s = torch.rand(3, 400, generator=g) * 2 - 1
    lab = torch.randint(-1, 7, (400,), generator=g)
    dense = kde_log_density(s, lab, 7, 0.05, kde_prepare(lab, 7, 0.05))
    sparse = kde_log_density(s, lab, 7, 0.05, kde_prepare(lab, 7, 0.05, onehot_limit=0))
    assert kde_prepare(lab, 7, 0.05, onehot_limit=0)[2] is None
    assert torch.allclose(dense, sparse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n,c", [(0, 3), (1, 1), (500, 7), (20000, 10), (300, 40000)])
def test_prepared_one_hot_and_label_groups_are_the_plain_ones(n, c):
    """The fast paths (one-hot written in its dtype; labels sorted as 16-bit keys) give exactly
    what F.one_hot and torch's stable argsort give, -1 (deleted) rows included."""
    from embedding.openset import label_groups
    from embedding.votes import kde_prepare

    g = torch.Generator().manual_seed(n + c)
    lab = torch.randint(-1, c, (n,), generator=g)
    for temperature in (0.05, 0.01):  # float32 and float64 kernels
        lab_c, _, onehot = kde_prepare(lab, c, temperature, onehot_limit=1 << 30)
        want = F.one_hot(lab_c, c + 1).to(onehot.dtype)
        assert onehot.dtype == want.dtype and torch.equal(onehot, want)
    order, starts = label_groups(lab, c)
    assert torch.equal(order, torch.argsort(lab, stable=True))
    assert int(starts[0]) == int((lab < 0).sum()) and int(starts[-1]) == n
