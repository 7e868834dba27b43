"""Do the engines answer as the torch path does? Every Fashion-MNIST test image (10,000)
classified by the service's own batch code (ServiceHost, the model inline, batches of 64) once
per SNCA_ENGINE, against `torch`: labels, probabilities, open-set and world scores.

    python benchmarks/engine_agreement.py runs/demo --engines onnxruntime,openvino \\
        --json docs/engine_agreement.json

Target (issue 42): labels identical on >= 99.9% of the test set, probabilities and scores
within 1e-3.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def classify_all(run: Path, engine: str, data: Path, pixels: list) -> tuple[list, dict]:
    from service.config import Settings
    from service.gallery.query import VoteQuery
    from service.model.runtime import Job
    from service.startup import ServiceHost

    s = Settings(model=run, data_dir=data, engine=engine, warmup_seconds=0, fused_batches=8)
    host = ServiceHost(s, model="inline")
    host.open()
    st = host.finish()
    try:
        q = VoteQuery(s.vote, s.k)
        out = []
        t0 = time.perf_counter()
        for i in range(0, len(pixels), 64):
            out += st.runtime.run_batch([Job("classify", p, q) for p in pixels[i : i + 64]])
        took = time.perf_counter() - t0
        info = {"engine": st.runtime.info.engine, "note": st.runtime.info.engine_note,
                "seconds": round(took, 2)}  # fmt: skip
    finally:
        host.stop()
    return out, info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("run", type=Path)
    ap.add_argument("--engines", default="onnxruntime,openvino")
    ap.add_argument("--limit", type=int, default=10_000)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    from embedding.datasets import load_raw

    src = load_raw("fashion-mnist", "test").source
    n = min(a.limit, len(src))
    pixels = [np.ascontiguousarray(src.get(i)[0].numpy(), np.uint8)[None] for i in range(n)]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        ref, info = classify_all(a.run, "torch", Path(tmp) / "torch", pixels)
        results["torch"] = info
        print(f"torch: {info}", flush=True)
        for engine in a.engines.split(","):
            got, info = classify_all(a.run, engine, Path(tmp) / engine, pixels)
            same = sum(x.label == y.label for x, y in zip(ref, got, strict=True))

            def worst(f, ref=ref, got=got):
                d = [abs(f(x) - f(y)) for x, y in zip(ref, got, strict=True)
                     if f(x) is not None and f(y) is not None]  # fmt: skip
                return max(d) if d else 0.0

            row = {
                **info,
                "images": n,
                "labels_identical": same / n,
                "max_abs_confidence": worst(lambda c: c.confidence),
                "max_abs_probability": max(
                    abs(p - dict(y.probabilities).get(lab, 0.0))
                    for x, y in zip(ref, got, strict=True)
                    for lab, p in x.probabilities
                ),
                "max_abs_best_similarity": worst(lambda c: c.best_similarity),
                "max_abs_unknown_score": worst(lambda c: c.unknown_score),
                "max_rel_world_score": max(
                    (
                        abs(x.world.score - y.world.score) / max(1.0, abs(x.world.score))
                        for x, y in zip(ref, got, strict=True)
                        if x.world.score is not None and y.world.score is not None
                    ),
                    default=0.0,
                ),
                "world_verdicts_identical": sum(
                    x.world.ok == y.world.ok for x, y in zip(ref, got, strict=True)
                )
                / n,
            }
            results[engine] = row
            print(f"{engine}: {row}", flush=True)
    if a.json:
        a.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
