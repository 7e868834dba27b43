"""This project's load client (benchmarks/service_load.py) against wrk on one server, alternating
in one run (issue 55: the two were said to disagree, 1,100-1,380 against 580-690 classify/s at 16
connections): the same multipart request of a 28x28 Fashion-MNIST PNG to POST /classify, the
same keep-alive connections and seconds; classify/s, non-2xx answers, and the server's CPU per
request from /proc (the front and its model process), which does not depend on the client.

    apt-get install wrk                                   # (a benchmark's tool; CI needs none)
    python benchmarks/service_load.py --prepare --models conv4 --levels 1 --max-batches 64
    python benchmarks/wrk_compare.py --model runs/bench-conv4 --rounds 3 --seconds 10
    python benchmarks/wrk_compare.py --model runs/demo    # make run's 55,000-item gallery
"""

from __future__ import annotations

import multiprocessing as mp
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import benchmarks.service_load as sl  # noqa: E402
from benchmarks.command_line import parser, write_report  # noqa: E402
from benchmarks.image_body import front, medians, service  # noqa: E402

LUA = """wrk.method = "POST"
wrk.headers["Content-Type"] = "{ctype}"
local f = assert(io.open("{body}", "rb"))
wrk.body = f:read("*all")
f:close()
"""


def wrk_level(exe: str, url: str, script: Path, conc: int, secs: float, pid: int) -> dict:
    """One wrk run (1 thread, `conc` connections): classify/s, requests, non-2xx, server CPU."""
    before = sl.server_cpu(pid)
    p = subprocess.run(
        [exe, "-t1", f"-c{conc}", f"-d{secs:g}s", "--latency", "-s", str(script), url],
        capture_output=True,
        text=True,
        check=True,
    )
    after = sl.server_cpu(pid)
    n = int(re.search(r"(\d+) requests in", p.stdout).group(1))
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", p.stdout)
    rps = float(re.search(r"Requests/sec:\s*([\d.]+)", p.stdout).group(1))
    return {
        "rps": rps,
        "requests": n,
        "errors": int(bad.group(1)) if bad else 0,
        "server_cpu_us": sl._server_cpu_us(before, after, n),
        "stdout": p.stdout,
    }


def main() -> int:
    ap = parser(__doc__, seconds=10.0, rounds=3, port=8919)
    ap.add_argument("--model", default=str(sl.RUNS["conv4"]), help="run dir with an index")
    ap.add_argument("--concurrency", type=int, default=16, help="keep-alive connections")
    a = ap.parse_args()
    exe = shutil.which("wrk")
    if exe is None:
        ap.error("wrk is not installed (apt-get install wrk)")
    run = Path(a.model)
    if not (run / "index" / "manifest.json").is_file():
        ap.error(f"{run} has no index (benchmarks/service_load.py --prepare makes the bench runs)")
    host = "127.0.0.1"
    req = sl.request_bytes(host, a.port, sl.query_png())
    head, body = req.split(b"\r\n\r\n", 1)
    ctype = re.search(rb"Content-Type: ([^\r\n]+)", head).group(1).decode()
    got: dict[str, list[dict]] = {"ours": [], "wrk": []}
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "body").write_bytes(body)
        script = Path(d) / "post.lua"
        script.write_text(LUA.format(ctype=ctype, body=Path(d) / "body"))
        proc = sl.serve(run, a.port, 64, run / "bench-serve-wrk")
        url = f"http://{host}:{a.port}/classify"

        def measure(who: str) -> dict:
            if who == "ours":
                args = (host, a.port, req, a.concurrency, a.seconds)
                r = sl._with_cpu(pool, proc.pid, sl.load_level, args)
            else:
                r = wrk_level(exe, url, script, a.concurrency, a.seconds, proc.pid)
            print(f"{who:4s}: {r['rps']:6.0f}/s, {r['errors']} non-2xx, CPU us/request: front "
                  f"{front(r):.0f}, service {service(r):.0f}", flush=True)  # fmt: skip
            return r

        try:
            with mp.get_context("spawn").Pool(1) as pool:
                pool.apply(sl.load_level, ((host, a.port, req, a.concurrency, 2.0),))  # warm-up
                for i in range(a.rounds):
                    for who in ("ours", "wrk") if i % 2 == 0 else ("wrk", "ours"):
                        got[who].append(measure(who))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    med = {who: medians(rs) | {"errors": sum(r["errors"] for r in rs)} for who, rs in got.items()}
    o, w = med["ours"], med["wrk"]
    print(
        f"medians of {a.rounds} at c={a.concurrency}, {run}: ours {o['rps']:.0f}/s (front "
        f"{o['front_cpu_us']:.0f} us, service {o['service_cpu_us']:.0f}); wrk {w['rps']:.0f}/s "
        f"(front {w['front_cpu_us']:.0f} us, service {w['service_cpu_us']:.0f}); wrk/ours "
        f"{w['rps'] / o['rps']:.2f}x"
    )
    if a.json:
        for rs in got["wrk"]:
            rs.pop("stdout", None)
        write_report(a.json, {"median": med, "rounds": got}, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
