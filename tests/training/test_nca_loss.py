"""The fused NCA loss against eq. 9 in closed form and the straightforward implementation."""

import pytest
import torch
import torch.nn.functional as F

from training.nca import nca_loss, nca_loss_reference


def _problem(b=12, n=200, d=16, c=5, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    memory = F.normalize(torch.randn(n, d, generator=g, dtype=dtype), dim=1)
    mem_labels = torch.randint(0, c, (n,), generator=g)
    slots = torch.randperm(n, generator=g)[:b]
    labels = mem_labels[slots].clone()
    feats = F.normalize(torch.randn(b, d, generator=g, dtype=dtype), dim=1)
    return feats, memory, mem_labels, slots, labels, c


def eq9_closed_form(f, memory, mem_labels, slots, labels, sigma):
    """Per-sample loss and ∂J/∂f (mean over valid samples), written out from eqs. 2-4 and 9."""
    b = f.shape[0]
    losses, grads, valid = [], torch.zeros_like(f), []
    for i in range(b):
        logits = memory @ f[i] / sigma  # (N,)
        others = torch.ones_like(logits, dtype=torch.bool)
        others[slots[i]] = False
        p = torch.zeros_like(logits)
        p[others] = torch.softmax(logits[others], dim=0)  # p_ik, k ≠ i        (eq. 2)
        omega = (mem_labels == labels[i]) & others
        if not omega.any():
            valid.append(False)
            continue
        valid.append(True)
        p_i = p[omega].sum()  # p_i = Σ_{k∈Ω_i} p_ik                         (eq. 3)
        losses.append(-torch.log(p_i))  # J_i                                (eq. 4)
        p_tilde = torch.where(omega, p / p_i, torch.zeros_like(p))
        grads[i] = (p @ memory - p_tilde @ memory) / sigma  # eq. 9
    n_valid = sum(valid)
    return torch.stack(losses).sum() / n_valid, grads / n_valid, b - n_valid


@pytest.mark.parametrize("strategy", ["scatter", "mask"])
@pytest.mark.parametrize("sigma", [0.05, 0.1, 0.02])
def test_gradient_equals_eq9_in_float64(sigma, strategy):
    f, memory, ml, slots, y, c = _problem()
    f = f.clone().requires_grad_()
    out = nca_loss(f, memory, ml, slots, y, sigma, c, strategy=strategy)
    (grad,) = torch.autograd.grad(out.loss, f)
    loss_ref, grad_ref, skipped = eq9_closed_form(f.detach(), memory, ml, slots, y, sigma)
    assert out.num_skipped == skipped == 0
    assert abs(out.loss.item() - loss_ref.item()) < 1e-10
    torch.testing.assert_close(grad, grad_ref, rtol=0, atol=1e-8)


@pytest.mark.parametrize("strategy", ["scatter", "mask"])
def test_matches_straightforward_implementation_float32(strategy):
    f, memory, ml, slots, y, c = _problem(b=64, n=3000, d=32, c=10, dtype=torch.float32)
    f1 = f.clone().requires_grad_()
    f2 = f.clone().requires_grad_()
    out = nca_loss(f1, memory, ml, slots, y, 0.05, c, strategy=strategy)
    ref = nca_loss_reference(f2, memory, ml, slots, y, 0.05)
    out.loss.backward()
    ref.backward()
    torch.testing.assert_close(out.loss, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(f1.grad, f2.grad, rtol=1e-4, atol=1e-6)


def test_self_slot_never_contributes():
    f, memory, ml, slots, y, c = _problem()
    for i in range(f.shape[0]):
        fi = f[i : i + 1].clone().requires_grad_()
        out = nca_loss(fi, memory, ml, slots[i : i + 1], y[i : i + 1], 0.05, c)
        (g1,) = torch.autograd.grad(out.loss, fi)
        # Make the sample's own slot identical to its feature, the most similar item there is.
        # Were the self slot counted, the loss would drop sharply.
        mem2 = memory.clone()
        mem2[slots[i]] = fi.detach()[0]
        out2 = nca_loss(fi, mem2, ml, slots[i : i + 1], y[i : i + 1], 0.05, c)
        (g2,) = torch.autograd.grad(out2.loss, fi)
        assert abs(out.loss.item() - out2.loss.item()) < 1e-12
        torch.testing.assert_close(g1, g2, rtol=0, atol=1e-12)


@pytest.mark.parametrize("strategy", ["scatter", "mask"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_sample_without_other_same_label_slot_is_skipped_and_counted(dtype, strategy):
    f, memory, ml, slots, y, c = _problem(c=5, dtype=dtype)
    ml = ml.clone()
    ml[ml == 4] = 3  # label 4 now exists only in sample 0's own slot
    ml[slots[0]] = 4
    y = ml[slots].clone()
    f = f.clone().requires_grad_()
    out = nca_loss(f, memory, ml, slots, y, 0.05, c, strategy=strategy)
    (grad,) = torch.autograd.grad(out.loss, f)
    loss_ref, grad_ref, skipped = eq9_closed_form(f.detach(), memory, ml, slots, y, 0.05)
    assert out.num_skipped == skipped == 1
    assert torch.isfinite(out.loss)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    assert abs(out.loss.item() - loss_ref.item()) < tol
    assert torch.isfinite(grad).all()
    assert torch.count_nonzero(grad[0]) == 0  # the skipped sample gets no gradient
    torch.testing.assert_close(grad, grad_ref, rtol=0, atol=tol * 100)


def test_all_samples_skipped_gives_zero_loss_and_gradient():
    f, memory, _, _, _, _ = _problem(b=3, n=3, c=3)
    ml = torch.tensor([0, 1, 2])
    slots = torch.tensor([0, 1, 2])
    y = ml.clone()
    f = f.clone().requires_grad_()
    out = nca_loss(f, memory[:3], ml, slots, y, 0.05, 3)
    (grad,) = torch.autograd.grad(out.loss, f)
    assert out.num_skipped == 3
    assert out.loss.item() == 0.0
    assert torch.count_nonzero(grad) == 0


def test_gradient_reaches_features_only():
    f, memory, ml, slots, y, c = _problem(dtype=torch.float32)
    f = f.clone().requires_grad_()
    memory = memory.clone().requires_grad_()
    out = nca_loss(f, memory, ml, slots, y, 0.05, c)
    out.loss.backward()
    assert f.grad is not None and torch.count_nonzero(f.grad) > 0
    assert memory.grad is None


def test_tiny_temperature_stays_finite():
    # 2/σ = 200 overflows float32's exp range: the loss switches to float64 internally.
    f, memory, ml, slots, y, c = _problem(dtype=torch.float32)
    f1 = f.clone().requires_grad_()
    f2 = f.clone().double().requires_grad_()
    out = nca_loss(f1, memory, ml, slots, y, 0.01, c)
    ref = nca_loss_reference(f2, memory.double(), ml, slots, y, 0.01)
    out.loss.backward()
    ref.backward()
    assert torch.isfinite(out.loss)
    assert abs(out.loss.item() - ref.item()) < 1e-4
    torch.testing.assert_close(f1.grad.double(), f2.grad, rtol=1e-4, atol=1e-5)


def test_second_backward_is_refused():
    f, memory, ml, slots, y, c = _problem()
    f = f.clone().requires_grad_()
    out = nca_loss(f, memory, ml, slots, y, 0.05, c)
    out.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="already"):
        out.loss.backward()
