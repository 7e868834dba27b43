"""What the event loop alone allows: service_load's measurements against a server whose
model thread is ideal, i.e. it holds no GIL and costs no CPU (each batch is a sleep of
`--batch-ms` + `--per-image-ms` x size, then a precomputed answer). Everything else is the
real service: uvicorn, the middleware, multipart, PNG decoding, the micro-batcher, JSON.

    python benchmarks/ideal_model.py                 # conv4 bench run, 0.6 + 0.1 ms per batch

If p99 at half of saturation is over 3x the single-request latency even here, no work on the
model thread can meet that target; the event loop's own cost per request has to fall.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from service_load import (  # noqa: E402
    RUNS,
    _cpu_text,
    _with_cpu,
    load_level,
    open_loop,
    query_png,
    request_bytes,
    serve,
)

STUB = """
import sys, time
from service import state
real = state.ServiceState._run_batch
answer = []
def run_batch(self, jobs):
    if not answer:
        answer.append(real(self, jobs[:1])[0])
    time.sleep(({batch_ms} + {per_image_ms} * len(jobs)) / 1000)  # no GIL, no CPU
    return answer * len(jobs)
state.ServiceState._run_batch = run_batch
from service.cli import main
sys.argv = ["snca-serve"] + sys.argv[1:]
sys.exit(main())
"""


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="conv4", help="bench model name or run dir")
    ap.add_argument("--batch-ms", type=float, default=0.6, help="sleep per batch")
    ap.add_argument("--per-image-ms", type=float, default=0.1, help="extra sleep per image")
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--port", type=int, default=8912)
    a = ap.parse_args()
    run = RUNS.get(a.model, Path(a.model))
    code = STUB.format(batch_ms=a.batch_ms, per_image_ms=a.per_image_ms)
    proc = serve(run, a.port, 64, run / "bench-ideal", python_args=("-c", code))
    try:
        req = request_bytes("127.0.0.1", a.port, query_png())
        host = "127.0.0.1"
        with mp.get_context("spawn").Pool(1) as pool:
            single = _with_cpu(pool, proc.pid, load_level, (host, a.port, req, 1, a.seconds))
            sat = _with_cpu(pool, proc.pid, load_level, (host, a.port, req, 64, a.seconds))
            half = _with_cpu(
                pool, proc.pid, open_loop, (host, a.port, req, sat["rps"] / 2, a.seconds)
            )
        for name, r in (("c=1", single), ("c=64", sat), ("half, open loop", half)):
            print(
                f"{name}: {r['rps']:.0f}/s p50 {r['p50_ms']:.2f} ms p99 {r['p99_ms']:.2f} ms; "
                f"{_cpu_text(r)}"
            )
        print(
            f"ideal model thread: p99 at half saturation {half['p99_ms']:.2f} ms = "
            f"{half['p99_ms'] / single['p50_ms']:.1f}x the single-request latency "
            f"{single['p50_ms']:.2f} ms"
        )
    finally:
        proc.terminate()
        proc.wait(timeout=60)


if __name__ == "__main__":
    main()
