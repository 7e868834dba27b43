"""Write a few Fashion-MNIST test images as PNG files, for trying the service with curl.

python -m service.examples runs/demo/examples
"""

from __future__ import annotations

import sys
from pathlib import Path

from PIL import Image

from embedding.datasets import load_raw


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
    return paths


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("runs/demo/examples")
    for p in write_examples(target):
        print(p)
