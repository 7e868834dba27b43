"""--init RUN_DIR (or run:RUN_DIR): another run of this project (transfer from one dataset or
class set to another): its backbone and its embedding layer."""

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
        return Loaded("run", spec, state, run / MODEL_WEIGHTS, preprocessing=pre)
