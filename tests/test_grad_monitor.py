"""Tests for diffusion_extras/monitoring/grad_monitor.py: per-bin gradients on a fixed probe batch, checked
against plain backward passes; through the training command line (the training result must not
change); and the health report's dominance check."""
import json

import numpy as np
import pytest
import torch
from diffusers import DDPMScheduler
from helpers import TINY_RECIPE, load_unet_weights, read_history, run_cli, run_training, tiny_unet
from safetensors.torch import load_file

from diffusion_extras.core.losses import min_snr_weight
from diffusion_extras.core.objectives import DDPM
from diffusion_extras.monitoring.grad_monitor import GradientMonitor
from diffusion_extras.report.checks import RunLog
from diffusion_extras.report.dynamics import check_gradient_dominance


def test_bin_gradients_match_plain_backward_and_leave_grad_untouched():
    torch.manual_seed(0)
    unet = tiny_unet(channels=3)
    unet.train()
    objective = DDPM(DDPMScheduler(num_train_timesteps=100), snr_gamma=5.0)
    schedule = objective.schedule
    images = np.random.default_rng(0).integers(0, 256, (4, 3, 8, 8), dtype=np.uint8)
    monitor = GradientMonitor(images, 100, 4, seed=1)
    assert all(((monitor.timesteps[i] >= 25 * i) & (monitor.timesteps[i] < 25 * (i + 1))).all() for i in range(4))
    measured = monitor.measure(unet, objective, device="cpu")
    assert unet.training and all(p.grad is None for p in unet.parameters())

    # Independent: the min-SNR-weighted epsilon loss of each bin written out, .backward() into .grad.
    clean = torch.from_numpy(images).float() / 127.5 - 1
    vectors = []
    unet.eval()
    for i in range(4):
        unet.zero_grad(set_to_none=True)
        t, noise = monitor.timesteps[i], monitor.noise[i]
        abar = schedule.alphas_cumprod[t].view(-1, 1, 1, 1)
        noisy = abar.sqrt() * clean + (1 - abar).sqrt() * noise
        per_sample = ((unet(noisy, t).sample - noise) ** 2).mean(dim=(1, 2, 3))
        (per_sample * min_snr_weight(schedule.snr[t], 5.0, "epsilon")).mean().backward()
        vectors.append(torch.cat([p.grad.reshape(-1) for p in unet.parameters()]).double().numpy())
    vectors = np.stack(vectors)
    np.testing.assert_allclose(measured["norms"], np.linalg.norm(vectors, axis=1), rtol=1e-5)
    total = vectors.mean(0)
    np.testing.assert_allclose(measured["shares"], vectors @ total / (4 * total @ total), rtol=1e-4, atol=1e-7)
    assert measured["shares"].sum() == pytest.approx(1.0) and measured["total_norm"] == pytest.approx(
        np.linalg.norm(total), rel=1e-5)


def test_monitor_logs_per_bin_and_does_not_change_the_training_result(tiny_recipe, tmp_path):
    # Dropout on: a probe that ran the UNet in training mode would draw from the global RNG.
    recipe = tiny_recipe(model={**TINY_RECIPE["model"], "dropout": 0.1})
    flags = ["--max_train_steps", "4", "--checkpointing_steps", "4"]
    for name, extra in (("plain", []), ("probed", ["--grad_diagnostics_steps", "1"])):
        run_training(recipe, tmp_path / name, *flags, *extra)
    for exported in (True, False):  # the exported (EMA) pipeline and the checkpoint's raw weights
        plain, probed = (load_unet_weights(tmp_path / name) if exported else
                         load_file(tmp_path / name / "checkpoint-4" / "model.safetensors")
                         for name in ("plain", "probed"))
        assert plain.keys() == probed.keys() and all(torch.equal(plain[k], probed[k]) for k in plain)
    rows = [r for r in read_history(tmp_path / "probed") if "grad_probe/total_norm" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    shares = [sum(r[f"grad_probe/share_bin/{i:02d}"] for i in range(10)) for r in rows]
    assert shares == pytest.approx([1.0] * 4) and all(r["grad_probe/norm_bin/05"] > 0 for r in rows)
    assert (tmp_path / "probed" / "images" / "grad_per_timestep.png").stat().st_size > 10_000
    assert not any("grad_probe/total_norm" in r for r in read_history(tmp_path / "plain"))


def probes(shares_per_probe):
    return [{"step": 10 * (k + 1), "loss": 1.0 / (k + 1), "grad_probe/total_norm": 1.0,
             **{f"grad_probe/share_bin/{i:02d}": s for i, s in enumerate(shares)}}
            for k, shares in enumerate(shares_per_probe)]


def test_report_warns_when_one_bin_dominates_the_gradient(tmp_path):
    dominated = [0.7] + [0.3 / 9] * 9
    (tmp_path / "logs").mkdir()
    with open(tmp_path / "logs" / "history.jsonl", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in probes([[0.1] * 10] * 4 + [dominated] * 4))
    (tmp_path / "training_config.yaml").write_text("snr_gamma: 0.0\nddpm_num_steps: 1000\n")
    printed = run_cli(["-m", "diffusion_extras.report", tmp_path]).stdout
    assert "gradient_dominated_by_one_bin" in printed and "Timesteps 0-99 carry 70%" in printed
    assert "--snr_gamma 5" in printed
    (tmp_path / "training_config.yaml").write_text("objective: flow_matching\nflow_shift: 1.0\nlogit_mean: 0.0\n")
    printed = run_cli(["-m", "diffusion_extras.report", tmp_path]).stdout  # a flow run: its levels, its flags
    assert "Sigma 0.00-0.10 carry 70%" in printed and "higher --logit_mean (now 0)" in printed
    assert "--snr_gamma" not in printed
    assert not check_gradient_dominance(RunLog(probes([[0.1] * 10] * 8), {}))
    assert not check_gradient_dominance(RunLog(probes([dominated] * 3 + [[0.1] * 10] * 5), {}))  # early only
