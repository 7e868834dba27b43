"""What one classify request asks of the vote, carried from the route through the batcher to
the gallery as one frozen value (hashable: the batcher groups a batch's jobs by it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VoteQuery:
    vote: str  # a rule of embedding.votes.RULES (SNCA_VOTE or the request's `vote`)
    k: int  # neighbours that vote (rules that use neighbours; also the open-set k bound)
    labels: tuple[str, ...] | None = None  # the label filter (None: every label)
    neighbors: bool = False  # return the k nearest items with the answer
