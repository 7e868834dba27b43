"""--init RUN_DIR (or run:RUN_DIR): another run of this project (transfer from one dataset or
class set to another, or the served model retrained on what users labelled): its backbone and
its embedding layer, its architecture and its preprocessing."""

from __future__ import annotations

import json
from pathlib import Path

from embedding.artifacts import MODEL_CARD, MODEL_WEIGHTS, read_safetensors

from .base import Loaded


class RunDirSource:
    @staticmethod
    def claims(spec: str) -> bool:
        return spec.startswith("run:") or (Path(spec) / MODEL_CARD).is_file()

    @staticmethod
    def load(spec: str) -> Loaded:
        run = Path(spec.removeprefix("run:"))
        state, _ = read_safetensors(run / MODEL_WEIGHTS)
        card = json.loads((run / MODEL_CARD).read_text())
        model = card.get("config", {})  # the ModelConfig the run was trained with
        pre = {"mean": list(model["mean"]), "std": list(model["std"])} if "mean" in model else None
        if pre is not None:  # and its input (an ImageFolder run keeps the source's size)
            pre |= {k: model[k] for k in ("image_size", "in_channels") if k in model}
            pre |= {k: model[k] for k in ("interpolation", "crop_pct") if k in model}
        # the weights need the source's architecture (a timm backbone above all: retraining the
        # served pretrained model on what users labelled, `--init runs/photos-lite0`)
        return Loaded(
            "run", spec, state, run / MODEL_WEIGHTS, preprocessing=pre, arch=model.get("arch")
        )
