"""The answer in words (service/gallery/verdict.py `explain`, issue 53): every verdict, and
each condition that makes an image unknown, gets its own sentence naming what decided it and
what to do; the sentence follows the same conditions as `unknown_reason`, in its order."""

from __future__ import annotations

import pytest

from service.gallery.gallery import Classification
from service.gallery.verdict import explain, unknown_reason
from service.gallery.world import NO_CHECK, WorldVerdict

FLOOR, PFLOOR = 0.5, 0.2


def answer(label="cat", confidence=0.9, best=0.8, score=0.7, world=NO_CHECK) -> Classification:
    return Classification(label, confidence, [(label, confidence)] if label else [], best, [],
                          score, 0, world)  # fmt: skip


CASES = [
    # (classification, threshold, the words that must say what decided)
    (answer(label=None, confidence=0.0, score=None), None, "The gallery is empty"),
    (answer(), 0.5, "Most like the images of 'cat': 100% likely right"),
    (answer(world=WorldVerdict(3.0, 1.0, False, "label")), 0.5, "Unlike every image of 'cat'"),
    (answer(world=WorldVerdict(3.0, 1.0, False, "training")), 0.5, "the model was trained on"),
    (answer(best=0.31), 0.2, "most similar image scores 0.31, under the 0.50"),
    (answer(confidence=0.15), 0.2, "'cat' has 15% of the vote, under the 20%"),
    (answer(score=0.3), 0.45, "(similarity 0.30, where 0.45 takes nearly all of them)"),
]


@pytest.mark.parametrize(("c", "threshold", "words"), CASES)
def test_each_verdict_says_in_words_what_decided_it(c, threshold, words):
    reason = unknown_reason(c, threshold, 0.95, FLOOR, PFLOOR)
    text = explain(c, reason, threshold, FLOOR, PFLOOR)
    assert words in text, text
    known = reason is None and c.label is not None
    # an unknown answer's label is a guess, and the sentence says so and what to do
    assert ("only a guess" in text) == (reason is not None and c.label is not None
                                        and c.confidence >= PFLOOR), text  # fmt: skip
    assert ("add such images to 'cat'" in text) == ("only a guess" in text)
    assert ("likely right" in text) == known


def test_the_confidence_is_the_share_between_the_two_best_labels():
    """p1 / (p1 + p2): the mass the vote's prior spreads over labels unlike the query (which
    grows with the number of labels) does not lower it; one label: 1; no label: 0."""
    from service.gallery.verdict import confidence

    two = Classification("cat", 0.6, [("cat", 0.6), ("dog", 0.2), ("cow", 0.1), ("owl", 0.1)],
                         0.8, [])  # fmt: skip
    assert confidence(two) == pytest.approx(0.75)
    more = Classification("cat", 0.48, [("cat", 0.48), ("cow", 0.3), ("dog", 0.12), ("owl", 0.1)],
                          0.8, [])  # fmt: skip
    assert confidence(more) < confidence(two)  # a nearer third label takes from the answer
    assert confidence(answer()) == 1.0
    assert confidence(answer(label=None, confidence=0.0)) == 0.0
