"""Per-step cost of the NCA module vs the backbone, and vs a straightforward implementation.

    python benchmarks/train_step.py                       # CPU, N=60000, d=128, B=128
    python benchmarks/train_step.py --device cuda --archs conv4,resnet18,resnet50

For each backbone, in one run: time of forward+backward of the network alone (EmbeddingNet on a
Fashion-MNIST-shaped batch), time of the NCA module (logits, loss, backward to the features,
eq. 11 memory update) with the fused loss and with the straightforward one (masked_fill + two
logsumexp + autograd). Measurements are interleaved and the median is reported, so the ratios
compare like with like. Peak memory of the module is reported in units of one B x N float32
buffer: on CPU as the growth of peak RSS (glibc is told to mmap large blocks, so freed buffers
leave RSS), on CUDA from torch.cuda.max_memory_allocated.
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

if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None and "--no-reexec" not in sys.argv:
    # Large blocks via mmap so that peak RSS reflects live tensors (set before malloc starts).
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    os.execv(sys.executable, [sys.executable, *sys.argv, "--no-reexec"])

import torch
import torch.nn.functional as F

from embedding import EmbeddingNet, ModelConfig
from training.memory import MemoryBank
from training.nca import nca_loss_reference


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

    def nca_fused():
        f = f0.clone().requires_grad_()
        out = bank.loss(f, slots, y, sigma)
        out.loss.backward()
        bank.update(slots, f.detach(), 0.5)

    def nca_plain():
        f = f0.clone().requires_grad_()
        loss = nca_loss_reference(f, bank.embeddings, bank.labels, slots, y, sigma)
        loss.backward()
        bank.update(slots, f.detach(), 0.5)

    results = {
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
    for name, fn in (("nca_fused", nca_fused), ("nca_plain", nca_plain)):
        fn()
        with PeakMemory(device) as pm:
            fn()
        results[f"{name}_peak_bxn_buffers"] = pm.peak / unit

    for arch in args.archs.split(","):
        cfg = ModelConfig(arch=arch, embedding_dim=d, class_names=[str(i) for i in range(c)])
        net = EmbeddingNet(cfg).to(device).train()
        x = torch.randn(b, 1, 28, 28, device=device)
        g = torch.randn(b, d, device=device)

        def backbone(net=net, x=x, g=g):
            net.zero_grad(set_to_none=True)
            net(x).backward(g)

        fns = {"backbone": backbone, "nca_fused": nca_fused, "nca_plain": nca_plain}
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
            "nca_over_backbone": med["nca_fused"] / med["backbone"],
            "nca_share_of_step": med["nca_fused"] / (med["backbone"] + med["nca_fused"]),
            "plain_over_fused": med["nca_plain"] / med["nca_fused"],
        }
    return results


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--n", type=int, default=60000, help="memory slots N")
    p.add_argument("--d", type=int, default=128, help="embedding dim d")
    p.add_argument("--batch", type=int, default=128, help="batch size B")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--temperature", type=float, default=0.05)
    p.add_argument("--archs", default="conv4,resnet18")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument("--no-reexec", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    r = bench(args)
    print(
        f"N={r['n']} d={r['d']} B={r['batch']} on {r.get('gpu', r['device'])}, "
        f"{r['threads']} threads, torch {r['torch']}"
    )
    print(
        f"peak memory of the NCA module: fused {r['nca_fused_peak_bxn_buffers']:.2f}, "
        f"straightforward {r['nca_plain_peak_bxn_buffers']:.2f} B x N float32 buffers"
    )
    for arch in args.archs.split(","):
        a = r[arch]
        print(
            f"{arch:9s} backbone fwd+bwd {a['backbone_ms']:8.1f} ms | NCA fused {a['nca_fused_ms']:6.1f} ms "
            f"({a['nca_over_backbone']:.2f}x backbone, {100 * a['nca_share_of_step']:.1f}% of step) | "
            f"straightforward {a['nca_plain_ms']:6.1f} ms ({a['plain_over_fused']:.2f}x fused)"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2) + "\n")


if __name__ == "__main__":
    main()
