"""The UNet and the noise scheduler, built from the config."""
from __future__ import annotations

import json
import os

from .config import ConfigError, TrainConfig, validate_model_shape


def unet_config(config: TrainConfig) -> dict:
    """UNet2DModel kwargs from --model_config_name_or_path (folder or JSON) or the recipe's `model`,
    with sample_size set to the training resolution (the pipeline samples at sample_size)."""
    if config.model_config_name_or_path:
        path = config.model_config_name_or_path
        if os.path.isdir(path):
            path = os.path.join(path, "unet", "config.json") if os.path.isdir(os.path.join(path, "unet")) \
                else os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise ConfigError(f"--model_config_name_or_path: no config.json in {config.model_config_name_or_path}")
        try:
            with open(path) as fh:
                values = json.load(fh)
        except json.JSONDecodeError as error:
            raise ConfigError(f"--model_config_name_or_path {path}: not valid JSON ({error})") from None
        values = {k: v for k, v in values.items() if not k.startswith("_")}
    else:
        values = dict(config.model)
    values["sample_size"] = config.resolution
    if values.get("in_channels", 3) not in (1, 3) or values.get("out_channels", 3) != values.get("in_channels", 3):
        raise ConfigError("the UNet must have in_channels == out_channels, 1 (grayscale) or 3 (RGB); "
                          f"got {values.get('in_channels')} -> {values.get('out_channels')}")
    validate_model_shape(values, config.resolution)
    return values


def build_unet(config: TrainConfig):
    from diffusers import UNet2DModel

    try:
        return UNet2DModel(**unet_config(config))
    except (TypeError, ValueError) as error:
        raise ConfigError(f"the UNet config is invalid: {error}") from None


def build_noise_scheduler(config: TrainConfig):
    from diffusers import DDPMScheduler

    # Zero terminal SNR needs sampling to start at t = T-1 (Lin et al. 2024, Sec. 3.3): "trailing"
    # spacing does, diffusers' default "leading" starts below it. Set here, the exported scheduler
    # config carries it, so DDPMPipeline.from_pretrained samples from the zero-SNR step too.
    spacing = "trailing" if config.rescale_betas_zero_snr else "leading"
    return DDPMScheduler(num_train_timesteps=config.ddpm_num_steps, beta_schedule=config.ddpm_beta_schedule,
                         prediction_type=config.prediction_type, timestep_spacing=spacing,
                         rescale_betas_zero_snr=config.rescale_betas_zero_snr)


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def export_pipeline(unet, noise_scheduler, output_dir: str) -> None:
    """Save a DDPMPipeline (weights only, no optimizer state) into output_dir, swapping each part in
    by rename so a kill mid-save leaves the previous export loadable."""
    import shutil

    from diffusers import DDPMPipeline

    staging = os.path.join(output_dir, ".pipeline.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    DDPMPipeline(unet=unet, scheduler=noise_scheduler).save_pretrained(staging)
    for name in ("unet", "scheduler", "model_index.json"):  # model_index.json last: it marks a pipeline
        target, old = os.path.join(output_dir, name), os.path.join(output_dir, f".{name}.old")
        shutil.rmtree(old, ignore_errors=True)
        if os.path.exists(target):
            os.rename(target, old)
        os.rename(os.path.join(staging, name), target)
        if os.path.isdir(old):
            shutil.rmtree(old)
        elif os.path.exists(old):
            os.remove(old)
    shutil.rmtree(staging, ignore_errors=True)
