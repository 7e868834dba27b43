"""Inference engines for the model process: the serving module exported once (export.py) and
run by ONNX Runtime or OpenVINO instead of torch, chosen by SNCA_ENGINE.

`auto` loads every installed engine on the export, checks each against the torch module, times
each at batch 1 and 4 on one thread, and serves the fastest; the timing is kept beside the
export (`choice.json`, per CPU and engine versions) so that the next start on this machine loads
only the winner. `torch` is the reference and the fallback: an engine not installed, an export
that fails (an architecture ONNX cannot express), or outputs that differ from the torch
module's by more than ENGINE_ATOL each leave the torch path serving, with one log line saying
why. A new engine is one file (a base.Engine) and one line in ENGINES (here); how one is
chosen is choice.py.
"""

from __future__ import annotations

import importlib

from service.model.engines.base import Engine

ENGINES = {  # SNCA_ENGINE value, which is also its pip package's name -> "module:class"
    "onnxruntime": "service.model.engines.ort_engine:OnnxRuntimeEngine",
    "openvino": "service.model.engines.openvino_engine:OpenVinoEngine",
}
CHOICES = ("auto", "torch", *ENGINES)


def engine_class(name: str) -> type[Engine]:
    """ENGINES[name]'s class (ImportError when its package is not installed)."""
    mod, cls = ENGINES[name].split(":")
    return getattr(importlib.import_module(mod), cls)
