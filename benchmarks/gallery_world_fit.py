"""What a write costs a gallery served with nothing trained: its world is fitted on the
registered images themselves (embedding.world.fit_gallery), anew on every write while the
gallery has fewer than FIT_SAMPLE (1,024) images, under the write lock, in each process that
holds the gallery. Two parts:

- fit_gallery alone on random statistics of N images, C labels, D dimensions (the per-write
  refit, in ms);
- with --run RUN (a model with nothing trained: `snca-train --init RUN --epochs 0`, indexed),
  POST /gallery/add of 2 random 28x28 images at a time, 8 labels, on a fresh snca-serve with an
  empty data dir: the latency of each add (median, p90, the last 50's median) as the gallery
  grows.

    python benchmarks/gallery_world_fit.py --run runs/untrained --adds 300

To compare two commits, run this file from a worktree of each (docs/PERFORMANCE.md did).
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from embedding.world import fit_gallery

SIZES = ((60, 10, 129), (300, 10, 129), (300, 10, 1025), (1024, 30, 129))


def fit_ms(n: int, labels: int, dim: int, repeat: int = 5) -> float:
    """The median time of fit_gallery on n images of `labels` clustered labels, in ms."""
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(labels, dim)) * 2
    y = rng.integers(0, labels, n)
    s = (centers[y] + rng.normal(size=(n, dim))).astype(np.float32)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fit_gallery(s, y)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def add_latency(run: Path, adds: int, port: int) -> dict:
    """Latencies (ms) of `adds` POST /gallery/add of 2 random images on a fresh snca-serve."""
    import httpx
    from PIL import Image

    from benchmarks.service_load import serve

    rng = np.random.default_rng(0)

    def png() -> bytes:
        b = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (28, 28), dtype=np.uint8)).save(b, "PNG")
        return b.getvalue()

    with tempfile.TemporaryDirectory() as d:
        p = serve(run, port, 64, Path(d) / "data")
        try:
            lat = []
            with httpx.Client(timeout=60) as c:
                for i in range(adds):
                    files = [("images", (f"{k}.png", png(), "image/png")) for k in range(2)]
                    t = time.perf_counter()
                    r = c.post(
                        f"http://127.0.0.1:{port}/gallery/add",
                        data={"label": f"label-{i % 8}"},
                        files=files,
                    )
                    lat.append((time.perf_counter() - t) * 1000)
                    if r.status_code != 201:
                        raise RuntimeError(f"add {i}: {r.status_code} {r.text[:200]}")
        finally:
            p.kill()
            p.wait()
    return {
        "adds": adds,
        "median_ms": statistics.median(lat),
        "p90_ms": float(np.percentile(lat, 90)),
        "last_50_median_ms": statistics.median(lat[-50:]),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, help="a model with nothing trained, for the HTTP part")
    ap.add_argument("--adds", type=int, default=300, help="adds of the HTTP part (300)")
    ap.add_argument("--port", type=int, default=8791)
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)
    out: dict = {"fit_gallery_ms": []}
    for n, labels, dim in SIZES:
        ms = fit_ms(n, labels, dim)
        out["fit_gallery_ms"].append({"images": n, "labels": labels, "dim": dim, "ms": ms})
        print(f"fit_gallery: {n} images, {labels} labels, D={dim}: {ms:.1f} ms", flush=True)
    if args.run is not None:
        out["adds"] = add_latency(args.run, args.adds, args.port)
        a = out["adds"]
        print(
            f"POST /gallery/add (2 images) x {a['adds']}: median {a['median_ms']:.1f} ms, "
            f"p90 {a['p90_ms']:.1f} ms, last 50 {a['last_50_median_ms']:.1f} ms",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
