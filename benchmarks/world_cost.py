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


def alternate(run: Path, settings: dict[str, dict], rounds: int, seconds: float,
              concurrency: int, port: int, label: str = "") -> dict[str, list]:  # fmt: skip
    """POST /classify load on a fresh snca-serve per setting (its SNCA_ variables), the
    settings alternating (reversed every other round): {setting: [load_level's results]}."""
    png = query_png()
    req = request_bytes("127.0.0.1", port, png)
    out: dict[str, list] = {k: [] for k in settings}
    names = list(settings)
    with mp.get_context("spawn").Pool(1) as pool:
        for r in range(rounds):
            for setting in names if r % 2 == 0 else names[::-1]:
                saved = {k: os.environ.get(k) for k in settings[setting]}
                os.environ.update(settings[setting])
                with tempfile.TemporaryDirectory() as d:
                    p = serve(run, port, 64, Path(d) / "data")
                    try:
                        pool.apply(load_level, (("127.0.0.1", port, req, concurrency, 2.0),))
                        s = pool.apply(
                            load_level, (("127.0.0.1", port, req, concurrency, seconds),)
                        )
                    finally:
                        p.terminate()
                        p.wait(timeout=60)
                        for k, v in saved.items():
                            if v is None:
                                os.environ.pop(k, None)
                            else:
                                os.environ[k] = v
                out[setting].append(s)
                print(f"round {r + 1} {label}{setting:3s}: {s['rps']:.0f}/s, p50 "
                      f"{s['p50_ms']:.2f} ms, p99 {s['p99_ms']:.2f} ms, errors {s['errors']}",
                      flush=True)  # fmt: skip
    return out


def median(out: dict[str, list], k: str, key: str) -> float:
    v = sorted(x[key] for x in out[k])
    return v[len(v) // 2]


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
    settings = {"on": {"SNCA_WORLD_TPR": "0.99"}, "off": {"SNCA_WORLD_TPR": "0"}}
    out = alternate(a.run, settings, a.rounds, a.seconds, a.concurrency, a.port, "world ")
    ratio = median(out, "on", "rps") / median(out, "off", "rps")
    print(f"median throughput: on {median(out, 'on', 'rps'):.0f}/s, off "
          f"{median(out, 'off', 'rps'):.0f}/s: on/off = {ratio:.3f}; p50 on/off "
          f"{median(out, 'on', 'p50_ms') / median(out, 'off', 'p50_ms'):.3f}")  # fmt: skip
    if a.json:
        a.json.write_text(json.dumps({**out, "throughput_ratio": ratio}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
