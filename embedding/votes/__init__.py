"""Voting rules: how a query's similarities to the gallery become label probabilities.

One module per rule (pytorch-metric-learning's one loss per file), all behind
`base.VoteRule`; the service and training's evaluation run the same classes, so evaluation
measures what the service serves. Adding a rule: one new file here and one entry in REGISTRY.

  knn        the paper's weighted kNN vote over the k nearest items
  prototype  nearest normalised label mean
  kde        each label's kernel density at the query, equal label priors
  kde_shrunk kde with a prior of a few pseudo-items from the whole gallery (the default): a
             label of one image no longer takes over a trained class
"""

from __future__ import annotations

import functools
from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .base import VoteRule

# The registry: a rule's name -> "module.Class" of this package (a new rule: one file, one line).
REGISTRY = {
    "knn": "knn.Knn",
    "prototype": "prototype.Prototype",
    "kde": "kde.Kde",
    "kde_shrunk": "kde_shrunk.KdeShrunk",
}
VOTES = tuple(REGISTRY)

# What the package exports -> the module that defines it, imported on first use (PEP 562): the
# rules' names cost no torch import (the service's config, snca-gallery's store commands).
_EXPORTS = {
    "base": ("Candidates", "GalleryView", "Neighbors", "VoteInput", "VoteRule", "softmax_or_zero"),
    "kde": ("Kde", "kde_candidates_log_density", "kde_log_density", "kde_prepare", "kde_probs"),
    "kde_shrunk": ("KdeShrunk", "shrink_log_density"),
    "knn": ("Knn", "knn_probs"),
    "prototype": ("Prototype", "prototype_probs"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}


@functools.cache
def _rules() -> dict[str, type[VoteRule]]:
    """{name: rule class}, in REGISTRY's order (each rule's module imported here)."""
    out = {}
    for rule, path in REGISTRY.items():
        module, cls = path.split(".")
        out[rule] = getattr(import_module(f".{module}", __name__), cls)
    return out


def __getattr__(name: str):
    if name == "RULES":
        return _rules()
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value  # (imported once)
    return value


def get_rule(name: str) -> VoteRule:
    try:
        return _rules()[name]()
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
