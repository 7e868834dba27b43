"""knn: the paper's weighted kNN vote (embedding.knn.weighted_knn_vote): the k most similar
items vote with exp(s/σ). Exact paper behaviour; in a gallery of thousands of items per trained
label, a label added from five images almost never wins (measured: 0%)."""

from __future__ import annotations

import torch

from ..knn import weighted_knn_vote
from .base import Candidates, VoteInput, VoteRule


def knn_probs(
    similarities, neighbor_labels, num_classes: int, temperature: float, k: int | None = None
):
    """(Q, K) similarities sorted descending + (Q, K) label ids (-1 = none) -> (Q, C)."""
    return weighted_knn_vote(similarities, neighbor_labels, num_classes, temperature, k=k)


class Knn(VoteRule):
    name = "knn"
    needs_neighbors = True

    def vote(self, x: VoteInput) -> torch.Tensor:
        nb, v = x.neighbors, x.view
        return knn_probs(nb.similarities, nb.labels, v.num_classes, v.temperature, k=x.k)

    def candidates_needed(self, k: int, top: int) -> int:
        return k  # the k nearest vote

    def vote_candidates(self, x: Candidates) -> torch.Tensor:
        # The k nearest are the first k candidates (k <= K'): the same vote.
        return knn_probs(x.similarities, x.labels, x.num_classes, x.temperature, k=x.k)
