"""Fine-tuning: a saved DDPMPipeline (a Hub id or a local folder: diffusers' own, or this trainer's
export, class-conditional included) as the start of a run. Its UNet's weights and shape, its
scheduler's settings and, where the user set none, a fine-tuning recipe.

    config, base = resolve(config)              # scheduler settings and resolution from the pipeline
    choice = base.choice(config, data_channels, class_names)   # refuses data that does not fit
    unet = base.load_unet(with_weights=True)    # diffusers' from_pretrained: safetensors or .bin

Everything is read with diffusers' from_pretrained / load_config machinery (the Hub through
huggingface_hub, HF_ENDPOINT and the cache honoured), nothing by hand.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

from diffusion_extras.evaluation.pipeline_latent import vae_scale_factor
from diffusion_extras.training.autoencoder import VAE_SUBFOLDER, LatentSpace
from diffusion_extras.training.config import ConfigError, TrainConfig, validate
from diffusion_extras.training.models import COLOUR_NAMES, Choice, shown

# What a fine-tune trains with where the user sets none: a tenth of a from-scratch learning rate
# for this size of model (the digits recipe's 2e-3, diffusers' 1e-4 for its 114M UNet sits lower
# still: the user's flag wins), a short warmup so Adam's first moments settle before full steps
# move the pretrained weights, and a short run. docs/BENCHMARKS.md measures it on digits.
FINETUNE_RECIPE = dict(learning_rate=2e-4, lr_warmup_steps=50, max_train_steps=600)

# the config fields that the pipeline's scheduler sets, by its config key
SCHEDULER_FIELDS = {"num_train_timesteps": "ddpm_num_steps", "beta_schedule": "ddpm_beta_schedule",
                    "prediction_type": "prediction_type", "variance_type": "variance_type",
                    "rescale_betas_zero_snr": "rescale_betas_zero_snr"}


class Pretrained(NamedTuple):
    """A pipeline's UNet and scheduler configs, and where they came from."""
    name: str              # --pretrained_model_name_or_path as given
    unet_config: dict      # UNet2DModel config (diffusers' private keys dropped)
    scheduler_config: dict  # its scheduler's config
    vae_factor: int | None = None  # a latent pipeline (vae/): the VAE's downsampling factor; None: pixels

    def load_unet(self, with_weights: bool):
        """The pipeline's UNet with its weights (from_pretrained), or its shape only (a resume:
        the checkpoint's weights replace them, the pretrained ones are not read)."""
        from diffusers import UNet2DModel

        if not with_weights:
            return UNet2DModel.from_config(self.unet_config)
        try:
            return UNet2DModel.from_pretrained(self.name, subfolder="unet")
        except Exception as error:  # diffusers raises several types for missing or broken weights
            raise ConfigError(f"--pretrained_model_name_or_path {self.name}: cannot load the UNet's weights: "
                              f"{type(error).__name__}: {_first_line(error)}") from None

    def choice(self, config: TrainConfig, data_channels: int, class_names: list | None,
               latent: LatentSpace | None = None) -> Choice:
        """The pipeline's UNet for this data (a `latent` space's latents), and the fine-tuning recipe
        where the user set none. Data that does not fit the UNet is refused in one line naming both,
        before training."""
        unet, flag = self.unet_config, f"--pretrained_model_name_or_path {self.name}"
        channels, size = unet.get("in_channels", 3), unet.get("sample_size")
        if (latent is None) != (self.vae_factor is None):
            raise ConfigError(f"{flag}: its UNet was trained on {'pixels' if latent else 'latents'}: "
                              + ("drop --pretrained_vae_model_name_or_path" if latent else
                                 "give its VAE as --pretrained_vae_model_name_or_path"))
        if latent is not None:
            if channels != latent.channels or (isinstance(size, int) and size != latent.size):
                raise ConfigError(f"{flag}: its UNet takes {channels}-channel latents of {size} px and the VAE "
                                  f"makes {latent.channels}-channel latents of {latent.size} px: fine-tune with its "
                                  "own VAE (leave --pretrained_vae_model_name_or_path out) at its resolution")
        elif channels != data_channels:
            raise ConfigError(f"{flag}: its UNet has {channels} channel(s) ({COLOUR_NAMES.get(channels, '?')}) and "
                              f"the images have {data_channels} ({COLOUR_NAMES.get(data_channels, '?')}): fine-tune "
                              "on images of its channels (or --keep_alpha / no --keep_alpha to match)")
        if latent is None and isinstance(size, int) and size != config.resolution:
            raise ConfigError(f"{flag}: its UNet samples at {size} px and --resolution is {config.resolution}: "
                              f"train at --resolution {size} (or leave --resolution out)")
        embeds = unet.get("num_class_embeds")
        if class_names is None and embeds:
            raise ConfigError(f"{flag}: its UNet is class-conditional ({embeds - 1} classes): add --class_conditional")
        if class_names is not None and embeds != len(class_names) + 1:
            raise ConfigError(f"{flag}: its UNet has {'no class embedding' if not embeds else f'{embeds - 1} classes'} "
                              f"and the data has {len(class_names)} classes: fine-tune on data of its classes")
        settings = {name: value for name, value in FINETUNE_RECIPE.items() if name not in config.given}
        kept = [f"--{name}" for name in FINETUNE_RECIPE if name in config.given]
        optimization = ""
        if settings:
            optimization = (f"fine-tuning recipe ({', '.join(f'{n} {shown(v)}' for n, v in settings.items())})"
                            + (f"; yours kept: {', '.join(kept)}" if kept else ""))
        description = f"pretrained UNet of {self.name}" + (f", {len(class_names)} classes" if class_names else "")
        return Choice(dict(unet), settings, description, optimization)


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [""])[0]


def load(name: str) -> Pretrained:
    """The configs of the pipeline at `name` (a Hub id or a folder with unet/ and scheduler/)."""
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DModel

    flag = f"--pretrained_model_name_or_path {name}"
    try:
        unet_config = UNet2DModel.load_config(name, subfolder="unet")
        scheduler_config = DDPMScheduler.load_config(name, subfolder="scheduler")
    except Exception as error:  # huggingface_hub and diffusers raise many types; the user needs one line
        raise ConfigError(f"{flag}: not a DDPMPipeline folder or Hub id (unet/ and scheduler/ configs): "
                          f"{type(error).__name__}: {_first_line(error)}") from None
    if unet_config.get("_class_name") != "UNet2DModel":
        raise ConfigError(f"{flag}: its unet is a {unet_config.get('_class_name')}, not a UNet2DModel")
    try:  # a latent pipeline (the trainer's LatentDiffusionPipeline export) has its VAE in vae/
        vae_factor = vae_scale_factor(AutoencoderKL.load_config(name, subfolder=VAE_SUBFOLDER))
    except (OSError, ValueError):  # no vae/: a pixel pipeline
        vae_factor = None
    return Pretrained(name, {k: v for k, v in unet_config.items() if not k.startswith("_")},
                      {k: v for k, v in scheduler_config.items() if not k.startswith("_")}, vae_factor)


def resolve(config: TrainConfig) -> tuple[TrainConfig, Pretrained | None]:
    """(the config with the pipeline's scheduler settings and sample size where the user set none,
    the pipeline), or (config, None) without --pretrained_model_name_or_path."""
    if not config.pretrained_model_name_or_path:
        return config, None
    base = load(config.pretrained_model_name_or_path)
    given = config.given
    values = {field: base.scheduler_config[key] for key, field in SCHEDULER_FIELDS.items()
              if key in base.scheduler_config and field not in given}
    if "resolution" not in given and isinstance(base.unet_config.get("sample_size"), int):
        values["resolution"] = base.unet_config["sample_size"] * (base.vae_factor or 1)  # a latent UNet's: decoded
    if base.vae_factor is not None and "pretrained_vae_model_name_or_path" not in given:
        values["pretrained_vae_model_name_or_path"] = config.pretrained_model_name_or_path  # its own vae/
    resolved = dataclasses.replace(config, **values)
    resolved._given = given  # the pipeline's values are not the user's
    validate(resolved)  # e.g. a variance_type or beta_schedule this trainer does not train
    return resolved, base
