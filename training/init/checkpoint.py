"""--init FILE: a checkpoint file. safetensors, or a PyTorch file read with
torch.load(weights_only=True) (tensors and plain containers only: a file that pickles code is
refused, never run). Layouts understood: a bare state_dict (torchvision's: conv1..., fc); a dict
holding it under `state_dict`, `model` or `net` (the SNCA paper's `.pth.tar`: a torchvision
ResNet under DataParallel's `module.` prefixes whose `fc` is the 128-d embedding, next to its
memory bank, which is not needed here)."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import torch

from embedding.errors import SNCAError

from .base import Loaded

SUFFIXES = (".pth", ".pt", ".tar", ".bin", ".ckpt", ".safetensors")


class CheckpointFile:
    @staticmethod
    def claims(spec: str) -> bool:
        return spec.startswith("file:") or spec.endswith(SUFFIXES) or Path(spec).is_file()

    @staticmethod
    def load(spec: str, kind: str = "checkpoint") -> Loaded:
        path = Path(spec.removeprefix("file:"))
        if not path.is_file():
            raise SNCAError(f"--init {spec}: no such file {path}")
        if path.suffix == ".safetensors":
            from embedding.artifacts import read_safetensors

            state, _ = read_safetensors(path)
            return Loaded(kind, spec, state, path)
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
            if found is None:  # not a pickle torch can read at all
                raise SNCAError(f"--init {spec}: not a readable checkpoint ({path})") from None
            raise SNCAError(
                f"--init {spec}: refused to unpickle {found.group(1)}: only tensors and plain "
                "containers are read (weights_only), never code. Where you trust the file, save "
                "just its weights: torch.save(torch.load(F)['state_dict'], 'weights.pth')"
            ) from None
        except Exception as e:  # not a PyTorch file at all (truncated, another format)
            raise SNCAError(f"--init {spec}: not a readable checkpoint ({e})") from None
        notes = []
        if isinstance(obj, dict) and not all(isinstance(v, torch.Tensor) for v in obj.values()):
            for key in ("state_dict", "model", "net"):
                if isinstance(obj.get(key), dict):
                    skipped = sorted(k for k in obj if k != key)
                    if skipped:
                        notes.append(f"read '{key}'; left out: {', '.join(skipped)}")
                    obj = obj[key]
                    break
        if not isinstance(obj, dict) or not obj:
            raise SNCAError(f"--init {spec}: holds no state_dict (a dict of tensors)")
        state = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
        if not state:
            raise SNCAError(f"--init {spec}: its state_dict holds no tensors")
        return Loaded(kind, spec, state, path, notes)
