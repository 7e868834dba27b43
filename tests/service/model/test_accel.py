"""The serving fast path: optimize_for_cpu is checked against eager mode and falls back."""

import torch

from service.model.accel import optimize_for_cpu

from .nets import net_with_statistics


def test_optimized_module_matches_eager_at_any_batch_size():
    m = net_with_statistics()
    opt, mode = optimize_for_cpu(m, torch.randn(8, 1, 28, 28))
    assert mode == "optimized"
    for b in (1, 3, 64):
        x = torch.randn(b, 1, 28, 28)
        with torch.no_grad():
            assert torch.allclose(opt(x), m(x), atol=1e-5)


def test_falls_back_to_eager_when_the_check_fails():
    m = net_with_statistics()
    opt, mode = optimize_for_cpu(m, torch.randn(4, 1, 28, 28), atol=-1.0)
    assert opt is m and mode.startswith("eager: optimized model differs")
    opt, mode = optimize_for_cpu(m, torch.randn(4, 3, 28, 28))  # wrong channels: trace fails
    assert opt is m and mode.startswith("eager: optimization failed")
