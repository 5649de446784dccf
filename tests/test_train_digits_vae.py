"""bench/train_digits_vae.py: a small AutoencoderKL trained on the digits, saved so the trainer loads it
as --pretrained_vae_model_name_or_path, with a scaling_factor that gives its latents unit std."""
import torch
from helpers import load_bench_module, run_main

from diffusion_extras.training import autoencoder
from diffusion_extras.training.config import parse_config

train_digits_vae = load_bench_module("train_digits_vae")


def test_a_few_steps_save_a_vae_the_trainer_loads_with_unit_scale(tmp_path):
    out = tmp_path / "digits-vae"
    result = run_main(train_digits_vae.main, ["--output_dir", out, "--steps", "3", "--resolution", "8", "--batch_size",
                                              "16", "--block_out_channels", "8,8", "--latent_channels", "2"])
    assert "step 2: reconstruction L1" in result.stdout
    space = autoencoder.load_latent_space(parse_config(["--output_dir", str(tmp_path / "run"), "--resolution", "8",
                                                        "--pretrained_vae_model_name_or_path", str(out)]))
    assert (space.image_channels, space.channels, space.factor, space.size) == (1, 2, 2, 4)
    assert not autoencoder.measures_statistics(space.vae)  # its config names the scale it measured
    data = train_digits_vae.digits(8)
    with torch.no_grad():
        posterior = space.vae.encode(data).latent_dist
    scaled_variance = (posterior.mean.var() + posterior.var.mean()) * space.vae.config.scaling_factor ** 2
    assert abs(float(scaled_variance) - 1) < 1e-3
