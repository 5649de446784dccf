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
import json
import os
from typing import NamedTuple

from diffusion_extras.hub.download import first_line, is_offline_error, local_folder, offline_reason
from diffusion_extras.training import checkpointing
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
    source: str            # what from_pretrained reads: the folder (`~` expanded) or the Hub id
    unet_config: dict      # UNet2DModel config (diffusers' private keys dropped)
    scheduler_config: dict  # its scheduler's config

    def load_unet(self, with_weights: bool):
        """The pipeline's UNet with its weights (from_pretrained), or its shape only (a resume:
        the checkpoint's weights replace them, the pretrained ones are not read)."""
        from diffusers import UNet2DModel

        if not with_weights:
            return UNet2DModel.from_config(self.unet_config)
        try:
            return UNet2DModel.from_pretrained(self.source, subfolder="unet")
        except Exception as error:  # diffusers raises several types for missing or broken weights
            offline = not os.path.isdir(self.source) and is_offline_error(error)
            raise ConfigError(f"--pretrained_model_name_or_path {self.name}: cannot load the UNet's weights: "
                              f"{offline_reason(self.source) if offline else first_line(error)}") from None

    def record(self) -> dict:
        """What a checkpoint records of the pipeline (JSON): its configs as read, so that a resume
        needs no network and sees the schedule it trained with, whatever the repo holds since."""
        return json.loads(json.dumps({"unet": self.unet_config, "scheduler": self.scheduler_config}))

    def choice(self, config: TrainConfig, data_channels: int, class_names: list | None) -> Choice:
        """The pipeline's UNet for this data, and the fine-tuning recipe where the user set none.
        Data that does not fit the UNet is refused in one line naming both, before training."""
        unet, flag = self.unet_config, f"--pretrained_model_name_or_path {self.name}"
        channels, size = unet.get("in_channels", 3), square_size(unet.get("sample_size"), flag)
        # grayscale images train an RGB UNet as grey RGB images, as diffusers' train_unconditional.py
        # converts every image to RGB; any other mismatch has a remedy of the user's (channel_fix)
        if channels != data_channels and (channels, data_channels) != (3, 1):
            raise ConfigError(f"{flag}: its UNet has {channels} channel(s) ({COLOUR_NAMES.get(channels, '?')}) and "
                              f"the images have {data_channels} ({COLOUR_NAMES.get(data_channels, '?')}): "
                              + channel_fix(channels, data_channels))
        if size is not None and size != config.resolution:
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


def channel_fix(unet_channels: int, data_channels: int) -> str:
    """What makes images of `data_channels` fit a base UNet of `unet_channels` (1, 3 or 4):
    data_channels is 4 only with --keep_alpha, else 1 for grayscale images and 3 for colour."""
    if data_channels == 4:
        return "drop --keep_alpha (transparency is then composited on --background)"
    if unet_channels == 4:
        return "add --keep_alpha (transparency kept as the 4th channel)"
    if unet_channels == 1:
        return ("converting them to grayscale would drop their colour: fine-tune on grayscale images, or "
                "choose an RGB base")
    return "fine-tune on images of its channels"


def square_size(sample_size, flag: str) -> int | None:
    """The side of a UNet's sample_size (an int, or diffusers' [height, width]); None when unset. A
    non-square one is refused: this trainer trains square images (--resolution)."""
    if isinstance(sample_size, (list, tuple)):
        if len(set(sample_size)) != 1:
            raise ConfigError(f"{flag}: its UNet samples {sample_size[0]}x{sample_size[1]} px images and this "
                              "trainer trains square ones (--resolution): fine-tune a square base")
        return int(sample_size[0])
    return sample_size


def load(name: str) -> Pretrained:
    """The configs of the pipeline at `name` (a Hub id, or a folder with unet/ and scheduler/)."""
    from diffusers import DDPMScheduler, UNet2DModel

    flag = f"--pretrained_model_name_or_path {name}"
    try:
        source = local_folder(name, "DDPMPipeline folder") or name
    except (OSError, ValueError) as error:
        raise ConfigError(f"{flag}: {error}") from None
    try:
        unet_config = UNet2DModel.load_config(source, subfolder="unet")
        scheduler_config = DDPMScheduler.load_config(source, subfolder="scheduler")
    except Exception as error:  # huggingface_hub and diffusers raise many types; the user needs one line
        if source == name and is_offline_error(error):
            raise ConfigError(f"{flag}: cannot download it: {offline_reason(name)}") from None
        raise ConfigError(f"{flag}: not a DDPMPipeline folder or Hub id (unet/ and scheduler/ configs): "
                          f"{first_line(error)}") from None
    if unet_config.get("_class_name") != "UNet2DModel":
        raise ConfigError(f"{flag}: its unet is a {unet_config.get('_class_name')}, not a UNet2DModel")
    return Pretrained(name, source, {k: v for k, v in unet_config.items() if not k.startswith("_")},
                      {k: v for k, v in scheduler_config.items() if not k.startswith("_")})


def resolve(config: TrainConfig) -> tuple[TrainConfig, Pretrained | None]:
    """(the config with the pipeline's scheduler settings and sample size where the user set none,
    the pipeline), or (config, None) without --pretrained_model_name_or_path. A resume takes the
    pipeline's configs from the checkpoint it starts from, as the first run read them: no network,
    and a repo changed since (its beta_*, clip_sample) changes nothing."""
    name = config.pretrained_model_name_or_path
    if not name:
        return config, None
    recorded = checkpointing.recorded_config(config.output_dir, config.resume_from_checkpoint) or {}
    if recorded.get("pretrained") and recorded.get("pretrained_model_name_or_path") == name:
        base = Pretrained(name, name, recorded["pretrained"]["unet"], recorded["pretrained"]["scheduler"])
    else:  # a fresh run, or a checkpoint from before the pipeline was recorded (resume() refuses another name)
        base = load(name)
    given = config.given
    values = {field: base.scheduler_config[key] for key, field in SCHEDULER_FIELDS.items()
              if key in base.scheduler_config and field not in given}
    size = square_size(base.unet_config.get("sample_size"), f"--pretrained_model_name_or_path {base.name}")
    if "resolution" not in given and size is not None:
        values["resolution"] = size
    resolved = dataclasses.replace(config, **values)
    resolved._given = given  # the pipeline's values are not the user's
    validate(resolved)  # e.g. a variance_type or beta_schedule this trainer does not train
    return resolved, base
