"""What registering `make run`'s printed example does to the trained classes.

    python benchmarks/example_label.py runs/demo          # the model `make run` trains

For each candidate registration (the printed example logo.png as "my-logo", and the old example,
a held-out test sandal as "my-shoe"), in the service's own gallery (ServiceHost, default vote,
a scratch data dir): the share of the 10,000 Fashion-MNIST test images classified as the new
label, per class, and whether the second drawing (logo-2.png) is recognised. Exit status 1 if
the printed example takes more than --max-share of any class.
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from embedding.datasets import load_raw
from service.config import Settings
from service.startup import ServiceHost
from service.tools.examples import logo


def png(img) -> bytes:
    b = io.BytesIO()
    img.save(b, "PNG")
    return b.getvalue()


def taken(run: Path, label: str, image: bytes, probe: bytes, test, vote: str) -> dict:
    """Register `image` as `label` in a fresh gallery of `run`; where the test images go."""
    with tempfile.TemporaryDirectory() as tmp:
        host = ServiceHost(Settings(model=run, data_dir=Path(tmp), vote=vote))
        st = host.finish()
        try:
            emb, _, _ = st.runtime.embed_stored([image])
            st.add(label, emb, [None], [None])
            e2, _, _ = st.runtime.embed_stored([probe])
            probe_label = st.gallery.classify(e2, vote, st.settings.k)[0].label
            got = []
            x = test.source.images
            for s in range(0, len(x), 500):
                q = st.runtime.embedder.embed(x[s : s + 500])
                got += [r.label == label for r in st.gallery.classify(q, vote, st.settings.k)]
        finally:
            host.stop()
    got = np.array(got)
    per = {name: float(got[test.targets == c].mean()) for c, name in enumerate(test.class_names)}
    return {"total": int(got.sum()), "per_class": per, "probe": probe_label}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("run", type=Path, help="run dir with its index (default RUN/index)")
    ap.add_argument("--vote", default="kde_shrunk")
    ap.add_argument("--max-share", type=float, default=0.02)
    a = ap.parse_args()
    test = load_raw("fashion-mnist", "test")
    sandals = np.nonzero(test.targets == 5)[0]
    cases = {
        "my-logo (logo.png, printed now)": (png(logo(0)), png(logo(1))),
        "my-shoe (sandal.png, printed before)": tuple(png(_image(test, i)) for i in sandals[:2]),
    }
    worst = 0.0
    for name, (image, probe) in cases.items():
        r = taken(a.run, name.split()[0], image, probe, test, a.vote)
        top = sorted(r["per_class"].items(), key=lambda kv: -kv[1])[:3]
        print(
            f"{name}: {r['total']} of {len(test.targets)} test images taken; most from "
            + ", ".join(f"{k} {100 * v:.1f}%" for k, v in top)
            + f"; a second image of it -> {r['probe']}"
        )
        if "printed now" in name:
            worst = max(r["per_class"].values())
    return 0 if worst <= a.max_share else 1


def _image(test, i):
    from PIL import Image

    return Image.fromarray(test.source.get(int(i))[0].numpy())


if __name__ == "__main__":
    sys.exit(main())
