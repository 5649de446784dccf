import io
import math

import numpy as np
import pytest
import torch
from PIL import Image

from diffusion_extras.monitoring.bins import timestep_bin_edges
from diffusion_extras.monitoring.diagnostics import (
    TimestepDiagnostics,
    bayes_optimal_curve,
    bayes_optimal_loss,
    per_dimension_variance,
)
from diffusion_extras.monitoring.plots import plot_loss_per_timestep

T = 1000


def _batches(seed=0, num_batches=4, batch_size=37, num_bins=7):
    """Random batches that leave bin 3 empty and hold a NaN and an inf sample."""
    rng = np.random.default_rng(seed)
    edges = np.arange(num_bins + 1) * T / num_bins
    allowed = np.array([t for t in range(T) if not edges[3] <= t < edges[4]])
    batches = []
    for _ in range(num_batches):
        timesteps = rng.choice(allowed, size=batch_size)
        loss = rng.gamma(2.0, 0.1, size=batch_size)
        batches.append((timesteps, loss))
    batches[1][1][5] = np.nan
    batches[2][1][9] = np.inf
    return batches, edges


def test_binned_statistics_match_brute_force_reference():
    num_bins = 7
    batches, edges = _batches(num_bins=num_bins)
    diag = TimestepDiagnostics(T, num_bins=num_bins)
    for timesteps, loss in batches:
        diag.update_loss(torch.tensor(timesteps), torch.tensor(loss, dtype=torch.float32))
    stats = diag.reduce_and_reset()

    per_bin = {i: [] for i in range(num_bins)}
    nonfinite = dict.fromkeys(range(num_bins), 0)
    for timesteps, loss in batches:
        for t, value in zip(timesteps, np.float32(loss).astype(np.float64)):
            i = int(np.searchsorted(edges, t, side="right")) - 1
            if math.isfinite(value):
                per_bin[i].append(value)
            else:
                nonfinite[i] += 1
    assert sum(nonfinite.values()) == 2
    for i, values in per_bin.items():
        key = f"{i:02d}"
        if not values:
            assert f"loss_bin/{key}" not in stats and f"loss_std_bin/{key}" not in stats
            continue
        assert stats[f"loss_bin/{key}"] == pytest.approx(np.mean(values), rel=1e-12)
        assert stats[f"loss_std_bin/{key}"] == pytest.approx(np.std(values, ddof=1), rel=1e-9)
        assert stats.get(f"nonfinite_bin/{key}", 0.0) == nonfinite[i]
    assert stats["nonfinite_samples"] == 2
    assert all(math.isfinite(v) for v in stats.values())
    # The window was reset: a new window with no updates has no loss bins.
    assert not any(k.startswith("loss_bin/") for k in diag.reduce_and_reset())


def test_bin_edges_and_centers():
    assert timestep_bin_edges(1000, 10) == list(range(0, 1001, 100))
    diag = TimestepDiagnostics(10, num_bins=3)  # edges 0, 4, 7, 10 (ceil of 10/3 multiples)
    assert diag.bin_edges() == [0, 4, 7, 10]
    np.testing.assert_allclose(diag.bin_centers(), [1.5, 5.0, 8.0])
    diag.update_loss(torch.tensor([3, 4, 6, 7]), torch.tensor([1.0, 2.0, 4.0, 8.0]))
    stats = diag.reduce_and_reset()
    assert (stats["loss_bin/00"], stats["loss_bin/01"], stats["loss_bin/02"]) == (1.0, 3.0, 8.0)
    with pytest.raises(ValueError, match="num_bins"):
        TimestepDiagnostics(5, num_bins=6)


def _run_steps(diag, norms, finite, max_grad_norm=1.0):
    for norm, ok in zip(norms, finite):
        diag.update_step(torch.tensor(norm), max_grad_norm, torch.tensor(ok))


def test_step_counters_clip_rate_and_consecutive_nonfinite():
    diag = TimestepDiagnostics(T)
    # The NaN-norm step claims to be finite: the norm overrules it.
    _run_steps(diag, [0.5, 2.0, float("inf"), float("nan"), 3.0, 0.1, 4.0, 7.0],
               [True, True, False, True, True, True, False, False])
    stats = diag.reduce_and_reset()
    assert stats["nonfinite_steps"] == 4
    assert stats["max_consecutive_nonfinite"] == 2
    assert stats["clip_rate"] == pytest.approx(2 / 4)  # 2.0 and 3.0 of the 4 finite steps
    assert stats["grad_norm"] == pytest.approx((0.5 + 2.0 + 3.0 + 0.1) / 4)
    assert "loss_scale" not in stats
    # The streak of 2 at the end of the window continues into the next one.
    _run_steps(diag, [9.0, 0.2, 9.0], [False, True, False])
    stats = diag.reduce_and_reset()
    assert stats["max_consecutive_nonfinite"] == 3
    assert stats["nonfinite_steps"] == 2 and stats["clip_rate"] == 0.0
    assert (diag.total_steps, diag.total_nonfinite, diag.total_clipped) == (11, 6, 2)
    # A finite step resets the streak; without max_grad_norm nothing counts as clipped.
    _run_steps(diag, [5.0], [True], max_grad_norm=None)
    _run_steps(diag, [6.0], [True], max_grad_norm=0.0)
    diag.update_step(torch.tensor(5.0), None, torch.tensor(True), loss_scale=torch.tensor(1024.0))
    stats = diag.reduce_and_reset()
    assert stats["max_consecutive_nonfinite"] == 0 and stats["clip_rate"] == 0.0
    assert stats["loss_scale"] == 1024.0 and stats["grad_norm"] == pytest.approx(16.0 / 3)


def _feed(diag, seed, num_windows=3):
    rng = np.random.default_rng(seed)
    outputs = []
    for _ in range(num_windows):
        for _ in range(3):
            diag.update_loss(torch.tensor(rng.integers(0, T, 16)), torch.tensor(rng.random(16)))
            norm = float(rng.random() * 2)
            diag.update_step(torch.tensor(norm), 1.0, torch.tensor(rng.random() > 0.3), 2.0 ** 10)
        outputs.append(diag.reduce_and_reset())
    return outputs


def test_state_dict_round_trip_continues_identically():
    original = TimestepDiagnostics(T, num_bins=5)
    _feed(original, seed=1)
    # Save in the middle of a window, as a checkpoint between logging steps would.
    original.update_loss(torch.tensor([10, 990]), torch.tensor([0.3, 0.01]))
    original.update_step(torch.tensor(float("nan")), 1.0, torch.tensor(False))
    buffer = io.BytesIO()
    torch.save(original.state_dict(), buffer)
    buffer.seek(0)
    resumed = TimestepDiagnostics(T, num_bins=5)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert _feed(original, seed=2) == _feed(resumed, seed=2)
    np.testing.assert_array_equal(original.running_bin_loss, resumed.running_bin_loss)
    assert (original.total_steps, original.total_nonfinite, original.total_clipped) == (
        resumed.total_steps, resumed.total_nonfinite, resumed.total_clipped)
    with pytest.raises(ValueError, match="num_bins"):
        TimestepDiagnostics(T, num_bins=4).load_state_dict(original.state_dict())


def test_running_bin_loss_is_an_ema_of_window_means():
    diag = TimestepDiagnostics(T, num_bins=2, running_decay=0.5)
    diag.update_loss(torch.tensor([0]), torch.tensor([4.0]))
    diag.reduce_and_reset()
    diag.update_loss(torch.tensor([0, 999]), torch.tensor([2.0, 1.0]))
    diag.reduce_and_reset()
    diag.reduce_and_reset()  # an empty window leaves the running values alone
    np.testing.assert_allclose(diag.running_bin_loss, [3.0, 1.0])


class _TwoRankAccelerator:
    """Stands in for accelerate with a second rank whose window is `other`."""
    num_processes = 2

    def __init__(self, other):
        self.other = other

    def gather(self, tensor):
        return torch.cat([tensor, self.other._window.unsqueeze(0)])


def test_reduce_without_accelerator_and_over_two_ranks():
    rank0, rank1 = TimestepDiagnostics(T, num_bins=2), TimestepDiagnostics(T, num_bins=2)
    rank0.update_loss(torch.tensor([1, 600]), torch.tensor([1.0, 5.0]))
    _run_steps(rank0, [0.5, 0.5], [True, True])
    single = rank0.reduce_and_reset(accelerator=None)
    assert (single["loss_bin/00"], single["loss_bin/01"]) == (1.0, 5.0)
    assert single["max_consecutive_nonfinite"] == 0

    rank0.update_loss(torch.tensor([1, 600]), torch.tensor([1.0, 5.0]))
    rank1.update_loss(torch.tensor([2, 3]), torch.tensor([3.0, float("nan")]))
    _run_steps(rank0, [0.5, 0.5], [True, True])
    _run_steps(rank1, [0.5, 0.5], [False, False])
    stats = rank0.reduce_and_reset(_TwoRankAccelerator(rank1))
    assert stats["loss_bin/00"] == 2.0 and stats["loss_bin/01"] == 5.0  # samples of both ranks
    assert stats["nonfinite_bin/00"] == 1.0
    assert stats["max_consecutive_nonfinite"] == 2 and stats["nonfinite_steps"] == 2


def _monte_carlo_mmse(abar, sigma, prediction_type, generator, num_samples=400_000):
    """MSE of the least-squares linear estimator (fit on one sample set, scored on another)."""
    def draw():
        x0 = torch.randn(num_samples, generator=generator, dtype=torch.float64) * sigma
        eps = torch.randn(num_samples, generator=generator, dtype=torch.float64)
        x_t = math.sqrt(abar) * x0 + math.sqrt(1 - abar) * eps
        target = {"epsilon": eps, "sample": x0,
                  "v_prediction": math.sqrt(abar) * eps - math.sqrt(1 - abar) * x0}[prediction_type]
        return x_t, target
    x_t, target = draw()
    coefficient = (x_t * target).sum() / (x_t * x_t).sum()
    x_t, target = draw()
    return float(((target - coefficient * x_t) ** 2).mean())


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction", "sample"])
def test_bayes_optimal_loss_matches_monte_carlo(prediction_type):
    generator = torch.Generator().manual_seed(0)
    abars = [1e-3, 0.1, 0.5, 0.9, 0.999]
    for sigma in (0.5, 1.0, 1.7):
        closed_form = bayes_optimal_loss(torch.tensor(abars, dtype=torch.float64), sigma, prediction_type)
        for abar, expected in zip(abars, closed_form.tolist()):
            estimate = _monte_carlo_mmse(abar, sigma, prediction_type, generator)
            # Relative standard error of a Gaussian MSE estimate: sqrt(2 / N) = 0.22 %.
            assert estimate == pytest.approx(expected, rel=1.2e-2), (abar, sigma)


def test_a_plausible_epsilon_formula_is_wrong_and_ours_is_not():
    abar, sigma = 0.9, 1.0
    estimate = _monte_carlo_mmse(abar, sigma, "epsilon", torch.Generator().manual_seed(1))
    wrong_formula = 1 - abar / (1 - abar + abar / sigma ** 2)  # once proposed for the epsilon MMSE
    ours = float(bayes_optimal_loss(torch.tensor([abar]), sigma, "epsilon"))
    assert ours == pytest.approx(abar, rel=1e-6)  # at sigma = 1 the eps-MMSE is abar
    assert estimate == pytest.approx(ours, rel=1.2e-2)
    assert abs(wrong_formula - estimate) > 0.5


def test_bayes_optimal_loss_limits_and_guards():
    abar = torch.tensor([0.0, 1.0], dtype=torch.float32)
    sigma = 0.6
    expected = {"epsilon": [0.0, 1.0], "sample": [sigma ** 2, 0.0], "v_prediction": [sigma ** 2, 1.0]}
    for prediction_type, values in expected.items():
        curve = bayes_optimal_loss(abar, sigma, prediction_type)
        assert curve.dtype == torch.float32
        np.testing.assert_allclose(curve.numpy(), values, rtol=1e-6)
        zero_data = bayes_optimal_loss(abar, 0.0, prediction_type)
        assert torch.isfinite(zero_data).all() and (zero_data == 0).all()
    with pytest.raises(ValueError, match="prediction_type"):
        bayes_optimal_loss(abar, sigma, "x0")


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction", "sample"])
def test_posterior_mean_predictor_loss_matches_bayes_bins(prediction_type):
    """The exact posterior mean, noised and scored the way training does, attains the curve."""
    from diffusers import DDPMScheduler

    scheduler = DDPMScheduler(num_train_timesteps=T)
    abar_all = scheduler.alphas_cumprod.to(torch.float64)
    sigma, num_bins = 0.5, 8
    diag = TimestepDiagnostics(T, num_bins=num_bins)
    generator = torch.Generator().manual_seed(3)
    for _ in range(4):
        x0 = sigma * torch.randn(4096, 3, 4, 4, generator=generator, dtype=torch.float64)
        noise = torch.randn(x0.shape, generator=generator, dtype=torch.float64)
        timesteps = torch.randint(0, T, (x0.shape[0],), generator=generator)
        x_t = scheduler.add_noise(x0, noise, timesteps)
        target = {"epsilon": noise, "sample": x0,
                  "v_prediction": scheduler.get_velocity(x0, noise, timesteps)}[prediction_type]
        a = abar_all[timesteps].sqrt().view(-1, 1, 1, 1)
        s = (1 - abar_all[timesteps]).sqrt().view(-1, 1, 1, 1)
        noisy_variance = a ** 2 * sigma ** 2 + s ** 2
        coefficient = {"epsilon": s, "sample": a * sigma ** 2,
                       "v_prediction": a * s * (1 - sigma ** 2)}[prediction_type] / noisy_variance
        per_sample = ((coefficient * x_t - target) ** 2).mean(dim=(1, 2, 3))
        diag.update_loss(timesteps, per_sample.float())
    stats = diag.reduce_and_reset()
    reference = diag.bayes_optimal_bins(scheduler.alphas_cumprod, sigma, prediction_type)
    assert len(reference) == num_bins
    for key, expected in reference.items():
        count = 4 * 4096 / num_bins
        standard_error = stats[key.replace("loss_bin", "loss_std_bin")] / math.sqrt(count)
        assert abs(stats[key] - expected) < 5 * standard_error + 1e-6 * expected, key


def test_per_dimension_variance():
    generator = torch.Generator().manual_seed(0)
    images = (torch.rand(300, 3, 5, 5, generator=generator) * 1.6 - 0.8) * torch.linspace(0.1, 1, 5)
    expected = images.double().var(dim=0, unbiased=False).mean().item()
    assert per_dimension_variance(images, chunk_size=64) == pytest.approx(expected, rel=1e-12)
    with pytest.raises(ValueError, match=r"\[-1, 1\]"):
        per_dimension_variance(images * 255)


def _red_pixels(path):
    pixels = np.asarray(Image.open(path).convert("RGB")).astype(int)
    return int((np.abs(pixels - [214, 39, 40]).sum(-1) < 30).sum())  # matplotlib "tab:red"


def test_plot_is_a_png_with_the_loss_markers(tmp_path):
    from diffusers import DDPMScheduler

    alphas_cumprod = DDPMScheduler(num_train_timesteps=T).alphas_cumprod
    diag = TimestepDiagnostics(T, num_bins=10)
    diag.update_loss(torch.arange(0, T, 7), torch.linspace(1.0, 0.01, len(range(0, T, 7))))
    diag.reduce_and_reset()
    path = plot_loss_per_timestep(diag, bayes_optimal_curve(alphas_cumprod, 0.5, "epsilon"), 0.5, "epsilon",
                                  str(tmp_path / "a" / "loss.png"))
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size == (700, 450)
    assert (tmp_path / "a" / "loss.png").stat().st_size > 10_000
    assert _red_pixels(path) > 100

    # Empty bins, and a zero-terminal-SNR schedule whose last reference value is exactly 0.
    empty = TimestepDiagnostics(T, num_bins=10)
    zero_snr = alphas_cumprod.clone()
    zero_snr[-1] = 0.0
    path = plot_loss_per_timestep(empty, bayes_optimal_curve(zero_snr, 0.5, "epsilon"), 0.5, "epsilon",
                                  str(tmp_path / "empty.png"), "empty")
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size == (700, 450)
    assert _red_pixels(path) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_updates_do_not_synchronize_with_the_host():
    diag = TimestepDiagnostics(T, device="cuda")
    timesteps = torch.randint(0, T, (64,), device="cuda")
    loss = torch.rand(64, device="cuda")
    scale = torch.tensor(65536.0, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            diag.update_loss(timesteps, loss)
            diag.update_step(loss.sum(), 1.0, torch.isfinite(loss).all(), scale)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stats = diag.reduce_and_reset()
    assert stats["clip_rate"] == 1.0 and stats["loss_scale"] == 65536.0


def test_loss_per_class_is_judged_against_all_classes_at_the_same_timesteps():
    """Two bins (t < 500: loss ~1, t >= 500: loss ~0.01) and 3 classes. Class 0 drew only the noisy,
    low-loss bin, so its raw mean is tiny, yet it sits at the average there; class 2 is twice the
    others at both. Dropped labels (3: "no class") and non-finite losses count for no class; the
    two-rank gather sums the (class, bin) cells like the bins, so two ranks give one rank's values."""
    timesteps = torch.tensor([600, 700, 100, 800, 200, 900, 300, 50, 60])
    loss = torch.tensor([0.01, 0.01, 1.0, 0.01, 2.0, 0.02, float("nan"), 5.0, 1.0])
    labels = torch.tensor([0, 0, 1, 1, 2, 2, 1, 3, 1])
    one = TimestepDiagnostics(T, num_bins=2, num_classes=3)
    one.update_loss(timesteps, loss, labels)
    stats = one.reduce_and_reset()
    # bin means over conditioned finite samples: low t (1.0, 2.0, 1.0) -> 4/3; high t (0.01 x3, 0.02) -> 0.0125
    low, high = 4 / 3, 0.05 / 4
    assert stats["loss_class/00"] == pytest.approx(0.02 / (2 * high))
    assert stats["loss_class/01"] == pytest.approx((1.0 + 0.01 + 1.0) / (2 * low + high))
    assert stats["loss_class/02"] == pytest.approx((2.0 + 0.02) / (low + high))
    assert "loss_class/03" not in stats
    first, second = TimestepDiagnostics(T, num_bins=2, num_classes=3), TimestepDiagnostics(T, num_bins=2, num_classes=3)
    first.update_loss(timesteps[:4], loss[:4], labels[:4])
    second.update_loss(timesteps[4:], loss[4:], labels[4:])
    two = first.reduce_and_reset(_TwoRankAccelerator(second))
    assert {k: v for k, v in two.items() if k.startswith("loss_class")} == pytest.approx(
        {k: v for k, v in stats.items() if k.startswith("loss_class")})
    unconditional = TimestepDiagnostics(T, num_bins=2)
    unconditional.update_loss(timesteps, loss, labels)  # no classes declared: labels are ignored
    assert not any(k.startswith("loss_class") for k in unconditional.reduce_and_reset())
    with pytest.raises(ValueError, match="num_classes = 1000/2/0, this run 1000/2/3"):
        one.load_state_dict(unconditional.state_dict())
