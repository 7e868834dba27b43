"""The world check's Gaussian of a run (embedding/world.py), as snca-train writes it at the end
of training: fitted on up to 20,000 training images, thresholds and the few-shot radius from up
to 5,000 validation images (never trained on; a held-out 20% of the training images when the
run has no validation split).

    python -m training.world_fit runs/demo     # (re)write runs/demo/world.safetensors

A run dir trained before the world check gets its statistics this way without retraining
(snca-build-index would otherwise fit them on training images alone); then rebuild the index.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from embedding import world
from embedding.cliutil import documented_parser
from embedding.errors import SNCAError
from embedding.rundir import RunDir

from .datasets import Data


def fit_run_world(net, data: Data, seed: int, device: torch.device, log=print) -> world.WorldFit:
    rng = np.random.default_rng(seed)
    train = data.train
    fit_pos = train.positions[rng.permutation(len(train))[:20000]]
    if data.val is not None and len(data.val) >= 100:
        pick = rng.permutation(len(data.val))[:5000]
        cal_pos, cal_y = data.val.positions[pick], data.val.labels[pick]
    else:
        rest = rng.permutation(len(train))
        cut = int(0.8 * len(rest))
        fit_pos = train.positions[rest[:cut][:20000]]
        held = rest[cut:][:5000]
        cal_pos, cal_y = train.positions[held], train.labels[held]
    dim = world.stats_dim(net)
    diag = (
        ""
        if world.estimable(len(fit_pos), dim)
        else f" (diagonal: fewer than its {dim} statistics)"
    )
    log(f"world statistics: fitting on {len(fit_pos)} images{diag}, calibrating on {len(cal_pos)}")
    return world.fit_from_images(
        net, train.raw.source, fit_pos, cal_pos, cal_y, device, 512, seed=seed
    )


def main(argv: list[str] | None = None) -> int:
    from .config import run_config
    from .datasets import build_data

    ap = documented_parser("python -m training.world_fit", __doc__)
    ap.add_argument("run", type=Path, help="a run dir")
    a = ap.parse_args(argv)
    try:
        rd = RunDir(a.run)
        model = rd.load_model()
        cfg = run_config(a.run)
        w = fit_run_world(model, build_data(cfg), cfg.seed, torch.device("cpu"))
        path = world.save(w, a.run, model.fingerprint)
    except (SNCAError, OSError) as e:
        print(f"world_fit: error: {e}", file=sys.stderr)
        return 2
    t = w.threshold(0.99)
    at = "none (too few held-out images)" if t is None else f"{t:.3f}"
    print(f"wrote {path}: threshold at 99% {at}, same_radius {w.same_radius:.3f}, "
          f"spread {w.spread:.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
