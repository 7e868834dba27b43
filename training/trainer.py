"""The training loop: NCA over the memory bank, or the softmax baseline trained the same way.

Both objectives share data, augmentation, backbone, 128-d embedding layer, optimiser and budget;
both keep a memory bank (eq. 11), which the softmax run uses only for kNN evaluation.
"""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from embedding.artifacts import read_safetensors, save_memory_bank, save_model, write_safetensors
from embedding.config import ModelConfig
from embedding.errors import SNCAError
from embedding.files import atomic_write_bytes, atomic_write_json
from embedding.inference import autocast_context
from embedding.knn import knn_evaluate
from embedding.model import EmbeddingNet
from embedding.progress import Progress
from embedding.rundir import DatasetProvenance, RunDir
from embedding.transforms import eval_transform, train_transform

from . import finetune, rundir
from .config import TrainConfig
from .datasets import Data, IndexedDataset, build_data, embed_split
from .distributed import DistEnv, GlobalBatchSampler
from .memory import MemoryBank, MomentumSchedule
from .outlier_exposure import OutlierExposure
from .world_fit import fit_run_world

SYNC_EVERY = 25  # steps between host reads of the loss (progress bar, divergence check)


# ---------------------------------------------------------------------------- model
class TrainModule(nn.Module):
    """EmbeddingNet (+ a linear classifier on the 128-d projection for the softmax baseline).

    forward -> (unit-norm embeddings (B, d) float32, class logits (B, C) or None)."""

    def __init__(self, model_cfg: ModelConfig, softmax: bool):
        super().__init__()
        self.net = EmbeddingNet(model_cfg)
        self.head = nn.Linear(model_cfg.embedding_dim, model_cfg.num_classes) if softmax else None

    def forward(self, x: torch.Tensor, norms: bool = False):
        """(embeddings, logits); with `norms` also (B,) the squared norms of the projection
        before normalisation, over d (outlier exposure's norm term)."""
        z = self.net.project(x)  # (B, d) unnormalised
        emb = F.normalize(z.float(), dim=1)  # v = normalize(W·backbone(x))
        logits = self.head(z) if self.head is not None else None
        if norms:
            return emb, logits, z.float().pow(2).mean(dim=1)
        return emb, logits


def lr_at(cfg: TrainConfig, step: int, steps_per_epoch: int) -> float:
    """Learning rate for a global step: linear warm-up, then step (x gamma at each fraction of
    the run in lr_steps) or cosine decay."""
    total = cfg.epochs * steps_per_epoch
    warm = int(cfg.warmup_epochs * steps_per_epoch)
    if step < warm:
        return cfg.lr * (step + 1) / warm
    if cfg.lr_schedule == "cosine":
        t = (step - warm) / max(total - warm, 1)
        return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * min(t, 1.0)))
    passed = sum(step >= round(f * total) for f in cfg.lr_steps)
    return cfg.lr * cfg.lr_gamma**passed


# ---------------------------------------------------------------------------- one step
@dataclass
class StepResult:
    """Per-step statistics as 0-dim device tensors: reading them forces a host sync, so the
    loop accumulates them on the device and looks only every few steps."""

    loss: torch.Tensor
    skipped: torch.Tensor
    correct: torch.Tensor


def train_step(
    module: nn.Module,
    bank: MemoryBank,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    slots: torch.Tensor,
    *,
    loss_kind: str,
    temperature: float,
    memory_momentum: float,
    dist: DistEnv,
    scaler: torch.amp.GradScaler | None = None,
    amp: bool = False,
    outliers: OutlierExposure | None = None,
) -> StepResult:
    """Forward, loss, backward, SGD step, then eq. 11 on the memory with the global batch.

    `module` is a TrainModule, possibly wrapped in DDP; x (B, C, H, W), y (B,), slots (B,)
    on the bank's device. `outliers`: synthetic outliers made from the batch go through the
    network with it (one forward: BatchNorm sees them as the model will at test time), add
    their loss, and never enter the memory bank.
    """
    b = x.shape[0]
    if outliers is not None and outliers.weight > 0:
        xo = outliers.make(x)
        with autocast_context(x.device, amp):
            emb_all, logits_all, norm_sq = module(torch.cat([x, xo]), norms=True)
        emb, logits = emb_all[:b], None if logits_all is None else logits_all[:b]
        extra = outliers.weight * outliers.loss(
            emb_all[b:], norm_sq[b:], bank.embeddings, bank.labels, bank.num_classes, temperature
        )
    else:
        with autocast_context(x.device, amp):
            emb, logits = module(x)
        extra = None
    zero = torch.zeros((), dtype=torch.long, device=x.device)
    if loss_kind == "nca":
        out = bank.loss(emb, slots, y, temperature)  # eqs. 2-4, float32
        loss, skipped, correct = out.loss, out.skipped, zero
    else:
        loss = F.cross_entropy(logits.float(), y)
        skipped, correct = zero, (logits.detach().argmax(1) == y).sum()
    if extra is not None:
        loss = loss + extra
    optimizer.zero_grad(set_to_none=True)
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        optimizer.step()
    # Every rank applies the same update with the same (all-gathered) global batch.
    bank.update(dist.all_gather(slots), dist.all_gather(emb.detach()), memory_momentum)
    return StepResult(loss.detach().float(), skipped, correct)


# ---------------------------------------------------------------------------- evaluation
@torch.no_grad()
def evaluate(
    net: EmbeddingNet,
    head: nn.Module | None,
    bank: MemoryBank,
    data: Data,
    cfg: TrainConfig,
    device: torch.device,
    recompute: bool = False,
) -> dict[str, float]:
    """Validation kNN (weighted vote, σ) against the memory bank (the paper's protocol) and,
    with `recompute`, against the training images re-embedded with the eval transform."""
    if data.val is None:
        return {}
    mc, w = data.model_cfg, cfg.num_workers
    z = embed_split(net.project, data.val, mc, device, 512, w, cfg.amp)  # (n, d) unnormalised
    val_emb = F.normalize(z, dim=1)
    val_y = torch.from_numpy(data.val.labels).to(device)
    c, t, ks = mc.num_classes, mc.temperature, tuple(cfg.knn_k)
    knn = knn_evaluate(val_emb, val_y, bank.embeddings, bank.labels, c, t, ks)
    res = {f"val_{k}": v for k, v in knn.items()}
    if head is not None:  # the softmax baseline's classifier reads the projection
        logits = head(z).float()
        res["val_softmax_top1"] = 100.0 * (logits.argmax(1) == val_y).float().mean().item()
    if recompute:
        gallery = embed_split(net, data.train, mc, device, 512, w, cfg.amp)
        rec = knn_evaluate(val_emb, val_y, gallery, bank.labels, c, t, ks)
        res.update({f"val_recompute_{k}": v for k, v in rec.items()})
    return res


# ---------------------------------------------------------------------------- checkpoints
def _optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    sd = opt.state_dict()
    tensors = {}
    for pid, st in sd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"optim.{pid}.{k}"] = v
    return tensors, {"param_groups": sd["param_groups"]}


def save_checkpoint(
    stage: Path, module: TrainModule, bank: MemoryBank, opt, scaler, state: dict
) -> None:
    tensors = {f"module.{k}": v for k, v in module.state_dict().items()}
    tensors.update({f"bank.{k}": v for k, v in bank.state_dict().items()})
    opt_t, opt_meta = _optimizer_tensors(opt)
    tensors.update(opt_t)
    tensors["rng.cpu"] = torch.get_rng_state()
    if torch.cuda.is_available() and any(p.is_cuda for p in module.parameters()):
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    state = dict(state, optimizer=opt_meta, scaler=scaler.state_dict() if scaler else None)
    write_safetensors(RunDir(stage).checkpoint, tensors, {"state": json.dumps(state)})


def load_checkpoint(stage: Path, module: TrainModule, bank: MemoryBank, opt, scaler) -> dict:
    tensors, meta = read_safetensors(RunDir(stage).checkpoint)
    try:
        state = json.loads(meta["state"])
    except (KeyError, json.JSONDecodeError):
        raise SNCAError(
            f"{RunDir(stage).checkpoint} has no training state; cannot resume"
        ) from None
    dev = next(module.parameters()).device
    try:
        module.load_state_dict({k[7:]: v for k, v in tensors.items() if k.startswith("module.")})
        bank.load_state_dict({k[5:]: v for k, v in tensors.items() if k.startswith("bank.")})
    except RuntimeError as e:
        raise SNCAError(f"checkpoint in {stage} does not fit this configuration: {e}") from None
    opt_state: dict[int, dict] = {}
    for k, v in tensors.items():
        if k.startswith("optim."):
            _, pid, name = k.split(".", 2)
            opt_state.setdefault(int(pid), {})[name] = v.to(dev)
    opt.load_state_dict({"state": opt_state, "param_groups": state["optimizer"]["param_groups"]})
    if scaler is not None and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    torch.set_rng_state(tensors["rng.cpu"])
    if "rng.cuda" in tensors and dev.type == "cuda":
        torch.cuda.set_rng_state(tensors["rng.cuda"])
    return state


# ---------------------------------------------------------------------------- curves
# curves.png is drawn at the end of a run (export) and, during a run, after an epoch when this
# long has passed since the last drawing: a drawing costs ~0.5 s of CPU, which was a seventh of
# a conv4 epoch on a GPU (3-4 s) and a fifth of a test's 2-epoch run
CURVES_EVERY_S = 30.0


def write_curves(path: Path, metrics: list[dict], title: str) -> None:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ep = [m["epoch"] for m in metrics]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    axes[0].plot(ep, [m["train_loss"] for m in metrics], marker="o")
    axes[0].set(title="training loss", xlabel="epoch")
    for key in sorted({k for m in metrics for k in m if k.startswith("val_") and "top1" in k}):
        axes[1].plot(ep, [m.get(key, float("nan")) for m in metrics], marker="o", label=key[4:])
    axes[1].set(title="validation top-1 (%)", xlabel="epoch")
    if axes[1].get_lines():
        axes[1].legend(fontsize=8)
    else:  # --val-size 0: nothing to plot
        axes[1].text(0.5, 0.5, "no validation split", ha="center", va="center")
    axes[2].plot(ep, [m["lr"] for m in metrics], marker="o", label="lr")
    axes[2].plot(ep, [m["memory_momentum"] for m in metrics], marker="o", label="memory momentum")
    axes[2].set(title="schedules", xlabel="epoch")
    axes[2].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def hardware() -> dict[str, str]:
    info = {
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": str(torch.get_num_threads()),
        "torch": torch.__version__,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


# ---------------------------------------------------------------------------- the run
@dataclass
class RunResult:
    out: Path
    metrics: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)


def train(
    cfg: TrainConfig, dist: DistEnv, device: torch.device, resume: bool, overwrite: bool, log=None
) -> RunResult:
    """Train per `cfg` into the run dir `cfg.out` (see rundir.py); returns metrics and summary."""
    if log is None:

        def log(msg: str) -> None:
            print(msg, flush=True)

    cfg.validate()
    # Run dir: rank 0 decides, everyone follows.
    stage, resuming, created = None, False, False
    if dist.is_main:
        stage, resuming, created = rundir.prepare(Path(cfg.out), resume, overwrite)
    stage, resuming = dist.broadcast_object((stage, resuming))
    trainer = None
    try:
        trainer = Trainer(cfg, dist, device, stage, resuming, log)
        return trainer.run()
    except BaseException:
        # A staging dir this call made, without a checkpoint of this call, has nothing to
        # resume: remove it rather than leave a stray OUT.partial behind.
        if created and not (trainer is not None and trainer.checkpointed):
            rundir.discard(stage)
        raise


def balanced_weights(labels, balance: float):
    """(n,) draw weights n_c^-balance of each image of a class of n_c images (None: 0, every
    image once an epoch)."""
    if not balance:
        return None
    y = torch.as_tensor(np.asarray(labels), dtype=torch.long)
    counts = torch.bincount(y).double()
    return counts[y].pow(-float(balance))


class Trainer:
    """One training run in the staging dir, in steps: set-up (here), `train_epoch`,
    `end_epoch` (evaluation, checkpoint, metrics), `export` (model, memory bank, summary)."""

    def __init__(
        self,
        cfg: TrainConfig,
        dist: DistEnv,
        device: torch.device,
        stage: Path,
        resuming: bool,
        log,
    ):
        self.cfg, self.dist, self.device, self.log = cfg, dist, device, log
        self.run_dir = RunDir(stage)
        self.checkpointed = False  # a checkpoint of this run exists: the stage is worth keeping
        self.curves_at = time.monotonic()  # when curves.png was last drawn (CURVES_EVERY_S)
        torch.manual_seed(cfg.seed)
        np.random.seed(cfg.seed)
        if device.type == "cuda":
            torch.backends.cudnn.benchmark = True

        loaded = None
        if cfg.init:  # read first: the source's architecture and preprocessing are the run's
            from .init import resolve

            loaded = resolve(cfg.init)
            self.cfg = cfg = loaded.train_config(cfg)
        self.data = data = build_data(cfg, dist)
        if loaded is not None:
            data.model_cfg = loaded.model_config(data.model_cfg)
        n = len(data.train)
        if (
            cfg.batch_size == TrainConfig.batch_size
            and 1 < n < cfg.batch_size
            and dist.world_size == 1
        ):
            # the default batch on a few labelled photos (a gallery of 5 a label): one batch of
            # them all, rather than an error; an explicit --batch-size is kept (and checked)
            print(f"--batch-size {n}: the default {cfg.batch_size} exceeds the {n} training images")
            self.cfg = cfg = dataclasses.replace(cfg, batch_size=n)
        try:
            self.sampler = GlobalBatchSampler(
                len(data.train),
                cfg.batch_size,
                dist.rank,
                dist.world_size,
                cfg.seed,
                weights=balanced_weights(data.train.labels, cfg.balance),
            )
        except ValueError as e:
            val = 0 if data.val is None else len(data.val)
            raise SNCAError(
                f"{e}; lower --batch-size (or --val-size: validation took {val} of the "
                f"{len(data.train) + val} images)"
            ) from None
        tf = train_transform(data.model_cfg) if cfg.augment else eval_transform(data.model_cfg)
        self.loader = DataLoader(
            IndexedDataset(data.train, tf),
            batch_sampler=self.sampler,
            num_workers=cfg.num_workers,
            pin_memory=device.type == "cuda",
            persistent_workers=cfg.num_workers > 0,
        )
        module = TrainModule(data.model_cfg, softmax=cfg.loss == "softmax")
        self.init = None  # the model card's record of --init
        if loaded is not None:
            from .init import apply

            self.init = apply(module.net, loaded)
            self.log(f"initialised from {cfg.init}: {self.init['embedding_layer']} embedding layer")
        self.module = module = module.to(device)
        if cfg.sync_bn and dist.enabled and device.type == "cuda":
            self.module = module = nn.SyncBatchNorm.convert_sync_batchnorm(module)
        self.bank = MemoryBank(
            torch.from_numpy(data.train.labels),
            cfg.embedding_dim,
            indices=torch.from_numpy(data.train.positions),
            num_classes=data.model_cfg.num_classes,
            generator=torch.Generator().manual_seed(cfg.seed),
        ).to(device)
        self.weight_decay = cfg.resolved_weight_decay(data.model_cfg.image_size)
        net = module.net
        if cfg.freeze_stages:
            n = finetune.freeze(net, cfg.freeze_stages)
            self.log(f"froze {cfg.freeze_stages} backbone stage(s): {n} parameters")
        self.opt = torch.optim.SGD(
            finetune.param_groups(module, net.backbone, cfg.backbone_lr),
            lr=cfg.lr,
            momentum=cfg.momentum,
            nesterov=True,
            weight_decay=self.weight_decay,
        )
        self.amp = cfg.amp and device.type == "cuda"
        use_scaler = self.amp and not torch.cuda.is_bf16_supported()
        self.scaler = torch.amp.GradScaler("cuda") if use_scaler else None
        self.outliers = None
        if cfg.outlier_exposure > 0 and cfg.loss == "nca":
            self.outliers = OutlierExposure.create(
                cfg.outlier_exposure,
                cfg.outlier_ratio,
                cfg.outlier_family_list(),
                data.model_cfg,
                cfg.seed + dist.rank,
            )
        self.momentum = MomentumSchedule(
            cfg.memory_momentum_start, cfg.memory_momentum_end, cfg.memory_momentum_schedule
        )
        self.metrics: list[dict] = []
        self.start_epoch, self.wall_before = 0, 0.0
        if resuming:
            state = load_checkpoint(stage, module, self.bank, self.opt, self.scaler)
            self.start_epoch = state["epoch"]
            self.metrics = state["metrics"]
            self.wall_before = state.get("wall_seconds", 0.0)
            if self.start_epoch >= cfg.epochs:
                raise SNCAError(
                    f"the run in {stage} already has {self.start_epoch} epochs; pass --epochs > "
                    f"{self.start_epoch} to extend it"
                )
        self.ddp = module
        if dist.enabled:
            self.ddp = nn.parallel.DistributedDataParallel(
                module, device_ids=[device.index] if device.type == "cuda" else None
            )
        if dist.is_main:
            self._write_config()

    def _write_config(self) -> None:
        cfg, data, dist = self.cfg, self.data, self.dist
        n_val = len(data.val) if data.val else 0
        resolved = dict(
            cfg.to_dict(),
            resolved_weight_decay=self.weight_decay,
            world_size=dist.world_size,
            train_images=len(data.train),
            val_images=n_val,
            class_names=data.model_cfg.class_names,
            device=str(self.device),
        )
        atomic_write_json(self.run_dir.config, resolved)
        self.run_dir.write_provenance(DatasetProvenance.of(data.train.raw))
        self.log(
            f"training {cfg.loss} / {cfg.arch} on {cfg.dataset}: {len(data.train)} train, "
            f"{n_val} val images, {data.model_cfg.num_classes} classes, {len(self.sampler)} "
            f"steps/epoch x {cfg.epochs} epochs on {self.device}"
            + (f" x {dist.world_size} processes" if dist.enabled else "")
        )

    def run(self) -> RunResult:
        t_run = time.perf_counter()
        self.epoch_seconds: list[float] = []  # this process's whole epochs (train + evaluation)
        for epoch in range(self.start_epoch, self.cfg.epochs):
            t0 = time.perf_counter()
            rec = self.train_epoch(epoch)
            if self.dist.is_main:
                self.end_epoch(epoch, rec, t0, self.wall_before + time.perf_counter() - t_run)
            self.dist.barrier()
            self.epoch_seconds.append(time.perf_counter() - t0)
        result = RunResult(out=Path(self.cfg.out), metrics=self.metrics)
        if self.dist.is_main:
            result.summary = self.export(self.wall_before + time.perf_counter() - t_run)
        self.dist.barrier()
        return result

    def train_epoch(self, epoch: int) -> dict:
        """One pass over the training set; the epoch's record (loss, lr, momentum, speed)."""
        cfg, dist, device = self.cfg, self.dist, self.device
        steps = len(self.sampler)
        t0 = time.perf_counter()
        self.module.train()
        finetune.hold_bn(self.module.net, self.cfg.bn_frozen, self.cfg.freeze_stages)
        self.sampler.set_epoch(epoch)
        m = self.momentum(epoch, cfg.epochs)
        # (loss sum, skipped, correct) accumulated on the device; images seen on the host
        acc = torch.zeros(3, dtype=torch.float64, device=device)
        seen = 0
        desc = f"epoch {epoch + 1}/{cfg.epochs}"
        # "~N left" is the run's: the epochs after this one at the pace of the whole epochs done
        # (evaluation included), or, in the first, at this epoch's pace
        after = cfg.epochs - epoch - 1
        done = getattr(self, "epoch_seconds", [])
        later = dict(later_seconds=after * sum(done) / len(done)) if done else {}
        with Progress(
            steps,
            desc,
            "steps",
            enabled=cfg.progress and dist.is_main,
            later_units=0 if done else after * steps,
            **later,
        ) as bar:
            for i, (x, y, slots) in enumerate(self.loader):
                lr = lr_at(cfg, epoch * steps + i, steps)
                for g in self.opt.param_groups:
                    g["lr"] = lr * g.get("lr_factor", 1.0)
                x = x.to(device, non_blocking=True)
                r = train_step(
                    self.ddp,
                    self.bank,
                    self.opt,
                    x,
                    y.to(device, non_blocking=True),
                    slots.to(device, non_blocking=True),
                    loss_kind=cfg.loss,
                    temperature=cfg.temperature,
                    memory_momentum=m,
                    dist=dist,
                    scaler=self.scaler,
                    amp=self.amp,
                    outliers=self.outliers,
                )
                acc += torch.stack([r.loss * x.shape[0], r.skipped, r.correct]).double()
                seen += x.shape[0]
                if i % SYNC_EVERY == 0 or i == steps - 1:
                    loss_now = float(r.loss)  # host sync, every SYNC_EVERY steps only
                    if not math.isfinite(loss_now):
                        raise SNCAError(
                            f"training diverged at epoch {epoch + 1}, step {i + 1}: loss is "
                            f"{loss_now} (σ = {cfg.temperature}, lr = {lr:g}); try a larger "
                            "--temperature or a lower --lr"
                        )
                    bar.note(f"loss {loss_now:.4f}, lr {lr:.3g}")
                bar.update()
        # Statistics of the whole global batch, the same on every rank.
        seen_t = torch.full((1,), float(seen), dtype=torch.float64, device=device)
        tot_loss, tot_skip, tot_correct, seen = dist.all_reduce_sum(
            torch.cat([acc, seen_t])
        ).tolist()
        if not math.isfinite(tot_loss):
            raise SNCAError(f"training diverged in epoch {epoch + 1}: the mean loss is {tot_loss}")
        train_time = time.perf_counter() - t0
        rec = {
            "epoch": epoch + 1,
            "lr": lr_at(cfg, (epoch + 1) * steps - 1, steps),
            "memory_momentum": m,
            "train_loss": tot_loss / max(seen, 1),
            "train_images_per_s": seen / train_time,
            "train_seconds": train_time,
        }
        if cfg.loss == "nca":
            rec["nca_skipped"] = int(tot_skip)
        else:
            rec["train_softmax_top1"] = 100.0 * tot_correct / max(seen, 1)
        return rec

    def end_epoch(self, epoch: int, rec: dict, t0: float, wall: float) -> None:
        """Rank 0 after each epoch: validation (every --eval-every and after the last), the
        checkpoint, metrics.jsonl, curves.png (every CURVES_EVERY_S; after the last: export),
        one log line."""
        cfg = self.cfg
        if (epoch + 1) % cfg.eval_every == 0 or epoch + 1 == cfg.epochs:
            m = self.module
            rec.update(evaluate(m.net, m.head, self.bank, self.data, cfg, self.device))
        rec["epoch_seconds"] = time.perf_counter() - t0
        self.metrics.append(rec)
        save_checkpoint(
            self.run_dir.path,
            self.module,
            self.bank,
            self.opt,
            self.scaler,
            {"epoch": epoch + 1, "metrics": self.metrics, "wall_seconds": wall},
        )
        self.checkpointed = True
        lines = "".join(json.dumps(x) + "\n" for x in self.metrics)
        atomic_write_bytes(self.run_dir.metrics, lines.encode())
        if epoch + 1 < cfg.epochs and time.monotonic() - self.curves_at >= CURVES_EVERY_S:
            self.draw_curves()  # (after the last epoch: export's)
        knn = ", ".join(
            f"kNN k={k} {rec[f'val_knn_top1@{k}']:.2f}%"
            for k in cfg.knn_k
            if f"val_knn_top1@{k}" in rec
        )
        extra = f", softmax {rec['val_softmax_top1']:.2f}%" if "val_softmax_top1" in rec else ""
        val = f", val {knn}{extra}" if knn or extra else " (no validation split)"
        self.log(
            f"epoch {epoch + 1}/{cfg.epochs}: loss {rec['train_loss']:.4f}{val} "
            f"({rec['epoch_seconds']:.0f}s)"
        )

    def _export_world(self, net, out: Path, fp: str) -> None:
        """The world check's Gaussian (training/world_fit.py) beside the model."""
        from embedding import world

        w = fit_run_world(net, self.data, self.cfg.seed, self.device, self.log)
        world.save(w, out, fp)

    def draw_curves(self) -> None:
        cfg = self.cfg
        write_curves(self.run_dir.curves, self.metrics, f"{cfg.loss} / {cfg.arch} / {cfg.dataset}")
        self.curves_at = time.monotonic()

    def export(self, wall: float) -> dict:
        """Rank 0 at the end: the curves of every epoch, final validation under both protocols,
        the model, the memory bank, the classifier (softmax), summary.json; then the run dir is
        published."""
        cfg, data, m, run = self.cfg, self.data, self.module, self.run_dir
        if self.metrics:  # (drawn here, not after the last epoch: a run resumed after its last
            self.draw_curves()  # checkpoint, killed before that drawing, draws them too)
        self.log("final validation (memory bank and re-embedded training images)...")
        final = evaluate(m.net, m.head, self.bank, data, cfg, self.device, recompute=True)
        recipe = {"loss": cfg.loss, "epochs": cfg.epochs, "outlier_exposure": None}
        recipe["init"] = self.init
        if self.outliers is not None:
            recipe["outlier_exposure"] = {
                "weight": cfg.outlier_exposure,
                "ratio": cfg.outlier_ratio,
                "families": list(cfg.outlier_family_list()),
                "norm_weight": self.outliers.norm_weight,
            }
        fp = save_model(m.net, run.path, recipe)
        extra = {}
        if data.train.fine_labels is not None:
            extra["fine_labels"] = torch.from_numpy(data.train.fine_labels)
        bank = self.bank
        save_memory_bank(run.memory, bank.embeddings, bank.labels, bank.indices, fp, extra)
        self._export_world(m.net, run.path, fp)
        if m.head is not None:
            write_safetensors(
                run.classifier,
                {k: v for k, v in m.head.state_dict().items()},
                {"model_fingerprint": fp},
            )
        key = f"val_knn_top1@{max(cfg.knn_k)}"
        best = max(self.metrics, key=lambda r: r.get(key, -1)) if self.metrics else {}
        summary = {
            "final": final,
            "best_epoch": best.get("epoch"),
            "best": {k: v for k, v in best.items() if k.startswith("val_")},
            "epochs": cfg.epochs,
            "wall_seconds": wall,
            "model_fingerprint": fp,
            "fine_class_names": data.train.fine_class_names,
            "hardware": hardware(),
            "protocol": "val = stratified split carved from the training set; 'val_knn_*' "
            "votes over the memory bank, 'val_recompute_knn_*' over re-embedded "
            "training images (eval transform)",
        }
        atomic_write_json(run.summary, summary)
        rundir.finalize(run.path, Path(cfg.out))
        return summary
