"""Is this the kind of image the gallery holds? The world check, beside "which label?".

The L2-normalised embedding throws away what tells an image from another world apart: a ReLU
network maps inputs far from its training data confidently into some class region (Hein et
al., CVPR 2019), and the unit sphere has no "far". What it drops is still in the network: the
per-channel mean and spread of each block's activations (Quintanilha et al. 2019; Sastry & Oore
2020 use higher moments) and the length of the projection before it is normalised
(objectosphere, Dhamija et al. 2018). `stats` collects them, (B, D):

    for each block of the backbone: channel means and channel standard deviations of its output
    (conv4: 4 blocks x 64 channels x 2 = 512, after each block's ReLU; ResNet: layer1..4,
    2 x (64+128+256+512) = 1,920; a timm model: each map forward_intermediates returns),
    log of the projection's norm (1).

`WorldFit` is a Gaussian over them fitted on training images (class-agnostic: the question is
the world, not the class): the mean and a whitening W (D, r) from the eigenvectors of the
covariance, each scaled by 1/sqrt(eigenvalue + shrink), so that z = (s - mean) W and the
Mahalanobis distance (Lee et al. 2018, with one class-agnostic Gaussian) is |z|^2 / r. Its
threshold at an acceptance rate is the quantile of held-out images' scores (never those it was
fitted on), calibrated like the label check (embedding/openset.py): no outlier data needed.

The statistics s are what the service keeps per added image (and z = (s - mean) W in memory):
|z|^2/r is the world score of the trained labels, and a label users registered is checked
against its own images' z (service/gallery/world.py: the distance to its nearest image, against
a radius from the label's own spread and the training world's), because a user's photos are far
from a Fashion-MNIST model's world and must still be recognised as theirs.
Nothing here assumes a look (background, size, colour): the statistics are of the model's own
activations on whatever it was trained on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .model import Conv4, EmbeddingNet, blank_width

WORLD_FILE = "world.safetensors"
FORMAT_VERSION = 1
DEFAULT_RANK = 4096  # whitened directions kept: all of them (conv4: D = 513; chosen on validation)
DEFAULT_SHRINK = 1e-3
DEFAULT_TPR = 0.99  # the world check alone accepts 99% of held-out known images


def _moments(h: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, 2C): per channel mean and standard deviation over space. By global
    average pools of h and h² (E[h²] - E[h]²): the serving module keeps activations in oneDNN's
    blocked layout, which pools read as they are, where a flatten and var made it copy every
    activation map back to a plain layout (5x the forward's time at batch 16, measured)."""
    mean = F.adaptive_avg_pool2d(h, 1).flatten(1).float()
    sq = F.adaptive_avg_pool2d(h * h, 1).flatten(1).float()
    std = (F.relu(sq - mean * mean) + 1e-6).sqrt()
    return torch.cat([mean, std], dim=1)


class WorldStats(nn.Module):
    """x (normalised, B x C x H x W) -> (vectors of `space` (B, d), statistics s (B, D)) in one
    pass of the backbone (embedding.model.SPACES: the NCA embedding, or the last feature map)."""

    def __init__(self, model: EmbeddingNet, space: str = "embedding"):
        super().__init__()
        self.model = model
        self.config = model.config
        self.spatial = space == "spatial"

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.model.backbone
        parts: list[torch.Tensor] = []
        if isinstance(b, Conv4):
            h = x
            last = x
            for i in range(4):  # each block: conv, bn, relu, pool
                blk = b.features[4 * i : 4 * i + 4]
                last = blk[2](blk[1](blk[0](h)))
                h = blk[3](last)
                # moments after the relu, at full resolution: the first block's there tell
                # images of another look apart (digits: 87% flagged; after its pool, 58%)
                parts.append(_moments(last))
            feat = torch.flatten(h, 1)
        elif hasattr(b, "forward_intermediates"):  # a timm model: each stage's output map
            last, maps = b.forward_intermediates(x)
            parts += [_moments(h) for h in maps if h.ndim == 4]
            feat = b.forward_head(last, pre_logits=True)  # its own pooling, (B, num_features)
        else:  # torchvision ResNet
            h = b.maxpool(b.relu(b.bn1(b.conv1(x))))
            for layer in (b.layer1, b.layer2, b.layer3, b.layer4):
                h = layer(h)
                parts.append(_moments(h))
            last = h
            feat = torch.flatten(b.avgpool(h), 1)
        proj = self.model.embed(feat).float()
        norm = proj.norm(dim=1, keepdim=True)
        parts.append(torch.log(norm + 1e-6))
        v = F.normalize(torch.flatten(last, 1).float() if self.spatial else proj, dim=1)
        return v, torch.cat(parts, dim=1)


class WorldNet(nn.Module):
    """x -> [v | s] (B, d + D): the served vectors and the world statistics side by side, one
    tensor (what the service's traced module returns: one call per batch). The statistics are
    kept raw (stored with added items): whitening them is the fit's, which a rebuilt index
    may change."""

    def __init__(self, model: EmbeddingNet, space: str = "embedding"):
        super().__init__()
        self.stats = WorldStats(model, space)
        self.config = model.config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v, s = self.stats(x)
        return torch.cat([v, s], dim=1)


def stats_dim(model: EmbeddingNet) -> int:
    """D: the length of the statistics of `model` (one forward of a blank image)."""
    return blank_width(model, StatsOnly(model))


class StatsOnly(nn.Module):
    """x -> s (B, D): the statistics alone (for embedding.inference.embed_images)."""

    def __init__(self, model: EmbeddingNet):
        super().__init__()
        self.stats = WorldStats(model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stats(x)[1]


def fit_from_images(
    model: EmbeddingNet,
    source,
    fit_positions: np.ndarray,
    calibration_positions: np.ndarray,
    calibration_labels: np.ndarray,
    device: torch.device,
    batch_size: int = 512,
    progress=None,
    seed: int = 0,
) -> WorldFit:
    """`fit` on images of an embedding.datasets source through the model's eval transform:
    the Gaussian from `fit_positions`, thresholds and the few-shot radius from the held-out
    `calibration_positions` (with their labels)."""
    from .inference import embed_images
    from .transforms import eval_transform

    net = StatsOnly(model).to(device)
    pos = np.concatenate([fit_positions, calibration_positions])
    s = embed_images(net, source, pos, eval_transform(model.config), device, batch_size,
                     progress=progress).cpu()  # fmt: skip
    n = len(fit_positions)
    return fit(s[:n], s[n:], calibration_labels, seed=seed)


@torch.no_grad()
def collect(model: EmbeddingNet, batches) -> tuple[torch.Tensor, torch.Tensor]:
    """(embeddings (N, d), statistics (N, D)) of normalised image batches (an iterable of
    (B, C, H, W) float tensors), eval mode."""
    net = WorldStats(model).eval()
    was = model.training
    model.eval()
    vs, ss = [], []
    try:
        for x in batches:
            v, s = net(x)
            vs.append(v.cpu())
            ss.append(s.cpu())
    finally:
        model.train(was)
    return torch.cat(vs), torch.cat(ss)


@dataclass
class WorldFit:
    mean: np.ndarray  # (D,)
    whiten: np.ndarray  # (D, r): eigenvectors / sqrt(eigenvalue + shrink)
    calibration: np.ndarray  # (m,) sorted scores of held-out known images
    fitted_on: int  # images the Gaussian was fitted on
    # A label's own world (a registered label: service/gallery/world.py), from the training
    # world's classes, 5 images of a class standing for a label: `same_radius` the distance
    # within which 95% of the class's other images lie from the nearest of the 5 (the
    # smallest radius a label gets: TPR 0.95, as the label check's calibration); `spread` the
    # 95th percentile of that distance over the 5's median leave-one-out distance (a label
    # looser than a class gets a radius in proportion).
    same_radius: float = 1.0
    spread: float = 2.0
    # "training": fitted on the training world (the index builder); "gallery": no training
    # world (nothing trained), fitted by the service on the registered images (fit_gallery);
    # `unfitted()` is such a fit before two registered images exist
    source: str = "training"
    _w32: tuple | None = field(default=None, repr=False, compare=False)

    @property
    def rank(self) -> int:
        return int(self.whiten.shape[-1])  # (D, r), or (D,) for a diagonal whitening

    @property
    def fitted(self) -> bool:
        return len(self.mean) > 0

    def z(self, s: np.ndarray | torch.Tensor) -> np.ndarray:
        """(B, D) statistics -> (B, r) whitened coordinates (float32: the serving hot path;
        `fit` itself works in float64)."""
        s = s.numpy() if isinstance(s, torch.Tensor) else s
        if self._w32 is None:
            self._w32 = (self.mean.astype(np.float32), self.whiten.astype(np.float32))
        mean, whiten = self._w32
        c = np.asarray(s, dtype=np.float32) - mean
        return c * whiten if whiten.ndim == 1 else c @ whiten

    def score(self, z: np.ndarray) -> np.ndarray:
        """(B, r) -> (B,) Mahalanobis distance per dimension: about 1 for the training world,
        larger the farther from it (higher = less of this world)."""
        return (np.asarray(z, dtype=np.float64) ** 2).sum(axis=1) / self.rank

    def threshold(self, tpr: float) -> float | None:
        """The score under which a share `tpr` of held-out known images falls; None when the
        held-out images are too few to place it: m of them bound the rate at m / (m + 1) (the
        conformal rank ceil((m + 1) tpr) is past the last), so 0.99 needs 99 (a run of a few
        photos calibrates on a fifth of them: its threshold would be their largest score)."""
        m = len(self.calibration)
        if m == 0 or math.ceil((m + 1) * tpr - 1e-9) > m:
            return None
        return float(np.quantile(self.calibration, tpr))

    def accepts(self, z: np.ndarray, tpr: float) -> np.ndarray:
        t = self.threshold(tpr)
        return np.ones(len(z), bool) if t is None else self.score(z) <= t

    def distances(self, za: np.ndarray, zb: np.ndarray) -> np.ndarray:
        """(A, r), (B, r) -> (A, B) squared distances per dimension (the score's units)."""
        za, zb = np.asarray(za, np.float64), np.asarray(zb, np.float64)
        d = (za**2).sum(1)[:, None] + (zb**2).sum(1)[None, :] - 2 * za @ zb.T
        return np.maximum(d, 0.0) / self.rank

    def radius(self, z: np.ndarray) -> float:
        """The world radius of a label from its images' z (m, r): its own spread (the median
        distance of an image to its nearest other image, times `spread`), never under the
        training world's `same_radius` (which a label of one image, with no spread, gets)."""
        if len(z) < 2:
            return self.same_radius
        d = self.distances(z, z)
        np.fill_diagonal(d, np.inf)
        return max(self.same_radius, self.spread * float(np.median(d.min(axis=1))))


def fit(
    fit_stats: torch.Tensor,
    calibration_stats: torch.Tensor,
    calibration_labels: np.ndarray | None = None,
    rank: int = DEFAULT_RANK,
    shrink: float = DEFAULT_SHRINK,
    seed: int = 0,
) -> WorldFit:
    """The Gaussian of `fit_stats` (N, D), the held-out scores of `calibration_stats`, and
    (with `calibration_labels`) the few-shot radius of a label's own world. Under D images
    (estimable): a diagonal one, each variance shrunk towards their mean (_shrunk_variances).
    `shrink` (relative to the mean eigenvalue) keeps near-empty directions from dominating."""
    s = fit_stats.double().numpy()
    mean = s.mean(axis=0)
    if not estimable(len(s), s.shape[1]):  # a few photos: per-dimension variances only
        var = _shrunk_variances(s, GALLERY_PRIOR)
        w = WorldFit(mean, 1.0 / np.sqrt(var), np.zeros(0), len(s))
        return _calibrated(w, calibration_stats, calibration_labels, seed)
    cov = np.cov(s - mean, rowvar=False)
    vals, vecs = np.linalg.eigh(cov)  # ascending
    order = np.argsort(vals)[::-1][: min(rank, len(vals))]
    vals, vecs = vals[order], vecs[:, order]
    floor = shrink * max(float(vals.mean()), 1e-12)
    whiten = vecs / np.sqrt(vals + floor)
    return _calibrated(WorldFit(mean, whiten, np.zeros(0), len(s)), calibration_stats,
                       calibration_labels, seed)  # fmt: skip


def _calibrated(w: WorldFit, calibration_stats, calibration_labels, seed: int) -> WorldFit:
    """`w` with the held-out scores of `calibration_stats` and, with their labels, the few-shot
    radius of a label's own world."""
    zc = w.z(calibration_stats)
    w.calibration = np.sort(w.score(zc))
    if calibration_labels is not None:
        w.same_radius, w.spread = _few_shot_radius(w, zc, np.asarray(calibration_labels), seed)
    return w


def _shrunk_variances(s: np.ndarray, prior: float) -> np.ndarray:
    """(n, D) -> (D,) each dimension's variance shrunk towards their mean by `prior`
    pseudo-images: (n var_j + prior mean(var)) / (n + prior); nearly isotropic from a few
    images, per dimension from many."""
    var = s.var(axis=0)
    shrunk = (len(s) * var + prior * float(var.mean())) / (len(s) + prior)
    return np.maximum(shrunk, 1e-12)  # (identical images: no spread in any dimension)


def estimable(n_fit: int, dim: int) -> bool:
    """Can a full covariance over `dim` statistics be estimated from `n_fit` images? Its rank is
    under n_fit: with fewer images than dimensions most directions are the shrink floor alone,
    and their whitened scale says nothing (a full fit on 16 photos put 81 % of other crops of
    its own objects outside its world). `fit` then fits a diagonal Gaussian instead."""
    return n_fit >= dim


SHOT_DRAWS = 200  # draws of a class in _few_shot_radius
KEYS_UP_TO = 4096  # _draws: classes up to this size by keys ((draws, n) floats: <= 6.6 MB)
GALLERY_PRIOR = 10.0  # pseudo-images of the isotropic prior in fit_gallery's variances


def unfitted() -> WorldFit:
    """The world of a model with nothing trained, before the gallery has images to fit it on
    (the service fits it with fit_gallery as images are registered)."""
    return WorldFit(np.zeros(0), np.zeros(0), np.zeros(0), 0, source="gallery")


def fit_gallery(
    stats: np.ndarray, labels: np.ndarray, prior: float = GALLERY_PRIOR, seed: int = 0
) -> WorldFit | None:
    """The world of the registered images themselves, when there is no training world:
    `stats` (n, D) of registered images, `labels` (n,) theirs. None under 2 images (no spread
    to measure a distance by).

    Diagonal: a full covariance from tens of images in ~1,000 dimensions is not estimable.
    Each dimension's variance is shrunk towards the mean variance by `prior` pseudo-images,
    (n var_j + prior mean(var)) / (n + prior), so that a few images give a nearly isotropic
    metric and many a per-dimension one. No threshold on the score (there are no held-out
    known images): the check is each label's own radius (WorldFit.radius), with `same_radius`
    and `spread` calibrated as the training world's are, on labels with 6 or more images
    (_few_shot_radius), and the training world's defaults (1.0, 2.0) before any has."""
    s = np.asarray(stats, dtype=np.float64)
    if len(s) < 2:
        return None
    if not float(s.var(axis=0).mean()) > 0:
        return None
    var = _shrunk_variances(s, prior)
    w = WorldFit(s.mean(axis=0), 1.0 / np.sqrt(var), np.zeros(0), len(s), source="gallery")
    w.same_radius, w.spread = _few_shot_radius(w, w.z(s), np.asarray(labels), seed)
    return w


def _draws(rng: np.random.Generator, n: int, k: int = 6, draws: int = SHOT_DRAWS) -> np.ndarray:
    """(draws, k) positions in range(n), each row k distinct ones in a uniformly random order:
    up to KEYS_UP_TO the k smallest of uniform keys in key order (a (draws, n) array), above it
    k uniform positions with the rows that repeat one drawn again (rejection keeps them
    uniform; repeats are rare there), so the memory stays (draws, k) for a class of any size."""
    if n <= KEYS_UP_TO:
        keys = rng.random((draws, n))
        pick = np.argpartition(keys, k - 1, axis=1)[:, :k]
        return np.take_along_axis(pick, np.take_along_axis(keys, pick, 1).argsort(axis=1), 1)
    pick = rng.integers(0, n, (draws, k))
    while True:
        s = np.sort(pick, axis=1)
        again = (s[:, 1:] == s[:, :-1]).any(axis=1)
        if not again.any():
            return pick
        pick[again] = rng.integers(0, n, (int(again.sum()), k))


def _few_shot_radius(w: WorldFit, z: np.ndarray, y: np.ndarray, seed: int) -> tuple[float, float]:
    """(same_radius, spread) of WorldFit from labelled held-out images: draws of 6 images of
    one class, 5 as a label and the 6th as a query of it. A class's draws in array operations:
    a gallery-fitted world is fitted anew on every write of a growing gallery, under the write
    lock (200 draws a label one at a time were 0.12-0.59 s of every add; now 2-15 ms)."""
    rng = np.random.default_rng(seed)
    near, ratios = [], []
    for c in np.unique(y):
        idx = np.nonzero(y == c)[0]
        if len(idx) < 6:
            continue
        six = _draws(rng, len(idx))  # (P, 6) positions in idx
        # the distances among the images drawn at all (<= 1,200), once; each draw's 6 x 6 of it
        used, at = np.unique(six, return_inverse=True)
        at = at.reshape(six.shape)  # (P, 6) rows of `used`
        zu = z[idx[used]]  # (m, r)
        d = w.distances(zu, zu)[at[:, :, None], at[:, None, :]]  # (P, 6, 6)
        q = d[:, 5, :5].min(axis=1)  # (P,) the query to its nearest of the 5
        sup = d[:, :5, :5] + np.diag(np.full(5, np.inf))  # leave-one-out within the 5
        near.append(q)
        ratios.append(q / np.maximum(np.median(sup.min(axis=2), axis=1), 1e-12))
    if not near:
        return 1.0, 2.0
    return float(np.quantile(np.concatenate(near), 0.95)), float(
        np.quantile(np.concatenate(ratios), 0.95)
    )


def save(w: WorldFit, out_dir: Path, fingerprint: str) -> Path:
    """world.safetensors in `out_dir`, atomically (embedding.artifacts: fsync, rename, the
    mode every artifact gets)."""
    from .artifacts import write_safetensors

    path = Path(out_dir) / WORLD_FILE
    write_safetensors(
        path,
        {
            "mean": torch.from_numpy(np.ascontiguousarray(w.mean, dtype=np.float64)),
            "whiten": torch.from_numpy(np.ascontiguousarray(w.whiten, dtype=np.float64)),
            "calibration": torch.from_numpy(np.ascontiguousarray(w.calibration, dtype=np.float64)),
        },
        {
            "format_version": str(FORMAT_VERSION),
            "model_fingerprint": fingerprint,
            "fitted_on": str(w.fitted_on),
            "same_radius": repr(w.same_radius),
            "spread": repr(w.spread),
        },
    )
    return path


def load(path: Path, fingerprint: str | None = None) -> WorldFit:
    from safetensors import safe_open

    from .errors import ArtifactError

    try:
        with safe_open(str(path), "numpy") as f:
            meta = f.metadata() or {}
            t = {k: f.get_tensor(k) for k in ("mean", "whiten", "calibration")}
    except Exception as e:  # a truncated or foreign file
        raise ArtifactError(f"{path}: not a world statistics file ({e})") from None
    if fingerprint is not None and meta.get("model_fingerprint") != fingerprint:
        raise ArtifactError(f"{path} was fitted for another model")
    return WorldFit(
        t["mean"],
        t["whiten"],
        t["calibration"],
        int(meta.get("fitted_on", 0)),
        float(meta.get("same_radius", 1.0)),
        float(meta.get("spread", 2.0)),
    )
