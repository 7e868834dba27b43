"""A prototype, for measurement only: the service with its classify batches run in a separate
process instead of on the model thread, against the one-process service (--no-model-process),
in one run. Issue 31 made the model process the service (service/model/remote.py,
service/model_process.py; measured in docs/PERFORMANCE.md with benchmarks/service_load.py);
this file stays as the record of the measurement that motivated it.

    python benchmarks/model_process.py                 # conv4 bench run
    python benchmarks/model_process.py --rates 700,1000,1400

Why: once requests overlap, the model thread spends about a third of its time in a batch
waiting to take the GIL back from the event loop (benchmarks/batch_trace.py,
docs/PERFORMANCE.md). Here the event loop writes each classify job (id, pixels) to a pipe; a
worker process with its own copy of the model and gallery (a second ServiceState on the same
run, with a store of its own: the benchmark adds nothing to either) reads whatever is queued as
one batch, runs the service's own `run_batch`, and writes the results back as JSON; the loop
reads them in a reader callback. No second Python thread shares the loop's GIL.

What the prototype leaves out, so it is not the service: gallery writes do not reach the
worker (the benchmark makes none), and only the benchmark's request is supported (no `labels`
filter, no neighbours). Everything else (HTTP, middleware, multipart, decoding, JSON) is the
real service.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import httpx  # noqa: E402
from service_load import RUNS, latency_ratio, print_rows, query_png, serve  # noqa: E402

# In the server process: start the worker, wait until it is ready, then run snca-serve with
# ModelRuntime.classify sending jobs to the worker.
STUB = r"""
import asyncio, itertools, json, os, struct, subprocess, sys
from service.model import runtime
from service.gallery.gallery import Classification
argv = sys.argv[1:]
opt = dict(zip(argv[::2], argv[1::2]))
jobs_r, jobs_w = os.pipe()
done_r, done_w = os.pipe()
worker = subprocess.Popen(
    [sys.executable, "-c", WORKER, opt["--model"], opt["--data-dir"], str(jobs_r), str(done_w)],
    pass_fds=(jobs_r, done_w),
)
os.close(jobs_r); os.close(done_w)
assert os.read(done_r, 1) == b"R", "the worker did not start"
os.set_blocking(done_r, False)
from embedding.votes import VOTES
HEAD = struct.Struct("<qBHI")  # job id, vote, k, pixel bytes
futures, ids, buf, loop = {}, itertools.count(), bytearray(), None

def on_results():
    global buf
    try:
        buf += os.read(done_r, 1 << 20)
    except BlockingIOError:
        return
    while len(buf) >= 4:
        n = int.from_bytes(buf[:4], "little")
        if len(buf) < 4 + n:
            return
        for i, r in json.loads(bytes(buf[4:4 + n])):
            f = futures.pop(i)
            if not f.done():
                f.set_result(
                    Classification(r[0], r[1], [tuple(p) for p in r[2]], r[3], [], r[4], r[5])
                )
        del buf[:4 + n]

async def classify(self, p, query):
    global loop
    vote, k = query.vote, query.k
    if query.labels or query.neighbors:
        raise RuntimeError("the prototype serves no labels filter and no neighbours")
    if loop is None:
        loop = asyncio.get_running_loop()
        loop.add_reader(done_r, on_results)
    i = next(ids)
    f = futures[i] = loop.create_future()
    px = p.pixels.tobytes()
    # a blocking write: it would stall the loop if ~80 jobs (64 KB) were waiting, which the
    # benchmark's 64 connections never reach
    os.write(jobs_w, HEAD.pack(i, VOTES.index(vote), k, len(px)) + px)
    return await f

runtime.ModelRuntime.classify = classify
from service.cli import main
sys.argv = ["snca-serve"] + argv
code = main()
worker.kill()
sys.exit(code)
"""

WORKER = r"""
import json, os, struct, sys
from pathlib import Path
import numpy as np
import torch
from service.config import Settings
from service.gallery.query import VoteQuery
from service.model.runtime import Job
from service.startup import ServiceHost
run, data_dir, jobs_r, done_w = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
st = ServiceHost(Settings(model=run, data_dir=data_dir / "worker")).finish().runtime
# the service sets its thread count on the model thread; OpenMP keeps it per thread
torch.set_num_threads(st.info.torch_threads)
shape = (st.embedder.model.config.in_channels,) + (st.embedder.model.config.image_size,) * 2
from embedding.votes import VOTES
HEAD = struct.Struct("<qBHI")
os.write(done_w, b"R")
buf = bytearray()
while data := os.read(jobs_r, 1 << 20):  # everything queued is one batch
    buf += data
    jobs, ids = [], []
    while len(buf) >= HEAD.size:
        i, v, k, n = HEAD.unpack_from(buf)
        if len(buf) < HEAD.size + n:
            break
        px = np.frombuffer(bytes(buf[HEAD.size:HEAD.size + n]), np.uint8).reshape(shape)
        jobs.append(Job("classify", px, VoteQuery(VOTES[v], k)))
        ids.append(i)
        del buf[:HEAD.size + n]
    for s in range(0, len(jobs), 64):
        res = st.run_batch(jobs[s:s + 64])
        out = json.dumps(
            [[i, [r.label, r.confidence, r.probabilities, r.best_similarity, r.unknown_score,
                  r.label_id]]
             for i, r in zip(ids[s:s + 64], res)]
        ).encode()
        os.write(done_w, len(out).to_bytes(4, "little") + out)
"""


def measure(name: str, proc, port: int, a, pool) -> tuple[dict, int]:
    """(one /classify answer, errors over all levels)"""
    png = query_png()
    answer = httpx.post(
        f"http://127.0.0.1:{port}/classify", files={"image": ("q.png", png, "image/png")}
    ).json()
    rows = latency_ratio(pool, proc.pid, port, png, a.seconds, rates=a.rates)
    print_rows(f"  {name} ", rows)
    return answer, sum(r.get("errors", 0) for _, r in rows)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="conv4", help="bench model name or run dir")
    ap.add_argument("--rates", default="700,1000", help="fixed open-loop rates too")
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--port", type=int, default=8915)
    a = ap.parse_args()
    try:
        a.rates = [float(x) for x in a.rates.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--rates {a.rates!r}: comma-separated numbers")
    if a.seconds <= 0 or any(r <= 0 for r in a.rates):
        ap.error("--seconds and --rates must be positive")
    run = RUNS.get(a.model, Path(a.model))
    code = STUB.replace("WORKER, ", repr(WORKER) + ", ", 1)  # the worker's code, inlined
    answers, errors = [], 0
    with mp.get_context("spawn").Pool(1) as pool:
        for name, args in (("model thread ", ("-m", "service")), ("model process", ("-c", code))):
            proc = serve(
                run,
                a.port,
                64,
                run / "bench-model-process",
                python_args=args,
                extra=("--no-model-process",),
            )
            try:
                answer, n = measure(name, proc, a.port, a, pool)
            finally:
                proc.terminate()
                proc.wait(timeout=60)
            answers.append({k: answer.get(k) for k in ("label", "probabilities", "unknown")})
            errors += n
    same = answers[0] == answers[1]
    print(f"same answer from both: {same}; errors {errors}")
    if not same or errors:
        print(f"  {answers}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
