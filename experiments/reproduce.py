"""`make reproduce`: the evaluation grid of the paper's claims on Fashion-MNIST with conv4, on CPU.

    python -m experiments.reproduce                 # whole grid (~42 min on 2 idle cores), docs/RESULTS.md
    python -m experiments.reproduce --quick         # small subsets, ~4 min; report in OUT/docs/
    python -m experiments.reproduce --only main,ablation --docs /tmp/report

Trains every run of the grid with `snca-train`'s entry point (in this process, seed fixed), then
evaluates it with the same code `snca-eval` and the service use:

- main: NCA and the softmax baseline, same backbone, data, augmentation and budget. Test split:
  weighted-kNN top-1/top-5 over a k sweep against the memory bank and the re-embedded training
  images, the softmax model's parametric top-1, its penultimate features after PCA (Table 2).
- ablation: embedding dim d, temperature σ (a run that diverges is reported as such, the paper's
  "N/A"), memory momentum schedule on/off; validation split only (this is model selection).
- coarse: trained on the coarse Fashion-MNIST groups, kNN on the fine labels (Table 5), and a
  linear probe on the frozen features as the paper's reference row.
- fewshot: trained on 7 base classes; 3-way K-shot episodes on the held-out classes 0, 2, 6
  (Table 6) and the generalized setting /gallery/add creates (every voting rule), test split.

The grid resumes: a run whose dir is complete and whose arguments are unchanged is not trained
again (delete OUT/<name> or pass --retrain to redo it). The report is the block between the
`reproduce:begin`/`reproduce:end` markers of DOCS/RESULTS.md (created if absent; the rest of the
file is kept), the figures are DOCS/figures/*.png, the raw numbers OUT/results.json.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from embedding.cliutil import documented_parser
from embedding.errors import SNCAError
from embedding.files import atomic_write_bytes
from embedding.rundir import RunDir

BEGIN, END = "<!-- reproduce:begin -->", "<!-- reproduce:end -->"
GROUPS = ("main", "ablation", "coarse", "fewshot")
BASE_CLASSES = "1,3,4,5,7,8,9"  # held out: T-shirt/top (0), Pullover (2), Shirt (6)
KS = (1, 5, 10, 20, 30, 50, 100, 200)
QUICK_TEST_QUERIES = 2000


@dataclass
class Job:
    name: str
    group: str
    args: list[str]
    label: str  # how the report names the run
    result: dict = field(default_factory=dict)


def grid(quick: bool, subset: int | None) -> list[Job]:
    """The runs. Full: 5 epochs on the whole training set (main, coarse, fewshot), ablations on a
    10,000-image subset for 4 epochs. Quick: the same shape on small subsets, 1-2 epochs."""
    if quick:
        big = ["--subset", str(subset or 4000), "--val-size", "0.1", "--epochs", "2"]
        small = ["--subset", str(subset or 2000), "--val-size", "0.1", "--epochs", "1"]
    else:
        big = ["--epochs", "5"] + (["--subset", str(subset), "--val-size", "0.1"] if subset else [])
        small = ["--subset", str(subset or 10000), "--val-size", "1000", "--epochs", "4"]
    jobs = [
        Job("main-nca", "main", [*big, "--loss", "nca"], "NCA"),
        Job("main-softmax", "main", [*big, "--loss", "softmax"], "softmax"),
        Job("coarse-nca", "coarse", [*big, "--loss", "nca", "--coarse"], "NCA"),
        Job("coarse-softmax", "coarse", [*big, "--loss", "softmax", "--coarse"], "softmax"),
        Job("fewshot-nca", "fewshot", [*big, "--loss", "nca", "--classes", BASE_CLASSES], "NCA"),
        Job(
            "fewshot-softmax",
            "fewshot",
            [*big, "--loss", "softmax", "--classes", BASE_CLASSES],
            "softmax",
        ),
        Job("abl-default", "ablation", small, "d=128, σ=0.05, momentum 0.5→0.9 (default)"),
    ]
    ablations = [("d", "--embedding-dim", v) for v in ("32", "64", "256")]
    ablations += [("sigma", "--temperature", v) for v in ("0.1", "0.03", "0.02")]
    if quick:
        ablations = [("sigma", "--temperature", "0.1")]
    for kind, flag, v in ablations:
        label = f"d={v}" if kind == "d" else f"σ={v}"
        jobs.append(Job(f"abl-{kind}{v}", "ablation", [*small, flag, v], label))
    if not quick:
        for name, start, label in (
            ("const", "0.5", "momentum 0.5 constant"),
            ("off", "0", "no momentum (m=0)"),
        ):
            jobs.append(
                Job(
                    f"abl-m{name}",
                    "ablation",
                    [
                        *small,
                        "--memory-momentum-schedule",
                        "constant",
                        "--memory-momentum-start",
                        start,
                    ],
                    label,
                )
            )
    return jobs


# ------------------------------------------------------------------------------------ training
def train(job: Job, out: Path, retrain: bool, log) -> dict:
    """Train job's run dir unless it is complete with the same arguments; returns the status.
    The run is `snca-train`'s own entry point called in this process (the same argument parsing,
    checks and run dir as `python -m training`), not a child process: each would import torch
    again (~3.5 s of the quick grid's ~10 s a run on 2 cores)."""
    run, stamp = out / job.name, out / f"{job.name}.args.json"
    args = [*job.args, "--seed", "0", "--no-progress"]
    done = not retrain and RunDir(run).summary.is_file() and stamp.is_file()
    if done and json.loads(stamp.read_text()) == args:
        log(f"[{job.name}] complete, kept (--retrain redoes it)")
        return {"status": "ok", "reused": True}
    from training.cli import main as snca_train

    log(f"[{job.name}] snca-train {' '.join(args)} --out {run}")
    t0 = time.perf_counter()
    said, err_out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(said), contextlib.redirect_stderr(err_out):
        try:
            code = snca_train([*args, "--out", str(run), "--overwrite"])
        except Exception as e:  # a bug in one run fails that run, as a child process would
            print(f"{type(e).__name__}: {e}", file=sys.stderr)
            code = 1
    wall = time.perf_counter() - t0
    if code != 0:
        err = (err_out.getvalue().strip().splitlines() or ["(no message)"])[-1]
        log(f"[{job.name}] failed after {wall:.0f}s: {err}")
        stamp.unlink(missing_ok=True)
        return {"status": "diverged" if "diverged" in err else "failed", "error": err}
    stamp.write_text(json.dumps(args))
    return {"status": "ok", "reused": False}


# ---------------------------------------------------------------------------------- evaluation
def evaluate(job: Job, run: Path, quick: bool) -> dict:
    from training.evaluate import closed_set

    if job.group == "ablation":  # model selection: validation split only
        return {"closed": closed_set(run, "val", (1, 30))}
    # quick: a stratified 2,000 of the 10,000 test images, and of the few-shot pools (a check of
    # the pipeline, 5x faster)
    res = {"closed": closed_set(run, "test", KS, limit=QUICK_TEST_QUERIES if quick else None)}
    if job.group == "fewshot":
        from training.fewshot import evaluate as gen_eval
        from training.fewshot import load_pools, run_episodes

        pools = load_pools(run, None, "test", "memory", limit=QUICK_TEST_QUERIES if quick else None)
        res["pools"] = {"shots": len(pools.shot_y), "base_queries": len(pools.base_y)}
        res["pools"]["novel_queries"] = len(pools.novel_y)
        draws, episodes = (3, 200) if quick else (10, 1000)
        res["generalized"] = {
            k: gen_eval(pools, k, draws, ["knn", "prototype", "kde"], 30, 500, 0) for k in (1, 5)
        }
        res["episodes"] = run_episodes(pools, [1, 5], episodes, 0, 15, 0)
    return res


# ------------------------------------------------------------------------------------- figures
def _save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def figures(jobs: dict[str, Job], out: Path, fig_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    nca, soft = jobs.get("main-nca"), jobs.get("main-softmax")
    if not (nca and soft and nca.result.get("closed") and soft.result.get("closed")):
        return made
    # training curves: validation kNN top-1 per epoch, both models (+ softmax parametric)
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for job, color in ((nca, "tab:blue"), (soft, "tab:orange")):
        rows = RunDir(out / job.name).read_metrics()
        ep = [r["epoch"] for r in rows]
        axes[0].plot(ep, [r["train_loss"] for r in rows], color=color, marker="o", label=job.label)
        for key, style in (("val_knn_top1@30", "-"), ("val_knn_top1@1", ":")):
            k = key.rsplit("@", 1)[1]
            axes[1].plot(
                ep,
                [r.get(key, np.nan) for r in rows],
                style,
                color=color,
                marker="o",
                label=f"{job.label} kNN k={k}",
            )
        if any("val_softmax_top1" in r for r in rows):
            axes[1].plot(
                ep,
                [r.get("val_softmax_top1", np.nan) for r in rows],
                "--",
                color=color,
                marker="s",
                label=f"{job.label} parametric",
            )
    axes[0].set(title="training loss", xlabel="epoch")
    axes[0].legend(fontsize=8)
    axes[1].set(title="validation top-1 (%)", xlabel="epoch")
    axes[1].legend(fontsize=8)
    _save(fig, fig_dir / "curves.png")
    made.append("curves.png")
    # accuracy vs k (test, both galleries)
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for job in (nca, soft):
        c = job.result["closed"]
        for gal, style in (("memory", "-"), ("recompute", "--")):
            ax.plot(
                KS,
                [c[gal][f"knn_top1@{k}"] for k in KS],
                style,
                marker="o",
                label=f"{job.label}, {'memory bank' if gal == 'memory' else 're-embedded'}",
            )
    if "parametric_top1" in soft.result["closed"]:
        ax.axhline(
            soft.result["closed"]["parametric_top1"], color="grey", lw=1, label="softmax parametric"
        )
    ax.set(xscale="log", xlabel="k", ylabel="test top-1 (%)", title="weighted kNN top-1 vs k")
    ax.legend(fontsize=8)
    _save(fig, fig_dir / "accuracy_vs_k.png")
    made.append("accuracy_vs_k.png")
    # per-class gain NCA - softmax (the paper's Fig. 5 style)
    names = nca.result["closed"]["class_names"]
    gain = np.array(nca.result["closed"]["per_class_top1"]) - np.array(
        soft.result["closed"]["per_class_top1"]
    )
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    ax.bar(range(len(names)), gain, color=["tab:green" if g >= 0 else "tab:red" for g in gain])
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xticks(range(len(names)), names, rotation=35, ha="right")
    ax.set(ylabel="top-1 gain (points)", title="per-class kNN top-1, NCA − softmax (test, k=30)")
    _save(fig, fig_dir / "per_class_gain.png")
    made.append("per_class_gain.png")
    made.append(neighbour_grid(out, fig_dir, (nca, soft)))
    return made


def _pixels(img) -> np.ndarray:
    """A dataset item (tensor (C,H,W)/(H,W) or PIL image) as an array imshow takes."""
    a = np.asarray(img)
    if a.ndim == 3 and a.shape[0] in (1, 3):
        a = a.transpose(1, 2, 0)
    return a.squeeze()


def neighbour_grid(out: Path, fig_dir: Path, jobs, n_queries: int = 6) -> str:
    """Test queries and their top-5 memory-bank neighbours under each model (Fig. 3 style);
    a red title marks a neighbour of another class."""
    import matplotlib.pyplot as plt

    from embedding.datasets import load_raw
    from training.evaluate import run_config
    from training.fewshot import embed_positions

    cfg = run_config(out / jobs[0].name)
    model0 = RunDir(out / jobs[0].name).load_model()
    mc = model0.config
    test = load_raw(cfg.dataset, "test", cfg.data_dir, mc.image_size, mc.in_channels)
    train = load_raw(cfg.dataset, "train", cfg.data_dir, mc.image_size, mc.in_channels)
    rng = np.random.default_rng(3)
    ty = np.asarray(test.targets)
    queries = [int(rng.choice(np.nonzero(ty == c)[0])) for c in range(n_queries)]
    fig, axes = plt.subplots(
        n_queries, 1 + 5 * len(jobs), figsize=(1.2 * (1 + 5 * len(jobs)), 1.35 * n_queries)
    )
    for col, job in enumerate(jobs):
        model = model0 if col == 0 else RunDir(out / job.name).load_model()
        bank = RunDir(out / job.name).load_memory()
        q = embed_positions(model.eval(), test, queries)  # (n, d)
        top = (q @ bank.embeddings.T).topk(5, dim=1)
        for r, qi in enumerate(queries):
            for j in range(5):
                ax = axes[r, 1 + 5 * col + j]
                pos = int(bank.indices[top.indices[r, j]])
                ax.imshow(_pixels(train.source.get(pos)), cmap="gray")
                same = int(train.targets[pos]) == int(ty[qi])
                ax.set_title(
                    f"{top.values[r, j]:.2f}", fontsize=7, color="black" if same else "red"
                )
                if r == 0 and j == 2:
                    ax.text(0.5, 1.45, job.label, transform=ax.transAxes, ha="center", fontsize=10)
    for r, qi in enumerate(queries):
        axes[r, 0].imshow(_pixels(test.source.get(qi)), cmap="gray")
        axes[r, 0].set_title(test.class_names[int(ty[qi])], fontsize=7)
    for ax in axes.ravel():
        ax.axis("off")
    _save(fig, fig_dir / "neighbours.png")
    return "neighbours.png"


# -------------------------------------------------------------------------------------- report
def _pct(x) -> str:
    return "—" if x is None else f"{x:.2f}"


def _ci(d: dict, scale: float = 100.0) -> str:
    """mean ± CI: accuracies (0..1) as percent with one decimal, HM (scale 1) with three."""
    p = 1 if scale == 100.0 else 3
    return f"{scale * d['mean']:.{p}f} ± {scale * d['ci95']:.{p}f}"


def _head(*cols: str) -> list[str]:
    """A markdown table's header row and the separator row under it."""
    return ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]


def _target(ok: bool) -> str:
    return "**met**" if ok else "**missed**"


def report(jobs: dict[str, Job], meta: dict, figs: list[str]) -> str:
    """The markdown block written between the markers of RESULTS.md."""
    L = [BEGIN, "", f"## Reproduction report (`{meta['command']}`)", ""]
    L += [
        f"Generated {meta['finished']} by `{meta['command']}` ({'quick' if meta['quick'] else 'full'} grid), "
        f"seed 0 for every run, {meta['hardware']}. Total wall time {meta['wall_minutes']:.1f} min "
        "(training and evaluation; reused runs count their original training time in the table). "
        "Runs and raw numbers: `" + meta["out"] + "/` and `" + meta["out"] + "/results.json`. "
        "Test-split numbers are read once per run, after training; ablations use the validation "
        "split carved from the training set.",
        "",
        *_head(
            "run", "arguments of `python -m training`", "status", "train wall (s)", "eval wall (s)"
        ),
    ]
    for j in jobs.values():
        st = j.result.get("train", {})
        L.append(
            f"| {j.name} | `{' '.join(j.args)}` | {st.get('status', '?')} | "
            f"{_pct(j.result.get('wall_seconds'))} | {_pct(j.result.get('eval_seconds'))} |"
        )
    nca, soft = jobs.get("main-nca"), jobs.get("main-softmax")
    if nca and soft and "closed" in nca.result and "closed" in soft.result:
        cn, cs = nca.result["closed"], soft.result["closed"]
        L += ["", "### Closed set, test split (the paper's Table 2 rows)", ""]
        L += _head("model", "top-1 k=1", "top-1 k=30", "top-5 k=30")
        L.append(
            f"| softmax, parametric (its classifier) | {_pct(cs.get('parametric_top1'))} | | |"
        )
        for c, name in ((cs, "softmax"), (cn, "NCA")):
            for gal, gname in (("memory", "memory bank"), ("recompute", "re-embedded")):
                m = c[gal]
                L.append(
                    f"| {name} 128-d embedding, kNN vs {gname} | {m['knn_top1@1']:.2f} | "
                    f"{m['knn_top1@30']:.2f} | {m['knn_top5@30']:.2f} |"
                )
            m = c["pca_features"]
            L.append(
                f"| {name} penultimate features + PCA-{c['pca_dim']}, kNN | {m['knn_top1@1']:.2f} | "
                f"{m['knn_top1@30']:.2f} | {m['knn_top5@30']:.2f} |"
            )
        L += ["", "Top-1 (%) against k (memory bank / re-embedded):", ""]
        L += _head("model", *(f"k={k}" for k in KS))
        for j in (nca, soft):
            c = j.result["closed"]
            L.append(
                f"| {j.label} | "
                + " | ".join(
                    f"{c['memory'][f'knn_top1@{k}']:.2f} / {c['recompute'][f'knn_top1@{k}']:.2f}"
                    for k in KS
                )
                + " |"
            )
        a, b, p = (
            cn["memory"]["knn_top1@30"],
            cs["memory"]["knn_top1@30"],
            cs.get("parametric_top1", 0),
        )
        L += [
            "",
            "Targets (memory-bank kNN, k=30, test):",
            f"- NCA ≥ softmax parametric: {a:.2f} vs {p:.2f} → {_target(a >= p)}",
            f"- NCA ≥ softmax-embedding kNN + 1.0: {a:.2f} vs {b:.2f} + 1.0 → {_target(a >= b + 1.0)}",
            f"- NCA ≥ 92.5 %: {a:.2f} → {_target(a >= 92.5)}",
        ]
    abl = [j for j in jobs.values() if j.group == "ablation"]
    if abl:
        L += ["", "### Ablations, validation split (the paper's Table 4)", ""]
        L += [
            *_head("run", "kNN top-1 k=1 (memory)", "k=30 (memory)", "k=30 (re-embedded)"),
        ]
        for j in abl:
            c = j.result.get("closed")
            if c is None:
                st = j.result.get("train", {})
                L.append(f"| {j.label} | N/A: {st.get('status')} ({st.get('error', '')}) | | |")
                continue
            L.append(
                f"| {j.label} | {c['memory']['knn_top1@1']:.2f} | {c['memory']['knn_top1@30']:.2f} | "
                f"{c['recompute']['knn_top1@30']:.2f} |"
            )
    cn_, cs_ = jobs.get("coarse-nca"), jobs.get("coarse-softmax")
    if cn_ and cs_ and "closed" in cn_.result and "closed" in cs_.result:
        L += ["", "### Sub-category discovery, test split (the paper's Table 5)", ""]
        L += [
            "Trained on the 4 coarse groups; kNN (k=30 unless noted) over the memory bank scored on the 10 fine labels.",
            "",
            *_head(
                "model",
                "coarse top-1",
                "fine top-1 k=1",
                "fine top-1 k=30",
                "fine, re-embedded k=30",
                "linear probe on features (fine labels)",
            ),
        ]
        for j in (cs_, cn_):
            c = j.result["closed"]
            f = c["fine"]
            L.append(
                f"| {j.label} | {c['memory']['knn_top1@30']:.2f} | {f['memory']['knn_top1@1']:.2f} | "
                f"{f['memory']['knn_top1@30']:.2f} | {f['recompute']['knn_top1@30']:.2f} | {f['linear_probe_top1']:.2f} |"
            )
        a = cn_.result["closed"]["fine"]["memory"]["knn_top1@30"]
        b = cs_.result["closed"]["fine"]["memory"]["knn_top1@30"]
        L += [
            "",
            f"Target NCA fine kNN ≥ softmax + 5: {a:.2f} vs {b:.2f} + 5 → {_target(a >= b + 5)}",
        ]
    fn, fs = jobs.get("fewshot-nca"), jobs.get("fewshot-softmax")
    if fn and fs and "episodes" in fn.result and "episodes" in fs.result:
        L += ["", "### Few-shot, test split (the paper's Table 6)", ""]
        e = fn.result["episodes"][1]
        L += [
            f"Trained on classes {BASE_CLASSES}; {e['way']}-way episodes over the held-out classes "
            f"(T-shirt/top, Pullover, Shirt: the hardest three), {e['episodes']} episodes, 15 "
            "queries per class, kNN over the support with k = K; mean ± 95% CI (%).",
            "",
            *_head("model", "1-shot", "5-shot"),
        ]
        for j in (fs, fn):
            ep = j.result["episodes"]
            L.append(f"| {j.label} | {_ci(ep[1])} | {_ci(ep[5])} |")
        L += [
            "",
            "Generalized (the whole base gallery + K shots of each held-out class, every voting "
            "rule the service offers), top-1 on novel / base test images and their harmonic mean, "
            "mean ± 95% CI over draws of the shots:",
            "",
            *_head(
                "model",
                "rule",
                "1-shot novel",
                "1-shot base",
                "1-shot HM",
                "5-shot novel",
                "5-shot base",
                "5-shot HM",
            ),
        ]
        for j in (fs, fn):
            g = j.result["generalized"]
            for r in g[1]:
                L.append(
                    f"| {j.label} | {r} | {_ci(g[1][r]['novel'])} | {_ci(g[1][r]['base'])} | "
                    f"{_ci(g[1][r]['hm'], 1)} | {_ci(g[5][r]['novel'])} | {_ci(g[5][r]['base'])} | "
                    f"{_ci(g[5][r]['hm'], 1)} |"
                )
        L += ["", "Targets (NCA above softmax, outside the CI):"]
        for k in (1, 5):
            a, b = fn.result["episodes"][k], fs.result["episodes"][k]
            ok = a["mean"] - a["ci95"] > b["mean"] + b["ci95"]
            L.append(f"- {k}-shot episodes: {_ci(a)} vs {_ci(b)} → {_target(ok)}")
            a, b = (
                fn.result["generalized"][k]["kde"]["hm"],
                fs.result["generalized"][k]["kde"]["hm"],
            )
            ok = a["mean"] - a["ci95"] > b["mean"] + b["ci95"]
            L.append(f"- {k}-shot generalized HM (kde): {_ci(a, 1)} vs {_ci(b, 1)} → {_target(ok)}")
    if figs:
        L += ["", "### Figures", ""]
        for f in figs:
            L.append(f"![{f}](figures/{f})")
    L += ["", END]
    return "\n".join(L) + "\n"


def write_report(path: Path, block: str) -> None:
    """Replace the block between the markers of `path` (append it when absent)."""
    old = path.read_text() if path.is_file() else "# Results\n\n"
    if BEGIN in old and END in old:
        new = old[: old.index(BEGIN)] + block.rstrip("\n") + old[old.index(END) + len(END) :]
    else:
        new = old.rstrip("\n") + "\n\n" + block
    atomic_write_bytes(path, new.encode())


def main(argv: list[str] | None = None) -> int:
    ap = documented_parser("python -m experiments.reproduce", __doc__)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="small subsets, 1-2 epochs, 2,000 test queries (~4 min)",
    )
    ap.add_argument("--out", type=Path, help="run dirs (default runs/reproduce[-quick])")
    ap.add_argument(
        "--docs", type=Path, help="report dir (default docs/, or OUT/docs with --quick)"
    )
    ap.add_argument("--only", help=f"comma-separated groups of {', '.join(GROUPS)} (default all)")
    ap.add_argument("--subset", type=int, help="override the training subset size of every run")
    ap.add_argument("--retrain", action="store_true", help="train every run again")
    a = ap.parse_args(argv)
    out = a.out or Path("runs/reproduce-quick" if a.quick else "runs/reproduce")
    docs = a.docs or (out / "docs" if a.quick else Path("docs"))
    groups = GROUPS if not a.only else tuple(g.strip() for g in a.only.split(","))
    bad = [g for g in groups if g not in GROUPS]
    if bad or (a.subset is not None and a.subset < 100):
        msg = (
            f"unknown groups {bad}; known: {', '.join(GROUPS)}"
            if bad
            else "--subset must be >= 100"
        )
        print(f"reproduce: error: {msg}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    from training.trainer import hardware

    def log(msg: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)

    t_start = time.perf_counter()
    jobs = {j.name: j for j in grid(a.quick, a.subset) if j.group in groups}
    failed = 0
    for j in jobs.values():
        t0 = time.perf_counter()
        j.result["train"] = train(j, out, a.retrain, log)
        if j.result["train"]["status"] != "ok":
            failed += j.result["train"]["status"] == "failed"
            continue
        t_eval = time.perf_counter()
        try:
            j.result.update(evaluate(j, out / j.name, a.quick))
        except (SNCAError, ValueError, OSError) as e:
            log(f"[{j.name}] evaluation failed: {e}")
            j.result["train"] = {"status": "failed", "error": f"evaluation: {e}"}
            failed += 1
            continue
        summary = RunDir(out / j.name).read_summary()
        j.result["wall_seconds"] = summary.get("wall_seconds")
        j.result["eval_seconds"] = round(time.perf_counter() - t_eval, 1)
        log(f"[{j.name}] done in {time.perf_counter() - t0:.0f}s")
    (docs / "figures").mkdir(parents=True, exist_ok=True)
    figs = figures(jobs, out, docs / "figures") if "main" in groups else []
    hw = hardware()
    meta = {
        "command": "make reproduce" + (" QUICK=1" if a.quick else ""),
        "quick": a.quick,
        "out": str(out),
        "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "hardware": f"{hw.get('cpu_count')} × {hw.get('cpu')} CPU, torch {hw.get('torch')}",
        "wall_minutes": (time.perf_counter() - t_start) / 60,
    }
    raw = {"meta": meta, "jobs": {n: {"args": j.args, **j.result} for n, j in jobs.items()}}
    atomic_write_bytes(out / "results.json", json.dumps(raw, indent=2).encode())
    docs.mkdir(parents=True, exist_ok=True)
    write_report(docs / "RESULTS.md", report(jobs, meta, figs))
    log(
        f"report: {docs / 'RESULTS.md'}, figures: {docs / 'figures'} ({meta['wall_minutes']:.1f} min)"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
