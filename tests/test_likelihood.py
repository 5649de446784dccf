"""Tests for diffusion_extras/evaluation/likelihood.py and `python -m diffusion_extras.evaluate ... --eval_metrics
nll`: the full bound against a float64 computation written out term by term (helpers.vlb_term_by_hand)."""
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import DDPMPipeline, DDPMScheduler
from helpers import VLB_BETAS, VLB_T, run_cli, save_random_images, save_tiny_pipeline, tiny_unet, vlb_term_by_hand

from diffusion_extras.data.batch_order import mix_seed
from diffusion_extras.evaluation.likelihood import NLL_STREAM, bits_per_dim, kl_blocks


class AffineUNet(torch.nn.Module):
    """eps_hat = 0.5 x_t and, learned, variance values 0.3: elementwise, so a hand computation can follow it."""

    def __init__(self, learned: bool):
        super().__init__()
        self.config = SimpleNamespace(in_channels=1, num_class_embeds=None)
        self.scale = torch.nn.Parameter(torch.tensor(0.5))
        self.learned = learned

    def forward(self, sample, timestep):
        outputs = [sample * self.scale] + ([torch.full_like(sample, 0.3)] if self.learned else [])
        return SimpleNamespace(sample=torch.cat(outputs, 1))


@pytest.mark.parametrize("variance_type", ["fixed_small", "learned_range"])
def test_full_bound_matches_a_float64_hand_computation(variance_type):
    images = np.array([[[0, 255], [128, 40]], [[7, 200], [255, 0]]], dtype=np.uint8)[..., None]  # [2, 2, 2, 1]
    scheduler = DDPMScheduler(num_train_timesteps=VLB_T, trained_betas=VLB_BETAS, variance_type=variance_type)
    got = bits_per_dim(AffineUNet(variance_type == "learned_range"), scheduler, images, batch_size=2, seed=3)
    clean = images[..., 0].astype(np.float64) / 127.5 - 1  # [2, 2, 2]
    abar = [math.prod(1 - b for b in VLB_BETAS[:i + 1]) for i in range(VLB_T)]
    totals = np.zeros(2)
    for t in range(VLB_T):
        noise = torch.randn((2, 1, 2, 2), generator=torch.Generator().manual_seed(mix_seed(3, NLL_STREAM, 0, t)))
        noise = noise.double().numpy()[:, 0]
        for n in range(2):
            terms = []
            for x0, e in zip(clean[n].flat, noise[n].flat):
                xt = math.sqrt(abar[t]) * x0 + math.sqrt(1 - abar[t]) * e
                terms.append(vlb_term_by_hand(x0, xt, 0.5 * xt, 0.3, t, variance_type))
            totals[n] += np.mean(terms)
    for n in range(2):  # the prior KL(N(sqrt(abar_T) x0, 1 - abar_T) || N(0, 1))
        totals[n] += np.mean([0.5 * (-1 - math.log(1 - abar[-1]) + (1 - abar[-1]) + abar[-1] * x0 ** 2)
                              for x0 in clean[n].flat]) / math.log(2)
    assert got["nll_bits_per_dim"] == pytest.approx(totals.mean(), rel=2e-4)
    assert got["nll_images"] == 2 and got["nll_unet_calls_per_image"] == VLB_T


def test_strided_blocks_cover_every_kl_term_once():
    for stride in (1, 3, 7, 999):
        blocks = kl_blocks(1000, stride)
        assert sum(weight for _, weight in blocks) == 999
        assert all(1 <= t <= 999 for t, _ in blocks) and len(blocks) == math.ceil(999 / stride)


@pytest.mark.parametrize("learned", [False, True])
def test_evaluate_command_reports_bits_per_dim(tmp_path, learned):
    pipeline = save_tiny_pipeline(tmp_path / "pipe")
    if learned:  # the same folder made into a learned-variance pipeline: 2C outputs and learned_range
        DDPMPipeline(unet=tiny_unet(out_channels=2),
                     scheduler=DDPMScheduler(num_train_timesteps=100, variance_type="learned_range")).save_pretrained(
            pipeline)
    references = save_random_images(tmp_path / "refs", 3, 8, 8)
    output = tmp_path / "nll.json"
    run_cli(["-m", "diffusion_extras.evaluate", pipeline, "--reference", references, "--eval_metrics", "nll",
             "--nll_timestep_stride", "25", "--device", "cpu", "--output", output])
    report = json.loads(output.read_text())
    assert report["nll_images"] == 3 and report["nll_unet_calls_per_image"] == 1 + 4
    assert report["nll_timestep_stride"] == 25 and 0 < report["nll_bits_per_dim"] < 100
    parts = sum(report[f"nll_{name}_bits_per_dim"] for name in ("prior", "decoder", "kl"))
    assert report["nll_bits_per_dim"] == pytest.approx(parts)
