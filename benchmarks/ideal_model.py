"""What the event loop alone allows: service_load's measurements against a server whose
model thread is ideal, i.e. it holds no GIL and costs no CPU (each batch is a sleep of
`--batch-ms` + `--per-image-ms` x size, then a precomputed answer). Everything else is the
real service: uvicorn, the middleware, multipart, PNG decoding, the micro-batcher, JSON.

    python benchmarks/ideal_model.py                 # conv4 bench run, 0.6 + 0.1 ms per batch
    python benchmarks/ideal_model.py --empty         # an empty ASGI app on uvicorn instead
    python benchmarks/ideal_model.py --empty --burn-us 400   # ... costing 0.4 ms per request

If p99 at half of saturation is over 3x the single-request latency even here, no work on the
model thread can meet that target; the event loop's own cost per request has to fall.
`--empty` measures the floor under any service on this machine: a raw ASGI app that reads the
same upload and answers a fixed JSON body, on uvicorn with the service's settings, measured by
the same client in the same way. With `--burn-us` each request also costs a fixed CPU time
on the event loop: a server whose cost per request does not fall under load.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from service_load import RUNS, latency_ratio, print_rows, query_png, serve, start_app  # noqa: E402

from benchmarks.command_line import parser  # noqa: E402

STUB = """
import sys, time
from service.model import runtime
real = runtime.ModelRuntime.run_batch
answer = []
def run_batch(self, jobs):
    if not answer:
        answer.append(real(self, jobs[:1])[0])
    time.sleep(({batch_ms} + {per_image_ms} * len(jobs)) / 1000)  # no GIL, no CPU
    return answer * len(jobs)
runtime.ModelRuntime.run_batch = run_batch
from service.cli import main
sys.argv = ["snca-serve"] + sys.argv[1:]
sys.exit(main())
"""


EMPTY = """
import sys, time, uvicorn
BURN = float(sys.argv[2]) / 1e6
BODY = (b'{"label":"Ankle boot","confidence":0.97,"probabilities":[{"label":"Ankle boot",'
        b'"probability":0.97}],"unknown":false,"best_similarity":0.9,"vote":"kde","k":30,'
        b'"gallery_version":0,"model_fingerprint":"0123456789abcdef"}')
HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())]
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    t = time.perf_counter() + BURN
    while time.perf_counter() < t:  # a fixed CPU cost per request, on the event loop
        pass
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    await send({"type": "http.response.body", "body": BODY})
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False)
"""


def main() -> None:
    ap = parser(__doc__, report=False, seconds=6.0, port=8912)
    ap.add_argument("--model", default="conv4", help="bench model name or run dir")
    ap.add_argument("--batch-ms", type=float, default=0.6, help="sleep per batch")
    ap.add_argument("--per-image-ms", type=float, default=0.1, help="extra sleep per image")
    ap.add_argument("--empty", action="store_true", help="an empty ASGI app, not the service")
    ap.add_argument(
        "--burn-us",
        type=float,
        default=0.0,
        help="with --empty: busy CPU time per request on the event loop, in microseconds",
    )
    a = ap.parse_args()
    if a.seconds <= 0 or min(a.batch_ms, a.per_image_ms, a.burn_us) < 0:
        ap.error("--seconds must be positive; --batch-ms, --per-image-ms, --burn-us not negative")
    if a.burn_us and not a.empty:
        ap.error("--burn-us applies to --empty only")
    if a.empty:
        proc = start_app(EMPTY, a.port, a.burn_us)
        what = f"empty ASGI app ({a.burn_us:.0f} us of CPU per request)"
    else:
        run = RUNS.get(a.model, Path(a.model))
        code = STUB.format(batch_ms=a.batch_ms, per_image_ms=a.per_image_ms)
        proc = serve(run, a.port, 64, run / "bench-ideal", python_args=("-c", code))
        what = "ideal model thread"
    try:
        with mp.get_context("spawn").Pool(1) as pool:
            rows = latency_ratio(
                pool, proc.pid, a.port, query_png(), a.seconds, fractions=(0.25, 0.5)
            )
        print_rows("", rows)
        single, half = rows[0][1], rows[-1][1]
        if "overloaded" in half:
            sys.exit(f"{what}: overloaded at half saturation")
        print(
            f"{what}: p99 at half saturation {half['p99_ms']:.2f} ms = "
            f"{half['p99_ms'] / single['p50_ms']:.1f}x the single-request latency "
            f"{single['p50_ms']:.2f} ms"
        )
    finally:
        proc.terminate()
        proc.wait(timeout=60)


if __name__ == "__main__":
    main()
