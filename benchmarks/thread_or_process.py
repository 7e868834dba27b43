"""A model thread or a model process? The same synthetic server both ways, measured by
service_load's clients: single-request latency, saturation (closed loop, 64 connections) and
p99 at half of saturation (open loop).

    python benchmarks/thread_or_process.py                      # loop 150 + 100 us, model 300 + 100/image
    python benchmarks/thread_or_process.py --pre-us 300 --post-us 150 --model-us 350

The synthetic server is a raw ASGI app on uvicorn (the service's settings). Per request the
event loop spends `--pre-us` of Python before handing the image over and `--post-us` after the
answer (the service's HTTP, multipart, decoding and JSON). The "model" takes the whole queue as
one batch and costs `--model-us` + `--per-image-us` x batch of CPU without the GIL (sha256 of a
buffer, which releases it), like a traced forward pass. As a thread it shares the event loop's
GIL: a queue in, `call_soon_threadsafe` out, the service's pattern. As a process it has its own:
a pipe in, a pipe out that the loop watches. Everything else is equal.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from service_load import _cpu_text, latency_ratio, query_png, start_app  # noqa: E402

from benchmarks.command_line import parser  # noqa: E402

APP = r"""
import asyncio, hashlib, os, queue, struct, sys, threading, time, uvicorn
port, mode = int(sys.argv[1]), sys.argv[2]
pre, post = float(sys.argv[3]) / 1e6, float(sys.argv[4]) / 1e6
fixed_us, per_us = int(sys.argv[5]), int(sys.argv[6])
BODY = b'{"label":"x"}'
HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())]
BUF = bytes(2048 * (fixed_us + 64 * per_us))  # sha256 hashes ~2 KB per microsecond here

def model(b):  # CPU without the GIL: hashlib releases it for buffers over 2 KB
    hashlib.sha256(memoryview(BUF)[: 2048 * (fixed_us + per_us * min(b, 64))]).digest()

def burn(s):  # Python on the event loop, GIL held
    t = time.perf_counter() + s
    while time.perf_counter() < t:
        pass

futures, ids, loop = {}, iter(range(1 << 62)), None

def deliver(done):
    for i in done:
        f = futures.pop(i)
        if not f.done():
            f.set_result(None)

if mode == "thread":
    q = queue.SimpleQueue()
    def work():
        while True:
            batch = [q.get()]
            while True:
                try:
                    batch.append(q.get_nowait())
                except queue.Empty:
                    break
            model(len(batch))
            loop.call_soon_threadsafe(deliver, batch)
    threading.Thread(target=work, daemon=True).start()
    submit = q.put
else:
    jobs_r, jobs_w = os.pipe()
    done_r, done_w = os.pipe()
    if os.fork() == 0:
        os.close(jobs_w); os.close(done_r)
        while data := os.read(jobs_r, 1 << 16):  # everything queued is one batch
            model(len(data) // 8)
            os.write(done_w, data)
        os._exit(0)
    os.close(jobs_r); os.close(done_w)
    os.set_blocking(done_r, False)
    def on_done():
        try:
            data = os.read(done_r, 1 << 16)
        except BlockingIOError:
            return
        deliver([i for (i,) in struct.iter_unpack("q", data)])
    def submit(i):
        os.write(jobs_w, struct.pack("q", i))

async def app(scope, receive, send):
    global loop
    if scope["type"] != "http":
        return
    if loop is None:
        loop = asyncio.get_running_loop()
        if mode == "process":
            loop.add_reader(done_r, on_done)
    while (await receive()).get("more_body"):
        pass
    burn(pre)
    i = next(ids)
    f = futures[i] = loop.create_future()
    submit(i)
    await f
    burn(post)
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    await send({"type": "http.response.body", "body": BODY})

uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
"""


def measure(mode: str, a, pool) -> dict:
    args = [mode, a.pre_us, a.post_us, a.model_us, a.per_image_us]
    p = start_app(APP, a.port, *args)
    try:
        rows = latency_ratio(pool, p.pid, a.port, query_png(), a.seconds)
    finally:
        p.kill()  # the process mode's child ends when its pipe closes
        p.wait()
    single, sat, half = (r for _, r in rows)
    if "overloaded" in half:
        sys.exit(f"model {mode}: overloaded at half saturation")
    ratio = half["p99_ms"] / single["p50_ms"]
    print(
        f"model {mode:7s}: single {single['p50_ms']:.2f} ms, saturation {sat['rps']:.0f}/s, "
        f"half saturation p50 {half['p50_ms']:.2f} ms p99 {half['p99_ms']:.2f} ms = {ratio:.1f}x "
        f"single; at half: {_cpu_text(half)} (a model process's CPU is not in these)",
        flush=True,
    )
    return {"single_ms": single["p50_ms"], "saturation_rps": sat["rps"], "ratio": ratio}


def main() -> None:
    ap = parser(__doc__, report=False, seconds=5.0, port=8914)
    ap.add_argument("--pre-us", type=float, default=150.0, help="loop Python before the model")
    ap.add_argument("--post-us", type=float, default=100.0, help="loop Python after it")
    ap.add_argument("--model-us", type=int, default=300, help="model CPU per batch")
    ap.add_argument("--per-image-us", type=int, default=100, help="model CPU per image")
    ap.add_argument("--repeats", type=int, default=1, help="thread/process pairs to run")
    a = ap.parse_args()
    if min(a.pre_us, a.post_us, a.model_us, a.per_image_us) < 0 or a.seconds <= 0:
        ap.error("times must not be negative and --seconds must be positive")
    if a.repeats < 1:
        ap.error("--repeats must be at least 1")
    with mp.get_context("spawn").Pool(1) as pool:
        for _ in range(a.repeats):
            for mode in ("thread", "process"):
                measure(mode, a, pool)


if __name__ == "__main__":
    main()
