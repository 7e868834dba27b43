"""What one upload costs before the model: decoding a JPEG and the eval geometry (resize + crop
to the model's input), full decode vs the service's reduced JPEG decode (service/model/
embedder.py load_image: libjpeg's 1/2-1/8 DCT scaling while both sides stay >= twice the
resize target), for a 640x480 photo and a 12-megapixel phone photo. One thread, best of runs.

    python benchmarks/decode_cost.py --model runs/bench-resnet50-224
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def best_ms(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="a run dir (its input size)")
    ap.add_argument("--repeats", type=int, default=10)
    a = ap.parse_args()
    import skimage.data
    import torch
    from PIL import Image

    from embedding.artifacts import load_model_card
    from embedding.transforms import eval_geometry, resize_side
    from service.model.embedder import load_image, open_image

    torch.set_num_threads(1)
    cfg, _ = load_model_card(a.model)
    geo, side = eval_geometry(cfg), 2 * resize_side(cfg)
    print(f"{a.model}: {cfg.image_size} px input, reduced decode keeps sides >= {side}")
    for w, h in ((640, 480), (4032, 3024)):
        b = io.BytesIO()
        Image.fromarray(skimage.data.astronaut()).resize((w, h)).save(b, "JPEG", quality=90)
        data = b.getvalue()
        for label, min_side in (("full decode", None), ("reduced decode", side)):

            def decode(min_side=min_side, data=data):
                return load_image(open_image(data, 10**9), min_side=min_side)[0]

            img = decode()
            d = best_ms(decode, a.repeats)
            g = best_ms(lambda img=img: geo(img), a.repeats)
            print(
                f"  {w}x{h} JPEG ({len(data) // 1024} KB), {label}: decoded {img.size[0]}x"
                f"{img.size[1]} in {d:.1f} ms, geometry {g:.1f} ms, total {d + g:.1f} ms"
            )


if __name__ == "__main__":
    main()
