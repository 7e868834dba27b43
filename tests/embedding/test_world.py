"""The world check's parts (embedding/world.py, embedding/outliers.py) and outlier exposure's
loss (training/outlier_exposure.py), on synthetic data."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embedding import outliers, world
from embedding.config import ModelConfig
from embedding.model import EmbeddingNet
from training.outlier_exposure import OutlierExposure


def _gaussian(n, d, seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(d, d, generator=g, dtype=torch.float64)
    return torch.randn(n, d, generator=g, dtype=torch.float64) @ a + 3.0


def test_fit_whitens_and_calibrates_on_held_out_data(tmp_path):
    s = _gaussian(3000, 12, 0)
    w = world.fit(s[:2500], s[2500:], np.arange(500) % 4)
    z = w.z(s[:2500])
    cov = np.cov(z, rowvar=False)
    # whitened: unit variance (a little less in the smallest directions: the shrinkage)
    assert np.all((np.diag(cov) > 0.9) & (np.diag(cov) <= 1.0 + 1e-9))
    assert np.allclose(cov - np.diag(np.diag(cov)), 0.0, atol=1e-6)
    assert abs(np.mean(w.score(w.z(s[2500:]))) - 1.0) < 0.1  # ~1 per dimension in the world
    assert abs(np.mean(w.accepts(w.z(s[2500:]), 0.9)) - 0.9) < 0.02  # the quantile it says
    far = s[2500:] + 10.0
    assert not w.accepts(w.z(far), 0.99).any()
    # saved and read back exactly (eigh's vectors are Fortran-ordered: written in C order)
    world.save(w, tmp_path, "fp")
    back = world.load(tmp_path / world.WORLD_FILE, "fp")
    assert np.array_equal(back.whiten, w.whiten) and np.array_equal(back.mean, w.mean)
    assert (back.same_radius, back.spread) == (w.same_radius, w.spread)
    from embedding.errors import ArtifactError

    with pytest.raises(ArtifactError):
        world.load(tmp_path / world.WORLD_FILE, "another model")


def test_a_label_radius_grows_with_its_spread_never_under_the_floor():
    s = _gaussian(2000, 8, 1)
    w = world.fit(s[:1500], s[1500:], np.arange(500) % 5)
    z = w.z(s[:50])
    tight = z[:1] + 1e-3 * np.arange(5)[:, None]  # five nearly identical images
    assert w.radius(tight) == w.same_radius
    assert w.radius(z[:1]) == w.same_radius  # one image: the floor
    loose = z[:20] * 10
    assert w.radius(loose) > w.same_radius


def _few_shot_one_draw_at_a_time(w, z, y, draws=2000, seed=7):
    """The few-shot radius as its docstring defines it, one draw at a time (what
    _few_shot_radius computed until it drew in array operations)."""
    rng = np.random.default_rng(seed)
    near, ratios = [], []
    for c in np.unique(y):
        idx = np.nonzero(y == c)[0]
        for _ in range(draws):
            pick = rng.choice(idx, 6, replace=False)
            d = w.distances(z[pick], z[pick])
            near.append(d[5, :5].min())
            sup = d[:5, :5] + np.diag(np.full(5, np.inf))
            ratios.append(near[-1] / float(np.median(sup.min(axis=1))))
    return float(np.quantile(near, 0.95)), float(np.quantile(ratios, 0.95))


def test_few_shot_radius_is_the_draw_by_draw_quantiles():
    """A gallery-fitted world: its same_radius and spread are the 95th percentiles of a query's
    distance to the nearest of 5 images of its label and of that over their median leave-one-out
    distance, as many draws one at a time say (sampling error only: ~1-2 %)."""
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(8, 40)) * 2
    y = np.repeat(np.arange(8), 30)
    s = (centres[y] + rng.normal(size=(len(y), 40)) * rng.uniform(0.5, 2, (len(y), 1))).astype(
        np.float32
    )
    w = world.fit_gallery(s, y)
    same, spread = _few_shot_one_draw_at_a_time(w, w.z(s), y)
    assert w.same_radius == pytest.approx(same, rel=0.05)
    assert w.spread == pytest.approx(spread, rel=0.05)
    assert world.fit_gallery(s, y).same_radius == w.same_radius  # the same draws every time


@pytest.mark.parametrize("n", [6, 7, 5000])
def test_few_shot_draws_are_distinct_and_uniform(n):
    """_draws: k distinct positions a row, every position as likely in every column, for a
    class drawn by keys (small) and by rejection (large, memory of the draws only)."""
    rng = np.random.default_rng(3)
    six = world._draws(rng, n, draws=6000)
    assert six.shape == (6000, 6) and six.min() >= 0 and six.max() < n
    assert (np.diff(np.sort(six, axis=1), axis=1) > 0).all()  # distinct in every row
    if n < 10:  # the query column (5) and the first: each position ~6000/n times
        for col in (0, 5):
            counts = np.bincount(six[:, col], minlength=n)
            assert np.all(np.abs(counts - 6000 / n) < 0.12 * 6000 / n), counts


def test_stats_and_world_net_match_the_model(tmp_path):
    cfg = ModelConfig(class_names=["a", "b"])
    model = EmbeddingNet(cfg).eval()
    x = torch.randn(3, 1, 28, 28)
    v, s = world.WorldStats(model)(x)
    assert torch.allclose(v, model(x), atol=1e-6)
    assert s.shape == (3, world.stats_dim(model)) == (3, 4 * 64 * 2 + 1)
    both = world.WorldNet(model)(x)
    assert torch.allclose(both[:, :128], v) and torch.allclose(both[:, 128:], s)


@pytest.mark.parametrize("name", sorted(outliers.FAMILIES))
def test_every_outlier_family_keeps_shape_and_dtype(name):
    g = torch.Generator().manual_seed(0)
    for shape in ((4, 1, 28, 28), (3, 3, 64, 48)):
        x = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
        y = outliers.FAMILIES[name](x, g)
        assert y.shape == x.shape and y.dtype == torch.uint8, name
    assert set(outliers.TRAINED).isdisjoint(outliers.HELD_OUT)


def test_outlier_exposure_loss_is_lowest_for_no_class():
    """L_u is the cross-entropy of an outlier's class distribution with the uniform one:
    an embedding among one class's memory rows costs more than one between the classes."""
    cfg = ModelConfig(class_names=["a", "b", "c"])
    oe = OutlierExposure.create(1.0, 0.5, outliers.TRAINED, cfg, 0)
    g = torch.Generator().manual_seed(0)
    centres = torch.nn.functional.normalize(torch.randn(3, 16, generator=g), dim=1)
    memory = torch.nn.functional.normalize(
        centres.repeat_interleave(10, 0) + 0.05 * torch.randn(30, 16, generator=g), dim=1
    )
    labels = torch.arange(3).repeat_interleave(10)
    in_class = memory[:2]
    between = torch.nn.functional.normalize(centres.sum(0, keepdim=True), dim=1).repeat(2, 1)
    zero = torch.zeros(2)
    assert oe.loss(between, zero, memory, labels, 3, 0.05) < oe.loss(
        in_class, zero, memory, labels, 3, 0.05
    )
    assert oe.loss(between, torch.ones(2), memory, labels, 3, 0.05) > oe.loss(
        between, zero, memory, labels, 3, 0.05
    )  # the norm term: a large projection costs
    x = torch.randn(8, 1, 28, 28)
    assert oe.make(x).shape == (4, 1, 28, 28)
