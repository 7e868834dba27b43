"""Issue 42's A/B: POST /classify on a real snca-serve from this tree (each SNCA_ENGINE asked
for) against a worktree of an older commit, alternating, in one run.

    git worktree add /tmp/base 1852e10   # and its index of the same model: --base-run
    python benchmarks/engine_ab.py runs/demo --base /tmp/base --rounds 2 --seconds 8 \\
        --engines auto,torch --json docs/engine_ab.json

Per server: the lone request (c = 1, median), closed-loop throughput at 16 and 64 keep-alive
connections, the open loop at fixed offered rates (p50/p99; "overloaded" where the server could
not keep up), the resident memory of front + model process after the run (benchmarks/
service_load.py's clients and measures). Each server gets a fresh copy of nothing: its own data
dir, created from the run's index at start. Prints a row per server and the medians' ratios.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.service_load import (
    _open_level,
    _with_cpu,
    load_level,
    photo_folder,
    query_photo,
    query_png,
    request_bytes,
    serve,
    server_memory,
)

ROOT = Path(__file__).resolve().parents[1]


def register_photos(port: int, folder: Path, per_label: int = 4) -> None:
    """An empty photo gallery answers without voting: give it labels first (crops of
    scikit-image's photographs, service_load.photo_folder)."""
    import httpx

    for d in sorted(p for p in folder.iterdir() if p.is_dir()):
        files = [("images", (f.name, f.read_bytes(), "image/jpeg"))
                 for f in sorted(d.glob("*.jpg"))[:per_label]]  # fmt: skip
        r = httpx.post(f"http://127.0.0.1:{port}/gallery/add", data={"label": d.name},
                       files=files, timeout=120)  # fmt: skip
        r.raise_for_status()


def measure(pool, proc, port, req, seconds: float, rates: list[float], levels: list[int]) -> dict:
    host = "127.0.0.1"
    out = {}
    for c in levels:
        r = _with_cpu(pool, proc.pid, load_level, (host, port, req, c, seconds))
        out[f"c{c}"] = {k: r[k] for k in ("rps", "p50_ms", "p99_ms", "errors")}
    for rate in rates:
        r = _open_level(pool, proc.pid, (host, port, req, rate, seconds))
        keep = ("offered_rps", "rps", "p50_ms", "p99_ms", "errors", "overloaded")
        out[f"open{rate:.0f}"] = {k: r[k] for k in keep if k in r}
    out["memory_mb"] = server_memory(proc.pid)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("run", type=Path, help="a run dir with its index (make run's: runs/demo)")
    ap.add_argument("--base", type=Path, help="worktree of the baseline commit (none: no base)")
    ap.add_argument("--levels", default="1,16,64", help="closed-loop connection counts")
    ap.add_argument(
        "--query", choices=("fashion", "photo"), default="fashion",
        help="a 28x28 Fashion-MNIST PNG, or a 640x480 JPEG photograph (photo models)",
    )  # fmt: skip
    ap.add_argument(
        "--base-run",
        type=Path,
        help="the run with an index built by the baseline's snca-build-index (an older service "
        "cannot read a newer index's gallery seed; default: RUN)",
    )
    ap.add_argument("--engines", default="auto,torch", help="SNCA_ENGINE values for this tree")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--rates", default="300,500,700,1000")
    ap.add_argument("--port", type=int, default=8917)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    rates = [float(x) for x in a.rates.split(",") if x]
    levels = [int(x) for x in a.levels.split(",")]
    png = query_photo() if a.query == "photo" else query_png()
    photos = ROOT / "runs" / "bench-photos"
    if a.query == "photo" and not photos.is_dir():
        photo_folder(photos)
    req = request_bytes("127.0.0.1", a.port, png)
    setups = [("base", a.base, {}, a.base_run or a.run)] if a.base else []
    setups += [(f"engine={e}", ROOT, {"SNCA_ENGINE": e}, a.run) for e in a.engines.split(",")]
    results: dict[str, list] = {name: [] for name, *_ in setups}
    with tempfile.TemporaryDirectory() as tmp, mp.get_context("spawn").Pool(1) as pool:
        for r in range(a.rounds):
            for name, tree, env, run in setups:
                data = Path(tmp) / f"{name}-{r}"
                proc = serve(run.resolve(), a.port, 64, data, cwd=tree, env=env)
                try:
                    if a.query == "photo":
                        register_photos(a.port, photos)
                    m = measure(pool, proc, a.port, req, a.seconds, rates, levels)
                finally:
                    proc.terminate()
                    proc.wait(timeout=60)
                results[name].append(m)
                opens = " ".join(
                    f"{k[4:]}/s: " + (f"p99 {v['p99_ms']:.1f}" if "p99_ms" in v else "overloaded")
                    for k, v in m.items()
                    if k.startswith("open")
                )
                errors = sum(v.get("errors", 0) for v in m.values() if isinstance(v, dict))
                if errors:
                    print(f"  ({errors} requests failed: this server's figures are not valid)")
                closed = "; ".join(
                    f"c{c} {m[f'c{c}']['rps']:.0f}/s p50 {m[f'c{c}']['p50_ms']:.2f} ms"
                    for c in levels
                )
                mem = m["memory_mb"]
                print(
                    f"round {r + 1} {name:16s} {closed}; {opens} ms; RSS {mem.get('rss', 0):.0f} "
                    f"MB (model process {mem.get('rss_model_process', 0):.0f})",
                    flush=True,
                )
    if a.base and "c16" in results["base"][0]:
        base16 = statistics.median(m["c16"]["rps"] for m in results["base"])
        for name in results:
            if name != "base":
                ratio = statistics.median(m["c16"]["rps"] for m in results[name]) / base16
                print(f"{name}: c16 throughput {ratio:.2f}x the base's (medians)")
    if a.json:
        a.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
