"""Voting rules: how a query's similarities to the gallery become label probabilities.

One module per rule (pytorch-metric-learning's one loss per file), all behind
`base.VoteRule`; the service and training's evaluation run the same classes, so evaluation
measures what the service serves. Adding a rule: one new file here and one entry in RULES.

  knn        the paper's weighted kNN vote over the k nearest items
  prototype  nearest normalised label mean
  kde        each label's kernel density at the query, equal label priors
  kde_shrunk kde with a prior of a few pseudo-items from the whole gallery (the default): a
             label of one image no longer takes over a trained class
"""

from __future__ import annotations

from .base import Candidates, GalleryView, Neighbors, VoteInput, VoteRule, softmax_or_zero
from .kde import Kde, kde_candidates_log_density, kde_log_density, kde_prepare, kde_probs
from .kde_shrunk import KdeShrunk, shrink_log_density
from .knn import Knn, knn_probs
from .prototype import Prototype, prototype_probs

RULES: dict[str, type[VoteRule]] = {r.name: r for r in (Knn, Prototype, Kde, KdeShrunk)}
VOTES = tuple(RULES)


def get_rule(name: str) -> VoteRule:
    try:
        return RULES[name]()
    except KeyError:
        raise ValueError(f"unknown vote {name!r}; choose one of {', '.join(VOTES)}") from None


__all__ = [
    "RULES",
    "VOTES",
    "Candidates",
    "GalleryView",
    "Kde",
    "KdeShrunk",
    "Knn",
    "Neighbors",
    "Prototype",
    "VoteInput",
    "VoteRule",
    "get_rule",
    "kde_candidates_log_density",
    "kde_log_density",
    "kde_prepare",
    "kde_probs",
    "knn_probs",
    "prototype_probs",
    "shrink_log_density",
    "softmax_or_zero",
]
