"""prototype: nearest normalised label mean (cosine), probabilities softmax(cos/σ)."""

from __future__ import annotations

import torch

from .base import Candidates, VoteInput, VoteRule, softmax_or_zero


def prototype_probs(
    queries: torch.Tensor, label_sums: torch.Tensor, counts: torch.Tensor, temperature: float
) -> torch.Tensor:
    """queries (Q, d) unit rows; label_sums (C, d) sum of each label's embeddings; counts (C,).

    Returns (Q, C) softmax(cos(q, mean_c) / σ) over labels with items (0 for empty labels)."""
    protos = torch.nn.functional.normalize(label_sums.to(queries.dtype), dim=1)  # (C, d)
    logits = (queries @ protos.T) / temperature  # (Q, C)
    logits = logits.masked_fill((counts <= 0).unsqueeze(0), float("-inf"))
    return softmax_or_zero(logits)


class Prototype(VoteRule):
    name = "prototype"

    def vote(self, x: VoteInput) -> torch.Tensor:
        v = x.view
        return prototype_probs(x.queries, v.label_sums, v.counts, v.temperature)

    def candidates_needed(self, k: int, top: int) -> int:
        return 1  # the statistics vote; the nearest item gives the best similarity

    def vote_candidates(self, x: Candidates) -> torch.Tensor:
        # Reads only the label statistics: exact at any size.
        return prototype_probs(x.queries, x.label_sums, x.counts, x.temperature)
