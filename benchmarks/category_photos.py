"""Real photographs of categories on the pretrained photo model with nothing trained (issue 52):
five photos of each category registered, every other photo of it classified, and unrelated
photos, paintings and Fashion-MNIST images classified too; several draws of the five.

The photos: Debian's `gcompris-qt-data` (the educational suite GCompris; its images come from
Wikimedia Commons and similar, their sources and licences in each folder's README), read out of
its Qt resource files (`apt-get download` into a cache, no install). Categories of different
things, not crops of one photo: mammals, birds, fish, fruit, monuments, wind turbines, hammers,
solar panels (each of at least 8 photos, duplicates by content dropped); unrelated: objects,
reptiles, insects, people and body parts (its word pictures), paintings, Fashion-MNIST.

    python benchmarks/category_photos.py runs/photos-lite0 --draws 5 --json docs/category_photos.json

Reports per draw and on average: the share of category photos named right, answered unknown,
named wrong (with the unknown reasons), and the share of each unrelated set answered unknown.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zlib
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.command_line import parser, write_report

CACHE = Path(os.environ.get("SNCA_CACHE", Path.home() / ".cache" / "snca")) / "gcompris"
PACKAGE = "gcompris-qt-data"
RCC = ("categorization", "lang", "erase", "explore_farm_animals", "explore_world_animals",
       "paintings")  # fmt: skip

MAMMALS = {
    "alpaca", "calf", "camels", "cheetah", "flying_fox", "gibbon", "giraffe", "goat", "gorilla",
    "horse", "kitten", "long_nosed_monkey", "macaque", "meerkats", "nubian_ibex", "pika",
    "red_panda", "rhinoceros", "squirrel", "cat", "cow", "dog", "pig", "sheep", "bison",
    "jaguar", "kangaroo", "koala", "lemur", "moose", "panda", "polar_bear", "bear", "bull",
    "camel", "fox", "hedgehog", "hippopotamus", "mouse", "rabbit", "wolf",
}  # fmt: skip
BIRDS = {"gosling", "heron", "kingfisher", "northern_harrier", "penguin", "spoonbills", "swans",
         "toucan", "chicken", "duck", "owl", "scarlet_macaw", "bird", "turkey"}  # fmt: skip
FRUIT = {"apple", "apricot", "coconut", "kiwi", "lemon", "melon", "orange", "peach", "pear",
         "plum", "raspberry", "strawberry"}  # fmt: skip
UNRELATED_WORDS = {"beetle", "bee", "bug", "butterfly", "flies", "mosquito", "spider", "snail",
                   "frog", "lizard", "snake", "turtle", "reptile", "dragon", "boy", "girl", "man",
                   "woman", "child", "hand", "foot", "face", "eyes", "ear", "nose", "mouth",
                   "teeth", "tongue", "hair", "leg", "knee", "arm", "thumb", "finger", "neck"}  # fmt: skip


def rcc_files(path: Path) -> dict[str, bytes]:
    """path inside -> bytes of a Qt resource file (zlib-compressed entries inflated)."""
    d = path.read_bytes()
    if d[:4] != b"qres":
        raise ValueError(f"{path}: not a Qt resource file")
    ver, tree, data, names = struct.unpack(">IIII", d[4:20])
    node = 22 if ver >= 2 else 14
    out: dict[str, bytes] = {}

    def name(off: int) -> str:
        (n,) = struct.unpack(">H", d[names + off : names + off + 2])
        return d[names + off + 6 : names + off + 6 + 2 * n].decode("utf-16-be")

    def walk(i: int, prefix: str) -> None:
        base = tree + i * node
        noff, flags = struct.unpack(">IH", d[base : base + 6])
        nm = name(noff) if i else ""
        if flags & 2:  # a directory
            count, first = struct.unpack(">II", d[base + 6 : base + 14])
            for c in range(count):
                walk(first + c, f"{prefix}/{nm}" if nm else prefix)
            return
        (doff,) = struct.unpack(">I", d[base + 10 : base + 14])
        (size,) = struct.unpack(">I", d[data + doff : data + doff + 4])
        blob = d[data + doff + 4 : data + doff + 4 + size]
        if flags & 1:
            blob = zlib.decompress(blob[4:])
        elif flags & 4:  # zstd: not used by these files
            return
        out[f"{prefix}/{nm}"] = blob

    walk(0, "")
    return out


def fetch() -> dict[str, bytes]:
    """Every image of the resource files RCC, from the Debian package (downloaded once)."""
    rcc_dir = CACHE / "rcc"
    if not all((rcc_dir / f"{n}.rcc").is_file() for n in RCC):
        with tempfile.TemporaryDirectory() as t:
            subprocess.run(["apt-get", "download", PACKAGE], cwd=t, check=True,
                           capture_output=True)  # fmt: skip
            deb = next(Path(t).glob(f"{PACKAGE}_*.deb"))
            subprocess.run(["dpkg", "-x", str(deb), str(Path(t) / "x")], check=True)
            rcc_dir.mkdir(parents=True, exist_ok=True)
            for n in RCC:
                shutil.copy(Path(t) / "x/usr/share/gcompris-qt/rcc" / f"{n}.rcc", rcc_dir)
    files = {}
    for n in RCC:
        for k, v in rcc_files(rcc_dir / f"{n}.rcc").items():
            if k.endswith((".webp", ".jpg", ".jpeg", ".png")):
                files[k] = v
    return files


def sets(files: dict[str, bytes]) -> tuple[dict[str, list[bytes]], dict[str, list[bytes]]]:
    """(category -> photos, unrelated set -> images), duplicates (by content) dropped."""
    cats: dict[str, list[bytes]] = {}
    other: dict[str, list[bytes]] = {}
    seen: set[str] = set()

    def put(d, key, b):
        h = hashlib.sha256(b).hexdigest()
        if h not in seen:
            seen.add(h)
            d.setdefault(key, []).append(b)

    for path, b in sorted(files.items()):
        stem, folder = Path(path).stem, Path(path).parent.name
        base = stem.rstrip("0123456789")
        if "paintings" in path:
            put(other, "paintings", b)
        elif folder == "fishes" or base in ("fish", "shark"):
            put(cats, "fish", b)
        elif folder == "monuments" and stem != "README":
            put(cats, "monument", b)
        elif base in ("windmill",):
            put(cats, "wind turbine", b)
        elif base == "solar":
            put(cats, "solar panel", b)
        elif base == "hammer":
            put(cats, "hammer", b)
        elif stem in MAMMALS:
            put(cats, "mammal", b)
        elif stem in BIRDS:
            put(cats, "bird", b)
        elif stem in FRUIT:
            put(cats, "fruit", b)
        elif folder == "others" or stem in UNRELATED_WORDS:
            put(other, "objects, small animals, people", b)
    cats = {k: v for k, v in cats.items() if len(v) >= 8}
    return cats, other


def _png(a: np.ndarray) -> bytes:
    from PIL import Image

    b = io.BytesIO()
    Image.fromarray(a).save(b, "PNG")
    return b.getvalue()


def photo_parser(doc: str, draws: int) -> argparse.ArgumentParser:
    """The options of a benchmark on these photos: the served model, shots, draws, seed (and
    --json); `doc`'s first paragraph is its help."""
    ap = parser(doc.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="the pretrained photo model (make photos makes it)")
    ap.add_argument("--shots", type=int, default=5, help="photos registered per category (5)")
    ap.add_argument("--draws", type=int, default=draws, help=f"draws of those photos ({draws})")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def photo_sets() -> tuple[dict, dict]:
    """(categories, unrelated sets) as PNG bytes: the package's photos, and Fashion-MNIST test
    images (every 333rd) among the unrelated."""
    from embedding.datasets import load_raw

    cats, other = sets(fetch())
    fm = load_raw("fashion-mnist", "test")
    other["Fashion-MNIST"] = [_png(fm.source.get(i)[0].numpy()) for i in range(0, 10000, 333)]
    return cats, other


def main(argv: list[str] | None = None) -> int:
    ap = photo_parser(__doc__, draws=5)
    ap.add_argument("--paintings", type=int, default=60, help="paintings classified per draw")
    ap.add_argument("--vote", help="the /classify vote (default: the service's)")
    ap.add_argument(
        "--learn",
        type=int,
        metavar="EPOCHS",
        help="then snca-gallery learn (this many epochs) and classify again on the learned model",
    )
    a = ap.parse_args(argv)
    from tests.service.helpers import make_client

    cats, other = photo_sets()
    print("categories:", {k: len(v) for k, v in cats.items()}, "unrelated:",
          {k: len(v) for k, v in other.items()}, flush=True)  # fmt: skip
    rng = np.random.default_rng(a.seed)
    draws = []
    for draw in range(a.draws):
        d = tempfile.mkdtemp(prefix="category-photos-")
        queries = []
        with make_client(a.run, Path(d) / "data") as c:
            for label, photos in cats.items():
                order = rng.permutation(len(photos))
                files = [("images", (f"{i}.img", photos[i])) for i in order[: a.shots]]
                r = c.post("/gallery/add", data={"label": label}, files=files)
                assert r.status_code == 201, r.text
                queries += [(label, photos[i]) for i in order[a.shots :]]
        rounds = [("served", a.run)]
        if a.learn:
            out = Path(d) / "learned"
            cmd = [sys.executable, "-m", "service.tools.gallery_tool", "learn", "--model",
                   str(a.run), "--data-dir", str(Path(d) / "data"), "--out", str(out),
                   "--epochs", str(a.learn), "--no-progress"]  # fmt: skip
            lp = subprocess.run(cmd, capture_output=True, text=True)
            print(lp.stdout[-1500:], lp.stderr[-1500:], flush=True)
            if json.loads((out / "learn.json").read_text()).get("switched"):
                rounds.append(("learned", out))
        for which, run in rounds:
            row = _round(make_client, run, d, queries, other, cats, rng, a)
            row["model"] = which
            draws.append(row)
            print(f"draw {draw + 1} ({which}): named right {100 * row['named_right']:.1f}%, "
                  f"unknown {100 * row['unknown']:.1f}% ({row['unknown_reasons']}), wrong "
                  f"{100 * row['wrong']:.1f}%; nearest label right {100 * row['nearest_right']:.1f}%; "
                  "unrelated unknown: " + ", ".join(
                      f"{k} {100 * v:.0f}%" for k, v in row["unrelated_unknown"].items()),
                  flush=True)  # fmt: skip
        shutil.rmtree(d, ignore_errors=True)
    for which in ("served", "learned"):
        rows = [r for r in draws if r["model"] == which]
        if not rows:
            continue
        mean = {
            k: float(np.mean([r[k] for r in rows])) for k in ("named_right", "unknown", "wrong")
        }
        worst = float(min(r["named_right"] for r in rows))
        unrel = {k: float(np.mean([r["unrelated_unknown"][k] for r in rows])) for k in other}
        print(f"{which}: mean of {len(rows)} draws: named right {100 * mean['named_right']:.1f}% "
              f"(worst {100 * worst:.1f}%), unknown {100 * mean['unknown']:.1f}%, wrong "
              f"{100 * mean['wrong']:.1f}%; unrelated unknown "
              + ", ".join(f"{k} {100 * v:.0f}%" for k, v in unrel.items()))  # fmt: skip
    write_report(a.json, {"source": f"Debian {PACKAGE}", "shots": a.shots, "learn_epochs": a.learn,
                          "categories": {k: len(v) for k, v in cats.items()}, "draws": draws})  # fmt: skip
    return 0


def _round(make_client, run, d, queries, other, cats, rng, a) -> dict:
    """The queries and the unrelated sets through /classify of `run` on the draw's gallery."""
    with make_client(run, Path(d) / "data") as c:  # (the learned model finds its own gallery)
        params = {"vote": a.vote} if a.vote else {}

        def ask(img):
            return c.post("/classify", params=params, files={"image": ("q.img", img)}).json()

        got = [(label, ask(img)) for label, img in queries]
        right = np.mean([x["label"] == lab for lab, x in got])
        unknown = np.mean([x["unknown"] for _, x in got])
        nearest = np.mean([x["nearest_label"] == lab for lab, x in got])
        reasons = Counter(x.get("unknown_reason") for _, x in got if x["unknown"])
        per = {
            lab: float(np.mean([x["label"] == lab for lb, x in got if lb == lab])) for lab in cats
        }
        unrel = {}
        for name, imgs in other.items():
            pick = imgs if name != "paintings" else [
                imgs[i] for i in rng.permutation(len(imgs))[: a.paintings]]  # fmt: skip
            unrel[name] = float(np.mean([ask(img)["unknown"] for img in pick]))
        return {"named_right": float(right), "unknown": float(unknown),
                "wrong": float(1 - right - unknown), "nearest_right": float(nearest),
                "unknown_reasons": dict(reasons), "per_category": per,
                "unrelated_unknown": unrel, "queries": len(got)}  # fmt: skip


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    sys.exit(main())
