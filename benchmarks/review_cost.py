"""What the review queue (issue 43) costs on the hot path: POST /classify throughput and latency
with 16 keep-alive clients on a real snca-serve (a front and its model process), the queue off
(the default), on with the default margin (what a served image of the gallery's kind costs:
the query's row rides back from the model process; it is queued only when unknown or unsure),
and on with SNCA_REVIEW_MARGIN=1 (every query queued: thumbnail, PNG of the model's view, one
store write per batch of the writer thread), alternating in one run. Then the bytes one queued
query takes in the store.

    python benchmarks/review_cost.py runs/demo --rounds 3 --seconds 10
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.command_line import parser, write_report
from benchmarks.world_cost import alternate, median


def main() -> int:
    ap = parser(__doc__, rounds=3, seconds=10.0, port=8917)
    ap.add_argument("run", type=Path, help="a run dir with its index (make run's: runs/demo)")
    ap.add_argument("--concurrency", type=int, default=16)
    a = ap.parse_args()
    settings = {
        "off": {"SNCA_REVIEW_QUEUE": "0"},
        "on": {"SNCA_REVIEW_QUEUE": "1", "SNCA_REVIEW_MARGIN": "0.1"},
        "all": {"SNCA_REVIEW_QUEUE": "1", "SNCA_REVIEW_MARGIN": "1.0"},
    }
    out = alternate(a.run, settings, a.rounds, a.seconds, a.concurrency, a.port, "queue ")
    base = median(out, "off", "rps")
    summary = {k: {"rps": median(out, k, "rps"), "p50_ms": median(out, k, "p50_ms"),
                   "p99_ms": median(out, k, "p99_ms"), "vs_off": median(out, k, "rps") / base}
               for k in settings}  # fmt: skip
    for k, v in summary.items():
        print(f"queue {k}: median {v['rps']:.0f}/s ({v['vs_off']:.3f} of off), p50 "
              f"{v['p50_ms']:.2f} ms, p99 {v['p99_ms']:.2f} ms")  # fmt: skip
    write_report(a.json, {"rounds": out, "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
