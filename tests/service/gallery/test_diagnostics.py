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
