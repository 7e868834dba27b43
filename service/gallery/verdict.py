"""The "unknown" verdict on a classification: made here, once, for the in-process runtime and
the model process's answers alike; the route only reports it.

An image is unknown when the open set is on (a rate `tpr`) and either its chosen label's world
says it is not that kind of image (`outside_world`), or no label accepts it
(`no_label_accepts`): no label chosen, a nearest neighbour or a vote below the fixed floors
(SNCA_UNKNOWN_SIMILARITY, SNCA_UNKNOWN_PROBABILITY), or an open-set score under the chosen
label's threshold at `tpr` (embedding/openset.py).

An unknown answer names no label: `answered` gives (label, confidence) as (None, None) then, so
that a client reading `label` first is never confidently wrong; the nearest label and its
probability are reported under their own names either way.

An answer's `confidence` is how likely it is right (`confidence`): the vote's share between its
two best labels, p1 / (p1 + p2). The vote's own probability p1 is not that: kde_shrunk's prior
(embedding/votes/kde_shrunk.py) spreads a share of the mass over every label, however unlike the
query, so p1 fell as labels were added (a right photo answer: 92.4 % with 6 labels, 87.9 % with
7) while the answer stayed as likely right. Measured on held-out queries of the gallery's labels
(benchmarks/confidence_calibration.py, docs/RESULTS.md): expected calibration error 0.009 on a
model's trained classes; 0.03-0.06 with 5-image labels and 0.04-0.15 on photo categories (by the
draw of the registered images): overconfident there, as p1 was (0.02-0.05, 0.07-0.12). Nothing
fitted on the gallery alone did better (leave-one-out answers do not predict held-out ones). It
is the probability of the right label among the gallery's labels: a query of something the
gallery does not hold is the unknown verdict's to catch."""

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


def confidence(c: Classification) -> float:
    """How likely the chosen label is right: p1 / (p1 + p2) of the vote's two best labels (one
    label: 1), see the module docstring; 0 with no label."""
    if c.label is None or not c.probabilities:
        return 0.0
    p1 = float(c.probabilities[0][1])
    p2 = float(c.probabilities[1][1]) if len(c.probabilities) > 1 else 0.0
    return min(1.0, p1 / (p1 + p2)) if p1 > 0 else 0.0


def answered(c: Classification, reason: str | None) -> tuple[str | None, float | None]:
    """(label, confidence) of the answer: the chosen label and how likely it is right, or
    (None, None) when the image is unknown (`reason` not None) or the gallery is empty."""
    if reason is not None or c.label is None:
        return None, None
    return c.label, confidence(c)


def explain(
    c: Classification,
    reason: str | None,
    threshold: float | None,
    min_similarity: float,
    min_probability: float,
) -> str:
    """The answer in one or two sentences a person reads (the API's `explanation`): what the
    image was compared with, what decided, and what to do; the codes stay beside it."""
    if c.label is None:
        return (
            "The gallery is empty: there is nothing to compare this image with. Register a "
            "label first (about five images of it)."
        )
    lab = c.label
    add = f"If it is one, add such images to '{lab}'; if it is something new, register it."
    if reason is None:
        runner = (
            f" against '{c.probabilities[1][0]}', the next label"
            if len(c.probabilities) > 1
            else ""
        )
        return (
            f"Most like the images of '{lab}': {100 * confidence(c):.0f}% likely right, from "
            f"the vote of its nearest images{runner}."
        )
    w = c.world
    if reason == "outside_world":
        if w.basis == "label":
            return (
                f"Unlike every image of '{lab}', the nearest label: farther from the nearest of "
                "them than they are from each other (a different kind of picture: its blur, "
                f"size, light or subject). '{lab}' is only a guess. {add}"
            )
        return (
            "Not the kind of image the model was trained on: its look is far from every "
            f"training image. The nearest label, '{lab}', is only a guess. {add}"
        )
    if c.best_similarity < min_similarity:
        return (
            f"Nothing in the gallery is much like it: its most similar image scores "
            f"{c.best_similarity:.2f}, under the {min_similarity:.2f} an answer needs. The "
            f"nearest label, '{lab}', is only a guess. {add}"
        )
    if c.confidence < min_probability:
        return (
            f"No label wins clearly: '{lab}' has {100 * c.confidence:.0f}% of the vote, under the "
            f"{100 * min_probability:.0f}% an answer needs."
        )
    score = (
        ""
        if c.unknown_score is None or threshold is None
        else (
            f" (similarity {c.unknown_score:.2f}, where {threshold:.2f} takes nearly all of them)"
        )
    )
    return (
        f"Farther from the images of '{lab}' than its own images are from each other{score}. "
        f"'{lab}' is only a guess. {add}"
    )
