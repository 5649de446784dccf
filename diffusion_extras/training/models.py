"""The UNet and the noise scheduler, built from the config."""
from __future__ import annotations

import json
import os

from diffusion_extras.core import losses
from diffusion_extras.evaluation import pipeline_class_conditional as conditional
from diffusion_extras.training.config import DIGITS_UNET, ConfigError, TrainConfig, validate_model_shape

# diffusers' examples/unconditional_image_generation/train_unconditional.py builds this UNet when no
# --model_config_name_or_path is given (~114M parameters; diffusers' other UNet2DModel defaults):
# six levels, so the resolution must be a multiple of 32, and attention at the fifth.
DIFFUSERS_DEFAULT_UNET = dict(
    layers_per_block=2, block_out_channels=[128, 128, 256, 256, 512, 512],
    down_block_types=["DownBlock2D", "DownBlock2D", "DownBlock2D", "DownBlock2D", "AttnDownBlock2D", "DownBlock2D"],
    up_block_types=["UpBlock2D", "AttnUpBlock2D", "UpBlock2D", "UpBlock2D", "UpBlock2D", "UpBlock2D"],
)
COLOUR_NAMES = {1: "grayscale", 3: "RGB"}


def unet_config(config: TrainConfig, model: dict | None = None) -> dict:
    """UNet2DModel kwargs from --model_config_name_or_path (folder or JSON) or `model` (default: the
    recipe's), with sample_size set to the training resolution (the pipeline samples at sample_size)."""
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
        values = dict(config.model if model is None else model)
    values["sample_size"] = config.resolution
    if values.get("in_channels", 3) not in (1, 3) or values.get("out_channels", 3) != values.get("in_channels", 3):
        raise ConfigError("the UNet must have in_channels == out_channels, 1 (grayscale) or 3 (RGB); "
                          f"got {values.get('in_channels')} -> {values.get('out_channels')}")
    validate_model_shape(values, config.resolution)
    return values


def follow_data(config: TrainConfig, data_channels: int, class_names: list | None = None) -> tuple[dict, str]:
    """The model of `model_for_data`, with a class embedding when `class_names` are given:
    num_class_embeds = classes + 1, the last entry being "no class" (classifier-free guidance)."""
    model, chosen = model_for_data(config, data_channels)
    if class_names is None:
        return model, chosen
    return {**model, "num_class_embeds": len(class_names) + 1}, f"{chosen}, conditioned on {len(class_names)} classes"


def model_for_data(config: TrainConfig, data_channels: int) -> tuple[dict, str]:
    """The UNet kwargs for this run and how they were chosen (one line for the log). With a dataset
    and no model chosen (no --model_config_name_or_path, the recipe's `model` untouched), the model
    follows the images: their channels, and diffusers' train_unconditional.py default shape where
    the resolution allows it (a multiple of 32), else our 16 px digits recipe's shape. The embedded
    digits keep the digits recipe."""
    if config.model_config_name_or_path:
        return config.model, f"UNet from {config.model_config_name_or_path}"
    if config.model != DIGITS_UNET or config.data_spec().uses_embedded_digits:
        return config.model, "the recipe's UNet" if config.model != DIGITS_UNET else "the digits recipe's UNet"
    channels = {"in_channels": data_channels, "out_channels": data_channels}
    if config.resolution % 32 == 0:
        return ({**DIFFUSERS_DEFAULT_UNET, **channels},
                f"diffusers train_unconditional.py's default UNet at {config.resolution} px (no model chosen)")
    return ({**DIGITS_UNET, **channels},
            f"the digits recipe's UNet shape at {config.resolution} px (no model chosen; diffusers' default "
            "needs a multiple of 32 px)")


def describe(unet, chosen: str, data_channels: int) -> list[str]:
    """The model line (shape and size) and, if the images are converted, the conversion line."""
    channels = unet.config.in_channels
    lines = [f"model: {chosen}: {channels} channel(s) ({COLOUR_NAMES.get(channels, channels)}), blocks "
             f"{list(unet.config.block_out_channels)} x{unet.config.layers_per_block}, "
             f"{count_parameters(unet) / 1e6:.1f}M parameters"]
    if channels != data_channels:
        lines.append(f"data: the images are {COLOUR_NAMES[data_channels]} and the UNet has {channels} channel(s): "
                     f"converting them to {COLOUR_NAMES.get(channels, channels)}")
    return lines


def build_unet(config: TrainConfig, model: dict | None = None):
    """The UNet of `model` kwargs (default: the recipe's, or --model_config_name_or_path); a
    `num_class_embeds` in `model` wins over the config file's."""
    from diffusers import UNet2DModel

    values = unet_config(config, model)
    if model is not None and "num_class_embeds" in model:
        values["num_class_embeds"] = model["num_class_embeds"]
    try:
        return UNet2DModel(**values)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"the UNet config is invalid: {error}") from None


def build_noise_scheduler(config: TrainConfig):
    return losses.ddpm_scheduler(config.ddpm_num_steps, config.ddpm_beta_schedule, config.prediction_type,
                                 config.rescale_betas_zero_snr)


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def export_pipeline(unet, noise_scheduler, output_dir: str, class_names: list | None = None) -> None:
    """Save a DDPMPipeline, or with `class_names` a ClassConditionalPipeline with its source file
    (weights only, no optimizer state), into output_dir, swapping each part in by rename so a
    kill mid-save leaves the previous export loadable."""
    import shutil

    staging = os.path.join(output_dir, ".pipeline.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    names = ["unet", "scheduler"]
    if class_names is None:
        from diffusers import DDPMPipeline
        DDPMPipeline(unet=unet, scheduler=noise_scheduler).save_pretrained(staging)
    else:
        save_class_conditional(unet, noise_scheduler, class_names, staging)
        names.append(f"{conditional.PIPELINE_MODULE}.py")
    for name in (*names, "model_index.json"):  # model_index.json last: it marks a pipeline
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


def save_class_conditional(unet, noise_scheduler, class_names: list, folder: str) -> None:
    """save_pretrained of a ClassConditionalPipeline, plus its source file beside model_index.json
    and `_class_name` [module, class]: diffusers' custom-pipeline convention, which
    DiffusionPipeline.from_pretrained(folder, trust_remote_code=True) resolves to that file
    (pipeline_loading_utils._resolve_custom_pipeline_and_cls), the package not needed."""
    import shutil

    pipeline = conditional.ClassConditionalPipeline(unet=unet, scheduler=noise_scheduler,
                                                    id2label=dict(enumerate(class_names)))
    pipeline.save_pretrained(folder)
    shutil.copyfile(conditional.__file__, os.path.join(folder, f"{conditional.PIPELINE_MODULE}.py"))
    index_path = os.path.join(folder, "model_index.json")
    with open(index_path) as fh:
        index = json.load(fh)
    index["_class_name"] = [conditional.PIPELINE_MODULE, conditional.PIPELINE_CLASS]
    with open(index_path, "w") as fh:
        json.dump(index, fh, indent=2, sort_keys=True)
