"""Open set: is a query something the gallery has no label for?

The score is deep nearest-neighbour OOD detection (Sun, Ming, Zhu, Li, ICML 2022) made
label-conditional: on unit vectors, the similarity of the query to the k_c-th nearest item of
the label the vote chose, k_c = min(k, n_c - 1) (at least 1: the statistic the calibration takes of
each of the label's items among the others). Sun et al. take the k-th nearest item of the whole
training set; conditioning on the chosen label keeps the score meaningful for a label registered
from fewer than k images (its k-th nearest item overall belongs to another label) and makes the
calibration of one label independent of every other label, so a write recalibrates only the
labels it touched.

Calibration needs no out-of-distribution data (Sun et al.'s own protocol): leave-one-out scores
of gallery items (an item's k_c-th nearest *other* item of its label, k_c = min(k, n_c - 1)),
for a sample of at most SAMPLE items per label. The threshold of a label with >= MIN_OWN items
is the (1 - TPR) quantile of its own scores, so that a share TPR of its kind is accepted;
a smaller label cannot estimate a quantile and takes the lower of the pooled threshold (every
big label's scores) and its own lowest score (a label registered from images that are looser
than the trained classes is not rejected for it). A label of one image, with nothing to compare,
takes the pooled threshold; a gallery with no label of >= MIN_OWN items pools what it has.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

# Chosen on validation (benchmarks/open_set.py, docs/RESULTS.md "Is this something new?").
K = 10
SAMPLE = 200  # leave-one-out scores per label (a reservoir sample of its items)
MIN_OWN = 20  # labels with at least this many items get a threshold of their own
TPR = 0.95


def label_kth(sims: torch.Tensor, labels: torch.Tensor, chosen: torch.Tensor, kc: torch.Tensor):
    """The score of each query: its similarity to the kc-th most similar item of label
    `chosen`. sims (B, M) and labels (B, M) (per query, -1 = none) or (M,) (shared); chosen
    (B,) label ids; kc (B,) >= 1. Items of the label beyond the M given count as absent: a
    query whose label has fewer than kc of them among M gets the lowest one it has (an upper
    bound of the true score when M are a query's top candidates), -1 when none. (B,) float."""
    if labels.dim() == 1:
        labels = labels.unsqueeze(0)
    mine = labels == chosen.unsqueeze(1)  # (B, M)
    kmax = int(min(int(kc.max()), sims.shape[1])) if sims.shape[1] else 0
    if kmax == 0:
        return torch.full((sims.shape[0],), -1.0)
    top = sims.masked_fill(~mine, float("-inf")).topk(kmax, dim=1).values  # (B, kmax) desc
    have = mine.sum(dim=1).clamp(max=kmax)  # (B,)
    pick = torch.minimum(kc.clamp(max=kmax), have).clamp(min=1) - 1
    out = top.gather(1, pick.unsqueeze(1)).squeeze(1).float()
    return torch.where(have > 0, out, torch.full_like(out, -1.0))


def label_groups(labels: torch.Tensor, num_labels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows grouped by label: (order (N,) row indices sorted by label, starts (C + 1,) so that
    label c's rows are order[starts[c]:starts[c + 1]]); rows labelled -1 belong to none."""
    # numpy's stable sort of 16-bit keys is a radix sort, O(N): 0.5 vs 1.4 ms at N = 55,000
    if num_labels < 32767 and labels.device.type == "cpu":
        keys = labels.numpy().astype(np.int16)  # (-1 stays -1: first, as in the int64 sort)
        order = torch.from_numpy(np.argsort(keys, kind="stable"))
    else:
        order = torch.argsort(labels, stable=True)
    counts = torch.bincount(labels[labels >= 0], minlength=num_labels)[:num_labels]
    skip = int((labels < 0).sum())
    starts = torch.zeros(num_labels + 1, dtype=torch.long)
    starts[1:] = torch.cumsum(counts, 0)
    return order, starts + skip


def label_kth_grouped(
    sims: torch.Tensor,
    order: torch.Tensor,
    starts: torch.Tensor,
    chosen: torch.Tensor,
    kc: torch.Tensor,
) -> torch.Tensor:
    """label_kth over every row for sims (B, N) to all rows, given label_groups(labels):
    each query reads only its chosen label's columns (B·N/C elements, not a masked copy of
    all B·N). (B,) float; -1 where the label has no rows. TorchScript-compatible."""
    out = torch.full((sims.shape[0],), -1.0)
    labels: list[int] = torch.unique(chosen).tolist()
    for c in labels:
        rows = order[int(starts[c]) : int(starts[c + 1])]
        n = rows.numel()
        if n == 0:
            continue
        qs = torch.nonzero(chosen == c).squeeze(1)
        sub = sims[qs.unsqueeze(1), rows.unsqueeze(0)]  # (|qs|, n_c)
        kq = kc.index_select(0, qs).clamp(min=1, max=n)
        top = sub.topk(int(kq.max()), dim=1).values
        out[qs] = top.gather(1, (kq - 1).unsqueeze(1)).squeeze(1).float()
    return out


def leave_one_out(sample: np.ndarray, members: np.ndarray, k: int, self_in: bool) -> np.ndarray:
    """Leave-one-out scores of `sample` (S, d) unit rows against their label's `members` (M, d):
    each row's k_c-th nearest other member, k_c = min(k, n - 1) with n the label's size (M, or
    M + 1 when the sample rows are not among the members: `self_in` False). (S,) float64."""
    sims = sample @ members.T  # (S, M)
    n = members.shape[0] if self_in else members.shape[0] + 1
    kc = min(k, n - 1)
    if kc < 1:
        return np.zeros(0)
    srt = -np.sort(-sims, axis=1)
    col = kc if self_in else kc - 1  # skip the row itself (similarity 1, first) when it is in
    col = min(col, srt.shape[1] - 1)
    return srt[:, col].astype(np.float64)


def quantile_low(scores: np.ndarray, tpr: float) -> float:
    """The threshold accepting a share `tpr` of `scores` (score >= threshold is accepted)."""
    return float(np.quantile(scores, 1.0 - tpr, method="lower"))


@dataclass
class Calibration:
    """Leave-one-out scores per label id and the thresholds they give."""

    k: int = K
    min_own: int = MIN_OWN
    scores: dict[int, np.ndarray] = field(default_factory=dict)  # label id -> sorted LOO scores
    sizes: dict[int, int] = field(default_factory=dict)  # label id -> items when scored

    def set(self, label: int, scores: np.ndarray, size: int) -> None:
        if size <= 0:
            self.scores.pop(label, None)
            self.sizes.pop(label, None)
            return
        self.scores[label] = np.sort(np.asarray(scores, dtype=np.float64))
        self.sizes[label] = size

    def pooled(self, tpr: float) -> float | None:
        """The pooled threshold: over labels with >= min_own items, or every label's scores
        when none has that many; None when there are no scores at all."""
        big = [s for c, s in self.scores.items() if self.sizes[c] >= self.min_own and len(s)]
        if not big:
            big = [s for s in self.scores.values() if len(s)]
        if not big:
            return None
        return quantile_low(np.concatenate(big), tpr)

    def thresholds(self, num_labels: int, tpr: float) -> np.ndarray:
        """(C,) threshold per label id at acceptance `tpr`; -inf where there is none (nothing
        to calibrate from: such a label never makes a query unknown)."""
        out = np.full(num_labels, -np.inf)
        pool = self.pooled(tpr)
        for c in range(num_labels):
            s, n = self.scores.get(c), self.sizes.get(c, 0)
            if n >= self.min_own and s is not None and len(s):
                out[c] = quantile_low(s, tpr)
            elif pool is not None and n > 0:
                own = float(s[0]) if s is not None and len(s) else np.inf
                out[c] = min(pool, own)
        return out
