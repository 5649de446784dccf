"""bench/train_digits_vae.py: a small AutoencoderKL trained on the digits, saved so the trainer loads it
as --pretrained_vae_model_name_or_path, with a scaling_factor that gives its latents unit std; a
progress bar with a time estimate; a stop signal saves the VAE trained so far."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import load_bench_module, run_main

from diffusion_extras.training import autoencoder
from diffusion_extras.training.config import parse_config

train_digits_vae = load_bench_module("train_digits_vae")
SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "train_digits_vae.py")
TINY = ["--resolution", "8", "--batch_size", "16", "--block_out_channels", "8,8", "--latent_channels", "2"]


def test_a_few_steps_save_a_vae_the_trainer_loads_with_unit_scale(tmp_path):
    out = tmp_path / "digits-vae"
    result = run_main(train_digits_vae.main, ["--output_dir", out, "--steps", "3", *TINY])
    printed = result.stdout
    assert "VAE steps: 100%" in printed and "3/3 [" in printed and "l1=" in printed  # tqdm's bar, its times
    assert f"saved to {out} (scaling_factor" in printed
    space = autoencoder.load_latent_space(parse_config(["--output_dir", str(tmp_path / "run"), "--resolution", "8",
                                                        "--pretrained_vae_model_name_or_path", str(out)]))
    assert (space.image_channels, space.channels, space.factor, space.size) == (1, 2, 2, 4)
    assert not autoencoder.measures_statistics(space.vae)  # its config names the scale it measured
    data = train_digits_vae.digits(8)
    with torch.no_grad():
        posterior = space.vae.encode(data).latent_dist
    scaled_variance = (posterior.mean.var() + posterior.var.mean()) * space.vae.config.scaling_factor ** 2
    assert abs(float(scaled_variance) - 1) < 1e-3


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit) as exit_:
        train_digits_vae.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert exit_.value.code == 0
    for flag, default in (("--steps", train_digits_vae.STEPS), ("--learning_rate", train_digits_vae.LEARNING_RATE),
                          ("--batch_size", 64), ("--block_out_channels", "32,64,64")):
        assert flag in text and f"(default: {default})" in text, flag


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=lambda stop: stop.name)
def test_a_stop_signal_saves_the_vae_trained_so_far(tmp_path, stop):
    """A process: the signal comes from outside, as Ctrl-C or a job scheduler sends it."""
    out, log = tmp_path / "digits-vae", tmp_path / "stdout"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    with open(log, "w") as fh:
        process = subprocess.Popen([sys.executable, SCRIPT, "--output_dir", str(out), "--steps", "100000", *TINY],
                                   stdout=fh, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 240
        while "VAE steps:" not in log.read_text() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        process.send_signal(stop)
        assert process.wait(timeout=240) == train_digits_vae.STOPPED
    finally:
        process.kill()
    printed = log.read_text()
    assert "Traceback" not in printed
    assert f"{stop.name}: stopped after step " in printed and " of 100000; saving the VAE trained so far" in printed
    from diffusers import AutoencoderKL
    vae = AutoencoderKL.from_pretrained(out)
    assert vae.config.latent_channels == 2 and vae.config.scaling_factor != 1.0  # measured, not the default
