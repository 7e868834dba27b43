"""What an inference engine is to the model process: an exported model (export.py) loaded at a
thread count, uint8 pixels in, the rows [vector | world statistics] out."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np


class Engine(ABC):
    name: str  # the SNCA_ENGINE value that picks it (and its pip package's name)
    # glibc's own malloc thresholds in this process (embedding.sysalloc.default_freed_memory):
    # for an engine that mallocs its buffers per input shape, which a heap that keeps freed
    # blocks (what torch's path wants) fragments into gigabytes
    malloc_defaults: bool = False
    # input shapes (batch sizes) the engine keeps compiled at once, least recently used out
    # (None: every one): start-up warms no more sizes than this, since each one past it
    # evicts one warmed before (Embedder.warmup_every_size)
    shapes_kept: int | None = None

    @abstractmethod
    def __init__(self, onnx: Path, threads: int):
        """Load the export at `onnx` to run on `threads` CPU threads (owned by the model
        process: no other pool than this one)."""

    @abstractmethod
    def run(self, pixels: np.ndarray) -> np.ndarray:
        """uint8 (B, C, H, W), C-contiguous -> float32 (B, d [+ D])."""
