"""Write example images for trying the service with curl: one Fashion-MNIST test image per
class, and two drawings of something no class looks like (logo.png, logo-2.png: the word
"Hi"), to register as a new label without taking images away from a trained class.

python -m service.tools.examples runs/demo/examples

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


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("runs/demo/examples")
    for p in write_examples(target):
        print(p)
