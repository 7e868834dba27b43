"""Per-step cost of the NCA module vs the backbone, and vs a straightforward implementation.

    python benchmarks/train_step.py                       # CPU, N=60000, d=128, B=128
    python benchmarks/train_step.py --device cuda --archs conv4,resnet18,resnet50

For each backbone, in one run: time of forward+backward of the network alone (EmbeddingNet on a
Fashion-MNIST-shaped batch), time of the NCA module (logits, loss, backward to the features,
eq. 11 memory update) with the fused loss and with the straightforward one (masked_fill + two
logsumexp + autograd). Measurements are interleaved and the median is reported, so the ratios
compare like with like. Peak memory of the module is reported in units of one B x N float32
buffer: on CPU as the growth of peak RSS (glibc is told to mmap large blocks, so freed buffers
leave RSS; measured in a child process so that setting does not slow the timings), on CUDA from
torch.cuda.max_memory_allocated.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from benchmarks.command_line import parser, write_report
from embedding import EmbeddingNet, ModelConfig
from embedding.sysalloc import keep_freed_memory
from training.memory import MemoryBank
from training.nca import nca_loss, nca_loss_reference


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


class PeakMemory:
    """Peak bytes allocated above the level at entry (CPU: RSS high-water mark)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak = 0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM
            self.base = _status("VmRSS")
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.base
        else:
            self.peak = _status("VmHWM") - self.base


def _cpu_memory_in_child(args) -> dict:
    """Peak RSS is only meaningful when glibc returns freed blocks to the OS: measure it in a
    child started with MALLOC_MMAP_THRESHOLD_ (which would slow down the timings here)."""
    import subprocess

    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    argv = [f"--{k}={getattr(args, k)}" for k in ("n", "d", "batch", "classes", "temperature")]
    out = subprocess.run(
        [sys.executable, __file__, *argv, "--memory-only"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench(args) -> dict:
    device = torch.device(args.device)
    torch.manual_seed(0)
    n, d, b, c, sigma = args.n, args.d, args.batch, args.classes, args.temperature
    labels = torch.randint(0, c, (n,))
    bank = MemoryBank(labels, d, num_classes=c).to(device)
    slots = torch.randperm(n)[:b].to(device)
    y = bank.labels[slots]
    f0 = F.normalize(torch.randn(b, d, device=device), dim=1)

    default = "scatter" if device.type == "cpu" else "mask"
    other = "mask" if default == "scatter" else "scatter"

    def fused(strategy):
        f = f0.clone().requires_grad_()
        out = nca_loss(
            f,
            bank.embeddings,
            bank.labels,
            slots,
            y,
            sigma,
            class_counts=bank.class_counts,
            strategy=strategy,
        )
        out.loss.backward()
        bank.update(slots, f.detach(), 0.5)

    def nca_fused():  # the strategy training uses on this device
        fused(default)

    def nca_fused_other():  # the other partition-sum strategy, for comparison
        fused(other)

    def nca_plain():
        f = f0.clone().requires_grad_()
        loss = nca_loss_reference(f, bank.embeddings, bank.labels, slots, y, sigma)
        loss.backward()
        bank.update(slots, f.detach(), 0.5)

    results = {
        "input": f"{args.channels}x{args.image_size}x{args.image_size}",
        "device": str(device),
        "n": n,
        "d": d,
        "batch": b,
        "classes": c,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    if device.type == "cuda":
        results["gpu"] = torch.cuda.get_device_name(0)
    unit = b * n * 4
    results["strategy"], results["other_strategy"] = default, other
    if args.memory_only or device.type == "cuda":
        for name, fn in (("nca_fused", nca_fused), ("nca_plain", nca_plain)):
            fn()
            with PeakMemory(device) as pm:
                fn()
            results[f"{name}_peak_bxn_buffers"] = pm.peak / unit
        if args.memory_only:
            return results
    else:
        results.update(_cpu_memory_in_child(args))

    for arch in args.archs.split(","):
        ch, size = args.channels, args.image_size
        cfg = ModelConfig(
            arch=arch,
            in_channels=ch,
            image_size=size,
            mean=(0.5,) * ch,
            std=(0.25,) * ch,
            embedding_dim=d,
            small_stem=not args.imagenet_stem,
            class_names=[str(i) for i in range(c)],
        )
        net = EmbeddingNet(cfg).to(device).train()
        x = torch.randn(b, ch, size, size, device=device)
        g = torch.randn(b, d, device=device)

        def backbone(net=net, x=x, g=g):
            net.zero_grad(set_to_none=True)
            net(x).backward(g)

        fns = {
            "backbone": backbone,
            "nca_fused": nca_fused,
            "nca_fused_other": nca_fused_other,
            "nca_plain": nca_plain,
        }
        times = {k: [] for k in fns}
        for _ in range(args.warmup):
            for fn in fns.values():
                fn()
        for _ in range(args.repeats):
            for k, fn in fns.items():  # interleaved: drift hits all three alike
                sync(device)
                t0 = time.perf_counter()
                fn()
                sync(device)
                times[k].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) * 1000 for k, v in times.items()}
        results[arch] = {
            "backbone_ms": med["backbone"],
            "nca_fused_ms": med["nca_fused"],
            "nca_plain_ms": med["nca_plain"],
            "nca_fused_other_strategy_ms": med["nca_fused_other"],
            "nca_over_backbone": med["nca_fused"] / med["backbone"],
            "nca_share_of_step": med["nca_fused"] / (med["backbone"] + med["nca_fused"]),
            "plain_over_fused": med["nca_plain"] / med["nca_fused"],
        }
    return results


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--n", type=int, default=60000, help="memory slots N")
    p.add_argument("--d", type=int, default=128, help="embedding dim d")
    p.add_argument("--batch", type=int, default=128, help="batch size B")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--temperature", type=float, default=0.05)
    p.add_argument("--archs", default="conv4,resnet18")
    p.add_argument("--image-size", type=int, default=28, help="input side (28: Fashion-MNIST)")
    p.add_argument("--channels", type=int, default=1)
    p.add_argument("--imagenet-stem", action="store_true", help="ResNet 7x7/2 stem + max-pool")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--memory-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if not args.memory_only:
        keep_freed_memory()  # as snca-train does: time compute, not page faults
    r = bench(args)
    if args.memory_only:
        print(json.dumps({k: v for k, v in r.items() if k.endswith("_bxn_buffers")}))
        return
    print(
        f"N={r['n']} d={r['d']} B={r['batch']} input {r['input']} on {r.get('gpu', r['device'])}, "
        f"{r['threads']} threads, torch {r['torch']}"
    )
    print(f"partition sums: {r['strategy']} (the default on this device)")
    print(
        f"peak memory of the NCA module: fused {r['nca_fused_peak_bxn_buffers']:.2f}, "
        f"straightforward {r['nca_plain_peak_bxn_buffers']:.2f} B x N float32 buffers"
    )
    for arch in args.archs.split(","):
        a = r[arch]
        print(
            f"{arch:9s} backbone fwd+bwd {a['backbone_ms']:8.1f} ms | NCA fused {a['nca_fused_ms']:6.1f} ms "
            f"({a['nca_over_backbone']:.2f}x backbone, {100 * a['nca_share_of_step']:.1f}% of step) | "
            f"straightforward {a['nca_plain_ms']:6.1f} ms ({a['plain_over_fused']:.2f}x fused) | "
            f"fused with {r['other_strategy']} sums {a['nca_fused_other_strategy_ms']:6.1f} ms"
        )
    write_report(args.json, r)


if __name__ == "__main__":
    main()
