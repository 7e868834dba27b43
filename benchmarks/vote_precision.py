"""The dense vote's one matrix product in float32, bfloat16 and float16 on this CPU: what a
reduced-precision vote (issue 55, point 3: half the bytes read) would gain or lose here before
any re-scoring. Queries (B, d) against N unit rows, one thread, the median ms of `--repeat`
calls at each batch size, interleaved; the CPU's capability as torch detects it.

    python benchmarks/vote_precision.py                  # 55,000 x 128, batches 1, 8, 16
    python benchmarks/vote_precision.py --rows 200000 --json out.json

Each reduced-precision product is timed both ways round (queries @ rows^T, rows @ queries^T):
oneDNN picks different kernels for them.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.command_line import parser, write_report


def cpu_features() -> dict:
    """What torch detects of this CPU (never assumed: the VM's CPU changes between days)."""
    cpu = torch.cpu
    probe = {
        "avx512_bf16": getattr(cpu, "_is_avx512_bf16_supported", None),
        "avx512_vnni": getattr(cpu, "_is_avx512_vnni_supported", None),
        "amx_tile": getattr(cpu, "_is_amx_tile_supported", None),
    }
    out = {"capability": torch.backends.cpu.get_cpu_capability()}
    out.update({k: bool(f()) for k, f in probe.items() if f is not None})
    return out


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--rows", type=int, default=55_000, help="gallery rows N (55000)")
    ap.add_argument("--dim", type=int, default=128, help="embedding dimension d (128)")
    ap.add_argument("--batches", default="1,8,16", help="query batch sizes (1,8,16)")
    ap.add_argument("--repeat", type=int, default=30, help="calls per setting (30)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    rows = F.normalize(torch.randn(a.rows, a.dim, generator=g), dim=1)  # (N, d)
    kinds = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    stored = {k: (rows.to(t), rows.to(t).t().contiguous()) for k, t in kinds.items()}
    results = {"cpu": cpu_features(), "rows": a.rows, "dim": a.dim, "ms": {}}
    print(f"CPU: {results['cpu']}; {a.rows} x {a.dim}, one thread, median ms of {a.repeat}")
    for b in (int(x) for x in a.batches.split(",")):
        q = F.normalize(torch.randn(b, a.dim, generator=g), dim=1)  # (B, d)
        calls = {}
        for k, t in kinds.items():
            r, rt = stored[k]
            qk = q.to(t)
            calls[f"{k} q@rows^T"] = lambda qk=qk, rt=rt: qk @ rt  # (B, N)
            if k != "fp32":
                calls[f"{k} rows@q^T"] = lambda qk=qk, r=r: r @ qk.t()  # (N, B)
        times = {name: [] for name in calls}
        for fn in calls.values():
            fn()  # (first-call setup out of the timing)
        for _ in range(a.repeat):  # interleaved: drift hits every kind alike
            for name, fn in calls.items():
                t0 = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t0) * 1e3)
        med = {name: round(statistics.median(v), 3) for name, v in times.items()}
        results["ms"][b] = med
        base = med["fp32 q@rows^T"]
        shown = "  ".join(f"{n} {v:.2f} ({v / base:.2f}x)" for n, v in med.items())
        print(f"batch {b:3d}: {shown}")
    write_report(a.json, results)


if __name__ == "__main__":
    main()
