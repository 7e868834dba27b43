"""CUDA correctness check of the fused NCA loss (run on a machine with a GPU).

    python benchmarks/cuda_check.py

Compares, at N=60000, d=128, B=128, the fused loss and its gradient on the GPU against the
float64 straightforward implementation, for float32 features and for features that went
through a bf16 autocast forward (the AMP training path), and checks the memory update keeps
unit rows. Prints one line per check and exits non-zero if any fails.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from training.memory import MemoryBank
from training.nca import nca_loss, nca_loss_reference


def main() -> int:
    import argparse

    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    torch.manual_seed(0)
    n, d, b, c = 60000, 128, 128, 10
    bank = MemoryBank(torch.randint(0, c, (n,)), d, num_classes=c).to(dev)
    slots = torch.randperm(n, device=dev)[:b]
    y = bank.labels[slots]
    ok = True
    cases = [
        (s, n_, c_)
        for s in ("mask", "scatter")
        for n_, c_ in (("float32", torch.float32), ("bf16-rounded", torch.bfloat16))
    ]
    for strategy, name, cast in cases:
        f = F.normalize(torch.randn(b, d, device=dev).to(cast).float(), dim=1).requires_grad_()
        out = nca_loss(
            f,
            bank.embeddings,
            bank.labels,
            slots,
            y,
            0.05,
            class_counts=bank.class_counts,
            strategy=strategy,
        )
        out.loss.backward()
        f64 = f.detach().double().requires_grad_()
        ref = nca_loss_reference(f64, bank.embeddings.double(), bank.labels, slots, y, 0.05)
        ref.backward()
        dl = abs(out.loss.item() - ref.item())
        dg = (f.grad.double() - f64.grad).abs().max().item()
        good = dl < 1e-4 and dg < 1e-5
        ok &= good
        print(
            f"{name:13s} loss {out.loss.item():.6f} vs float64 {ref.item():.6f} (|Δ| {dl:.1e}), "
            f"max |Δgrad| {dg:.1e} -> {'ok' if good else 'FAIL'}"
        )
    bank.update(slots, f.detach(), 0.5)
    norm_err = (bank.embeddings.norm(dim=1) - 1).abs().max().item()
    ok &= norm_err < 1e-5
    print(f"memory rows unit norm after update: max |‖v‖-1| {norm_err:.1e}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
