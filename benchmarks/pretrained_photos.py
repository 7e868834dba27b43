"""A pretrained photo model served with nothing trained (issue 41), measured on real photographs.

    python benchmarks/pretrained_photos.py RUN [--json docs/pretrained_photos.json]

RUN: a run dir with its index (`snca-train --init pypi:efficientnet-lite0 --epochs 0` then
`snca-build-index`; `make photos` makes runs/photos-lite0). For K = 1, 3, 5: a fresh gallery
(the service's app in this process, default settings: vote, open set, world check), K crops of
each object registered through /gallery/add, then through /classify:
- held-out crops of every object (other regions and scales, mirrored, turned by up to 15
  degrees, JPEG quality 50-95): top-1 (right and known), the share answered unknown, and the
  largest share of one object's crops named as another object;
- unrelated photographs (scikit-image's others, LFW portraits) and 200 Fashion-MNIST test
  images: the share answered unknown.
Photographs: scikit-image's (installed with `make install`); none is used to choose anything.
"""

from __future__ import annotations

import argparse
import io
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from embedding.datasets import load_raw
from service.config import Settings
from service.http.app import create_app

CUP = (90, 0, 490, 400)  # the cup and saucer in skimage's coffee.png
OBJECTS = {
    "cup": ("coffee", CUP),
    "cat": ("chelsea", None),
    "astronaut": ("astronaut", None),
    "rocket": ("rocket", None),
    "motorcycle": ("motorcycle", None),
}
UNRELATED = ("camera", "coins", "moon", "page", "text", "brick", "grass", "gravel",
             "hubble_deep_field", "retina", "cell", "immunohistochemistry")  # fmt: skip


def photo(name: str) -> Image.Image:
    import skimage.data

    im = (
        skimage.data.stereo_motorcycle()[0]
        if name == "motorcycle"
        else getattr(skimage.data, name)()
    )
    if im.dtype == bool:
        im = im.astype(np.uint8) * 255
    if im.ndim == 3 and im.shape[2] == 4:
        im = im[..., :3]
    return Image.fromarray(im)


def crops(img: Image.Image, n: int, seed: int, box=None, hard: bool = False) -> list[bytes]:
    """`n` JPEG crops: square, 60-100% of the box (or the image's short side); `hard`: also
    mirrored at random, turned by up to 15 degrees, JPEG quality 50-95 (else 92)."""
    r = np.random.default_rng(seed)
    x0, y0, x1, y1 = box or (0, 0, *img.size)
    out = []
    for _ in range(n):
        side = min(x1 - x0, y1 - y0)
        s = int(side * r.uniform(0.6, 1.0))
        x, y = x0 + int(r.integers(0, x1 - x0 - s + 1)), y0 + int(r.integers(0, y1 - y0 - s + 1))
        c = img.crop((x, y, x + s, y + s)).convert("RGB")
        if hard:
            if r.random() < 0.5:
                c = c.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            c = c.rotate(float(r.uniform(-15, 15)), Image.Resampling.BICUBIC)
        b = io.BytesIO()
        c.save(b, "JPEG", quality=int(r.integers(50, 96)) if hard else 92)
        out.append(b.getvalue())
    return out


def unrelated_images() -> list[bytes]:
    import skimage.data

    out = [x for name in UNRELATED for x in crops(photo(name), 2, 3)]
    for f in skimage.data.lfw_subset()[:10]:
        b = io.BytesIO()
        Image.fromarray((f * 255).astype(np.uint8)).convert("RGB").save(b, "JPEG", quality=92)
        out.append(b.getvalue())
    return out


def fashion_images(n: int = 200) -> list[bytes]:
    test = load_raw("fashion-mnist", "test")
    out = []
    for i in np.random.default_rng(0).choice(len(test.targets), n, replace=False):
        b = io.BytesIO()
        Image.fromarray(test.source.get(int(i))[0].numpy()).save(b, "PNG")
        out.append(b.getvalue())
    return out


def _in_world(a: dict) -> bool:
    """The world check's verdict on an answer (no check counts as in)."""
    t = a["world_threshold"]
    return a["world_score"] is None or t is None or a["world_score"] <= t


def _margin(name: str, a: dict) -> float:
    """Cosine similarity of the nearest item of the right object minus that of the nearest
    other one, among the answer's neighbours (an absent side counts as the farthest shown)."""
    sims = [n["similarity"] for n in a["neighbors"]]
    right = max((n["similarity"] for n in a["neighbors"] if n["label"] == name), default=min(sims))
    other = max((n["similarity"] for n in a["neighbors"] if n["label"] != name), default=min(sims))
    return right - other


def measure(run: Path, k: int, held_out: int, data_dir: Path | None = None) -> dict:
    """`data_dir` given: the gallery there (registered when empty, else carried to `run` at
    start-up, as a retrained model's start does)."""
    with tempfile.TemporaryDirectory() as tmp:
        return _measure(run, k, held_out, data_dir or Path(tmp))


def _measure(run: Path, k: int, held_out: int, data_dir: Path) -> dict:
    from fastapi.testclient import TestClient

    fresh = not any(data_dir.glob("*.sqlite"))
    app = create_app(Settings(model=run, data_dir=data_dir, model_process=False))
    with TestClient(app, base_url="http://localhost") as c:

        def ask(b: bytes) -> dict:
            r = c.post("/classify?neighbors=true", files={"image": ("q.jpg", b, "image/jpeg")})
            r.raise_for_status()
            return r.json()

        deadline = time.monotonic() + 600  # a start on another model's gallery carries it
        while c.get("/readyz").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.5)
        for name, (src, box) in OBJECTS.items() if fresh else ():
            files = [("images", (f"{i}.jpg", b, "image/jpeg")) for i, b in enumerate(crops(photo(src), k, 1, box))]  # fmt: skip
            c.post("/gallery/add", data={"label": name}, files=files).raise_for_status()
        rows, t0, n = {}, time.perf_counter(), 0
        for name, (src, box) in OBJECTS.items():
            rows[name] = [ask(b) for b in crops(photo(src), held_out, 7, box, hard=True)]
            n += held_out
        per_s = n / (time.perf_counter() - t0)
        flat = [(name, a) for name, got in rows.items() for a in got]
        taken = max(
            np.mean([a["label"] == other for a in got])
            for name, got in rows.items()
            for other in OBJECTS
            if other != name
        )
        strangers = [ask(b) for b in unrelated_images()]
        clothes = [ask(b) for b in fashion_images()]
    return {
        "k": k,
        "held_out": len(flat),
        "top1": float(np.mean([a["label"] == name for name, a in flat])),
        "unknown": float(np.mean([a["unknown"] for _, a in flat])),
        "nearest_top1": float(np.mean([a["nearest_label"] == name for name, a in flat])),
        "margin": round(float(np.mean([_margin(name, a) for name, a in flat])), 4),
        "max_taken_by_another": float(taken),
        "unrelated": len(strangers),
        "unrelated_unknown": float(np.mean([a["unknown"] for a in strangers])),
        "fashion_mnist_unknown": float(np.mean([a["unknown"] for a in clothes])),
        # the world check alone (fitted on the registered images: nothing trained)
        "world_checked": float(np.mean([a["world_basis"] is not None for _, a in flat])),
        "held_out_outside_world": float(np.mean([not _in_world(a) for _, a in flat])),
        "unrelated_outside_world": float(np.mean([not _in_world(a) for a in strangers])),
        "fashion_mnist_outside_world": float(np.mean([not _in_world(a) for a in clothes])),
        "classify_per_s": round(per_s, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("run", type=Path)
    ap.add_argument("--held-out", type=int, default=20, help="crops per object to classify")
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--ks",
        default="1,3,5",
        help="K registered crops an object, one gallery each (comma-separated; empty: none)",
    )
    ap.add_argument(
        "--retrain",
        action="append",
        default=[],
        metavar="FLAGS",
        help="also: after K = 5, `snca-train --dataset gallery --init RUN FLAGS` on that "
        "gallery, index, start on it (the carry) and measure again; repeatable",
    )
    a = ap.parse_args()
    out, retrained = [], []
    for k in [int(x) for x in a.ks.split(",") if x]:
        r = measure(a.run, k, a.held_out)
        out.append(r)
        _report(r)
    with tempfile.TemporaryDirectory() as tmp:
        for i, flags in enumerate(a.retrain):
            data = Path(tmp) / f"data-{i}"
            before = measure(a.run, 5, a.held_out, data)  # the same K = 5 gallery, kept
            ft = Path(tmp) / f"ft-{i}"
            t0 = time.perf_counter()
            subprocess.run(
                [sys.executable, "-m", "training", "--dataset", "gallery", "--init", str(a.run),
                 "--data-dir", str(data), *flags.split(), "--out", str(ft), "--no-progress"],
                check=True,
            )  # fmt: skip
            trained_s = time.perf_counter() - t0
            subprocess.run([sys.executable, "-m", "index_builder", str(ft), "--no-progress"], check=True)  # fmt: skip
            after = measure(ft, 5, a.held_out, data)
            after |= {"flags": flags, "train_seconds": round(trained_s, 1)}
            retrained.append({"before": before, "after": after})
            print(f"retrained with `{flags}` ({trained_s:.0f} s): before / after")
            _report(before)
            _report(after)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS of this process (model, app, client): {rss:.0f} MB")
    if a.json:
        doc = {"results": out, "retrained": retrained, "peak_rss_mb": round(rss)}
        a.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


def _report(r: dict) -> None:
    k = r["k"]
    print(
        f"K={k}: top-1 {100 * r['top1']:.1f}% ({r['held_out']} held-out crops), unknown "
        f"{100 * r['unknown']:.1f}%, nearest label right {100 * r['nearest_top1']:.1f}%, most "
        f"taken by another object {100 * r['max_taken_by_another']:.1f}%; unrelated photos "
        f"unknown {100 * r['unrelated_unknown']:.1f}% of {r['unrelated']}, Fashion-MNIST "
        f"unknown {100 * r['fashion_mnist_unknown']:.1f}%; {r['classify_per_s']} classify/s; "
        f"the world check alone (on {100 * r['world_checked']:.0f}% of crops): outside "
        f"{100 * r['held_out_outside_world']:.1f}% of held-out crops, "
        f"{100 * r['unrelated_outside_world']:.1f}% of unrelated, "
        f"{100 * r['fashion_mnist_outside_world']:.1f}% of Fashion-MNIST; margin "
        f"{r['margin']:+.3f}",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
