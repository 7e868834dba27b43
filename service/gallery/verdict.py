"""The "unknown" verdict on a classification: made here, once, for the in-process runtime and
the model process's answers alike; the route only reports it.

An image is unknown when the open set is on (a rate `tpr`) and either its chosen label's world
says it is not that kind of image (`outside_world`), or no label accepts it
(`no_label_accepts`): no label chosen, a nearest neighbour or a vote below the fixed floors
(SNCA_UNKNOWN_SIMILARITY, SNCA_UNKNOWN_PROBABILITY), or an open-set score under the chosen
label's threshold at `tpr` (embedding/openset.py).

An unknown answer names no label: `answered` gives (label, confidence) as (None, None) then, so
that a client reading `label` first is never confidently wrong; the nearest label and its
probability are reported under their own names either way."""

from __future__ import annotations

from service.gallery.gallery import Classification


def unknown_reason(
    c: Classification,
    threshold: float | None,
    tpr: float | None,
    min_similarity: float,
    min_probability: float,
) -> str | None:
    """None (known), "outside_world" or "no_label_accepts"; `threshold`: the chosen label's
    open-set threshold at `tpr` (None: none calibrated)."""
    if tpr is None:
        return None
    if c.label is not None and not c.world.ok:
        return "outside_world"  # not the kind of image the chosen label holds
    if (
        c.label is None
        or c.best_similarity < min_similarity
        or c.confidence < min_probability
        or (threshold is not None and c.unknown_score is not None and c.unknown_score < threshold)
    ):
        return "no_label_accepts"
    return None


def answered(c: Classification, reason: str | None) -> tuple[str | None, float | None]:
    """(label, confidence) of the answer: the chosen label and its probability, or (None, None)
    when the image is unknown (`reason` not None) or the gallery is empty."""
    if reason is not None or c.label is None:
        return None, None
    return c.label, c.confidence
