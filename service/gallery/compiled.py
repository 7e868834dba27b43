"""The kde vote compiled for the service's hot path: queries against every gallery row, the
per-label densities and the top labels in one TorchScript call, which runs without the GIL
(one hand-off per batch instead of one per operation). Same results as embedding.votes.Kde
(tests/service/gallery/test_gallery_vote.py); serving-only, so it lives here, not in embedding/.

After the one matrix product every pass over the (B, N) similarities is as few sweeps as the
vote allows: the queries are scaled by 1/σ before the product so that one in-place exp gives
the kernel, the best similarity is an amax (no indices), per-label sums a one-hot product for
few labels and a scatter-add for many, and the open-set score reads only the chosen label's
columns. Measured against the call it replaced (benchmarks/vote_ab.py: 55,000 rows, 10
labels, one thread): 3.3-3.4 -> 2.9-3.0 ms for a batch of 8, 16.7-17.7 -> 13.7-14.5 for 64.
Grouping the rows by label made it 0.1-0.3 ms faster still, but the grouped copy took 17.6 ms to
make against 2.6 for a plain one, and it is made again after every write."""

from __future__ import annotations

import functools

import torch

from embedding.votes.kde_shrunk import shrink_log_density

# Per-label sums as one product with kde_prepare's one-hot (N, C + 1) up to this many labels, a
# scatter-add above: the product's cost grows with C, the scatter's does not (55,000 rows,
# batch of 8: one-hot 0.22 / 1.25 / 44.6 ms at 10 / 100 / 1,000 labels; the scatter ~0.5 ms).
ONEHOT_MAX_LABELS = 16


def kde_top(
    queries: torch.Tensor,
    gallery_t: torch.Tensor,
    lab: torch.Tensor,
    onehot: torch.Tensor | None,
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
    (gallery_t: (d, N), the rows transposed, Rows.embeddings_t; N >= 1) -> (best similarity
    (B,), top-`top` probabilities (B, top) and label ids, the probability total (B,), 0 for a
    query no label can take, and the open-set score (B,): embedding.openset.label_kth of the
    top label with kcs (C,) = min(k, n_c - 1), -1 where it has no rows). lab, counts, onehot:
    embedding.votes.kde_prepare's (lab (N,) with deleted rows at C; onehot (N, C + 1) or None:
    a scatter-add instead). `live` (N,) bool masks deleted rows out of the best similarity;
    order, starts: embedding.openset.label_groups of the rows; alpha > 0: the kde_shrunk vote
    (its prior, embedding/votes/kde_shrunk.py), 0: kde.
    Compiled by `scripted_kde_top` the service runs it without the GIL: one hand-off per
    batch instead of one per operation, which is what an event loop on the other core
    made slow (docs/PERFORMANCE.md)."""
    c = counts.shape[0]
    if 2.0 / temperature > 80.0:  # kde_dtype's rule: the kernel in float64, shifted by 1/σ
        sims = queries @ gallery_t  # (B, N) s_j
        if live is not None:
            sims = sims.masked_fill(~live, float("-inf"))
        best = sims.amax(dim=1)
        shift = 1.0 / temperature
        w = sims.to(torch.float64).sub_(1.0).div_(temperature).exp_()  # exp((s_j - 1)/σ)
    else:  # float32 unshifted: kde_dtype picks it only where s/σ stays within ±40
        z = (queries * (1.0 / temperature)) @ gallery_t  # (B, N) s_j/σ
        if live is not None:  # a deleted row: weight 0, never the best
            z = z.masked_fill_(~live, float("-inf"))
        best = z.amax(dim=1) * temperature
        shift = 0.0
        w = z.exp_()  # exp(s_j/σ), in place
    if onehot is not None:
        sums = (w @ onehot)[:, :c]  # (B, C) Σ_{j: y_j = c} exp(s_j/σ); column C: deleted rows
    else:
        sums = torch.zeros(w.shape[0], c + 1, dtype=w.dtype)
        sums = sums.scatter_add_(1, lab.unsqueeze(0).expand(w.shape[0], -1), w)[:, :c]
    n = counts.to(w.dtype)
    logd = sums.log() + shift - n.log()  # log f_c(q) = log((1/n_c) Σ exp(s_j/σ))
    logd = logd.masked_fill((counts <= 0).unsqueeze(0), float("-inf")).float()
    if alpha > 0:
        logd = shrink_log_density(logd, n, alpha)
    probs = torch.softmax(logd.nan_to_num(neginf=-1e30), dim=1)
    vals, idx = probs.topk(top, dim=1)
    pred = idx[:, 0]
    # the open-set score: the k_c-th largest similarity among the chosen label's rows, read
    # off the kernel (exp is increasing), back to a similarity by σ·log
    score = torch.full((queries.shape[0],), -1.0)
    chosen: list[int] = torch.unique(pred).tolist()
    for label in chosen:
        rows = order[int(starts[label]) : int(starts[label + 1])]
        if rows.numel() == 0:
            continue
        qs = torch.nonzero(pred == label).squeeze(1)
        k = min(int(kcs[label]), rows.numel())
        kth = w.index_select(0, qs).index_select(1, rows).topk(k, dim=1).values[:, k - 1]
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
