"""Write example images for trying the service with curl: one Fashion-MNIST test image per
class, and two drawings of something no class looks like (logo.png, logo-2.png: the word
"Hi"), to register as a new label without taking images away from a trained class.

python -m service.tools.examples runs/demo/examples
python -m service.tools.examples --photos runs/photos-lite0/examples   # make photos

Photos (`--photos`): crops of scikit-image's real photographs, five of a coffee cup and five of
a cat to register (cup-1.jpg .. cat-5.jpg), another crop of each to classify (cup-query.jpg,
cat-query.jpg) and a photograph of neither (moon.jpg), for a model served with an empty gallery.

Registering a held-out image of a trained class (a sandal as "my-shoe") would take most of that
class's images: the default vote gives every label an equal prior, so one image weighs as much
as five thousand (docs/RESULTS.md). The drawn logo lands where no class lives: registered on
`make run`'s model it takes 0.3% of the 10,000 test images (docs/RESULTS.md,
benchmarks/example_label.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from embedding.datasets import load_raw

SIDE = 28  # Fashion-MNIST's size: light object on a black background


def logo(variant: int = 0, side: int = SIDE) -> Image.Image:
    """The word "Hi", light on black at `side` px (greyscale), in Pillow's built-in font;
    variant 1 is a second drawing of it, smaller and shifted (another photo of the same
    thing). Of the drawings measured (shapes, words, strokes; docs/RESULTS.md) this one took
    the fewest test images from the trained classes."""
    scale = 4  # drawn large, then downsampled: smooth edges like the dataset's
    big = side * scale
    img = Image.new("L", (big, big), 0)
    size, dx, dy = ((60, 0, 0), (54, 5, 3))[variant]
    font = ImageFont.load_default(size=size * side / SIDE)
    ImageDraw.Draw(img).text((big / 2 + dx, big / 2 + dy), "Hi", fill=255, font=font, anchor="mm")
    return img.resize((side, side), Image.LANCZOS)


def write_examples(out: Path, per_class: int = 1) -> list[Path]:
    raw = load_raw("fashion-mnist", "test")
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for c, name in enumerate(raw.class_names):
        slug = name.lower().replace("/", "-").replace(" ", "-")
        picks = [i for i in range(len(raw.targets)) if raw.targets[i] == c][:per_class]
        for j, i in enumerate(picks):
            p = out / (f"{slug}.png" if per_class == 1 else f"{slug}-{j}.png")
            Image.fromarray(raw.source.get(i)[0].numpy()).save(p)
            paths.append(p)
    for variant, name in ((0, "logo.png"), (1, "logo-2.png")):
        logo(variant).save(out / name)
        paths.append(out / name)
    return paths


# scikit-image's photographs (name, crop box or None: the whole picture's centre)
PHOTOS = {"cup": ("coffee", (90, 0, 490, 400)), "cat": ("chelsea", None)}


def write_photo_examples(out: Path, shots: int = 5) -> list[Path]:
    """Crops of real photographs (scikit-image's, installed with `make install`): `shots` of each
    object to register, one more to classify, and a photo of neither."""
    try:
        import skimage.data
    except ImportError:
        raise SystemExit("the photo examples need scikit-image: pip install scikit-image") from None
    import numpy as np

    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    paths = []
    for name, (src, box) in PHOTOS.items():
        img = Image.fromarray(getattr(skimage.data, src)())
        x0, y0, x1, y1 = box or (0, 0, *img.size)
        side = min(x1 - x0, y1 - y0)
        for j in [*range(1, shots + 1), "query"]:
            s = int(side * rng.uniform(0.8, 1.0))
            x, y = (
                x0 + int(rng.integers(0, x1 - x0 - s + 1)),
                y0 + int(rng.integers(0, y1 - y0 - s + 1)),
            )
            crop = img.crop((x, y, x + s, y + s))
            if rng.random() < 0.5:
                crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            paths.append(out / f"{name}-{j}.jpg")
            crop.save(paths[-1], quality=90)
    Image.fromarray(skimage.data.moon()).convert("RGB").save(out / "moon.jpg", quality=90)
    return [*paths, out / "moon.jpg"]


if __name__ == "__main__":
    args = sys.argv[1:]
    photos = "--photos" in args
    args = [a for a in args if a != "--photos"]
    default = "runs/photos-lite0/examples" if photos else "runs/demo/examples"
    target = Path(args[0]) if args else Path(default)
    for p in (write_photo_examples if photos else write_examples)(target):
        print(p)
