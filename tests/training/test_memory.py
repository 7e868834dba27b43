import pytest
import torch
import torch.nn.functional as F

from training.memory import MemoryBank, MomentumSchedule


def test_init_rows_are_unit_norm():
    bank = MemoryBank(torch.randint(0, 3, (500,)), 32, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(bank.embeddings.norm(dim=1), torch.ones(500))


def test_update_is_eq11_and_keeps_rows_unit_norm():
    g = torch.Generator().manual_seed(1)
    bank = MemoryBank(torch.randint(0, 3, (100,)), 16, generator=g)
    before = bank.embeddings.clone()
    slots = torch.tensor([3, 50, 7, 99])
    f = F.normalize(torch.randn(4, 16, generator=g), dim=1)
    m = 0.7
    bank.update(slots, f, m)
    expect = F.normalize(m * before[slots] + (1 - m) * f, dim=1)  # eq. 11
    torch.testing.assert_close(bank.embeddings[slots], expect, rtol=0, atol=1e-6)
    others = torch.ones(100, dtype=torch.bool)
    others[slots] = False
    assert torch.equal(bank.embeddings[others], before[others])
    torch.testing.assert_close(bank.embeddings.norm(dim=1), torch.ones(100))


def test_update_takes_no_gradient():
    bank = MemoryBank(torch.randint(0, 3, (10,)), 8)
    f = F.normalize(torch.randn(2, 8), dim=1).requires_grad_()
    bank.update(torch.tensor([0, 1]), f * 2, 0.5)
    assert not bank.embeddings.requires_grad


@pytest.mark.parametrize(
    "kind,epochs,expect",
    [
        ("linear", 5, [0.5, 0.6, 0.7, 0.8, 0.9]),
        ("constant", 4, [0.5, 0.5, 0.5, 0.5]),
        ("step", 13, [0.5] * 8 + [0.8] * 4 + [0.9]),  # 80/130 and 120/130 of the run
    ],
)
def test_momentum_schedules(kind, epochs, expect):
    s = MomentumSchedule(0.5, 0.9, kind)
    got = [s(e, epochs) for e in range(epochs)]
    assert got == pytest.approx(expect)


def test_bad_schedule_is_refused():
    with pytest.raises(ValueError, match="schedule"):
        MomentumSchedule(0.5, 0.9, "exponential")
    with pytest.raises(ValueError, match="momentum"):
        MomentumSchedule(1.5, 0.9)
