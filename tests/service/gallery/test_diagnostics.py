"""Registration diagnostics' plain-language warnings (service/gallery/diagnostics.py)."""

import numpy as np

from embedding.collapse import pair_similarity
from service.gallery.diagnostics import Diagnostics, _warn


def _diag(cohesion, nearest):
    return Diagnostics("mine", 5, 5, 1.0, cohesion, 0.6, "theirs", nearest)


def test_a_collapsed_model_is_named_when_a_label_is_registered():
    """The photo model trained from scratch on 96 photos: a new label's images at cosine 0.9996
    with each other and with the other labels' (every answer a guess), and the registration
    said nothing. A label that is tight but far from the others, or spread out, is no warning."""
    collapsed = _diag(0.9996, 0.9991)
    _warn(collapsed, 5, labels_alike=0.999)  # the other labels alike too
    assert any("nearly all alike" in w and "0.999" in w for w in collapsed.warnings)
    # (issue 53) two labels of near-identical images on a model whose other labels are spread:
    # an overlap of the two, not a collapse (whose advice was to retrain the served model)
    twins = _diag(0.97, 0.965)
    _warn(twins, 5, labels_alike=0.45)
    assert any("nearly identical" in w and "'theirs'" in w for w in twins.warnings), twins
    assert not any("collapsed" in w for w in twins.warnings), twins.warnings
    for coh, near in ((0.97, 0.40), (0.60, 0.98), (0.70, 0.80)):
        fine = _diag(coh, near)
        _warn(fine, 5)
        assert not any("alike" in w for w in fine.warnings), (coh, near, fine.warnings)


def test_pair_similarity_measures_spread_and_needs_two_rows():
    rng = np.random.default_rng(0)
    spread = rng.standard_normal((300, 64)).astype(np.float32)
    spread /= np.linalg.norm(spread, axis=1, keepdims=True)
    assert abs(pair_similarity(spread)) < 0.05
    assert pair_similarity(np.tile(spread[:1], (10, 1))) > 0.999
    assert pair_similarity(spread[:1]) is None


def test_a_one_image_label_is_told_to_add_more():
    """(issue 53) A one-image label on the photo model got no advice: it takes only images very
    like its one, and nothing says how much its kind varies."""
    one = Diagnostics("mine", 1, 1, None, None, 0.6, "theirs", 0.3)
    _warn(one, 1, labels_alike=0.4)
    assert any("register about five varied images" in w for w in one.warnings), one.warnings
    five = _diag(0.7, 0.3)
    _warn(five, 5, labels_alike=0.4)
    assert not any("about five" in w for w in five.warnings)


def test_a_label_added_while_diagnosing_is_left_out_not_a_crash():
    """The diagnostics of an add read the label tables once, then search the index, which other
    writers keep adding to: a neighbour of a label made after that read (label id past the
    tables) raised IndexError in the vote and answered the add 500 after it was committed
    (test_hardening's four writers with a snapshot each write, fresh clone of 39f5808). Such a
    neighbour is not in the gallery the diagnostics read: it is left out."""
    import torch

    from embedding.votes import RULES
    from service.gallery.diagnostics import leave_one_out_votes

    rng = np.random.default_rng(0)
    emb = rng.standard_normal((3, 8)).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    counts = np.array([3.0, 2.0])  # two labels when the tables were read
    sums = np.stack([emb.sum(0), emb[:2].sum(0)]).astype(np.float64)

    def search(q, kk):  # label 2 was added since: one of its items is the nearest of each row
        sims = np.tile(np.linspace(0.9, 0.1, kk), (len(q), 1))
        ids = np.tile(np.arange(100, 100 + kk), (len(q), 1))
        lab = np.tile(np.array([2, 0, 1, 0, 1, 0][:kk]), (len(q), 1))
        return sims, ids, lab

    for name, rule in RULES.items():
        probs, scores = leave_one_out_votes(
            rule(), emb, np.array([-1, -1, -1]), 0, search, sums, counts, 0.05, 3, 10, 2
        )
        assert probs.shape == (3, 2) and torch.isfinite(probs).all(), name
        assert np.isfinite(scores).all(), name
