"""Tests for diffusion_extras/evaluation/metrics.py and the `python -m diffusion_extras.evaluate` command line."""
import json
import os

import numpy as np
import pytest
import torch
from diffusers import DDPMScheduler
from faults import read_shares
from helpers import run_cli, save_random_images, save_tiny_pipeline, tiny_unet
from processes import run_command

from diffusion_extras.evaluation.metrics import (
    ReferenceStatistics,
    build_feature_extractor,
    evaluate_unet,
    feature_statistics,
    frechet_distance,
    kernel_inception_distance,
    reference_statistics,
    sample_features,
    score_suites,
)
from diffusion_extras.evaluation.sampling import make_scheduler


def test_frechet_distance_matches_closed_form_for_diagonal_gaussians():
    rng = np.random.default_rng(0)
    mu1, mu2 = rng.normal(size=6), rng.normal(size=6)
    var1, var2 = rng.uniform(0.1, 3, 6), rng.uniform(0.1, 3, 6)
    # Diagonal covariances commute: Tr(S1 + S2 - 2 sqrt(S1 S2)) = sum (sqrt(v1) - sqrt(v2))^2.
    expected = np.sum((mu1 - mu2) ** 2) + np.sum((np.sqrt(var1) - np.sqrt(var2)) ** 2)
    assert frechet_distance(mu1, np.diag(var1), mu2, np.diag(var2)) == pytest.approx(expected, rel=1e-10)


def test_frechet_distance_matches_closed_form_for_rotated_full_covariances():
    rng = np.random.default_rng(1)
    rotation, _ = np.linalg.qr(rng.normal(size=(5, 5)))
    var1, var2 = rng.uniform(0.2, 2, 5), rng.uniform(0.2, 2, 5)
    sigma1, sigma2 = rotation @ np.diag(var1) @ rotation.T, rotation @ np.diag(var2) @ rotation.T
    # Same eigenbasis, so the trace term is again sum (sqrt(v1) - sqrt(v2))^2.
    expected = 4.0 + np.sum((np.sqrt(var1) - np.sqrt(var2)) ** 2)
    mu2 = np.zeros(5)
    mu2[0] = 2.0
    assert frechet_distance(np.zeros(5), sigma1, mu2, sigma2) == pytest.approx(expected, rel=1e-8)


def test_frechet_distance_of_a_sample_with_itself_is_zero_even_when_singular():
    features = np.random.default_rng(2).normal(size=(10, 32))  # 10 samples in 32-d: singular covariance
    mu, sigma = feature_statistics(features)
    assert abs(frechet_distance(mu, sigma, mu, sigma)) < 1e-6
    shifted_mu, shifted_sigma = feature_statistics(features + 1.0)
    assert frechet_distance(mu, sigma, shifted_mu, shifted_sigma) == pytest.approx(32.0, rel=1e-4)


def brute_force_mmd2(x, y):
    """Unbiased MMD^2 (Binkowski et al. 2018, eq. 4 with k(a, b) = (a.b / d + 1)^3), written as loops."""
    m, d = len(x), x.shape[1]
    kernel = lambda a, b: (float(np.dot(a, b)) / d + 1) ** 3  # noqa: E731
    xx = sum(kernel(x[i], x[j]) for i in range(m) for j in range(m) if i != j) / (m * (m - 1))
    yy = sum(kernel(y[i], y[j]) for i in range(m) for j in range(m) if i != j) / (m * (m - 1))
    xy = sum(kernel(x[i], y[j]) for i in range(m) for j in range(m)) / (m * m)
    return xx + yy - 2 * xy


def test_kid_matches_brute_force_mmd_on_a_small_set():
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(12, 4)), rng.normal(0.3, 1.2, size=(12, 4))
    # One subset of all 12 points is a permutation of the full sets, which MMD^2 ignores.
    kid, kid_std = kernel_inception_distance(x, y, num_subsets=1, subset_size=12)
    assert kid == pytest.approx(brute_force_mmd2(x, y), rel=1e-10) and kid_std == 0


def test_kid_is_near_zero_for_one_distribution_and_positive_for_shifted():
    rng = np.random.default_rng(4)
    x, y, shifted = rng.normal(size=(400, 16)), rng.normal(size=(400, 16)), rng.normal(0.5, 1, size=(400, 16))
    same, same_std = kernel_inception_distance(x, y, num_subsets=20, subset_size=200)
    different, _ = kernel_inception_distance(x, shifted, num_subsets=20, subset_size=200)
    assert abs(same) < 3 * same_std + 1e-3
    assert different > 20 * abs(same) and different > 0.1


def test_tiny_extractor_is_deterministic_handles_grayscale_and_keeps_global_rng():
    images = np.random.default_rng(5).integers(0, 256, (4, 20, 20, 1), dtype=np.uint8)
    state = torch.get_rng_state()
    first, second = build_feature_extractor("tiny"), build_feature_extractor("tiny")
    assert torch.equal(torch.get_rng_state(), state)
    features = first(images)
    assert features.dtype == np.float64 and features.shape == (4, 64)
    np.testing.assert_array_equal(features, second(images))
    np.testing.assert_array_equal(features, first(np.repeat(images, 3, axis=-1)))
    assert "NOT comparable" in first.name


def test_inception_needs_weights_and_loads_a_torchscript_detector(tmp_path):
    with pytest.raises(ValueError, match="--inception_weights FILE.*--feature_extractor tiny"):
        build_feature_extractor("inception")
    with pytest.raises(FileNotFoundError):
        build_feature_extractor("inception", weights=str(tmp_path / "missing.pt"))
    (tmp_path / "junk.pt").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="not a TorchScript Inception detector"):
        build_feature_extractor("inception", weights=str(tmp_path / "junk.pt"))

    class StandInDetector(torch.nn.Module):
        """The real detector's call signature; checks it receives 3-channel pixels in [0, 255]."""

        def forward(self, img: torch.Tensor, return_features: bool = False) -> torch.Tensor:
            assert img.shape[1] == 3 and return_features and img.dtype == torch.float32
            return img.mean(dim=(2, 3)).repeat(1, 4) / 255.0

    torch.jit.script(StandInDetector()).save(str(tmp_path / "detector.pt"))
    extractor = build_feature_extractor("inception", weights=str(tmp_path / "detector.pt"))
    images = np.stack([np.full((7, 7, 1), 51, np.uint8), np.full((7, 7, 1), 255, np.uint8)])
    np.testing.assert_allclose(extractor(images), [[0.2] * 12, [1.0] * 12], rtol=1e-6)
    assert extractor.name.startswith("inception-v3") and "sha256:" in extractor.name


class CountingExtractor:
    def __init__(self, name="counting"):
        self.name, self.calls = name, 0
        self.inner = build_feature_extractor("tiny")

    def __call__(self, images):
        self.calls += 1
        return self.inner(images)


def test_reference_statistics_cache_is_reused_and_invalidated_by_fingerprint(tmp_path):
    images = np.random.default_rng(6).integers(0, 256, (20, 8, 8, 3), dtype=np.uint8)
    cache = str(tmp_path / "cache" / "reference.npz")
    extractor = CountingExtractor()
    fresh = reference_statistics(images, extractor, cache_path=cache, fingerprint="v1")
    assert extractor.calls == 1 and os.path.isfile(cache)
    cached = reference_statistics(images, extractor, cache_path=cache, fingerprint="v1")
    assert extractor.calls == 1
    np.testing.assert_array_equal(cached.sigma, fresh.sigma)
    np.testing.assert_array_equal(cached.features, fresh.features)
    assert (cached.num_images, cached.extractor_name) == (20, "counting")
    reference_statistics(images[:10], extractor, cache_path=cache, fingerprint="v2")
    assert extractor.calls == 2 and ReferenceStatistics.load(cache).num_images == 10
    reference_statistics(iter([images[:5], images[5:]]), CountingExtractor("other"), cache_path=cache,
                         fingerprint="v2")
    assert ReferenceStatistics.load(cache).extractor_name == "other"


def test_evaluate_unet_returns_finite_metrics_and_is_seeded():
    unet, scheduler = tiny_unet(channels=3), make_scheduler("ddim", DDPMScheduler(num_train_timesteps=100).config)
    extractor = build_feature_extractor("tiny")
    images = np.random.default_rng(7).integers(0, 256, (24, 8, 8, 3), dtype=np.uint8)
    reference = reference_statistics(images, extractor)
    metrics = evaluate_unet(unet, scheduler, reference, extractor, num_samples=10, num_inference_steps=4,
                            batch_size=4)
    assert metrics["num_samples"] == 10 and set(metrics) == {"fid", "kid", "kid_std", "num_samples"}
    assert all(np.isfinite(metrics[key]) for key in ("fid", "kid", "kid_std")) and metrics["fid"] > 0
    assert evaluate_unet(unet, scheduler, reference, extractor, 10, 4, batch_size=4) == metrics
    with pytest.raises(ValueError, match="same feature extractor"):
        evaluate_unet(unet, scheduler, reference, CountingExtractor("other"), 4, 2)


@pytest.mark.parametrize("num_ranks", [2, 3])
def test_ranks_sharing_the_images_give_those_of_one_rank_bitwise(num_ranks):
    """Each rank samples the batches k = rank mod num_ranks of the one-rank run (10 images in batches
    of 4: a ragged last batch): merged, the features and the metrics are bitwise those of one rank."""
    unet, scheduler = tiny_unet(channels=3), make_scheduler("ddim", DDPMScheduler(num_train_timesteps=100).config)
    extractor = build_feature_extractor("tiny")
    reference = reference_statistics(np.random.default_rng(7).integers(0, 256, (24, 8, 8, 3), dtype=np.uint8),
                                     extractor)
    suites = [(extractor, reference, ["fid", "kid"])]
    one = sample_features(unet, scheduler, [extractor], 10, 2, seed=3, batch_size=4)
    shares = [sample_features(unet, scheduler, [extractor], 10, 2, seed=3, batch_size=4, rank=rank,
                              num_ranks=num_ranks) for rank in range(num_ranks)]
    assert [sorted(share) for share in shares] == ([[0, 8], [4]] if num_ranks == 2 else [[0], [4], [8]])
    merged = {first: value for share in shares for first, value in share.items()}
    assert sorted(merged) == sorted(one)
    for first in one:
        np.testing.assert_array_equal(merged[first][0], one[first][0])
    assert score_suites(merged, suites, 10, seed=3) == score_suites(one, suites, 10, seed=3)


def test_cli_writes_metrics_json_and_caches_the_reference(tmp_path):
    pipeline_dir = save_tiny_pipeline(tmp_path / "run", channels=3)
    reference_dir = save_random_images(tmp_path / "reference", 12, 16, 12, seed=8)
    run_cli(["-m", "diffusion_extras.evaluate", pipeline_dir, "--reference", str(reference_dir),
             "--num_samples", "6", "--feature_extractor", "tiny", "--num_inference_steps", "3",
             "--batch_size", "6", "--cache_dir", str(tmp_path / "cache"), "--output", str(tmp_path / "m.json"),
             "--device", "cpu"])
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["num_samples"] == 6 and metrics["reference_images"] == 12 and np.isfinite(metrics["fid"])
    assert len(os.listdir(tmp_path / "cache")) == 1


def test_cli_under_a_two_rank_launch_reports_the_one_rank_metrics(tmp_path):
    """torchrun --nproc_per_node 2 -m diffusion_extras.evaluate: each rank samples its batches (10
    images in batches of 4), rank 0 scores and writes the report: bitwise the one-process report.
    The two ranks are processes of one gloo group (tests/faults.py --command evaluate, which records
    each rank's share); the one-rank report is made in this process."""
    pipeline_dir = save_tiny_pipeline(tmp_path / "run", channels=3)
    reference_dir = save_random_images(tmp_path / "reference", 12, 16, 12, seed=8)
    flags = [pipeline_dir, "--reference", str(reference_dir), "--num_samples", "10", "--feature_extractor", "tiny",
             "--num_inference_steps", "3", "--batch_size", "4", "--cache_dir", str(tmp_path / "cache"),
             "--device", "cpu"]
    run_cli(["-m", "diffusion_extras.evaluate", *flags, "--output", tmp_path / "one.json"])  # one rank: in this process
    shares = tmp_path / "shares"
    run_command(["tests/faults.py", "--command", "evaluate", "--record_shares", shares, "--", *flags,
                 "--output", tmp_path / "two.json"], ranks=2, env={"ACCELERATE_USE_CPU": "1"})
    assert json.loads((tmp_path / "two.json").read_text()) == json.loads((tmp_path / "one.json").read_text())
    # each rank sampled its own batches, not all of them nor none: rank 0 images 0-3 and 8-9, rank 1 4-7
    assert read_shares(shares) == {0: [{"firsts": [0, 8], "images": 6}], 1: [{"firsts": [4], "images": 4}]}


@pytest.mark.parametrize("reference, message", [("nowhere", "neither a folder of images nor"),
                                                ("stats.npz", "was made with")])
def test_cli_bad_reference_is_one_line_error_exit_2(tmp_path, reference, message):
    images = np.random.default_rng(9).integers(0, 256, (4, 8, 8, 3), dtype=np.uint8)
    reference_statistics(images, CountingExtractor("other"), cache_path=str(tmp_path / "stats.npz"))
    result = run_cli(["-m", "diffusion_extras.evaluate", save_tiny_pipeline(tmp_path / "run", channels=3),
                      "--reference", str(tmp_path / reference), "--feature_extractor", "tiny", "--device", "cpu"],
                     check=False)
    error = result.stderr.strip().splitlines()[-1]  # after diffusers' loading progress bar
    assert result.returncode == 2 and error.startswith("error: ") and message in error
