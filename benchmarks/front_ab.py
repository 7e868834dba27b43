"""This tree's service against an older commit's, side by side in one run (issue 55's measure):
CPU per /classify of the front (its event loop and other threads) and of the whole service
(front + model process), from /proc, and classify/s, at each concurrency; the two servers are
loaded in turn, round after round, the order alternating (the VM's speed drifts: only ratios
measured side by side mean anything). Both serve the same run with the deployed defaults, each
from its own data dir. `--rates`: also open-loop levels at those fixed offered rates (arrivals
not paced by the answers), for p50/p99 at a rate both servers can carry.

    git worktree add /tmp/base cfa811e
    python benchmarks/front_ab.py --base /tmp/base --prepare --rounds 4 --seconds 8
    python benchmarks/front_ab.py --base /tmp/base --model runs/demo --concurrency 16 64
    python benchmarks/front_ab.py --base /tmp/base --concurrency 16 --rates 300

The older server runs the worktree's code with this environment's packages (`python -m
service` from the worktree).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.image_body import front, service  # noqa: E402
from benchmarks.service_load import (  # noqa: E402
    RUNS,
    _open_level,
    _with_cpu,
    load_level,
    prepare,
    query_png,
    request_bytes,
    serve,
    server_memory,
)


def summary(rounds: list[dict]) -> dict:
    """Medians over one server's rounds at one level (rounds it could not keep up with at an
    offered rate are counted, not measured)."""
    over = [r for r in rounds if "overloaded" in r]
    rounds = [r for r in rounds if "overloaded" not in r]
    if not rounds:
        return {"overloaded": len(over)}
    return {
        "overloaded": len(over),
        "rps": statistics.median(r["rps"] for r in rounds),
        "front_cpu_us": statistics.median(front(r) for r in rounds),
        "service_cpu_us": statistics.median(service(r) for r in rounds),
        "p50_ms": statistics.median(r["p50_ms"] for r in rounds),
        "p99_ms": statistics.median(r["p99_ms"] for r in rounds),
        "errors": sum(r["errors"] for r in rounds),
        "requests": sum(r["requests"] for r in rounds),
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--base", required=True, help="a worktree of the commit to compare against")
    ap.add_argument("--prepare", action="store_true", help="train the tiny conv4 bench run first")
    ap.add_argument("--model", default=str(RUNS["conv4"]), help="run dir with an index")
    ap.add_argument("--rounds", type=int, default=4, help="rounds of (base, this tree) each")
    ap.add_argument("--seconds", type=float, default=8.0, help="per measurement")
    ap.add_argument(
        "--concurrency", type=int, nargs="+", default=[16], help="keep-alive connections"
    )
    ap.add_argument(
        "--rates", type=float, nargs="*", default=[], help="also open-loop levels at these /s"
    )
    ap.add_argument("--port", type=int, default=8931, help="the base's; this tree's is +1")
    ap.add_argument("--json", help="also write every round here")
    a = ap.parse_args()
    base = Path(a.base).resolve()
    if not (base / "service" / "__main__.py").is_file():
        ap.error(f"{base} is not a checkout of this project (git worktree add DIR COMMIT)")
    if a.rounds < 1 or a.seconds <= 0 or min(a.concurrency) < 1 or min(a.rates, default=1) <= 0:
        ap.error("--rounds, --seconds, --concurrency and --rates must be positive")
    if a.prepare:
        prepare(["conv4"])
    run = Path(a.model).resolve()
    if not (run / "index" / "manifest.json").is_file():
        ap.error(f"{run} has no index: run with --prepare (the conv4 bench run) or give one")
    png, host = query_png(), "127.0.0.1"
    trees = {"base": base, "this": ROOT}
    ports = {"base": a.port, "this": a.port + 1}
    dirs = {k: run / f"bench-front-ab-{k}" for k in trees}
    procs = {}
    # the levels: closed loops of c connections, then open loops at r/s
    levels = [(str(c), load_level, c) for c in a.concurrency]
    levels += [(f"{r:g}/s", _open_level, r) for r in a.rates]
    got: dict[str, dict[str, list[dict]]] = {k: {n: [] for n, _, _ in levels} for k in trees}
    try:
        for k, tree in trees.items():
            shutil.rmtree(dirs[k], ignore_errors=True)
            print(f"starting {k} ({tree}) on port {ports[k]}", flush=True)
            procs[k] = serve(run, ports[k], 64, dirs[k], cwd=tree, env={"PYTHONPATH": str(tree)})
        reqs = {k: request_bytes(host, ports[k], png) for k in trees}
        with mp.get_context("spawn").Pool(1) as pool:
            for k in trees:  # a warm-up level each, not counted (caches, the batcher's sizes)
                pool.apply(load_level, ((host, ports[k], reqs[k], max(a.concurrency), 2.0),))
            for i in range(a.rounds):
                order = list(trees) if i % 2 == 0 else list(reversed(trees))
                for name, how, x in levels:
                    for k in order:
                        args = (host, ports[k], reqs[k], x, a.seconds)
                        if how is load_level:
                            r = _with_cpu(pool, procs[k].pid, load_level, args)
                        else:
                            r = _open_level(pool, procs[k].pid, args)
                        got[k][name].append(r)
                        at = f"round {i + 1} {name:>6s} {k:4s}:"
                        if "overloaded" in r:
                            print(f"{at} overloaded ({r['overloaded']})", flush=True)
                            continue
                        print(
                            f"{at} {r['rps']:6.0f}/s p50 {r['p50_ms']:.2f} p99 {r['p99_ms']:.2f} "
                            f"ms errors {r['errors']}  CPU us/request: front {front(r):.0f}, "
                            f"service {service(r):.0f}",
                            flush=True,
                        )
        memory = {k: server_memory(procs[k].pid) for k in trees}
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            p.wait(timeout=60)
        for d in dirs.values():
            shutil.rmtree(d, ignore_errors=True)
    out = {"memory_mb": memory, "levels": {}}
    for c, _, _ in levels:
        s = {k: summary(got[k][c]) for k in trees}
        b, t = s["base"], s["this"]
        if "rps" not in b or "rps" not in t:
            out["levels"][c] = s
            print(f"{c}: overloaded in every round ({b['overloaded']} / {t['overloaded']})")
            continue
        ratios_at = (
            f"; p50 {b['p50_ms']:.2f} / {t['p50_ms']:.2f} ms, p99 {b['p99_ms']:.2f} / "
            f"{t['p99_ms']:.2f} ms (base / this; rounds overloaded {b['overloaded']} / "
            f"{t['overloaded']})"
        )
        ratios = {
            "front_cpu": t["front_cpu_us"] / b["front_cpu_us"],
            "service_cpu": t["service_cpu_us"] / b["service_cpu_us"],
            "rps": t["rps"] / b["rps"],
        }
        out["levels"][c] = {**s, "this/base": ratios}
        level = f"c={c}" if c.isdigit() else f"offered {c}"
        print(
            f"{level}, medians of {a.rounds} rounds: base {b['rps']:.0f}/s, front "
            f"{b['front_cpu_us']:.0f} us, service {b['service_cpu_us']:.0f} us | this "
            f"{t['rps']:.0f}/s, front {t['front_cpu_us']:.0f} us, service "
            f"{t['service_cpu_us']:.0f} us | this/base: front {ratios['front_cpu']:.2f}x, "
            f"service {ratios['service_cpu']:.2f}x, classify/s {ratios['rps']:.2f}x; errors "
            f"{b['errors']} / {t['errors']}{ratios_at}",
            flush=True,
        )
    for k in trees:
        m = memory[k]
        print(
            f"{k}: RSS front {m.get('rss_front', 0):.0f} MB, model process "
            f"{m.get('rss_model_process', 0):.0f} MB",
            flush=True,
        )
    if a.json:
        Path(a.json).write_text(json.dumps({"summary": out, "rounds": got}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
