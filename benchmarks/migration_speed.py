"""How long carrying a gallery to a new model takes: at start-up (service/store/migration.py)
and beside the live one (`snca-gallery upgrade --switch`, service/store/upgrade.py).

    python benchmarks/migration_speed.py runs/demo --items 5000

In-process (ServiceHost, a scratch dir): a gallery on RUN with ITEMS added Fashion-MNIST
training images (28x28 PNGs, stored), then the service opened on a new model: RUN's weights
perturbed (a new fingerprint, as a retrain gives; tests/service/conftest.py:replaced_model) with
its own index. Prints the time to open (model load, optimise, warm up), to migrate (decode,
re-embed on the model thread, one transaction per SNCA_MIGRATION_BATCH) and to load the gallery.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from PIL import Image  # noqa: E402

from embedding.datasets import load_raw  # noqa: E402
from service.config import Settings  # noqa: E402
from service.startup import ServiceHost  # noqa: E402
from tests.service.helpers import replaced_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("run", type=Path)
    ap.add_argument("--items", type=int, default=5000)
    ap.add_argument("--batch", type=int, default=64, help="SNCA_MIGRATION_BATCH")
    a = ap.parse_args()
    raw = load_raw("fashion-mnist", "train")

    def png(i: int) -> bytes:
        b = io.BytesIO()
        Image.fromarray(raw.source.get(i)[0].numpy()).save(b, "PNG")
        return b.getvalue()

    tmp = Path(tempfile.mkdtemp(prefix="snca-migration-"))
    try:
        data = tmp / "data"
        host = ServiceHost(Settings(model=a.run, data_dir=data))
        st = host.finish()
        imgs = [png(i) for i in range(a.items)]
        for s in range(0, a.items, 64):
            emb, _, _ = st.runtime.embed_stored(imgs[s : s + 64])
            stored = [(b, "image/png") for b in imgs[s : s + 64]]
            st.add(f"label{s // 640}", emb, [None] * len(emb), stored)
        host.stop()
        new = replaced_model(a.run, tmp / "new")
        # the same gallery carried beside the live one: `snca-gallery upgrade --switch` (its own
        # process: start, model load, backfill, catch-up, switch), on a copy of the data dir
        shutil.copytree(data, tmp / "beside")
        t0 = time.perf_counter()
        tool = [sys.executable, "-m", "service.tools.gallery_tool", "upgrade", "--to", str(new)]
        flags = ["--switch", "--no-progress", "--model", str(a.run), "--batch-size", str(a.batch)]
        p = subprocess.run(
            [*tool, *flags, "--data-dir", str(tmp / "beside")],
            capture_output=True,
            text=True,
            env=dict(os.environ, SNCA_WARMUP_SECONDS="0"),
        )
        up = time.perf_counter() - t0
        assert p.returncode == 0, p.stdout + p.stderr
        n = int(re.search(r": (\d+) items carried", p.stdout).group(1))
        print(
            f"snca-gallery upgrade --switch: {up:.1f} s in all for {n} items "
            f"({n / up:,.0f} items/s including the command's start)"
        )
        t0 = time.perf_counter()
        host = ServiceHost(Settings(model=new, data_dir=data, migration_batch=a.batch))
        host.open()
        t1 = time.perf_counter()
        st = host.finish()
        t2 = time.perf_counter()
        m = st.migration
        print(
            f"{a.items} added items: open {t1 - t0:.1f} s, migration {m.seconds:.1f} s "
            f"({m.carried / max(m.seconds, 1e-9):,.0f} items/s), gallery load "
            f"{t2 - t1 - m.seconds:.1f} s; carried {m.carried}, not carried {len(m.uncarried)}"
        )
        host.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
