"""The shared contract: model config, network, transforms, weighted kNN, artifact formats.

The names below load their module on first use (PEP 562): `import embedding.errors` or
`embedding.cliutil` costs no torch import, so a CLI can start other processes before it
pays for torch (service/model/spawn.py)."""

import importlib

_WHERE = {
    "load_memory_bank": "artifacts",
    "load_model": "artifacts",
    "load_model_card": "artifacts",
    "save_memory_bank": "artifacts",
    "save_model": "artifacts",
    "ARCHS": "config",
    "ModelConfig": "config",
    "ArtifactError": "errors",
    "DataError": "errors",
    "SNCAError": "errors",
    "knn_evaluate": "knn",
    "knn_search": "knn",
    "weighted_knn_vote": "knn",
    "EmbeddingNet": "model",
    "eval_transform": "transforms",
    "train_transform": "transforms",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'embedding' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value
    return value
