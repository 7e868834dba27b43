"""Voting rules: how a query's similarities to the gallery become label probabilities.

One module for the service and for evaluation, so evaluation measures what the service serves.

  knn        the paper's weighted kNN (embedding.knn.weighted_knn_vote): the k most similar
             items vote with exp(s/σ). Exact paper behaviour; in a gallery of thousands of items
             per trained label, a label added from five images almost never wins (measured: 0%).
  prototype  nearest normalised label mean (cosine), probabilities softmax(cos/σ).
  kde        density-aware: each label's kernel density at the query,
                 f_c(q) = (1/n_c) Σ_{j: y_j = c} exp(s_j / σ),
             over *all* of the label's items, with equal prior for every label; probabilities
             f_c / Σ f. Dividing by n_c is what lets five exemplars compete with five thousand:
             a big label is not rewarded for its size, only for being dense where the query is.
             The sum runs over every item (the top-m nearest only would favour big labels,
             whose m-th neighbour is always close: measured, that variant lost all novel queries).
"""

import functools

import torch

from .knn import weighted_knn_vote

VOTES = ("knn", "prototype", "kde")


def knn_probs(
    similarities, neighbor_labels, num_classes: int, temperature: float, k: int | None = None
):
    """(Q, K) similarities sorted descending + (Q, K) label ids (-1 = none) -> (Q, C)."""
    return weighted_knn_vote(similarities, neighbor_labels, num_classes, temperature, k=k)


def prototype_probs(
    queries: torch.Tensor, label_sums: torch.Tensor, counts: torch.Tensor, temperature: float
) -> torch.Tensor:
    """queries (Q, d) unit rows; label_sums (C, d) sum of each label's embeddings; counts (C,).

    Returns (Q, C) softmax(cos(q, mean_c) / σ) over labels with items (0 for empty labels)."""
    protos = torch.nn.functional.normalize(label_sums.to(queries.dtype), dim=1)  # (C, d)
    logits = (queries @ protos.T) / temperature  # (Q, C)
    logits = logits.masked_fill((counts <= 0).unsqueeze(0), float("-inf"))
    return _softmax_or_zero(logits)


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
        onehot = torch.nn.functional.one_hot(lab, num_classes + 1).to(dtype)  # (N, C+1)
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


def kde_top(
    queries: torch.Tensor,
    gallery: torch.Tensor,
    onehot: torch.Tensor,
    counts: torch.Tensor,
    temperature: float,
    top: int,
    live: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The service's kde classification in one call: queries (B, d) against every gallery row
    (N, d) -> (best similarity (B,), top-`top` probabilities (B, top) and label ids, the
    probability total (B,), 0 for a query no label can take). `live` (N,) bool masks deleted
    rows out of the best similarity (their labels are already outside `onehot`'s C columns).
    Compiled by `scripted_kde_top` the service runs it without the GIL: one hand-off per
    batch instead of one per operation, which is what an event loop on the other core
    made slow (docs/PERFORMANCE.md)."""
    sims = queries @ gallery.t()  # (B, N) cosine similarities
    if live is None:
        best = sims.max(dim=1).values
    else:
        best = sims.masked_fill(~live, float("-inf")).max(dim=1).values
    logd = kde_from_onehot(sims, onehot, counts, temperature)  # (B, C)
    probs = torch.softmax(logd.nan_to_num(neginf=-1e30), dim=1)
    vals, idx = probs.topk(top, dim=1)
    return best, vals, idx, probs.sum(dim=1)


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


def kde_probs(
    similarities: torch.Tensor, labels: torch.Tensor, num_classes: int, temperature: float
) -> torch.Tensor:
    """(Q, C) f_c / Σ_c f_c (equal label priors)."""
    return _softmax_or_zero(kde_log_density(similarities, labels, num_classes, temperature))


def _softmax_or_zero(logits: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim; a row that is all -inf (no labels) gives all zeros."""
    empty = torch.isinf(logits).all(dim=1, keepdim=True) & (logits < 0).all(dim=1, keepdim=True)
    safe = logits.masked_fill(empty, 0.0)
    return torch.softmax(safe, dim=1).masked_fill(empty, 0.0)
