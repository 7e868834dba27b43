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
    _warn(collapsed, 5)
    assert any("nearly all alike" in w and "0.999" in w for w in collapsed.warnings)
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
