"""Generalized few-shot evaluation: the situation /gallery/add creates.

A model trained on base classes; its gallery (memory bank, or re-embedded training images) holds
every base training item; K images of each held-out ("novel") class are added; queries from
base and novel classes are classified by each voting rule of embedding.votes. Reports top-1
on novel queries, on base queries, and their harmonic mean, mean ± 95% CI over draws of shots.

    python -m training.fewshot runs/base7 --shots 1,5 --draws 5            # validation split
    python -m training.fewshot runs/base7 --split test --rules kde          # test split, once

split=val: base queries = the run's validation split; novel shots and queries both from the
novel classes' training images (disjoint). split=test: base and novel queries from the test
split, novel shots from the novel classes' training images.

--episodes N adds the paper's Table 6 protocol on the same embeddings: N-way K-shot episodes over
the novel classes alone (support and queries disjoint, kNN over the support with k = K), mean ±
95% CI over the episodes (training/protocols.py).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from embedding.cliutil import documented_parser, positive_int
from embedding.datasets import load_raw
from embedding.errors import SNCAError
from embedding.inference import embed_images
from embedding.model import SPACES, in_space
from embedding.rundir import RunDir
from embedding.transforms import eval_transform
from embedding.votes import VOTES, GalleryView, get_rule

from .config import run_config
from .datasets import build_data, stratified_pick
from .protocols import episode_accuracy, mean_ci95, novel_base_hm, sample_episodes


@dataclass
class Pools:
    gallery: torch.Tensor  # (N, d) base gallery
    gallery_labels: torch.Tensor  # (N,)
    base_q: torch.Tensor  # (Qb, d)
    base_y: torch.Tensor  # (Qb,)
    shot_pool: torch.Tensor  # (S, d) novel images the shots are drawn from
    shot_y: torch.Tensor  # (S,) labels nb..C-1
    novel_q: torch.Tensor  # (Qn, d) novel queries (split=test); None for val (drawn from pool)
    novel_y: torch.Tensor | None
    num_base: int
    num_classes: int
    temperature: float


def embed_positions(model, raw, positions) -> torch.Tensor:
    """`model`: an EmbeddingNet or embedding.model.in_space(...) of one (same `config`);
    the images `positions` of `raw` with the eval transform -> (n, D) on the CPU."""
    cpu = torch.device("cpu")
    return embed_images(model, raw.source, positions, eval_transform(model.config), cpu, 1024)


def load_pools(
    run: Path,
    novel: list[int] | None,
    split: str,
    gallery: str,
    space: str = "embedding",
    limit: int | None = None,
) -> Pools:
    """`space` (embedding.model.SPACES): the vectors compared, as index_builder --space builds
    them; anything but the NCA embedding needs the re-embedded gallery. `limit`: at most this
    many of the novel classes' training images (the shots' pool) and of each query set, the
    same share of every class (a check of the pipeline: `make reproduce QUICK=1`)."""

    def cut(positions: np.ndarray, labels: np.ndarray) -> np.ndarray:
        if limit is None or len(positions) <= limit:
            return positions
        return positions[stratified_pick(labels[positions], limit, np.random.default_rng(0))]

    if space != "embedding" and gallery == "memory":
        raise SNCAError(f"--space {space} needs --gallery recompute (the memory bank is NCA)")
    rd = RunDir(run)
    model = in_space(rd.load_model(), space)
    cfg = run_config(run)
    if cfg.coarse:
        raise SNCAError("generalized few-shot needs a run trained on fine labels (not --coarse)")
    data = build_data(cfg)
    raw = data.train.raw
    base_names = data.model_cfg.class_names
    base_ids = [raw.class_names.index(n) for n in base_names]
    novel = novel or [c for c in range(len(raw.class_names)) if c not in base_ids]
    if not novel or set(novel) & set(base_ids):
        raise SNCAError(
            f"novel classes {novel} must be non-empty and disjoint from the base {base_ids}"
        )
    nb, c = len(base_ids), len(base_ids) + len(novel)
    bank = rd.load_memory()
    g = (
        bank.embeddings
        if gallery == "memory"
        else embed_positions(model, raw, bank.indices.numpy())
    )
    novel_train = cut(np.nonzero(np.isin(raw.targets, novel))[0], raw.targets)
    to_novel = {cls: nb + i for i, cls in enumerate(novel)}
    shot_y = torch.tensor([to_novel[int(t)] for t in raw.targets[novel_train]])
    shot_pool = embed_positions(model, raw, novel_train)
    if split == "val":
        if data.val is None:
            raise SNCAError(f"{run} has no validation split (trained with --val-size 0)")
        base_q = embed_positions(model, raw, data.val.positions)
        base_y = torch.from_numpy(data.val.labels)
        novel_q = novel_y = None
    else:
        test = load_raw(
            cfg.dataset, "test", cfg.data_dir, data.model_cfg.image_size, data.model_cfg.in_channels
        )
        bpos = cut(np.nonzero(np.isin(test.targets, base_ids))[0], test.targets)
        base_q = embed_positions(model, test, bpos)
        base_y = torch.tensor([base_ids.index(int(t)) for t in test.targets[bpos]])
        npos = cut(np.nonzero(np.isin(test.targets, novel))[0], test.targets)
        novel_q = embed_positions(model, test, npos)
        novel_y = torch.tensor([to_novel[int(t)] for t in test.targets[npos]])
    return Pools(
        g,
        bank.labels,
        base_q,
        base_y,
        shot_pool,
        shot_y,
        novel_q,
        novel_y,
        nb,
        c,
        model.config.temperature,
    )


def predict(
    rule: str, q: torch.Tensor, g: torch.Tensor, y: torch.Tensor, c: int, sigma: float, k: int
) -> torch.Tensor:
    """Top-1 label of each query under `rule` (the service's rule classes, exact search)."""
    vote, view = get_rule(rule), GalleryView.of(g, y, c, sigma)
    out = []
    for s in range(0, q.shape[0], 1024):  # (1024, N) similarity blocks
        out.append(vote.probs(q[s : s + 1024], view, k).argmax(1))
    return torch.cat(out) if out else torch.empty(0, dtype=torch.long)


def evaluate(
    p: Pools,
    shots: int,
    draws: int,
    rules: list[str],
    k: int,
    queries_per_class: int,
    seed: int = 0,
) -> dict[str, dict]:
    rng = np.random.default_rng(seed)
    per: dict[str, list[tuple[float, float]]] = {r: [] for r in rules}
    for _ in range(draws):
        pick, qpick = [], []
        for cls in range(p.num_base, p.num_classes):
            idx = rng.permutation(np.nonzero((p.shot_y == cls).numpy())[0])
            pick.append(idx[:shots])
            qpick.append(idx[shots : shots + queries_per_class])
        pick = np.concatenate(pick)
        g = torch.cat([p.gallery, p.shot_pool[pick]])
        y = torch.cat([p.gallery_labels, p.shot_y[pick]])
        if p.novel_q is None:  # val: novel queries from the same pool, disjoint from the shots
            qn, yn = p.shot_pool[np.concatenate(qpick)], p.shot_y[np.concatenate(qpick)]
        else:
            qn, yn = p.novel_q, p.novel_y
        q = torch.cat([p.base_q, qn])
        qy = torch.cat([p.base_y, yn])
        novel = qy >= p.num_base
        for r in rules:
            pred = predict(r, q, g, y, p.num_classes, p.temperature, k)
            ok = (pred == qy).float()
            per[r].append((ok[novel].mean().item(), ok[~novel].mean().item()))
    out = {}
    for r, v in per.items():
        n, b, hm = novel_base_hm(v)
        out[r] = {name: _mean_ci(a) for name, a in (("novel", n), ("base", b), ("hm", hm))}
    return out


def _mean_ci(a: np.ndarray) -> dict[str, float]:
    m, ci = mean_ci95(a)
    return {"mean": m, "ci95": ci}


def run_episodes(
    p: Pools, shots: list[int], n: int, way: int = 0, queries: int = 15, seed: int = 0
) -> dict[int, dict]:
    """Table 6: N-way K-shot episodes over the novel classes alone, support and queries from the
    novel images (the test split, or the novel training images for val), kNN over the support
    with k = K. Returns {K: {way, episodes, mean, ci95}} (accuracies 0..1)."""
    emb, y = (p.shot_pool, p.shot_y) if p.novel_q is None else (p.novel_q, p.novel_y)
    way = way or (p.num_classes - p.num_base)
    out = {}
    for k_shot in shots:
        eps = sample_episodes(
            y.numpy(), range(p.num_base, p.num_classes), way, k_shot, queries, n, seed
        )
        m, ci = mean_ci95(episode_accuracy(emb, eps, p.temperature))
        out[k_shot] = {"way": way, "episodes": n, "mean": m, "ci95": ci}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = documented_parser("python -m training.fewshot", __doc__)
    ap.add_argument("run", type=Path, help="run dir of a model trained on base classes (--classes)")
    ap.add_argument("--novel", help="held-out class ids (default: every class not trained on)")
    ap.add_argument("--shots", default="1,5", help="K values, comma-separated")
    ap.add_argument("--draws", type=positive_int, default=5, help="draws of the shots")
    ap.add_argument("--rules", default=",".join(VOTES), help="voting rules to compare")
    ap.add_argument("--k", type=positive_int, default=30, help="k of the knn rule")
    ap.add_argument("--split", choices=("val", "test"), default="val")
    ap.add_argument("--gallery", choices=("memory", "recompute"), default="memory")
    ap.add_argument(
        "--space",
        choices=SPACES,
        default="embedding",
        help="vectors compared (index_builder --space); spatial needs --gallery recompute",
    )
    ap.add_argument(
        "--queries-per-class",
        type=positive_int,
        default=500,
        help="split=val: novel queries per class",
    )
    ap.add_argument(
        "--episodes",
        type=int,
        default=0,
        help="also N-way K-shot episodes over the novel classes only (paper Table 6): how many "
        "(0: none; the paper's protocol uses >= 1000)",
    )
    ap.add_argument("--way", type=int, default=0, help="episodes: N (0: every novel class)")
    ap.add_argument("--episode-queries", type=positive_int, default=15, help="per class")
    ap.add_argument(
        "--limit",
        type=positive_int,
        help="at most this many of the novel classes' training images (the shots' pool) and of "
        "each query set, the same share of every class (a quicker, rougher table; default: all)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="also write the table here")
    a = ap.parse_args(argv)
    try:
        rules = [r.strip() for r in a.rules.split(",")]
        unknown = [r for r in rules if r not in VOTES]
        if unknown:
            raise SNCAError(f"unknown rules {unknown}; known: {', '.join(VOTES)}")
        if a.episodes < 0 or a.way < 0:
            raise SNCAError("--episodes and --way must be >= 0")
        novel = [int(c) for c in a.novel.split(",")] if a.novel else None
        shots = [int(s) for s in a.shots.split(",")]
        pools = load_pools(a.run, novel, a.split, a.gallery, a.space, a.limit)
        table = {}
        for k_shot in shots:
            res = evaluate(pools, k_shot, a.draws, rules, a.k, a.queries_per_class, a.seed)
            table[k_shot] = res
            for r, v in res.items():
                print(
                    f"{k_shot}-shot {r:9s} novel {100 * v['novel']['mean']:5.1f} ± {100 * v['novel']['ci95']:.1f}  "
                    f"base {100 * v['base']['mean']:5.1f} ± {100 * v['base']['ci95']:.1f}  "
                    f"HM {v['hm']['mean']:.3f} ± {v['hm']['ci95']:.3f}",
                    flush=True,
                )
        episodes = {}
        if a.episodes > 0:
            episodes = run_episodes(pools, shots, a.episodes, a.way, a.episode_queries, a.seed)
            for k_shot, e in episodes.items():
                print(
                    f"{e['way']}-way {k_shot}-shot episodes ({a.episodes}, {a.episode_queries} "
                    f"queries/class): {100 * e['mean']:.2f} ± {100 * e['ci95']:.2f}",
                    flush=True,
                )
        if a.json:
            a.json.write_text(
                json.dumps(
                    {
                        "split": a.split,
                        "gallery": a.gallery,
                        "space": a.space,
                        "limit": a.limit,
                        "shot_pool": len(pools.shot_y),
                        "table": table,
                        "episodes": episodes,
                    },
                    indent=2,
                )
            )
    except (SNCAError, ValueError) as e:
        print(f"fewshot: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
