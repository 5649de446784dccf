import math

import pytest
import torch

from diffusion_extras.core.ema import ExponentialMovingAverage


def closed_form_decay(k, inv_gamma, power, max_decay):
    return min(1 - (1 + (k - 1) / inv_gamma) ** -power, max_decay) if k > 1 else 0.0


@pytest.mark.parametrize("inv_gamma,power,max_decay", [(1.0, 0.75, 0.9999), (10.0, 2 / 3, 0.99), (1.0, 1.0, 0.9)])
def test_decay_matches_closed_form(inv_gamma, power, max_decay):
    ema = ExponentialMovingAverage([torch.nn.Parameter(torch.zeros(1))], max_decay, inv_gamma, power)
    for k in (1, 2, 3, 10, 100, 10_000, 10 ** 7):
        assert ema.decay(k) == pytest.approx(closed_form_decay(k, inv_gamma, power, max_decay), abs=1e-12)
    assert ema.decay(10 ** 9) == max_decay


def test_average_matches_recurrence():
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(5, 3))
    ema = ExponentialMovingAverage([param], max_decay=0.95, inv_gamma=1.0, power=0.75)
    expected = torch.zeros(5, 3, dtype=torch.float64)
    for k in range(1, 60):
        with torch.no_grad():
            param.add_(torch.randn(5, 3) * 0.1)
        ema.step([param])
        d = closed_form_decay(k, 1.0, 0.75, 0.95)
        expected = d * expected + (1 - d) * param.detach().double()
    assert torch.allclose(ema.shadow_params[0].double(), expected, atol=1e-6)
    assert ema.optimization_step == 59


def test_first_update_copies_weights():
    param = torch.nn.Parameter(torch.full((4,), 3.0))
    ema = ExponentialMovingAverage([torch.nn.Parameter(torch.zeros(4))])
    ema.step([param])
    assert torch.equal(ema.shadow_params[0], param.detach())


def test_non_finite_flag_skips_update_without_host_read():
    param = torch.nn.Parameter(torch.ones(3))
    ema = ExponentialMovingAverage([param], max_decay=0.5)
    ema.step([param])
    before = ema.shadow_params[0].clone()
    with torch.no_grad():
        param.fill_(100.0)
    ema.step([param], finite=torch.tensor(False))
    assert torch.equal(ema.shadow_params[0], before)
    ema.step([param], finite=torch.tensor(True))
    assert torch.allclose(ema.shadow_params[0], 0.5 * before + 0.5 * 100.0)


def test_average_parameters_swaps_and_restores():
    model = torch.nn.Linear(3, 2)
    ema = ExponentialMovingAverage(model.parameters(), max_decay=0.9)
    ema.step(model.parameters())
    trained = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    current = [p.detach().clone() for p in model.parameters()]
    with ema.average_parameters(model.parameters()):
        for p, t in zip(model.parameters(), trained):
            assert torch.equal(p, t)
    for p, c in zip(model.parameters(), current):
        assert torch.equal(p, c)


def test_state_dict_round_trip_continues_identically():
    torch.manual_seed(1)
    model = torch.nn.Linear(4, 4)
    a = ExponentialMovingAverage(model.parameters(), max_decay=0.99, power=2 / 3)
    for _ in range(5):
        a.step(model.parameters())
    b = ExponentialMovingAverage(torch.nn.Linear(4, 4).parameters(), max_decay=0.99, power=2 / 3)  # same config
    b.load_state_dict(a.state_dict())
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-2)
    a.step(model.parameters())
    b.step(model.parameters())
    assert a.optimization_step == b.optimization_step == 6
    for x, y in zip(a.shadow_params, b.shadow_params):
        assert torch.equal(x, y)
    assert math.isclose(b.power, 2 / 3)


def test_load_state_dict_keeps_the_current_settings():
    """The decay settings come from the resumed run's config (a change is warned about at resume),
    the checkpoint gives the position and the average."""
    a = ExponentialMovingAverage(torch.nn.Linear(2, 2).parameters(), max_decay=0.99, power=2 / 3)
    a.step(torch.nn.Linear(2, 2).parameters())
    b = ExponentialMovingAverage(torch.nn.Linear(2, 2).parameters(), max_decay=0.5, power=1.0)
    b.load_state_dict(a.state_dict())
    assert (b.max_decay, b.power, b.optimization_step) == (0.5, 1.0, 1)
    assert all(torch.equal(x, y) for x, y in zip(a.shadow_params, b.shadow_params))


def test_load_state_dict_rejects_other_model():
    a = ExponentialMovingAverage(torch.nn.Linear(2, 2).parameters())
    b = ExponentialMovingAverage(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)).parameters())
    with pytest.raises(ValueError, match="EMA state holds 2 tensors but the model has 4"):
        b.load_state_dict(a.state_dict())


def test_step_with_device_flag_never_reads_it_on_the_host():
    """A 0-dim tensor lerp weight is read with .item() by torch's argument parser (a sync per step on a GPU)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class ScalarReads(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func.overloadpacket.__name__ == "_local_scalar_dense"
            return func(*args, **(kwargs or {}))

    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4))]
    ema = ExponentialMovingAverage(params, max_decay=0.9)
    ema.step(params)
    with torch.no_grad():
        for p in params:
            p.add_(1.0)
    before = [s.clone() for s in ema.shadow_params]
    with ScalarReads() as reads:
        ema.step(params, finite=torch.tensor(False))
        skipped = [s.clone() for s in ema.shadow_params]
        ema.step(params, finite=torch.tensor(True))
    assert reads.count == 0
    assert all(torch.equal(a, b) for a, b in zip(before, skipped)), "a skipped step moved the EMA"
    decay = ema.decay(3)
    for shadow, old, p in zip(ema.shadow_params, before, params):
        assert torch.allclose(shadow, decay * old + (1 - decay) * p.detach(), atol=1e-6)
