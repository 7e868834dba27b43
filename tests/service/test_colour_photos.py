"""Your own photographs, end to end (issue 30): an ImageFolder of colour JPEG photos (crops of
scikit-image's real photographs, at their own sizes, some stored sideways with an EXIF
Orientation tag as phones do) trained at 224 px from ImageNet-layout weights (`--init
torchvision:resnet18`, read offline from the hub cache), indexed with thumbnails and served by a
real snca-serve process: a photo is classified over HTTP, a new label added from five photos wins
its own, EXIF rotation is applied, colour is kept, and the model card says where the weights
came from."""

from __future__ import annotations

import hashlib
import io
import json

import httpx
import numpy as np
import pytest
import torch
import torchvision
from PIL import Image

from service.model.engines import ENGINES
from tests.helpers import run_cli

from .helpers import Server
from .photos import CUP_BOX, crops, photo

CLASSES = {"cat": ("chelsea", None), "cup": ("coffee", CUP_BOX), "rocket": ("rocket", None)}
ROTATE_TAG = 6  # EXIF Orientation 6: the stored pixels must be turned 90° clockwise to view


def jpeg(img: Image.Image, orientation: int | None = None, fmt: str = "JPEG") -> bytes:
    """`img` encoded; with `orientation`, stored as a camera does: the pixels turned so that
    applying the tag gives `img` back."""
    b = io.BytesIO()
    if orientation is None:
        img.save(b, fmt, quality=92) if fmt == "JPEG" else img.save(b, fmt)
        return b.getvalue()
    exif = Image.Exif()
    exif[0x0112] = orientation
    stored = img.transpose(Image.Transpose.ROTATE_90)  # tag 6 turns it back
    stored.save(b, fmt, exif=exif.tobytes(), **({"quality": 92} if fmt == "JPEG" else {}))
    return b.getvalue()


def landscape(img: Image.Image, seed: int) -> Image.Image:
    """A 3:2 landscape version at a random size between 180 and 420 px wide."""
    w = int(np.random.default_rng(seed).integers(180, 420))
    return img.resize((w, w * 2 // 3), Image.Resampling.BICUBIC)


@pytest.fixture(scope="module")
def photo_run(tmp_path_factory):
    """(run dir, hub file, tmp dir): the folder written, trained and indexed with thumbnails."""
    tmp = tmp_path_factory.mktemp("photos")
    root = tmp / "photos"
    for name, (src, box) in CLASSES.items():
        (root / name).mkdir(parents=True)
        for i, c in enumerate(crops(photo(src), 14, seed=1, box=box)):
            # every fourth stored sideways with its EXIF tag (as phones write portrait shots)
            tag = ROTATE_TAG if i % 4 == 0 else None
            (root / name / f"{i}.jpg").write_bytes(jpeg(landscape(c, i), tag))
    # "ImageNet weights" in torch's hub cache, where torchvision keeps them (random here:
    # nothing can be downloaded; the loading path is the real one)
    hub = tmp / "torch" / "hub" / "checkpoints"
    hub.mkdir(parents=True)
    url = torchvision.models.ResNet18_Weights.DEFAULT.url
    torch.manual_seed(0)
    torch.save(torchvision.models.resnet18(weights=None).state_dict(), hub / url.rsplit("/")[-1])
    run = tmp / "run"
    env = {"TORCH_HOME": str(tmp / "torch")}
    p = run_cli(
        "training", "--dataset", "imagefolder", "--data-dir", root, "--image-size", "224",
        "--arch", "resnet18", "--init", "torchvision:resnet18", "--epochs", "1",
        "--batch-size", "12", "--val-size", "0", "--num-workers", "0", "--out", run,
        "--no-progress", env=env,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    p = run_cli("index_builder", run, "--thumbnails", "--no-progress", env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    return run, hub / url.rsplit("/")[-1], tmp


def test_model_card_records_the_weights_source_and_the_photo_preprocessing(photo_run):
    run, hub_file, _ = photo_run
    card = json.loads((run / "model.json").read_text())
    init = card["training"]["init"]
    assert init["source"] == "torchvision:resnet18" and init["kind"] == "torchvision"
    assert init["sha256"] == "sha256:" + hashlib.sha256(hub_file.read_bytes()).hexdigest()
    assert init["file"] == str(hub_file)
    cfg = card["config"]
    # the weights' own normalisation (ImageNet's), colour, 224 px, ImageNet's stem
    want = torchvision.models.ResNet18_Weights.DEFAULT.transforms()
    assert cfg["mean"] == pytest.approx(list(want.mean)) and cfg["std"] == pytest.approx(want.std)
    assert (cfg["in_channels"], cfg["image_size"], cfg["small_stem"]) == (3, 224, False)


def test_photos_are_classified_over_http_with_exif_rotation_and_colour(photo_run, tmp_path):
    run, _, _ = photo_run
    srv = Server(run, tmp_path / "serve", {"SNCA_WARMUP_SECONDS": "5"})
    try:
        c = httpx.Client(base_url=srv.url, timeout=60)
        ready = json.loads(next(x for x in srv.read_log().splitlines() if '"ready"' in x))
        # an inference engine serves (its world statistics, ~150 in size, differ from the eager
        # model's by ~1e-4 of that: checked relative to their size, as the traced copy's were;
        # an absolute check once refused it), and the start-up warm-up is bounded
        assert ready["engine"] in ENGINES and ready["model_mode"] == ready["engine"], ready
        assert 1 <= ready["warmed_batch_sizes"] < 64 and ready["warmup_s"] < 30

        def classify(data: bytes, name: str = "q.jpg") -> dict:
            r = c.post("/classify", files={"image": (name, data, "image/jpeg")})
            assert r.status_code == 200, r.text
            return r.json()

        def neighbours(data: bytes) -> list[dict]:
            r = c.post(
                "/classify",
                params={"neighbors": "true", "k": 1},
                files={"image": ("q.jpg", data, "image/jpeg")},
            )
            assert r.status_code == 200, r.text
            return r.json()["neighbors"]

        # the gallery's own photos, sent as the files they were trained from, find themselves
        # under their label. (Held-out accuracy is no check of this model: its "ImageNet
        # weights" are random; 3 epochs on 42 photos gave held-out answers that changed with
        # the CPU's arithmetic: 10/12 right on one machine, 9 on another, 5 after 5 epochs.
        # Photos of categories never trained: test_pretrained.py, on real weights. So one epoch
        # here: what is checked is the path, not the model.) EXIF is checked exactly below: this
        # model is too flat for a sideways photo to miss itself.
        root = photo_run[2] / "photos"
        for name in CLASSES:
            for i in range(4):  # 0 tagged sideways, 1-3 upright
                (top,) = neighbours((root / name / f"{i}.jpg").read_bytes())
                assert top["label"] == name and top["similarity"] > 0.999, (name, i, top)

        # EXIF applied: the tagged file answers exactly as the upright one (lossless PNG, so
        # the pixels after rotation are the same), the sideways pixels without the tag do not
        q = landscape(crops(photo("chelsea"), 1, seed=7)[0], 3)
        upright = classify(jpeg(q, fmt="PNG"), "q.png")
        tagged = classify(jpeg(q, ROTATE_TAG, fmt="PNG"), "q.png")
        sideways = classify(jpeg(q.transpose(Image.Transpose.ROTATE_90), fmt="PNG"), "q.png")
        assert tagged["probabilities"] == upright["probabilities"]
        assert tagged["world_score"] == upright["world_score"]
        assert sideways["world_score"] != upright["world_score"]

        # colour kept: the same photo in grey is another input to the model
        grey = classify(jpeg(q.convert("L").convert("RGB"), fmt="PNG"), "q.png")
        assert grey["world_score"] != upright["world_score"]

        # a new category from five photos, at run time: each of them, sent again, finds itself
        # under the new label (winning held-out photos needs real weights: test_pretrained.py
        # with EfficientNet-Lite0's)
        shots = [jpeg(s) for s in crops(photo("astronaut"), 5, seed=5)]
        files = [("images", (f"{i}.jpg", s, "image/jpeg")) for i, s in enumerate(shots)]
        r = c.post("/gallery/add", data={"label": "astronaut"}, files=files)
        assert r.status_code == 201, r.text
        added_ids = set(r.json()["ids"])
        for s in shots:
            (top,) = neighbours(s)
            assert top["label"] == "astronaut" and top["id"] in added_ids, top

        # thumbnails of the indexed photos: colour JPEG, upright (a 3:2 landscape stays one,
        # also for the files stored sideways with a tag), at most 96 px
        items = c.get("/gallery/items", params={"limit": 60}).json()["items"]
        # registered photos keep theirs too, though the server was not told --thumbnails: a
        # photo model's default (they showed "no preview" before)
        added = [it for it in items if it["source"] == "added"]
        assert added and all(it.get("thumbnail_url") for it in added), added
        shapes, colourful = [], 0
        for it in items:
            if it.get("thumbnail_url") and it["source"] == "trained":
                t = Image.open(io.BytesIO(c.get(it["thumbnail_url"]).content))
                shapes.append(t.size)
                a = np.asarray(t.convert("RGB")).astype(int)
                colourful += t.format == "JPEG" and np.abs(a[..., 0] - a[..., 2]).mean() > 3
        assert len(shapes) >= 30
        assert all(w == 96 and 60 <= h <= 66 for w, h in shapes), set(shapes)
        assert colourful >= len(shapes) // 2
        assert c.get("/").status_code == 200  # the page serves
    finally:
        srv.kill()
