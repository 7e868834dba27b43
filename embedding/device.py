"""One device resolver for every stage (training, index building, serving)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import SNCAError

if TYPE_CHECKING:
    import torch

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(name: str) -> torch.device:
    """'auto' (CUDA when present, else CPU), 'cpu' or 'cuda' -> a torch.device. Asking for CUDA
    on a machine without it is an error, never a silent fall-back to the CPU."""
    import torch  # (here: the names above cost no torch)

    if name not in DEVICES:
        raise SNCAError(f"unknown device {name!r} (choose from {', '.join(DEVICES)})")
    if name == "cuda" and not torch.cuda.is_available():
        raise SNCAError("device cuda: no CUDA device is available (use auto or cpu)")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
