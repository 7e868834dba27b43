"""What the world check (issue 28) costs on the hot path: POST /classify throughput and latency
with 16 keep-alive clients on a real snca-serve, world check on (the default: the statistics
come out of the same forward pass, the vote then whitens them and compares) and off
(SNCA_WORLD_TPR=0: no statistics computed), alternating A/B in one run.

    python benchmarks/world_cost.py runs/demo --rounds 3 --seconds 10

Prints one line per server and the ratio of the medians (on / off).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.service_load import load_level, query_png, request_bytes, serve


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("run", type=Path, help="a run dir with its index (make run's: runs/demo)")
    ap.add_argument("--rounds", type=int, default=3, help="A/B pairs")
    ap.add_argument("--seconds", type=float, default=10.0, help="load per server")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--port", type=int, default=8913)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    png = query_png()
    req = request_bytes("127.0.0.1", a.port, png)
    out: dict[str, list] = {"on": [], "off": []}
    with mp.get_context("spawn").Pool(1) as pool:
        for r in range(a.rounds):
            for setting in ("on", "off") if r % 2 == 0 else ("off", "on"):
                os.environ["SNCA_WORLD_TPR"] = "0.99" if setting == "on" else "0"
                with tempfile.TemporaryDirectory() as d:
                    p = serve(a.run, a.port, 64, Path(d) / "data")
                    try:
                        pool.apply(load_level, (("127.0.0.1", a.port, req, a.concurrency, 2.0),))
                        s = pool.apply(
                            load_level,
                            (("127.0.0.1", a.port, req, a.concurrency, a.seconds),),
                        )
                    finally:
                        p.terminate()
                        p.wait(timeout=60)
                out[setting].append(s)
                print(f"round {r + 1} world {setting:3s}: {s['rps']:.0f}/s, p50 "
                      f"{s['p50_ms']:.2f} ms, p99 {s['p99_ms']:.2f} ms, errors {s['errors']}",
                      flush=True)  # fmt: skip

    def med(k, key):
        v = sorted(x[key] for x in out[k])
        return v[len(v) // 2]

    ratio = med("on", "rps") / med("off", "rps")
    print(f"median throughput: on {med('on', 'rps'):.0f}/s, off "
          f"{med('off', 'rps'):.0f}/s: on/off = {ratio:.3f}; p50 on/off "
          f"{med('on', 'p50_ms') / med('off', 'p50_ms'):.3f}")  # fmt: skip
    if a.json:
        a.json.write_text(json.dumps({**out, "throughput_ratio": ratio}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
