"""Does an NCA embedding transfer? The paper's claim (Tables 5-6) on this data (issue 30).

    python benchmarks/transfer.py --out runs/transfer                # everything below
    python benchmarks/transfer.py --out runs/transfer --base-nca runs/base7   # reuse a base run

1. Base runs: conv4 on the 7 base Fashion-MNIST classes (the held-out three are Pullover, Shirt,
   Ankle boot), once with NCA and once with the softmax baseline, same options (`--base-epochs`).
2. The user's photos: an ImageFolder of the 3 held-out classes written as PNG files, with
   `--per-class` training images per class (drawn from Fashion-MNIST's train split, seeded), a
   validation folder (other train-split images, for choices) and the test folder (all 3,000
   test images of the three, read once for the final table).
3. `sweep`: fine-tuning settings (--backbone-lr, --bn-frozen, --freeze-stages, --warmup-epochs,
   --lr) one at a time from the NCA init, kNN top-1 on the validation folder.
4. `table`: scratch vs --init NCA vs --init softmax at each size (and each init without any
   fine-tuning), the same steps for every row, kNN top-1 on the test folder, over `--seeds`.

Every trained row is a real `snca-train --dataset imagefolder` run (the command is printed);
kNN top-1 is the weighted vote of embedding/knn.py (k = 1 and k = 30, σ of the model card) with
the folder's training images as the reference set, every image through the eval transform.
Results go to OUT/results.json and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from embedding.artifacts import load_model
from embedding.datasets import load_image_folder, load_raw
from embedding.inference import embed_images
from embedding.knn import knn_evaluate
from embedding.transforms import eval_transform

BASE = "0,1,3,4,5,7,8"  # T-shirt/top, Trouser, Dress, Coat, Sandal, Sneaker, Bag
HELD_OUT = (2, 6, 9)  # Pullover, Shirt, Ankle boot
# One factor at a time from the plain setting (every flag at its old default).
SWEEP = {
    "plain": [],
    "backbone-lr 0.1": ["--backbone-lr", "0.1"],
    "bn-frozen": ["--bn-frozen"],
    "freeze-stages 2": ["--freeze-stages", "2"],
    "warmup 2 epochs": ["--warmup-epochs", "2"],
    "lr 0.01": ["--lr", "0.01"],
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def train(out: Path, args: list[str]) -> Path:
    """One snca-train run into `out` (skipped when a finished run is there)."""
    if (out / "model.json").is_file():
        return out
    cmd = [sys.executable, "-m", "training", *args, "--out", str(out), "--no-progress"]
    log(" ".join(["snca-train", *cmd[3:]]))
    t0 = time.time()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    log(f"  {out.name}: {time.time() - t0:.0f} s")
    return out


def write_folder(root: Path, raw, positions: np.ndarray) -> None:
    """PNG files root/<class>/<i>.png of the Fashion-MNIST items `positions`."""
    from PIL import Image

    for p in positions:
        c = raw.class_names[int(raw.targets[p])].replace("/", "-")
        (root / c).mkdir(parents=True, exist_ok=True)
        Image.fromarray(raw.source.get(int(p))[0].numpy(), mode="L").save(root / c / f"{p}.png")


def make_folders(out: Path, per_class: list[int], seeds: list[int], val_per_class: int) -> dict:
    """data/n{N}-s{seed}/train/<class>/*.png, data/val/, data/test/: the paths by name."""
    tr, te = load_raw("fashion-mnist", "train"), load_raw("fashion-mnist", "test")
    rng = np.random.default_rng(1234)
    val_pos, pool = [], {}
    for c in HELD_OUT:
        idx = rng.permutation(np.nonzero(tr.targets == c)[0])
        val_pos += list(idx[:val_per_class])  # validation: never a training image
        pool[c] = idx[val_per_class:]
    paths = {"val": out / "data" / "val", "test": out / "data" / "test"}
    if not paths["val"].is_dir():
        write_folder(paths["val"], tr, np.asarray(val_pos))
    if not paths["test"].is_dir():
        write_folder(paths["test"], te, np.nonzero(np.isin(te.targets, HELD_OUT))[0])
    for n in per_class:
        for s in seeds:
            root = out / "data" / f"n{n}-s{s}"
            paths[f"n{n}-s{s}"] = root
            if not (root / "train").is_dir():
                r = np.random.default_rng(s)
                pos = np.concatenate([r.permutation(pool[c])[:n] for c in HELD_OUT])
                write_folder(root / "train", tr, pos)
    return paths


def embed(model, folder: Path) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = model.config
    raw = load_image_folder(folder, "train", cfg.image_size, cfg.in_channels)
    v = embed_images(
        model, raw.source, np.arange(len(raw.targets)), eval_transform(cfg), torch.device("cpu")
    )
    return v, torch.from_numpy(raw.targets)


def knn_top1(run: Path, reference: Path, queries: Path) -> dict:
    """kNN top-1 (k 1, 30) of `queries` against `reference` in `run`'s embedding."""
    model = load_model(run)
    g, gl = embed(model, reference)
    q, ql = embed(model, queries)
    r = knn_evaluate(q, ql, g, gl, len(HELD_OUT), model.config.temperature, ks=(1, 30))
    return {"top1@1": round(r["knn_top1@1"], 2), "top1@30": round(r["knn_top1@30"], 2)}


def finetune_args(folder: Path, n: int, args) -> list[str]:
    """The same budget for every row of one size: `--steps` optimizer steps of batch 32."""
    per_epoch = max(3 * n // 32, 1)
    epochs = max(round(args.steps / per_epoch), 1)
    return [
        "--dataset", "imagefolder", "--data-dir", str(folder), "--image-size", "28",
        "--in-channels", "1", "--arch", "conv4", "--batch-size", "32", "--val-size", "0",
        "--epochs", str(epochs), "--seed", "0", "--num-workers", "0",
    ]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/transfer"))
    ap.add_argument("--base-nca", type=Path, help="an existing NCA base run (else trained)")
    ap.add_argument("--base-softmax", type=Path, help="an existing softmax base run")
    ap.add_argument("--base-epochs", type=int, default=5)
    ap.add_argument("--per-class", default="50,500", help="training images per class")
    ap.add_argument("--seeds", default="0,1,2", help="draws of the training images (table)")
    ap.add_argument("--val-per-class", type=int, default=500)
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps per fine-tuning run")
    ap.add_argument("--only", choices=("sweep", "table"), help="one part (default both)")
    ap.add_argument(
        "--finetune", default="", help="flags for the table's --init rows (from the sweep)"
    )
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    sizes = [int(x) for x in args.per_class.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    base = ["--dataset", "fashion-mnist", "--classes", BASE, "--arch", "conv4"]
    base += ["--epochs", str(args.base_epochs), "--seed", "0"]
    nca = args.base_nca or train(args.out / "base7-nca", [*base, "--loss", "nca"])
    soft = args.base_softmax or train(args.out / "base7-softmax", [*base, "--loss", "softmax"])
    paths = make_folders(args.out, sizes, seeds, args.val_per_class)
    results_file = args.out / "results.json"
    results = json.loads(results_file.read_text()) if results_file.is_file() else {}
    results["steps"], results["base"] = args.steps, {"nca": str(nca), "softmax": str(soft)}

    if args.only in (None, "sweep"):
        sweep = results.setdefault("sweep", {})
        for n in sizes:
            folder = paths[f"n{n}-s0"]
            for name, flags in SWEEP.items():
                run = args.out / "sweep" / f"n{n}-{name.replace(' ', '_')}"
                train(run, [*finetune_args(folder, n, args), "--init", str(nca), *flags])
                sweep.setdefault(str(n), {})[name] = knn_top1(run, folder / "train", paths["val"])
                log(f"  val {n}/class {name}: {sweep[str(n)][name]}")
        results_file.write_text(json.dumps(results, indent=1))

    if args.only in (None, "table"):
        table = results.setdefault("table", {})
        extra = args.finetune.split()
        results["finetune"] = args.finetune
        for n in sizes:
            for s in seeds:
                folder, cell = paths[f"n{n}-s{s}"], f"{n}/s{s}"
                rows = {
                    "NCA features, no fine-tuning": nca,
                    "softmax features, no fine-tuning": soft,
                }
                ft = finetune_args(folder, n, args)
                rows["scratch"] = train(args.out / "table" / f"n{n}-s{s}-scratch", ft)
                for name, src in (("--init NCA", nca), ("--init softmax", soft)):
                    tag = name.split()[-1].lower()
                    run = args.out / "table" / f"n{n}-s{s}-{tag}"
                    rows[name] = train(run, [*ft, "--init", str(src), *extra])
                for name, run in rows.items():
                    table.setdefault(name, {})[cell] = knn_top1(
                        run, folder / "train", paths["test"]
                    )
                    log(f"  test {cell} {name}: {table[name][cell]}")
                results_file.write_text(json.dumps(results, indent=1))
    results_file.write_text(json.dumps(results, indent=1))
    print_tables(results, sizes, seeds)


def print_tables(results: dict, sizes: list[int], seeds: list[int]) -> None:
    if "sweep" in results:
        print("\nvalidation kNN top-1 (k=1 / k=30), --init NCA base, one factor at a time")
        print("| setting | " + " | ".join(f"{n}/class" for n in sizes) + " |")
        print("|---|" + "---|" * len(sizes))
        for name in SWEEP:
            cells = [results["sweep"].get(str(n), {}).get(name) for n in sizes]
            print(
                f"| {name} | "
                + " | ".join(f"{c['top1@1']:.1f} / {c['top1@30']:.1f}" if c else "-" for c in cells)
                + " |"
            )
    if "table" in results:
        print(f"\ntest kNN top-1 (k=1 / k=30), mean ± sd over seeds {seeds}")
        print("| start | " + " | ".join(f"{n}/class" for n in sizes) + " |")
        print("|---|" + "---|" * len(sizes))
        for name, cells in results["table"].items():
            out = []
            for n in sizes:
                got = [cells[f"{n}/s{s}"] for s in seeds if f"{n}/s{s}" in cells]
                if not got:
                    out.append("-")
                    continue
                a = np.array([[g["top1@1"], g["top1@30"]] for g in got])
                out.append(
                    f"{a[:, 0].mean():.1f} ± {a[:, 0].std():.1f} / "
                    f"{a[:, 1].mean():.1f} ± {a[:, 1].std():.1f}"
                )
            print(f"| {name} | " + " | ".join(out) + " |")


if __name__ == "__main__":
    main()
