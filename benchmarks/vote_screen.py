"""A reduced-precision kde vote, measured against the service's exact one on a trained run's own
gallery (issue 55, point 3): the similarities from bfloat16 rows, the best similarity and the
open-set score re-scored exactly in float32 from the rows within the proven error band, the
chosen label proven by its margin or the query voted again exactly. Reports what the answers
share with the exact vote's, how much of the gallery carries the kde densities (why re-scoring a
few top candidates cannot make the probabilities identical), and the time of both, interleaved.

    python benchmarks/vote_screen.py runs/demo                      # 55,000 items, 2,000 queries
    python benchmarks/vote_screen.py runs/demo --queries 500 --batches 1,8,16 --json out.json

The gallery is the run's memory bank (memory.safetensors), the queries the first `--queries`
images of the run's dataset's test split embedded by its model; the vote is the service's
default (kde_shrunk) at the run's temperature. A prototype, not served: docs/PERFORMANCE.md says
why.

The bound (z = s/σ, u = 2^-8 bfloat16's unit roundoff, unit rows and queries): rounding the
scaled query and the row to bfloat16 moves q·r by at most (2u + u²)/σ, the float32 sums of d
products by d·2^-24/σ more, and the bfloat16 result by u·|z| <= u/σ: |z' - z| <= EZ. Every
weight exp(z) is then within a factor exp(±EZ), and so is every label's density (a positive
sum of weights, also after kde_shrunk's prior): the label whose log density leads by more than
2·EZ leads exactly too.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.command_line import parser, write_report
from benchmarks.vote_precision import cpu_features
from embedding.votes.kde_shrunk import ALPHA, shrink_log_density

U = 2.0**-8  # bfloat16's unit roundoff (8 significant bits)


def error_band(temperature: float, dim: int) -> float:
    """EZ: the most a bfloat16 z = s/σ can be off the float32 one (the module docstring)."""
    return ((2 * U + U * U) + dim * 2.0**-24 + U) / temperature


def kde_top_screened(
    queries: torch.Tensor,
    gallery: torch.Tensor,
    gallery_bt: torch.Tensor,
    lab: torch.Tensor,
    onehot: torch.Tensor | None,
    counts: torch.Tensor,
    temperature: float,
    top: int,
    order: torch.Tensor,
    starts: torch.Tensor,
    kcs: torch.Tensor,
    alpha: float,
    ez: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """service.gallery.compiled.kde_top with the similarities from bfloat16 rows (gallery_bt
    (d, N)): (best (B,), top probabilities (B, top), their labels, the total, the open-set
    score, proven (B,) bool: the chosen label is the exact vote's). best and the score are
    exact: re-scored in float32 (gallery (N, d), its rows gathered) over every row within 2·EZ
    of the approximate value. TorchScript-compatible; no deleted rows (a run's memory bank)."""
    c = counts.shape[0]
    qz = queries * (1.0 / temperature)  # (B, d)
    z = (qz.to(torch.bfloat16) @ gallery_bt).float()  # (B, N) s/σ within EZ
    zmax = z.amax(dim=1)
    w = z.exp()  # exp(s/σ) within a factor exp(±EZ)
    if onehot is not None:
        sums = (w @ onehot)[:, :c]
    else:
        sums = torch.zeros(w.shape[0], c + 1, dtype=w.dtype)
        sums = sums.scatter_add_(1, lab.unsqueeze(0).expand(w.shape[0], -1), w)[:, :c]
    n = counts.to(w.dtype)
    logd = (sums.log() - n.log()).masked_fill((counts <= 0).unsqueeze(0), float("-inf"))
    if alpha > 0:
        logd = shrink_log_density(logd, n, alpha)
    lead = logd.topk(2, dim=1).values  # (B, 2)
    proven = (lead[:, 0] - lead[:, 1]) > 2.0 * ez
    probs = torch.softmax(logd.nan_to_num(neginf=-1e30), dim=1)
    vals, idx = probs.topk(top, dim=1)
    best = torch.empty(queries.shape[0])
    score = torch.full((queries.shape[0],), -1.0)
    for i in range(queries.shape[0]):
        near = torch.nonzero(z[i] >= zmax[i] - 2.0 * ez).squeeze(1)  # holds the exact best
        best[i] = (gallery.index_select(0, near) @ qz[i]).amax() * temperature
        label = int(idx[i, 0])
        rows = order[int(starts[label]) : int(starts[label + 1])]
        if rows.numel() == 0:
            continue
        k = min(int(kcs[label]), rows.numel())
        zr = z[i].index_select(0, rows)
        # the exact k-th is >= the approximate k-th - EZ: every row above it is within 2·EZ
        kth = zr.topk(k).values[k - 1]
        near = rows.index_select(0, torch.nonzero(zr >= kth - 2.0 * ez).squeeze(1))
        exact = gallery.index_select(0, near) @ qz[i]
        score[i] = exact.topk(k).values[k - 1] * temperature
    return best, vals, idx, probs.sum(dim=1), score, proven


def load(run: Path, queries: int) -> dict:
    """The run's memory bank and `queries` test images embedded by its model."""
    from embedding.artifacts import load_memory_bank, load_model
    from embedding.datasets import load_raw
    from embedding.inference import embed_images
    from embedding.transforms import eval_transform

    model = load_model(run)
    bank, _ = load_memory_bank(run / "memory.safetensors")
    rows = torch.nn.functional.normalize(bank["embeddings"].float(), dim=1)  # (N, d)
    where = json.loads((run / "dataset.json").read_text())  # what training read
    test = load_raw(where["dataset"], "test", where.get("root"))
    q = embed_images(model, test.source, np.arange(queries), eval_transform(model.config),
                     torch.device("cpu"))  # fmt: skip
    return {"rows": rows, "labels": bank["labels"], "queries": q,
            "temperature": float(model.config.temperature)}  # fmt: skip


def mass_spread(z: torch.Tensor, labels: torch.Tensor, etas) -> dict:
    """How many rows carry all but η of the kde's total density (each row's weight
    exp(s/σ)/n_c, f-units), median and largest over the queries: the rows a vote would have
    to re-score exactly for probabilities within η."""
    n = torch.bincount(labels).double()
    zz = z.double()
    w = (zz - zz.amax(dim=1, keepdim=True)).exp() / n[labels]  # (Q, N)
    cum = w.sort(dim=1, descending=True).values.cumsum(dim=1)
    cum = cum / cum[:, -1:]
    out = {}
    for eta in etas:
        need = (cum < 1.0 - eta).sum(dim=1) + 1
        out[str(eta)] = {"median": int(need.median()), "max": int(need.max())}
    return out


class Votes:
    """The exact compiled vote (the service's kde_top) and the screened one over the same
    gallery: rows (N, d) unit, labels (N,) in [0, C), at temperature σ, kde_shrunk's prior."""

    def __init__(self, rows: torch.Tensor, labels: torch.Tensor, temperature: float):
        import warnings

        from embedding.openset import K, label_groups
        from embedding.votes.kde import kde_prepare
        from service.gallery.compiled import scripted_kde_top

        self.c = int(labels.max()) + 1
        self.sigma = temperature
        self.lab, self.counts, self.onehot = kde_prepare(labels, self.c, temperature)
        self.order, self.starts = label_groups(labels, self.c)
        self.kcs = (self.counts.long() - 1).clamp(min=1, max=K)
        self.rows = rows.contiguous()  # (N, d) float32
        self.gt = rows.T.contiguous()  # (d, N) float32
        self.gbt = rows.to(torch.bfloat16).T.contiguous()  # (d, N) bfloat16
        self.ez = error_band(temperature, rows.shape[1])
        self.top = min(5, self.c)
        self._exact = scripted_kde_top()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TorchScript's deprecation notice
            self._screened = torch.jit.script(kde_top_screened)

    def exact(self, q: torch.Tensor) -> tuple:
        """(best, top probabilities, their labels, total, score) of the service's vote."""
        return self._exact(q, self.gt, self.lab, self.onehot, self.counts, self.sigma, self.top,
                           None, self.order, self.starts, self.kcs, ALPHA)  # fmt: skip

    def screened_once(self, q: torch.Tensor) -> tuple:
        """kde_top_screened's six: no query voted again."""
        with torch.jit.optimized_execution(False):
            return self._screened(
                q, self.rows, self.gbt, self.lab, self.onehot, self.counts, self.sigma, self.top,
                self.order, self.starts, self.kcs, ALPHA, self.ez,
            )  # fmt: skip

    def screened(self, q: torch.Tensor) -> tuple:
        """exact's five, from the bfloat16 rows, + how many queries were voted again."""
        best, vals, idx, total, score, proven = self.screened_once(q)
        redo = torch.nonzero(~proven).squeeze(1)
        if redo.numel():  # the label not proven: this query voted again, exactly
            again = self.exact(q.index_select(0, redo))
            for out, new in zip((best, vals, idx, total, score), again, strict=True):
                out[redo] = new
        return best, vals, idx, total, score, int(redo.numel())


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("run", type=Path, help="a trained run dir (memory.safetensors, its model)")
    ap.add_argument("--queries", type=int, default=2000, help="test images to vote for (2000)")
    ap.add_argument("--batches", default="1,8,16", help="batch sizes timed (1,8,16)")
    ap.add_argument("--repeat", type=int, default=30, help="timed calls per batch size (30)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    d = load(a.run, a.queries)
    rows, labels, queries, sigma = d["rows"], d["labels"], d["queries"], d["temperature"]
    if 2.0 / sigma > 80.0:  # kde_dtype's float64 kernel, which the prototype does not have
        ap.error(
            f"{a.run}: temperature {sigma} needs the float64 kernel (2/σ > 80): not prototyped"
        )
    votes = Votes(rows, labels, sigma)
    exact, screened, gt, gbt = votes.exact, votes.screened, votes.gt, votes.gbt
    c, ez = votes.c, votes.ez
    agree = {"queries": 0, "voted_again": 0, "top1_same": 0, "top_order_same": 0,
             "max_abs_dprob": 0.0, "max_abs_dbest": 0.0, "max_abs_dscore": 0.0}  # fmt: skip
    for i in range(0, len(queries), 16):
        q = queries[i : i + 16]
        e, s = exact(q), screened(q)
        agree["queries"] += len(q)
        agree["voted_again"] += s[5]
        agree["top1_same"] += int((e[2][:, 0] == s[2][:, 0]).sum())
        agree["top_order_same"] += int((e[2] == s[2]).all(dim=1).sum())
        for key, j in (("max_abs_dprob", 1), ("max_abs_dbest", 0), ("max_abs_dscore", 4)):
            agree[key] = max(agree[key], float((e[j] - s[j]).abs().max()))
    z_exact = (queries / sigma) @ gt
    z_bf16 = ((queries / sigma).to(torch.bfloat16) @ gbt).float()
    report = {
        "cpu": cpu_features(), "run": str(a.run), "rows": rows.shape[0], "dim": rows.shape[1],
        "labels": c, "temperature": sigma, "error_band_z": ez,
        "max_abs_dz_seen": float((z_bf16 - z_exact).abs().max()),
        "agreement": agree,
        "rows_carrying_density": mass_spread(z_exact, labels, (1e-3, 1e-4, 1e-6)),
        "ms": {},
    }  # fmt: skip
    print(f"CPU: {report['cpu']}; {rows.shape[0]} rows x {rows.shape[1]}, {c} labels, "
          f"σ {sigma}; EZ {ez:.3f} (seen {report['max_abs_dz_seen']:.3f})")  # fmt: skip
    print(f"agreement over {agree['queries']} queries: {agree}")
    print(f"rows carrying all but η of the density: {report['rows_carrying_density']}")
    for b in (int(x) for x in a.batches.split(",")):
        calls = {
            "exact": exact,
            "screened": screened,
            "screened, none voted again": votes.screened_once,
        }
        times = {name: [] for name in calls}
        for r in range(a.repeat + 2):
            at = (r * b) % max(1, len(queries) - b)
            q = queries[at : at + b]
            for name, fn in calls.items():
                t0 = time.perf_counter()
                fn(q)
                if r >= 2:  # two warm-up calls
                    times[name].append((time.perf_counter() - t0) * 1e3)
        med = {k: round(statistics.median(v), 3) for k, v in times.items()}
        report["ms"][b] = med
        shown = ", ".join(f"{k} {v:.2f} ms ({v / med['exact']:.2f}x)" for k, v in med.items())
        print(f"batch {b:3d}: {shown}")
    write_report(a.json, report)


if __name__ == "__main__":
    main()
