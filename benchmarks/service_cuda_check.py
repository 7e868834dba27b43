"""The service's CUDA path against its CPU path, through the real app (TestClient, lifespan):
same labels, neighbours and similarities up to AMP rounding; add, classify-after-add and batch
work on both; bare model + vote throughput at batch 64 on each device.

    python benchmarks/service_cuda_check.py RUN_DIR IMAGE_DIR      # e.g. runs/demo runs/demo/examples
    DEVS=cpu python benchmarks/service_cuda_check.py ...           # the CPU half only

Exit status 0 when every image gets the same label on both devices.
"""

import argparse
import glob
import os
import sys
import time
from pathlib import Path

import torch
from fastapi.testclient import TestClient

from service.config import Settings
from service.http.app import create_app

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
_ap = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
)
_ap.add_argument("run", type=Path, help="a run dir with its index")
_ap.add_argument("images", type=Path, help="a folder of PNG images (one named *bag*)")
_args = _ap.parse_args()
RUN, IMAGES = _args.run, _args.images
imgs = sorted(glob.glob(str(IMAGES / "*.png")))
bag = next(p for p in imgs if "bag" in p)


def part(name: str, path: str) -> tuple[str, tuple[str, bytes, str]]:
    return name, (Path(path).name, Path(path).read_bytes(), "image/png")


print("cuda", torch.cuda.is_available(), torch.__version__)
DEVS = os.environ.get("DEVS", "cuda,cpu").split(",")
res = {}
for dev in DEVS:
    app = create_app(Settings(model=RUN, data_dir=Path(f"/tmp/snca-cuda-check-{dev}"), device=dev))
    with TestClient(app, base_url="http://localhost") as c:
        rt = app.state.snca.state.runtime
        print(
            dev,
            c.get("/readyz").json(),
            "embedder on",
            rt.embedder.device,
            "mode",
            rt.embedder.mode,
            "amp",
            rt.embedder.amp,
            "torch_threads",
            rt.info.torch_threads,
        )
        out = []
        for p in imgs:
            r = c.post(
                "/classify",
                files=[part("image", p)],
                params={"neighbors": "true", "k": 5},
            )
            assert r.status_code == 200, r.text
            out.append(r.json())
        add = c.post(
            "/gallery/add",
            data={"label": "my-bag"},
            files=[part("images", bag)],
        )
        print(dev, "add", add.status_code, add.json())
        after = c.post(
            "/classify",
            files=[part("image", bag)],
        ).json()
        print(
            dev, "bag after add ->", after["nearest_label"], round(after["nearest_probability"], 3)
        )
        batch = c.post(
            "/classify/batch",
            files=[part("images", p) for p in (imgs * 8)[:64]],
        )
        print(dev, "batch", batch.status_code, len(batch.json()["results"]))
        # bare throughput of the model + vote on this device, batch 64
        x = torch.zeros(64, 1, 28, 28, dtype=torch.uint8)
        rt.gallery.classify(rt.embedder.embed(x), "kde", 30)
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        n = 0
        while time.perf_counter() - t0 < 3:
            rt.gallery.classify(rt.embedder.embed(x), "kde", 30)
            n += 64
        print(dev, "bare img/s", round(n / (time.perf_counter() - t0)))
        res[dev] = out
if len(DEVS) == 1:
    sys.exit(0)
ok = 0
for a, b, p in zip(res["cuda"], res["cpu"], imgs, strict=True):
    same = a["nearest_label"] == b["nearest_label"]
    ok += same
    print(
        Path(p).name,
        a["nearest_label"],
        round(a["nearest_probability"], 4),
        b["nearest_label"],
        round(b["nearest_probability"], 4),
        "nbr ids equal",
        [n["id"] for n in a["neighbors"]] == [n["id"] for n in b["neighbors"]],
        "max|dsim|",
        round(
            max(
                abs(x["similarity"] - y["similarity"])
                for x, y in zip(a["neighbors"], b["neighbors"], strict=True)
            ),
            4,
        ),
    )
print(f"labels equal on {ok}/{len(imgs)}")
sys.exit(0 if ok == len(imgs) else 1)
