"""The serving fast path: optimize_for_cpu is checked against eager mode and falls back."""

import torch

from embedding.config import ModelConfig
from embedding.model import EmbeddingNet
from service.model.accel import optimize_for_cpu


def _model():
    torch.manual_seed(0)
    m = EmbeddingNet(ModelConfig()).eval()
    with torch.no_grad():  # non-trivial BatchNorm statistics, so folding them matters
        for mod in m.modules():
            if isinstance(mod, torch.nn.BatchNorm2d):
                mod.running_mean.uniform_(-0.5, 0.5)
                mod.running_var.uniform_(0.5, 2.0)
    return m


def test_optimized_module_matches_eager_at_any_batch_size():
    m = _model()
    opt, mode = optimize_for_cpu(m, torch.randn(8, 1, 28, 28))
    assert mode == "optimized"
    for b in (1, 3, 64):
        x = torch.randn(b, 1, 28, 28)
        with torch.no_grad():
            assert torch.allclose(opt(x), m(x), atol=1e-5)


def test_falls_back_to_eager_when_the_check_fails():
    m = _model()
    opt, mode = optimize_for_cpu(m, torch.randn(4, 1, 28, 28), atol=-1.0)
    assert opt is m and mode.startswith("eager: optimized model differs")
    opt, mode = optimize_for_cpu(m, torch.randn(4, 3, 28, 28))  # wrong channels: trace fails
    assert opt is m and mode.startswith("eager: optimization failed")
