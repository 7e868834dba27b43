"""The open-set score and its calibration (embedding/openset.py), and the service gallery's three
paths to the score (compiled kde, the general dense path, the candidate vote) agreeing."""

import faiss
import numpy as np
import pytest
import torch

from embedding.openset import (
    Calibration,
    label_groups,
    label_kth,
    label_kth_grouped,
    leave_one_out,
    quantile_low,
)
from service.gallery.gallery import Gallery
from service.gallery.vectors import VectorIndex


def _unit(n, d, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.nn.functional.normalize(torch.randn(n, d, generator=g), dim=1)


def test_label_kth_is_the_kth_nearest_item_of_the_chosen_label():
    x, q = _unit(300, 8, 0), _unit(20, 8, 1)
    labels = torch.randint(-1, 4, (300,), generator=torch.Generator().manual_seed(2))
    chosen = torch.randint(0, 4, (20,), generator=torch.Generator().manual_seed(3))
    kc = torch.randint(1, 12, (20,), generator=torch.Generator().manual_seed(4))
    sims = q @ x.T
    want = torch.tensor(
        [
            sims[b][labels == chosen[b]].sort(descending=True).values[int(kc[b]) - 1]
            for b in range(20)
        ]
    )
    torch.testing.assert_close(label_kth(sims, labels, chosen, kc), want)
    order, starts = label_groups(labels, 4)
    torch.testing.assert_close(label_kth_grouped(sims, order, starts, chosen, kc), want)
    scripted = torch.jit.script(label_kth_grouped)
    torch.testing.assert_close(scripted(sims, order, starts, chosen, kc), want)
    # a label with fewer items than kc: its last one; a label without items: -1
    few = torch.tensor([0, 0, 1] + [-1] * 297)
    got = label_kth(sims[:2], few, torch.tensor([0, 2]), torch.tensor([5, 1]))
    assert got[0] == sims[0][:2].min() and got[1] == -1.0


def test_leave_one_out_skips_the_item_itself():
    m = _unit(6, 4, 5).numpy()
    got = leave_one_out(m, m, k=2, self_in=True)
    sims = m @ m.T
    np.fill_diagonal(sims, -np.inf)
    want = -np.sort(-sims, axis=1)[:, 1]  # the 2nd nearest other
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert len(leave_one_out(m[:1], m[:1], k=10, self_in=True)) == 0  # one item: nothing


def test_thresholds_per_label_pooled_and_small_labels():
    cal = Calibration(k=10, min_own=20)
    rng = np.random.default_rng(0)
    big_a, big_b = rng.uniform(0.8, 1.0, 200), rng.uniform(0.6, 1.0, 200)
    cal.set(0, big_a, 5000)
    cal.set(1, big_b, 300)
    cal.set(2, np.array([0.5, 0.9, 0.95]), 4)  # a loose small label
    cal.set(3, np.array([0.97, 0.99]), 3)  # a tight small label
    cal.set(4, np.zeros(0), 1)  # one image
    th = cal.thresholds(6, 0.95)
    assert th[0] == quantile_low(big_a, 0.95) and th[1] == quantile_low(big_b, 0.95)
    pool = quantile_low(np.concatenate([big_a, big_b]), 0.95)
    assert th[2] == 0.5  # its own lowest, below the pool: its own kind is not rejected
    assert th[3] == pool and th[4] == pool
    assert th[5] == -np.inf  # no items: never makes a query unknown
    assert (cal.thresholds(6, 0.5)[:2] > th[:2]).all()  # a lower rate is stricter


@pytest.mark.parametrize("vote", ["kde_shrunk", "kde", "knn", "prototype"])
def test_the_gallery_scores_the_same_on_every_path(vote):
    """Dense (compiled kde or the general path) and candidate vote give the same score and the
    same thresholds when every item is a candidate."""
    x, y = _unit(400, 16, 6), torch.arange(400) % 5
    q = _unit(30, 16, 7).numpy()
    out = {}
    for name, exact_max in (("dense", 10**6), ("candidates", 0)):
        g = Gallery(
            VectorIndex(faiss.IndexIDMap2(faiss.IndexFlatIP(16)), {}), 16, 0.05, 512, exact_max
        )
        for c in range(5):
            rows = np.nonzero((y == c).numpy())[0]
            g.apply_add(rows.tolist(), f"l{c}", x[rows].numpy(), c + 1)
        g.apply_add([400, 401], "small", _unit(2, 16, 8).numpy(), 6)
        res = g.classify(q, vote, 30)
        out[name] = ([r.label for r in res], [r.unknown_score for r in res], g.thresholds(0.9))
    assert out["dense"][0] == out["candidates"][0]
    np.testing.assert_allclose(out["dense"][2], out["candidates"][2], atol=1e-6)
    np.testing.assert_allclose(out["dense"][1], out["candidates"][1], atol=1e-5)
