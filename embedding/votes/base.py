"""The vote rule interface: what a rule reads (GalleryView) and what it returns.

A rule turns queries and a gallery into label probabilities (Q, C). It declares what it needs
beyond the view: the k nearest neighbours (`needs_neighbors`) or the similarities to every row
(`needs_similarities`). The caller may pass them precomputed (the service: from its FAISS index
and its own matrix product); otherwise `probs` computes them exactly from the view (evaluation).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..knn import knn_search


@dataclass
class Neighbors:
    """The k nearest gallery items of each query."""

    similarities: torch.Tensor  # (Q, k) float32, descending
    labels: torch.Tensor  # (Q, k) int64 label ids; -1 = padding (fewer items than k)


@dataclass
class GalleryView:
    """The gallery as a vote sees it. Rows of deleted (or filtered-out) items stay in
    `embeddings` with label -1, and their labels' `counts` exclude them."""

    embeddings: torch.Tensor  # (N, d) float32 unit rows
    labels: torch.Tensor  # (N,) int64 in [0, C); -1 = not part of the gallery
    label_sums: torch.Tensor  # (C, d) sum of each label's embeddings
    counts: torch.Tensor  # (C,) int64 items per label (0: no items, or filtered out)
    temperature: float  # σ
    # What a rule derives from the view and keeps while the view lives (kde's one-hot labels).
    cache: dict[str, Any] = field(default_factory=dict)

    @property
    def num_classes(self) -> int:
        return int(self.counts.shape[0])

    def memo(self, key: str, make: Callable[[], Any]) -> Any:
        if key not in self.cache:
            self.cache[key] = make()
        return self.cache[key]

    @classmethod
    def of(
        cls, embeddings: torch.Tensor, labels: torch.Tensor, num_classes: int, temperature: float
    ) -> GalleryView:
        """A view of (N, d) rows with (N,) label ids (-1: left out): the statistics computed."""
        live = labels >= 0
        lab = labels[live]
        sums = torch.zeros(num_classes, embeddings.shape[1], dtype=torch.float64)
        sums.index_add_(0, lab.cpu(), embeddings[live].double().cpu())
        counts = torch.bincount(lab.cpu(), minlength=num_classes)
        return cls(embeddings, labels, sums, counts, temperature)

    def exact_neighbors(self, queries: torch.Tensor, k: int) -> Neighbors:
        """The k most similar live rows of each query (exact, brute force)."""
        live = self.labels >= 0
        if bool(live.all()):  # no copy of the rows
            emb, lab = self.embeddings, self.labels
        else:
            rows = torch.nonzero(live).squeeze(1)
            emb, lab = self.embeddings[rows], self.labels[rows]
        k = min(k, int(lab.numel()))
        if k == 0:
            empty = torch.zeros(queries.shape[0], 0)
            return Neighbors(empty, empty.long())
        sims, idx = knn_search(queries, emb, k)
        return Neighbors(sims, lab[idx])

    def candidates(self, queries: torch.Tensor, k: int, top: int) -> Candidates:
        """The candidate-vote input of `queries` with the exact top-`top` rows as candidates
        (what a Flat index returns): the reference for the service's index-backed one."""
        nb = self.exact_neighbors(queries, top)
        return Candidates(
            queries, nb.similarities, nb.labels, self.label_sums, self.counts, self.temperature, k
        )


@dataclass
class Candidates:
    """What a rule votes from at gallery scale: each query's top-K' candidates from the index
    (sorted by similarity, descending) plus exact per-label statistics; no similarity to every
    row. Cost O(Q·K' + Q·C·d) whatever the gallery's size (the dense path is O(Q·N·d))."""

    queries: torch.Tensor  # (Q, d) unit rows
    similarities: torch.Tensor  # (Q, K') float32, descending
    labels: torch.Tensor  # (Q, K') int64 label ids; -1 = padding (fewer candidates than K')
    label_sums: torch.Tensor  # (C, d) float64 sum of each label's embeddings (exact)
    counts: torch.Tensor  # (C,) int64 live items per label (0: none, or filtered out)
    temperature: float  # σ
    k: int  # neighbours that vote (rules that use neighbours), k <= K'

    @property
    def num_classes(self) -> int:
        return int(self.counts.shape[0])


@dataclass
class VoteInput:
    """What a rule votes from (`VoteRule.probs` fills in what the rule needs)."""

    queries: torch.Tensor  # (Q, d) unit rows
    view: GalleryView
    k: int  # neighbours that vote (rules that use neighbours)
    neighbors: Neighbors | None  # the k nearest items, when the rule needs them
    similarities: torch.Tensor | None  # (Q, N) to every row of the view, when needed


class VoteRule(ABC):
    """One way to vote. Subclasses set `name` (and what they need) and implement `vote`."""

    name: ClassVar[str]
    needs_neighbors: ClassVar[bool] = False
    needs_similarities: ClassVar[bool] = False

    def fused_kde_prior(self) -> float | None:
        """Whether the service may run this rule as its one fused kde call
        (service/gallery/compiled.py: similarities, per-label densities and top labels in one
        compiled call): None for no (the generic path, `probs`), else the α of the shrinkage
        prior that call applies (0: none). A rule says it here; nothing checks its type."""
        return None

    def probs(
        self,
        queries: torch.Tensor,
        view: GalleryView,
        k: int,
        neighbors: Neighbors | None = None,
        similarities: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """queries (Q, d) unit rows -> (Q, C) probabilities; an all-zero row when no label can
        take the query (an empty gallery). `neighbors` and `similarities` ((Q, N), to every
        row of the view) are computed exactly when the rule needs them and they are not given."""
        if self.needs_neighbors and neighbors is None:
            neighbors = view.exact_neighbors(queries, k)
        if self.needs_similarities and similarities is None:
            similarities = queries @ view.embeddings.T  # (Q, N)
        return self.vote(VoteInput(queries, view, k, neighbors, similarities))

    @abstractmethod
    def vote(self, x: VoteInput) -> torch.Tensor:
        """(Q, C) label probabilities; an all-zero row for a query no label can take."""

    def candidates_needed(self, k: int, top: int) -> int:
        """How many index candidates `vote_candidates` reads, given k and the service's K'
        (`top`): all K' unless the rule says fewer (the first is the best similarity)."""
        return max(top, k)

    @abstractmethod
    def vote_candidates(self, x: Candidates) -> torch.Tensor:
        """The same (Q, C) probabilities from the index's top-K' candidates and the exact
        label statistics (the vote at gallery scale); equal to `vote` where the rule needs
        nothing beyond them, else as close as the docstring of the rule says."""


def softmax_or_zero(logits: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim; a row that is all -inf (no labels) gives all zeros."""
    empty = torch.isinf(logits).all(dim=1, keepdim=True) & (logits < 0).all(dim=1, keepdim=True)
    safe = logits.masked_fill(empty, 0.0)
    return torch.softmax(safe, dim=1).masked_fill(empty, 0.0)
