"""The image as the request body (`Content-Type: image/png`) against the same image in a
multipart form, on one snca-serve process: CPU per /classify of the front (its event loop and
its other threads) and of the model process, from /proc, and classify/s; the two kinds of
request alternate, round after round, in one run (the VM's speed drifts: only ratios measured
side by side mean anything).

    python benchmarks/image_body.py --prepare           # tiny conv4 bench run + index first
    python benchmarks/image_body.py --rounds 6 --seconds 8 --concurrency 16
    python benchmarks/image_body.py --model runs/demo   # any run dir with an index
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.service_load import (  # noqa: E402
    RUNS,
    _with_cpu,
    load_level,
    prepare,
    query_png,
    request_bytes,
    serve,
)


def image_request(host: str, port: int, png: bytes, path: str = "/classify") -> bytes:
    """The raw-body request of `png` (what `curl --data-binary @q.png -H 'Content-Type:
    image/png'` sends)."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: image/png\r\n"
        f"Content-Length: {len(png)}\r\n\r\n"
    ).encode()
    return head + png


def front(r: dict) -> float:
    """The front's CPU per request (us): its event loop and its other threads."""
    return r["server_cpu_us"]["event_loop"] + r["server_cpu_us"]["other_threads"]


def service(r: dict) -> float:
    """The whole service's CPU per request (us): the front and its model process."""
    return front(r) + r["server_cpu_us"].get("model_process", 0.0)


def medians(rounds: list[dict]) -> dict:
    """Medians over rounds of one setting: classify/s, the front's and the service's CPU per
    request (us)."""
    return {
        "rps": statistics.median(r["rps"] for r in rounds),
        "front_cpu_us": statistics.median(front(r) for r in rounds),
        "service_cpu_us": statistics.median(service(r) for r in rounds),
    }


def describe(r: dict) -> str:
    return (
        f"{r['rps']:6.0f}/s errors {r['errors']}  CPU us/request: front {front(r):.0f} "
        f"(event loop {r['server_cpu_us']['event_loop']:.0f}), service {service(r):.0f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--prepare", action="store_true", help="train the tiny conv4 bench run first")
    ap.add_argument("--model", default=str(RUNS["conv4"]), help="run dir with an index")
    ap.add_argument("--rounds", type=int, default=6, help="rounds of (form, image) each")
    ap.add_argument("--seconds", type=float, default=8.0, help="per measurement")
    ap.add_argument("--concurrency", type=int, default=16, help="keep-alive connections")
    ap.add_argument("--port", type=int, default=8913)
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args()
    if a.rounds < 1 or a.seconds <= 0 or a.concurrency < 1:
        ap.error("--rounds, --seconds and --concurrency must be positive")
    if a.prepare:
        prepare(["conv4"])
    run = Path(a.model)
    if not (run / "index" / "manifest.json").is_file():
        ap.error(f"{run} has no index: run with --prepare (the conv4 bench run) or give one")
    png, host = query_png(), "127.0.0.1"
    kinds = {
        "form": request_bytes(host, a.port, png),
        "image": image_request(host, a.port, png),
    }
    proc = serve(run, a.port, 64, run / "bench-serve-image-body")
    got: dict[str, list[dict]] = {k: [] for k in kinds}
    try:
        with mp.get_context("spawn").Pool(1) as pool:
            # a warm-up level of each, not counted (caches, the batcher's sizes)
            for req in kinds.values():
                pool.apply(load_level, ((host, a.port, req, a.concurrency, 2.0),))
            for i in range(a.rounds):
                order = list(kinds) if i % 2 == 0 else list(reversed(kinds))
                for kind in order:
                    r = _with_cpu(
                        pool,
                        proc.pid,
                        load_level,
                        (host, a.port, kinds[kind], a.concurrency, a.seconds),
                    )
                    got[kind].append(r)
                    print(f"round {i + 1} {kind:5s}: {describe(r)}", flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)

    def med(kind: str, key) -> float:
        return statistics.median(key(r) for r in got[kind])

    summary = {
        kind: {
            "rps": med(kind, lambda r: r["rps"]),
            "front_cpu_us": med(kind, front),
            "service_cpu_us": med(kind, service),
            "errors": sum(r["errors"] for r in got[kind]),
        }
        for kind in kinds
    }
    f, i = summary["form"], summary["image"]
    print(
        f"medians of {a.rounds} rounds at c={a.concurrency}: form {f['rps']:.0f}/s, front "
        f"{f['front_cpu_us']:.0f} us, service {f['service_cpu_us']:.0f} us; image body "
        f"{i['rps']:.0f}/s, front {i['front_cpu_us']:.0f} us, service {i['service_cpu_us']:.0f} us; "
        f"image/form: front {i['front_cpu_us'] / f['front_cpu_us']:.2f}x, service "
        f"{i['service_cpu_us'] / f['service_cpu_us']:.2f}x, classify/s {i['rps'] / f['rps']:.2f}x"
    )
    if a.json:
        Path(a.json).write_text(json.dumps({"summary": summary, "rounds": got}, indent=1))


if __name__ == "__main__":
    main()
