"""The shared contract: model config, network, transforms, weighted kNN, artifact formats."""

from .artifacts import load_memory_bank, load_model, load_model_card, save_memory_bank, save_model
from .config import ARCHS, ModelConfig
from .errors import ArtifactError, DataError, SNCAError
from .knn import knn_evaluate, knn_search, weighted_knn_vote
from .model import EmbeddingNet
from .transforms import eval_transform, train_transform

__all__ = [
    "ARCHS",
    "ArtifactError",
    "DataError",
    "EmbeddingNet",
    "ModelConfig",
    "SNCAError",
    "eval_transform",
    "knn_evaluate",
    "knn_search",
    "load_memory_bank",
    "load_model",
    "load_model_card",
    "save_memory_bank",
    "save_model",
    "train_transform",
    "weighted_knn_vote",
]
