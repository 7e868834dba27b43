"""Vote rules over many draws of the shots, fast: the generalized few-shot protocol (training/
fewshot.py's: a model trained on base classes, its re-embedded training images as the gallery, K
training images of each held-out class added, the test split's queries of every class) with the
similarities to the base gallery computed once per model, so that 30+ draws of every shot count
and rule take seconds. What a rule needs of the base gallery (each label's log-sum-exp of the
kernel, each query's top-K base neighbours, each label's count and sum) is kept; a draw adds the
shots'. Every rule here is computed exactly as embedding/votes' class of that name computes it
(tests/benchmarks/test_vote_draws.py checks each against the class on real draws).

    python benchmarks/vote_draws.py runs/base7-269 runs/base7-046 runs/base7-158 \\
        --shots 5,20,50 --draws 30 --json docs/vote_draws.json

Also the one-image duplicate guard (issue 21): one training image of each base class registered
as a label of its own; the share of that class's test queries the one-image label takes (mean
and worst over the base classes and draws), which a default rule must keep <= 20%.

Reports per run, shots and rule: H (harmonic mean of novel and base top-1) mean, worst, 10th
percentile over the draws, novel and base top-1 means.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from embedding.votes import RULES
from training.protocols import novel_base_hm

TOP = 256  # base neighbours kept per query (the kNN-type rules read at most this many)


@dataclass
class Base:
    """What the rules need of the base gallery, per query: computed once per model."""

    lse: torch.Tensor  # (Q, B) log Σ_{j: y_j=c} exp(s_j/σ) over each base label's items
    top_s: torch.Tensor  # (Q, TOP) the nearest base items' similarities, descending
    top_y: torch.Tensor  # (Q, TOP) their labels
    counts: torch.Tensor  # (B,) items per base label
    sums: torch.Tensor  # (B, d) each base label's embedding sum
    sigma: float

    def rows(self, mask: torch.Tensor) -> Base:
        """The statistics of the queries `mask` selects."""
        return Base(
            self.lse[mask], self.top_s[mask], self.top_y[mask], self.counts, self.sums, self.sigma
        )


def base_stats(q: torch.Tensor, g: torch.Tensor, y: torch.Tensor, nb: int, sigma: float) -> Base:
    lse, ts, ty = [], [], []
    onehot = torch.nn.functional.one_hot(y, nb).double()  # (N, B)
    for s0 in range(0, q.shape[0], 512):
        s = q[s0 : s0 + 512] @ g.T  # (q, N)
        w = ((s.double() - 1.0) / sigma).exp()  # shifted by 1/σ
        lse.append((w @ onehot).log() + 1.0 / sigma)
        v, i = s.topk(TOP, dim=1)
        ts.append(v)
        ty.append(y[i])
    sums = torch.zeros(nb, g.shape[1], dtype=torch.float64).index_add_(0, y, g.double())
    return Base(
        torch.cat(lse), torch.cat(ts), torch.cat(ty), torch.bincount(y, minlength=nb), sums, sigma
    )


@dataclass
class Draw:
    """One draw's gallery as the rules see it: the base statistics plus the shots'."""

    base: Base
    shots: torch.Tensor  # (S, d)
    shot_y: torch.Tensor  # (S,) labels B..C-1
    num_classes: int

    def kde_log_density(self, q: torch.Tensor) -> torch.Tensor:
        """(Q, C) log f_c: kde's mean kernel over every item of each label."""
        b, c = self.base, self.num_classes
        s = q @ self.shots.T  # (Q, S)
        w = ((s.double() - 1.0) / b.sigma).exp()
        onehot = torch.nn.functional.one_hot(self.shot_y, c).double()  # (S, C)
        shot_sums = w @ onehot  # (Q, C)
        nb = b.lse.shape[1]
        lse = torch.full((q.shape[0], c), -math.inf, dtype=torch.float64)
        lse[:, :nb] = b.lse
        lse = torch.logaddexp(lse, shot_sums.log() + 1.0 / b.sigma)
        return lse - self.counts().double().log()

    def counts(self) -> torch.Tensor:
        b = self.base
        extra = torch.bincount(self.shot_y, minlength=self.num_classes)
        out = extra.clone()
        out[: b.counts.shape[0]] += b.counts
        return out

    def neighbours(self, q: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(Q, k) similarities and labels of the k nearest items of the whole gallery."""
        s = q @ self.shots.T
        sims = torch.cat([self.base.top_s, s], dim=1)
        labs = torch.cat([self.base.top_y, self.shot_y.expand(q.shape[0], -1)], dim=1)
        v, i = sims.topk(k, dim=1)
        return v, labs.gather(1, i)


def score(rule: str, d: Draw, q: torch.Tensor, k: int) -> torch.Tensor:
    """(Q, C) scores whose argmax is the rule's top-1 (exactly its class's)."""
    return FAST[rule](d, q, k)


def _kde(d: Draw, q: torch.Tensor, k: int) -> torch.Tensor:
    return d.kde_log_density(q)


def _kde_shrunk(d: Draw, q: torch.Tensor, k: int) -> torch.Tensor:
    from embedding.votes import shrink_log_density

    return shrink_log_density(d.kde_log_density(q).float(), d.counts(), RULES["kde_shrunk"].alpha)


def _knn(d: Draw, q: torch.Tensor, k: int) -> torch.Tensor:
    s, y = d.neighbours(q, k)
    w = (s.double() / d.base.sigma).exp()
    return torch.zeros(q.shape[0], d.num_classes, dtype=torch.float64).scatter_add_(1, y, w)


def _topk_balanced(beta: float, kk: int):
    """Exploration: log Σ over the kk nearest items of each label's kernel, minus β log n_c."""

    def fn(d: Draw, q: torch.Tensor, k: int) -> torch.Tensor:
        s, y = d.neighbours(q, kk)
        w = ((s.double() - 1.0) / d.base.sigma).exp()
        sums = torch.zeros(q.shape[0], d.num_classes, dtype=torch.float64).scatter_add_(1, y, w)
        return sums.log() - beta * d.counts().double().log()

    return fn


def _local_kde(m: int, beta: float):
    """Exploration: each label's mean kernel over its min(m, n_c) nearest items, minus β log
    (n_c / m_c)."""

    def fn(d: Draw, q: torch.Tensor, k: int) -> torch.Tensor:
        s, y = d.neighbours(q, TOP)
        c = d.num_classes
        out = torch.full((q.shape[0], c), -math.inf, dtype=torch.float64)
        n = d.counts().double()
        for lab in range(c):
            sl = s.masked_fill(y != lab, -2.0)
            v = sl.topk(m, dim=1).values  # (Q, m), -2 where the label has fewer in TOP
            mc = int(min(m, n[lab].item()))
            if mc == 0:
                continue
            v = v[:, :mc]
            lw = torch.logsumexp((v.double() - 1.0) / d.base.sigma, dim=1) - math.log(mc)
            out[:, lab] = lw - beta * math.log(n[lab].item() / mc)
        return out

    return fn


def _logit_adjusted(tau: float):
    """Exploration: kde's log f_c + τ log n_c (τ < 0 favours small labels)."""

    def fn(d: Draw, q: torch.Tensor, k: int) -> torch.Tensor:
        return d.kde_log_density(q) + tau * d.counts().double().log()

    return fn


def _bandwidth(gamma: float, dim: float, ref: float = 1000.0, alpha: float = 0.0):
    """Exploration: each label's kernel widened with fewer examples, σ_c = σ·max(1, ref/n_c)^γ,
    its density normalised as a von Mises-Fisher kernel's of `dim` effective dimensions:
    log f_c = logmeanexp((s_j - 1)/σ_c) + (dim/2)·log(σ/σ_c) (+ kde_shrunk's prior, alpha)."""

    def fn(d: Draw, q: torch.Tensor, k: int) -> torch.Tensor:
        b, c = d.base, d.num_classes
        n = d.counts().double()
        sig = b.sigma * torch.clamp(ref / n, min=1.0) ** gamma  # (C,)
        nb = b.lse.shape[1]
        out = torch.full((q.shape[0], c), -math.inf, dtype=torch.float64)
        base_sig = sig[:nb]
        assert bool((base_sig == b.sigma).all()), "exploration: base labels need ref <= their size"
        out[:, :nb] = b.lse - n[:nb].log()  # (σ_c = σ there)
        s = (q @ d.shots.T).double()  # (Q, S)
        for lab in range(nb, c):
            m = d.shot_y == lab
            if not bool(m.any()):
                continue
            z = (s[:, m] - 1.0) / sig[lab]
            out[:, lab] = torch.logsumexp(z, dim=1) - math.log(int(m.sum())) + 1.0 / b.sigma
            out[:, lab] += (dim / 2.0) * math.log(b.sigma / sig[lab].item())
        if alpha:
            from embedding.votes import shrink_log_density

            return shrink_log_density(out.float(), d.counts(), alpha)
        return out

    return fn


FAST = {"kde": _kde, "kde_shrunk": _kde_shrunk, "knn": _knn}
for _g in (0.05, 0.1, 0.15, 0.2):
    for _dim in (2.0, 3.0, 4.0, 5.0, 10.0, 20.0):
        FAST[f"x_bw{_g}_d{_dim:g}"] = _bandwidth(_g, _dim)
        for _a in (0.5, 2.0):
            FAST[f"x_bw{_g}_d{_dim:g}_a{_a:g}"] = _bandwidth(_g, _dim, alpha=_a)
for _b in (0.25, 0.5, 0.75, 1.0):
    for _kk in (30, 100):
        FAST[f"x_topk{_kk}_b{_b}"] = _topk_balanced(_b, _kk)
for _m in (5, 10):
    for _b in (0.0, 0.1, 0.2):
        FAST[f"x_local{_m}_b{_b}"] = _local_kde(_m, _b)
for _t in (-0.1, -0.2, -0.3):
    FAST[f"x_logit{_t}"] = _logit_adjusted(_t)


def fast_rule(name: str):
    """A rule of embedding/votes with a `fast_scores(draw, q, k)` of its own (new rules state
    their fast form beside their definition), or one of FAST."""
    if name in FAST:
        return lambda d, q, k: FAST[name](d, q, k)
    rule = RULES[name]()
    return lambda d, q, k: rule.fast_scores(d, q, k)


def load(run: Path, limit: int | None):
    """(pools, base stats) of a run: training/fewshot.py's pools on the test split, the
    re-embedded gallery."""
    from training.fewshot import load_pools

    t0 = time.monotonic()
    p = load_pools(run, None, "test", "recompute", limit=limit)
    q = torch.cat([p.base_q, p.novel_q])
    qy = torch.cat([p.base_y, p.novel_y])
    b = base_stats(q, p.gallery, p.gallery_labels, p.num_base, p.temperature)
    print(
        f"{run}: {len(p.gallery)} gallery items, {len(q)} queries, {time.monotonic() - t0:.0f} s",
        flush=True,
    )
    return p, q, qy, b


def draws(p, b: Base, q, qy, rules: list[str], shots: int, n: int, k: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    per = {r: [] for r in rules}
    novel = qy >= p.num_base
    fns = {r: fast_rule(r) for r in rules}
    for _ in range(n):
        pick = []
        for cls in range(p.num_base, p.num_classes):
            idx = rng.permutation(np.nonzero((p.shot_y == cls).numpy())[0])
            pick.append(idx[:shots])
        pick = np.concatenate(pick)
        d = Draw(b, p.shot_pool[pick], p.shot_y[pick], p.num_classes)
        for r in rules:
            pred = fns[r](d, q, k).argmax(1)
            ok = (pred == qy).double()
            per[r].append((ok[novel].mean().item(), ok[~novel].mean().item()))
    out = {}
    for r, v in per.items():
        nv, bv, hm = novel_base_hm(v)
        out[r] = {
            "hm_mean": float(hm.mean()),
            "hm_worst": float(hm.min()),
            "hm_p10": float(np.percentile(hm, 10)),
            "novel": float(nv.mean()),
            "base": float(bv.mean()),
            "hm": [round(float(x), 4) for x in hm],
        }
    return out


def duplicate_guard(p, b: Base, q, qy, rules: list[str], n: int, k: int, seed: int) -> dict:
    """One training image of a base class registered as a label of its own (the base classes
    one at a time, n draws of the image): the share of that class's queries it takes."""
    rng = np.random.default_rng(seed)
    out = {r: [] for r in rules}
    fns = {r: fast_rule(r) for r in rules}
    gy = p.gallery_labels.numpy()
    for cls in range(p.num_base):
        mask = qy == cls
        for _ in range(n):
            j = int(rng.choice(np.nonzero(gy == cls)[0]))
            d = Draw(b.rows(mask), p.gallery[j : j + 1], torch.tensor([p.num_base]), p.num_base + 1)
            for r in rules:
                pred = fns[r](d, q[mask], k).argmax(1)
                out[r].append(float((pred == p.num_base).double().mean()))
    return {r: {"mean": float(np.mean(v)), "worst": float(np.max(v))} for r, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "runs", nargs="+", type=Path, help="run dirs trained on base classes (--classes)"
    )
    ap.add_argument("--shots", default="5,20,50")
    ap.add_argument("--draws", type=int, default=30)
    ap.add_argument("--rules", default="kde_shrunk,kde,knn")
    ap.add_argument("--k", type=int, default=30)
    ap.add_argument("--guard-draws", type=int, default=5, help="duplicate-guard draws per class")
    ap.add_argument("--limit", type=int, help="queries and shot pool per set (a quick look)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    rules = a.rules.split(",")
    report = {"draws": a.draws, "k": a.k, "rules": rules, "runs": {}}
    for run in a.runs:
        p, q, qy, b = load(run, a.limit)
        r = {"novel": list(range(p.num_base, p.num_classes)), "shots": {}}
        for shots in [int(s) for s in a.shots.split(",")]:
            res = draws(p, b, q, qy, rules, shots, a.draws, a.k, a.seed)
            r["shots"][shots] = res
            for name, v in res.items():
                print(
                    f"  {shots:3d}-shot {name:18s} H {v['hm_mean']:.3f} (worst {v['hm_worst']:.3f}, "
                    f"p10 {v['hm_p10']:.3f})  novel {100 * v['novel']:5.1f}  base {100 * v['base']:5.1f}",
                    flush=True,
                )
        r["duplicate_guard"] = duplicate_guard(p, b, q, qy, rules, a.guard_draws, a.k, a.seed)
        for name, v in r["duplicate_guard"].items():
            print(
                f"  duplicate guard {name:18s} {100 * v['mean']:.1f}% (worst {100 * v['worst']:.1f}%)"
            )
        report["runs"][str(run)] = r
    if a.json:
        a.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
