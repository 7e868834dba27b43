"""ONNX Runtime's CPU provider. At the batch sizes a server forms (1-16) it ran conv4 at
28 x 28 2.5-4x faster per image than the traced torch module (docs/PERFORMANCE.md)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from service.model.engines.base import Engine
from service.model.engines.export import INPUT


class OnnxRuntimeEngine(Engine):
    name = "onnxruntime"

    def __init__(self, onnx: Path, threads: int):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # no busy-waiting pool threads between batches: the front's event loop shares the cores
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        so.log_severity_level = 3  # errors only (its warnings go to stderr, not our log)
        self.session = ort.InferenceSession(str(onnx), so, providers=["CPUExecutionProvider"])

    def run(self, pixels: np.ndarray) -> np.ndarray:
        return self.session.run(None, {INPUT: pixels})[0]
