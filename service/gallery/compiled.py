"""The kde vote compiled for the service's hot path: queries against every live gallery row,
the per-label densities and the top labels in one TorchScript call, which runs without the GIL
(one hand-off per batch instead of one per operation). Same results as embedding.votes.Kde
(tests/service/gallery/test_gallery_vote.py); serving-only, so it lives here, not in embedding/.

It reads the rows grouped by label (GroupedRows: live rows only, each label's columns
contiguous), so that after the one matrix product every pass over the (B, L) similarities is a
plain sweep: one in-place exp, one max, the per-label sums as segment sums, and the open-set
score a top-k over a slice, not a gather. Measured against the ungrouped call it replaced (55,000
rows, 10 labels, one thread): 3.6 -> 2.5 ms for a batch of 8 (docs/PERFORMANCE.md, "The vote")."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from embedding.votes.kde import kde_dtype
from embedding.votes.kde_shrunk import shrink_log_density

# Per-label sums as one product with a one-hot (L, C) matrix up to this many labels, as
# segment sums above: the product's cost grows with C, the segments' does not (55,000 rows,
# batch of 8: one-hot 0.22 / 1.25 / 44.6 ms at 10 / 100 / 1,000 labels, segments 0.31 /
# 0.33 / 0.51 ms).
ONEHOT_MAX_LABELS = 16


@dataclass(frozen=True)
class GroupedRows:
    """The live rows as the compiled vote reads them: rows_t (d, L) the live embeddings
    transposed and grouped by label (label c's are columns starts[c]:starts[c+1]), starts
    (C + 1,) int64, onehot (L, C) in kde's dtype when C <= ONEHOT_MAX_LABELS, else None.
    A copy of the live rows (d·L floats): made once per change of the rows."""

    rows_t: torch.Tensor
    starts: torch.Tensor
    onehot: torch.Tensor | None

    @staticmethod
    def of(emb_t: np.ndarray, labels: np.ndarray, num_labels: int, temperature: float):
        """emb_t (d, n) every row transposed, labels (n,) with -1 for deleted rows."""
        live = np.flatnonzero(labels >= 0)
        order = live[np.argsort(labels[live], kind="stable")]  # (L,) grouped by label
        counts = np.bincount(labels[live], minlength=num_labels)[:num_labels]
        starts = np.zeros(num_labels + 1, dtype=np.int64)
        starts[1:] = np.cumsum(counts)
        onehot = None
        if num_labels <= ONEHOT_MAX_LABELS:
            grouped = torch.from_numpy(labels[order])
            onehot = torch.nn.functional.one_hot(grouped, num_labels).to(kde_dtype(temperature))
        rows_t = torch.from_numpy(np.take(emb_t, order, axis=1))  # (d, L) contiguous
        return GroupedRows(rows_t, torch.from_numpy(starts), onehot)


def kde_top(
    queries: torch.Tensor,
    rows_t: torch.Tensor,
    starts: torch.Tensor,
    onehot: torch.Tensor | None,
    temperature: float,
    top: int,
    kcs: torch.Tensor,
    alpha: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The service's kde classification in one call: queries (B, d) against GroupedRows
    (rows_t (d, L) with L >= 1, starts, onehot) -> (best similarity (B,), top-`top`
    probabilities (B, top) and label ids, the probability total (B,), 0 for a query no label
    can take, and the open-set score (B,): embedding.openset.label_kth of the top label with
    kcs (C,) = min(k, n_c - 1), -1 where the label has no rows). alpha > 0: the kde_shrunk
    vote (its prior, embedding/votes/kde_shrunk.py), 0: kde.
    Compiled by `scripted_kde_top` the service runs it without the GIL: one hand-off per
    batch instead of one per operation, which is what an event loop on the other core
    made slow (docs/PERFORMANCE.md)."""
    c = starts.shape[0] - 1
    lengths = starts[1:] - starts[:-1]  # (C,) live items per label, n_c
    if 2.0 / temperature > 80.0:  # kde_dtype's rule: the kernel in float64, shifted by 1/σ
        sims = queries @ rows_t  # (B, L) s_j
        best = sims.amax(dim=1)
        shift = 1.0 / temperature
        w = sims.to(torch.float64).sub_(1.0).div_(temperature).exp_()  # exp((s_j - 1)/σ)
    else:  # float32 unshifted: kde_dtype picks it only where s/σ stays within ±40
        z = (queries * (1.0 / temperature)) @ rows_t  # (B, L) s_j/σ
        best = z.amax(dim=1) * temperature
        shift = 0.0
        w = z.exp_()  # exp(s_j/σ), in place
    if onehot is not None:
        sums = w @ onehot  # (B, C) Σ_{j: y_j = c} exp(s_j/σ)
    else:
        sums = torch.segment_reduce(w, "sum", lengths=lengths.expand(w.shape[0], c), axis=1)
    n = lengths.to(w.dtype)
    logd = sums.log() + shift - n.log()  # log f_c(q) = log((1/n_c) Σ exp(s_j/σ))
    logd = logd.masked_fill((lengths <= 0).unsqueeze(0), float("-inf")).float()
    if alpha > 0:
        logd = shrink_log_density(logd, n, alpha)
    probs = torch.softmax(logd.nan_to_num(neginf=-1e30), dim=1)
    vals, idx = probs.topk(top, dim=1)
    pred = idx[:, 0]
    # the open-set score: the k_c-th largest similarity among the chosen label's columns,
    # read off the kernel (exp is increasing), back to a similarity by σ·log
    score = torch.full((queries.shape[0],), -1.0)
    chosen: list[int] = torch.unique(pred).tolist()
    for label in chosen:
        lo, hi = int(starts[label]), int(starts[label + 1])
        if hi <= lo:
            continue
        qs = torch.nonzero(pred == label).squeeze(1)
        k = min(int(kcs[label]), hi - lo)
        kth = w.index_select(0, qs)[:, lo:hi].topk(k, dim=1).values[:, k - 1]
        score[qs] = ((kth.log() + shift) * temperature).float()
    return best.float(), vals, idx, probs.sum(dim=1), score


@functools.cache
def scripted_kde_top():
    """kde_top compiled by TorchScript (once per process, on first use); kde_top itself where
    it cannot be compiled (TorchScript needs the .py source), same results, slower."""
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TorchScript's deprecation notice; the pin keeps it
            compiled = torch.jit.script(kde_top)
    except Exception:
        return kde_top

    def run(*args):
        # Plain interpretation: the profiling executor re-specialises the graph for new shapes
        # (batch size, gallery size), and measured, that put 37 ms pauses among 0.5 ms calls.
        with torch.jit.optimized_execution(False):
            return compiled(*args)

    run.__wrapped__ = compiled
    return run
