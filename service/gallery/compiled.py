"""The kde vote compiled for the service's hot path: queries against every gallery row, the
per-label densities and the top labels in one TorchScript call, which runs without the GIL
(one hand-off per batch instead of one per operation). Same results as embedding.votes.Kde
(tests/service/gallery/test_gallery_vote.py); serving-only, so it lives here, not in embedding/."""

from __future__ import annotations

import functools

import torch

from embedding.openset import label_kth_grouped
from embedding.votes.kde import kde_from_onehot
from embedding.votes.kde_shrunk import shrink_log_density


def kde_top(
    queries: torch.Tensor,
    gallery_t: torch.Tensor,
    onehot: torch.Tensor,
    counts: torch.Tensor,
    temperature: float,
    top: int,
    live: torch.Tensor | None,
    order: torch.Tensor,
    starts: torch.Tensor,
    kcs: torch.Tensor,
    alpha: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The service's kde classification in one call: queries (B, d) against every gallery row
    (gallery_t: (d, N), the rows transposed, Rows.embeddings_t) -> (best similarity (B,), top-`top` probabilities (B, top) and label ids, the
    probability total (B,), 0 for a query no label can take, and the open-set score (B,):
    embedding.openset.label_kth_grouped of the top label with kcs (C,) = min(k, n_c - 1)). `live`
    (N,) bool masks deleted rows out of the best similarity (their labels are already outside
    `onehot`'s C columns); order, starts: embedding.openset.label_groups of the rows; alpha > 0: the
    kde_shrunk vote (its prior, embedding/votes/kde_shrunk.py), 0: kde.
    Compiled by `scripted_kde_top` the service runs it without the GIL: one hand-off per
    batch instead of one per operation, which is what an event loop on the other core
    made slow (docs/PERFORMANCE.md)."""
    sims = queries @ gallery_t  # (B, N) cosine similarities
    if live is None:
        best = sims.max(dim=1).values
    else:
        best = sims.masked_fill(~live, float("-inf")).max(dim=1).values
    logd = kde_from_onehot(sims, onehot, counts, temperature)  # (B, C)
    if alpha > 0:
        logd = shrink_log_density(logd, counts, alpha)
    probs = torch.softmax(logd.nan_to_num(neginf=-1e30), dim=1)
    vals, idx = probs.topk(top, dim=1)
    pred = idx[:, 0]
    score = label_kth_grouped(sims, order, starts, pred, kcs[pred])
    return best, vals, idx, probs.sum(dim=1), score


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
