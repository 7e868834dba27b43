"""Intel's OpenVINO CPU plugin, at fp32 (its default on a CPU with bf16 is bf16, whose answers
differ from the torch path's by more than the 1e-3 the service promises). On EfficientNet-Lite0
at 224 px it was the fastest measured (docs/PERFORMANCE.md)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from service.model.engines.base import Engine


class OpenVinoEngine(Engine):
    name = "openvino"
    malloc_defaults = True  # (base.py; measured: a Lite0 model process 6.1 -> 1.x GB)
    # kernels compiled per input shape, kept for this many shapes: the default (5,000) held
    # every warmed batch size, a Lite0 model process grew to 8.7 GB after 1..64; 8 measured
    # 1.7 GB and the same ms/image (docs/PERFORMANCE.md)
    shapes_kept = 8

    def __init__(self, onnx: Path, threads: int):
        import openvino as ov

        core = ov.Core()
        self.compiled = core.compile_model(
            str(onnx),
            "CPU",
            {
                "INFERENCE_NUM_THREADS": threads,
                "NUM_STREAMS": 1,
                "PERFORMANCE_HINT": "LATENCY",
                "INFERENCE_PRECISION_HINT": "f32",
                "ENABLE_CPU_PINNING": False,  # the front shares these cores: no pinning
                "CPU_RUNTIME_CACHE_CAPACITY": self.shapes_kept,
            },
        )
        self.request = self.compiled.create_infer_request()

    def run(self, pixels: np.ndarray) -> np.ndarray:
        self.request.infer({0: pixels})
        return self.request.get_output_tensor(0).data.copy()
