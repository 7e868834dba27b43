"""kde: density-aware vote. Each label's kernel density at the query,

    f_c(q) = (1/n_c) Σ_{j: y_j = c} exp(s_j / σ),

over *all* of the label's items, with equal prior for every label; probabilities f_c / Σ f.
Dividing by n_c is what lets five exemplars compete with five thousand: a big label is not
rewarded for its size, only for being dense where the query is. The sum runs over every item
(the top-m nearest only would favour big labels, whose m-th neighbour is always close:
measured, that variant lost all novel queries).
"""

from __future__ import annotations

import numpy as np
import torch

from .base import Candidates, GalleryView, VoteInput, VoteRule, softmax_or_zero


def kde_dtype(temperature: float) -> torch.dtype:
    """float64 when 2/σ leaves float32's exp range (as the NCA loss does)."""
    return torch.float64 if 2.0 / temperature > 80.0 else torch.float32


# Up to this many elements (N x (C+1)) the per-label sums are one matrix product with a one-hot
# label matrix (2.3x faster than scatter_add on CPU at N = 55,000); above it, scatter_add.
ONEHOT_LIMIT = 1 << 25


def kde_prepare(
    labels: torch.Tensor, num_classes: int, temperature: float, onehot_limit: int = ONEHOT_LIMIT
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """What kde_log_density needs from the gallery's labels alone (the service caches it until
    the gallery changes): labels (N,) with deleted items (-1) moved to a spare column C, the
    live count per label (C,), and the one-hot matrix (N, C+1) when it fits `onehot_limit`."""
    dtype = kde_dtype(temperature)
    lab = torch.where(labels >= 0, labels, num_classes)  # (N,)
    counts = torch.bincount(lab, minlength=num_classes + 1)[:num_classes]  # (C,)
    onehot = None
    if lab.numel() * (num_classes + 1) <= onehot_limit:
        # written straight in `dtype` (F.one_hot's int64 matrix and its conversion took 1.6 ms
        # in float32, 11.6 in float64 at N = 55,000, C = 10; this 0.9: docs/PERFORMANCE.md)
        onehot = torch.zeros(lab.numel(), num_classes + 1, dtype=dtype)  # (N, C+1)
        onehot.scatter_(1, lab.unsqueeze(1), 1.0)
    return lab, counts.to(dtype), onehot


def kde_log_density(
    similarities: torch.Tensor,
    labels: torch.Tensor,
    num_classes: int,
    temperature: float,
    prepared: tuple | None = None,
) -> torch.Tensor:
    """log f_c(q) = log((1/n_c) Σ_{j: y_j=c} exp(s_j/σ)) for every label.

    similarities (Q, N) to every gallery item; labels (N,) int64 in [0, C), -1 = deleted item;
    `prepared` = kde_prepare(labels, ...) when the caller has it. Returns (Q, C); -inf for
    labels without items. Shifted by 1/σ (s <= 1) so nothing overflows.
    """
    dtype = kde_dtype(temperature)
    lab, counts, onehot = (
        prepared if prepared is not None else kde_prepare(labels, num_classes, temperature)
    )
    if onehot is not None:
        return kde_from_onehot(similarities, onehot, counts, temperature)
    w = _kde_weights(similarities, dtype, temperature)  # (Q, N)
    sums = torch.zeros(w.shape[0], num_classes + 1, dtype=dtype, device=w.device)
    sums.scatter_add_(1, lab.unsqueeze(0).expand(w.shape[0], -1), w)  # (Q, C+1)
    return _kde_finish(sums[:, :num_classes], counts, temperature)


def kde_from_onehot(
    similarities: torch.Tensor, onehot: torch.Tensor, counts: torch.Tensor, temperature: float
) -> torch.Tensor:
    """kde_log_density given kde_prepare's one-hot (N, C+1) and counts (C,): (Q, N) -> (Q, C).
    TorchScript-compatible (kde_top compiles it)."""
    w = _kde_weights(similarities, onehot.dtype, temperature)  # (Q, N)
    sums = w @ onehot  # (Q, C+1): per-label sums, the last column collects deleted items
    return _kde_finish(sums[:, : counts.shape[0]], counts, temperature)


def _kde_weights(
    similarities: torch.Tensor, dtype: torch.dtype, temperature: float
) -> torch.Tensor:
    """exp((s - 1)/σ) in `dtype`: each item's kernel weight, shifted by 1/σ (s <= 1) so that
    nothing overflows. (Q, N), a fresh tensor (the rest is in place)."""
    w = similarities.to(dtype) - 1.0
    return w.div_(temperature).exp_()


def _kde_finish(sums: torch.Tensor, counts: torch.Tensor, temperature: float) -> torch.Tensor:
    """log((1/n_c) Σ exp(s/σ)) from the shifted sums (Q, C); -inf where n_c = 0."""
    out = torch.log(sums) + 1.0 / temperature - torch.log(counts)
    return out.masked_fill((counts <= 0).unsqueeze(0), float("-inf")).float()


# The weight of the upper bound in the tail estimate (log-space, see below): chosen on the demo
# gallery (runs/demo, 55,000 items) and checked on a second, weaker model, where labels
# identical to the exact vote at K' = 1,024 went 99.60 -> 99.81% and 99.23 -> 99.58% against
# the lower bound alone (0.5: 99.41 / 99.24%; benchmarks/gallery_scale.py, docs/RESULTS.md).
TAIL_UPPER_WEIGHT = 0.25


def kde_candidates_log_density(x: Candidates) -> torch.Tensor:
    """log f_c(q) from the top-K' candidates and the exact label statistics: (Q, C).

    f_c = (1/n_c) [Σ_{j∈K', y_j=c} exp(s_j/σ) + D_c], where D_c = Σ_{j∉K', y_j=c} exp(s_j/σ)
    is the mass the truncation drops. It is not computed item by item; what is known of it
    exactly: the r_c = n_c − m_c items of label c outside the candidates (m_c of them are
    candidates) have mean similarity μ_c = (q·S_c − Σ_{j∈K', y_j=c} s_j) / r_c, from the label's
    embedding sum S_c, and (an exact search) each is at most s_K', the K'-th candidate's
    similarity. Among all spreads of r_c similarities on [-1, s_K'] with mean μ_c,

        L_c = r_c·exp(μ_c/σ)  <=  D_c  <=  U_c = r_c·[p·exp(s_K'/σ) + (1-p)·exp(-1/σ)],

    p = (μ_c + 1)/(s_K' + 1): the left side by Jensen (exp is convex; all at μ_c), the right
    one by the same convexity (all at the ends of the interval). The vote takes
    D_c ≈ L_c^(3/4)·U_c^(1/4) (TAIL_UPPER_WEIGHT): within the bounds always, exact when the
    dropped items sit at one similarity, nearer the lower bound because dropped items crowd
    far below s_K' more often than at it. μ_c is clipped to s_K' (an approximate index can
    miss a nearer item). Without a tail a label with no candidate gets f_c = 0 and can never
    be second; a label whose dropped mass sits right at s_K' is what the estimate can get
    wrong, by at most log(U_c/L_c) in log f_c·n_c (measured against the exact vote:
    benchmarks/gallery_scale.py, docs/RESULTS.md).
    """
    dtype = torch.float64
    q, c, t = x.queries.shape[0], x.num_classes, x.temperature
    s = x.similarities.to(dtype)  # (Q, K')
    valid = x.labels >= 0
    lab = torch.where(valid, x.labels, c)  # (Q, K'): padding to the spare column C
    w = ((s - 1.0) / t).exp().masked_fill(~valid, 0.0)  # exp((s-1)/σ), shifted by 1/σ
    mass = torch.zeros(q, c + 1, dtype=dtype).scatter_add_(1, lab, w)[:, :c]  # (Q, C)
    m = torch.zeros(q, c + 1, dtype=dtype).scatter_add_(1, lab, valid.to(dtype))[:, :c]
    ssum = torch.zeros(q, c + 1, dtype=dtype).scatter_add_(1, lab, s.masked_fill(~valid, 0.0))
    total = x.queries.to(dtype) @ x.label_sums.to(dtype).T  # (Q, C) q·S_c, exact
    n = x.counts.to(dtype).unsqueeze(0)  # (1, C)
    r = (n - m).clamp_min(0.0)  # (Q, C) items outside the candidates
    # s_K': the last valid candidate's similarity (1 where a row has none)
    last = s.masked_fill(~valid, float("inf")).amin(dim=1, keepdim=True)  # (Q, 1)
    last = torch.where(torch.isinf(last), torch.ones_like(last), last)
    mu = ((total - ssum[:, :c]) / r.clamp_min(1.0)).clamp(min=-1.0).minimum(last)  # (Q, C)
    log_lower = (mu - 1.0) / t  # log of L_c / r_c, shifted by 1/σ
    p = ((mu + 1.0) / (last + 1.0)).clamp(0.0, 1.0)
    log_upper = torch.log(p * ((last - 1.0) / t).exp() + (1.0 - p) * float(np.exp(-2.0 / t)))
    lam = TAIL_UPPER_WEIGHT
    tail = r * ((1.0 - lam) * log_lower + lam * log_upper).exp()  # (Q, C), shifted by 1/σ
    out = torch.log(mass + tail) + 1.0 / t - torch.log(n)
    return out.masked_fill((x.counts <= 0).unsqueeze(0), float("-inf")).float()


def kde_probs(
    similarities: torch.Tensor, labels: torch.Tensor, num_classes: int, temperature: float
) -> torch.Tensor:
    """(Q, C) f_c / Σ_c f_c (equal label priors)."""
    return softmax_or_zero(kde_log_density(similarities, labels, num_classes, temperature))


class Kde(VoteRule):
    name = "kde"
    needs_similarities = True

    @staticmethod
    def prepared(view: GalleryView) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """kde_prepare of the view's labels, kept as long as the view (the service's view
        lives until the gallery changes)."""
        return view.memo(
            "kde", lambda: kde_prepare(view.labels, view.num_classes, view.temperature)
        )

    def fused_kde_prior(self) -> float | None:
        return 0.0  # plain kde: the fused call without a prior

    def log_density(self, x: VoteInput) -> torch.Tensor:
        """(Q, C) log f_c of every label (-inf: no items), exact."""
        v = x.view
        prepared = self.prepared(v)
        return kde_log_density(x.similarities, v.labels, v.num_classes, v.temperature, prepared)

    def vote(self, x: VoteInput) -> torch.Tensor:
        v = x.view
        if not bool((v.counts > 0).any()):
            return torch.zeros(x.queries.shape[0], v.num_classes)
        return torch.softmax(self.log_density(x).nan_to_num(neginf=-1e30), dim=1)  # (Q, C)

    def vote_candidates(self, x: Candidates) -> torch.Tensor:
        if not bool((x.counts > 0).any()):
            return torch.zeros(x.queries.shape[0], x.num_classes)
        logd = kde_candidates_log_density(x)
        return torch.softmax(logd.nan_to_num(neginf=-1e30), dim=1)  # (Q, C)
